"""The flat layout of a model as FSDP1 builds it, read from FSDP's own FlatParameters (this imports torch).

For a LOCAL checkpoint saved by FSDP1 itself, which carries no ``flat_layout.json``: :func:`derive_layout`
wraps the model under a fake process group, and :func:`layout_of` reads a live wrapped model.
"""

from __future__ import annotations

import importlib
from typing import Any

from ...errors import UsageError
from .layout import FLAT_PARAM, FlatLayout, FlatParam, FlatUnit

__all__ = ["derive_layout", "layout_of"]


def derive_layout(model: str, auto_wrap: str = "none", *, world_size: int, use_orig_params: bool,
                  param_dtype: str | None = None) -> FlatLayout:
    """The layout FSDP1 gives ``model`` (``"package.module:factory"``, called with no arguments) wrapped with
    ``auto_wrap`` at ``world_size`` ranks, read from the FlatParameters FSDP builds.

    ``auto_wrap`` is ``none`` (one unit, FSDP's default), ``size:<min_num_params>``
    (``size_based_auto_wrap_policy``) or ``block:<module.path:ClassName>[,...]`` (``ModuleWrapPolicy``). The
    model is built under a fake tensor mode (no parameter memory) and wrapped under a fake process group of
    ``world_size`` ranks, so no real ranks are needed.

    ``param_dtype`` (torch's name, ``bfloat16``) is the dtype the run computed in; None is the dtype the
    factory builds. It is handed to FSDP as ``MixedPrecision(param_dtype=...)``: the parameters keep their
    dtype, and FSDP aligns them as it did in the run (see :mod:`.layout`). That also covers a model that was
    cast to bf16 before wrapping, which the fake tensor mode cannot do to a model with tied weights.
    """
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    from torch.testing._internal.distributed.fake_pg import FakeStore

    factory = _import(model, "--model")
    policy = _wrap_policy(auto_wrap)
    if dist.is_initialized():
        raise UsageError("deriving a flat layout needs a process of its own (it starts a fake process group), "
                         "but this process already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # FSDP1 refuses a meta-device module without an accelerator; fake CPU tensors take no memory either.
        with FakeTensorMode():
            module = factory()
            if not isinstance(module, torch.nn.Module):
                raise UsageError(f"--model {model}: the factory returned {type(module).__name__}, "
                                 "not a torch.nn.Module")
            order = tuple(name for name, _ in module.named_parameters())
            mixed = None if param_dtype is None else MixedPrecision(param_dtype=getattr(torch, param_dtype))
            wrapped = FSDP(module, auto_wrap_policy=policy, use_orig_params=use_orig_params,
                           device_id=torch.device("cpu"), mixed_precision=mixed)
        layout = _layout(wrapped, use_orig_params, order)
    finally:
        dist.destroy_process_group()
    return layout


def layout_of(wrapped: Any) -> FlatLayout:
    """The layout of a live FSDP1 model, as ``ckptkit.save(form="local")`` records it beside the rank files."""
    use_orig = bool(getattr(wrapped, "_use_orig_params", False))
    # With use_orig_params the optimizer holds the original parameters, in the wrapped model's order.
    order = tuple(_clean(name) for name, _ in wrapped.named_parameters()) if use_orig else ()
    return _layout(wrapped, use_orig, order)


def _layout(wrapped: Any, use_orig_params: bool, order: tuple[str, ...]) -> FlatLayout:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    handles = [(_clean(name), sub._handle) for name, sub in wrapped.named_modules()
               if isinstance(sub, FSDP) and sub._handle is not None]
    # The dtype FSDP aligned in (torch 2.13, _flat_param.py, FlatParamHandle._init_param_reduce_dtypes):
    # MixedPrecision.param_dtype, else the parameters' dtype at wrap time. A model whose units differ in it
    # (built in several dtypes, no MixedPrecision) records none: the offsets carry the alignment anyway.
    dtypes = {str(handle._fwd_bwd_param_dtype).removeprefix("torch.") for _, handle in handles}
    return FlatLayout(tuple(_unit(name, handle.flat_param) for name, handle in handles), use_orig_params, order,
                      dtypes.pop() if len(dtypes) == 1 else None)


def _clean(name: str) -> str:
    # FSDP's state-dict hooks drop the wrapper segments from keys; so do we.
    return ".".join(p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def _unit(module_name: str, flat: Any) -> FlatUnit:
    prefix = f"{module_name}." if module_name else ""
    params, at, names = [], 0, iter(zip(flat._fqns, flat._shapes, strict=True))
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not is_padding:
            fqn, shape = next(names)
            params.append(FlatParam(prefix + _clean(fqn), tuple(shape), at))
        at += numel
    shared = tuple((prefix + _clean(f"{s.module_name}.{s.param_name}".lstrip(".")),
                    prefix + _clean(f"{s.prim_module_name}.{s.prim_param_name}".lstrip(".")))
                   for s in flat._shared_param_infos)
    return FlatUnit(prefix + FLAT_PARAM, tuple(params), shared)


def _import(spec: str, option: str) -> Any:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise UsageError(f"{option} {spec!r}: expected package.module:name")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{option} {spec!r}: cannot import it ({type(e).__name__}: {e}); is its package on "
                         "PYTHONPATH?") from e
    return obj


def _wrap_policy(auto_wrap: str) -> Any:
    import functools

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    kind, _, arg = auto_wrap.partition(":")
    if kind == "none" and not arg:
        return None
    if kind == "size" and arg.isdigit():
        return functools.partial(size_based_auto_wrap_policy, min_num_params=int(arg))
    if kind == "block" and arg:
        return ModuleWrapPolicy({_import(a.strip(), "--auto-wrap block:") for a in arg.split(",")})
    raise UsageError(f"--auto-wrap {auto_wrap!r}: expected none, size:<min_num_params> or "
                     "block:<module.path:ClassName>[,<module.path:ClassName>...]")
