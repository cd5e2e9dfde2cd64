"""Parameters: register_parameters (the class parameter on every registered parameter's bytes)
and the walk over registered modules that gives each sleep the parameters' spans.

Registered modules are held by weak reference and walked again at every sleep, so parameters
replaced later (a weight loader assigning param.data) are followed. At thousands of parameters
that walk costs more than everything else a sleep does in Python, so each module's last result
is kept and used again while its parameters are the same objects at the same addresses
(``module_spans``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from ..errors import InvalidArgument, InvalidType
from ..pool import MemoryClass, Pool
from . import routing
from .marks import Span
from .runtime import span_bytes, torch_module


@dataclass
class Registration:
    """What register_parameters marked."""

    parameters: int = 0
    nbytes: int = 0
    outside: list[str] = field(default_factory=list)  # parameters not in a torpor pool


@dataclass
class ModuleSpans:
    """One registered module's parameter spans as the last sleep computed them, and what they
    were computed from (see module_spans)."""

    signature: tuple  # per submodule: (name, its parameters' names, their identities)
    first: list | None  # positions of each parameter's first occurrence among every listed one (None: all)
    pointers: list  # data_ptr() of each parameter
    sizes: list  # nbytes of each parameter
    spans: dict  # device -> [Span]


@dataclass
class Registry:
    lock: threading.RLock = field(default_factory=threading.RLock)
    modules: list = field(default_factory=list)  # (weakref to nn.Module, prefix)
    spans: dict = field(default_factory=dict)  # (id(module), prefix) -> ModuleSpans of a registered module


registry = Registry()


def _submodule_parameters(module, prefix: str) -> tuple[tuple, list]:
    """(signature, every value of every submodule's parameter dict, in named_modules order)."""
    signature, values = [], []
    for module_prefix, m in module.named_modules(prefix=prefix):
        d = m._parameters
        signature.append((module_prefix, tuple(d), tuple(map(id, d.values()))))
        values.extend(d.values())
    return tuple(signature), values


def computed_spans(signature: tuple, values: list) -> ModuleSpans:
    """The spans of the parameters in `values`, named as named_parameters names them (each
    parameter once, under its first name)."""
    seen, first, names = set(), [], []
    at = 0
    for module_prefix, keys, _ in signature:
        dot = module_prefix + "." if module_prefix else ""
        for name in keys:
            p = values[at]
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                first.append(at)
                names.append(dot + name)
            at += 1
    params = [values[i] for i in first]
    out: dict[int, list[Span]] = {}
    pointers, sizes = [], []
    for name, p in zip(names, params):
        device = p.get_device() if p.is_cuda else -1
        address, nbytes = p.data_ptr(), p.nbytes
        pointers.append(address)
        sizes.append(nbytes)
        extent = nbytes if p.is_contiguous() else span_bytes(p)
        out.setdefault(device, []).append(Span(name, address, extent))
    return ModuleSpans(signature, None if len(first) == len(values) else first, pointers, sizes, out)


def module_spans(module, prefix: str) -> dict[int, list[Span]]:
    """device -> spans of the parameters of one registered module. The last result is kept and
    used again when every submodule lists the same parameter objects under the same names, and
    each of them still has the data pointer and byte size it had (a weight loader's p.data = t,
    a module's .to(), a parameter replaced or deleted all change one of these). A parameter
    that changes its strides in place without changing its address or size keeps its last
    extent."""
    signature, values = _submodule_parameters(module, prefix)
    key = (id(module), prefix)
    last = registry.spans.get(key)
    if last is not None and last.signature == signature:
        params = values if last.first is None else [values[i] for i in last.first]
        if [p.data_ptr() for p in params] == last.pointers and [p.nbytes for p in params] == last.sizes:
            return last.spans
    computed = computed_spans(signature, values)
    registry.spans[key] = computed
    return computed.spans


def parameter_spans(modules) -> dict[int, list[Span]]:
    """device -> named spans of the CUDA parameters of (module, prefix) pairs; the rest under
    device -1. The lists may be the ones a module's last result holds: not to be changed."""
    results = [module_spans(module, prefix) for module, prefix in modules]
    if len(results) == 1:
        return results[0]
    out: dict[int, list[Span]] = {}
    for spans in results:
        for device, device_spans in spans.items():
            out.setdefault(device, []).extend(device_spans)
    return out


def live_modules() -> list:
    """(module, prefix) of every registered module still alive; the others' kept spans go."""
    with registry.lock:
        alive = [(ref(), prefix) for ref, prefix in registry.modules]
        registry.modules = [(ref, prefix) for ref, prefix in registry.modules if ref() is not None]
        live = [(m, prefix) for m, prefix in alive if m is not None]
        keys = {(id(m), prefix) for m, prefix in live}
        for key in [k for k in registry.spans if k not in keys]:
            del registry.spans[key]
    return live


def registered_spans() -> dict[int, list[Span]]:
    """device -> spans of the parameters of every registered module still alive."""
    return parameter_spans(live_modules())


def _preserve_globs(preserve) -> list[str]:
    globs = [] if preserve is None else ([preserve] if isinstance(preserve, str) else list(preserve))
    for g in globs:
        if not isinstance(g, str) or not g:
            raise InvalidArgument(f"register_parameters: preserve glob {g!r} is not a non-empty string")
    return globs


def add_preserve(globs) -> None:
    """Parameter-name globs (fnmatch) kept through level 2 on every device pool, as
    register_parameters(preserve=...) adds them, without a module."""
    globs = [globs] if isinstance(globs, str) else list(globs)
    for g in globs:
        if not isinstance(g, str) or not g:
            raise InvalidType(f"add_preserve: glob {g!r} is not a non-empty string")
    routing.add_preserve(globs)


def register_parameters(module, preserve=None, prefix: str = "") -> Registration:
    """Mark every parameter of `module` (named as named_parameters(prefix) names it) as class
    parameter: reloadable, so level 2 discards it unless its name matches a `preserve` glob
    (fnmatch, e.g. "embed.*"). Everything else a weights pool holds (buffers, tensors a module
    computed at load) stays state and survives every level bit-exact. The module is kept (by
    weak reference) and re-marked at every sleep, so parameters replaced later (e.g. by a
    weight loader assigning param.data) are followed. Globs add up over calls."""
    torch = torch_module()
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgument(f"register_parameters: {type(module).__name__} is not a torch.nn.Module")
    globs = _preserve_globs(preserve)
    with registry.lock:
        if not any(ref() is module and p == prefix for ref, p in registry.modules):
            registry.modules.append((weakref.ref(module), prefix))
    routing.add_preserve(globs)
    devices = routing.devices()
    result = Registration()
    for device, device_spans in parameter_spans([(module, prefix)]).items():
        pool = Pool.torch(device) if device in devices else None
        marks = []
        for s in device_spans:
            if pool is None or s.nbytes == 0 or not pool.contains(s.address):
                result.outside.append(s.name)
                continue
            marks.append((s.address, s.nbytes, MemoryClass.PARAMETER, s.name))
            result.parameters += 1
            result.nbytes += s.nbytes
        if marks:
            pool.mark_ranges(marks)
    for hook in list(_on_registered):
        hook(result)
    return result


_on_registered: list = []  # called with the Registration after every register_parameters


def on_registered(hook) -> None:
    """Call `hook(registration)` after every register_parameters (torpor.torch.prepare's trigger:
    registered parameters change what a level-2 sleep keeps). Hooks must not raise."""
    if hook not in _on_registered:
        _on_registered.append(hook)
