"""Which kernel a call runs: a named kernel checked against the call's problem, or a
dispatcher's choice; the kernel itself comes loaded from tilecast.runtime.kernel_library."""
from __future__ import annotations

import torch

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


def needs_custom_op(tensors, records_gradient: bool) -> bool:
    """Whether a call must go through its torch custom op: autograd has a gradient to
    record, a compiler is tracing, or an operand is a tensor subclass. Otherwise the op's
    body runs directly: the op's dispatch costs 50-100 us a call, more than a small product."""
    return (records_gradient or torch.compiler.is_compiling()
            or any(type(t) is not torch.Tensor for t in tensors))


# (family, kernel name, problem) pairs a kernel was found able to run (bounded: cleared when full)
_runnable: set[tuple] = set()
_RUNNABLE_MAX = 4096


def load_kernel(family, name: str, problem) -> kernel_library.InProcessKernel:
    """The loaded kernel `name` after checking that it can run `problem` (a pair that passed
    is not checked again)."""
    if not name:
        raise ValueError(f"no {family.name} kernel was chosen for {family.dims_key(problem)}; "
                         "pass kernel='<name>' or a dispatcher")
    key = (family.name, name, problem)
    if key in _runnable:
        return kernel_library.load(family, name)
    reason = family.unsupported_reason(_config(family, name), problem)
    if reason is None:
        if len(_runnable) >= _RUNNABLE_MAX:
            _runnable.clear()
        _runnable.add(key)
    else:
        raise ValueError(f"kernel {name!r} cannot run {family.dims_key(problem)}: {reason}")
    return kernel_library.load(family, name)


def select(family, dispatcher, problem) -> str:
    """The dispatcher's kernel for `problem` (anything with `select`, e.g. a StaticDispatcher)."""
    chosen_for = getattr(dispatcher, "family", None)
    if chosen_for is not None and chosen_for.name != family.name:
        raise ValueError(f"the dispatcher of model {getattr(dispatcher, 'model', '?')!r} picks "
                         f"{chosen_for.name} kernels; this call needs a {family.name} kernel")
    return dispatcher.select(problem)
