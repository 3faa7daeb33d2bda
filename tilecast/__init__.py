"""tilecast: learn, publish and dispatch the fastest kernel variant per problem shape."""

__version__ = "0.1.0"
__all__ = ["Dispatcher", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import tilecast` does not import lightgbm.
    if name == "Dispatcher":
        from tilecast.runtime.dispatch import Dispatcher

        return Dispatcher
    raise AttributeError(f"module 'tilecast' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), "Dispatcher"])
