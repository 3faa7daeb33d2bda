"""Which kernel a call runs: a named kernel checked against the call's problem, or a
dispatcher's choice; the kernel itself comes loaded from tilecast.runtime.kernel_library."""
from __future__ import annotations

from tilecast.runtime import kernel_library


# (family, kernel name) -> its parsed config: parsing and validating a name on every product
# took about as long as a small product itself
_configs: dict[tuple[str, str], object] = {}


def _config(family, name: str):
    """family.parse_name(name), parsed once per process (a bad name raises every time)."""
    key = (family.name, name)
    config = _configs.get(key)
    if config is None:
        config = _configs[key] = family.parse_name(name)
    return config


def load_kernel(family, name: str, problem) -> kernel_library.InProcessKernel:
    """The loaded kernel `name` after checking that it can run `problem`."""
    if not name:
        raise ValueError(f"no {family.name} kernel was chosen for {family.dims_key(problem)}; "
                         "pass kernel='<name>' or a dispatcher")
    reason = family.unsupported_reason(_config(family, name), problem)
    if reason is not None:
        raise ValueError(f"kernel {name!r} cannot run {family.dims_key(problem)}: {reason}")
    return kernel_library.load(family, name)


def select(family, dispatcher, problem) -> str:
    """The dispatcher's kernel for `problem` (anything with `select`, e.g. a StaticDispatcher)."""
    chosen_for = getattr(dispatcher, "family", None)
    if chosen_for is not None and chosen_for.name != family.name:
        raise ValueError(f"the dispatcher of model {getattr(dispatcher, 'model', '?')!r} picks "
                         f"{chosen_for.name} kernels; this call needs a {family.name} kernel")
    return dispatcher.select(problem)
