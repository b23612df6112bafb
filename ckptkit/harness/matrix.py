"""The cells the harness runs: ``quick`` (what CI runs on CPU) and ``full`` (every option of every wrapper,
as a source and as a target)."""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from itertools import product
from typing import TypeVar

from .configs import AutoWrap, Cell, ConfigError, Format, ParamDtype, Sharding, TrainConfig, ddp, fsdp1, fsdp2, plain

__all__ = ["MATRICES", "QUICK", "full", "named", "select"]

_Made = TypeVar("_Made", TrainConfig, Cell)

QUICK: tuple[Cell, ...] = (
    # The demo's story, checked: FSDP2 saves with DCP at 2, ckptkit reshards to 3, FSDP2 resumes at 3.
    Cell(fsdp2(2), fsdp2(3)),
    # The same checkpoint as one torch.save file (FULL_STATE_DICT), resumed by DDP at 3.
    Cell(fsdp2(2), ddp(3, form=Format.FULL)),
    # The same checkpoint exported as HF safetensors (lm_head left out, tied) into a plain model.
    Cell(fsdp2(2), plain(form=Format.HF)),
    # FSDP1 FULL_SHARD SHARDED_STATE_DICT, per-block units, loaded by FSDP2 on one rank.
    Cell(fsdp1(2), fsdp2(1)),
    # DDP's torch.save resumed by FSDP1 FULL_STATE_DICT with size-based units and use_orig_params.
    Cell(ddp(2), fsdp1(3, form=Format.FULL, auto_wrap=AutoWrap.SIZE, use_orig_params=True)),
    # FSDP1 HYBRID_SHARD on a 2 x 2 mesh to FSDP2 on a 1-D mesh of 3.
    Cell(fsdp1(4, sharding=Sharding.HYBRID_SHARD), fsdp2(3)),
    # FSDP2 HSDP (2 x 2) with bf16 compute to FSDP2 1-D at 2, bf16 too.
    Cell(fsdp2(4, hsdp=True, bf16=True), fsdp2(2, bf16=True)),
    # FSDP1 LOCAL_STATE_DICT at 2 to DCP for FSDP2 at 3, and re-laid as LOCAL for FSDP1 at 3.
    Cell(fsdp1(2, form=Format.LOCAL), fsdp2(3)),
    Cell(fsdp1(2, form=Format.LOCAL), fsdp1(3, form=Format.LOCAL)),
    # The same under MixedPrecision(param_dtype=bfloat16) with use_orig_params: FSDP aligns to 8 elements.
    Cell(fsdp1(2, form=Format.LOCAL, use_orig_params=True, param_dtype=ParamDtype.BF16),
         fsdp1(3, form=Format.LOCAL, use_orig_params=True, param_dtype=ParamDtype.BF16)),
    # One rank on each side (what a one-GPU machine runs with --device cuda): FSDP2 with CPUOffloadPolicy
    # saves a torch.save file, FSDP1 resumes from it as DCP; FSDP2 bf16 without resharding after forward.
    Cell(fsdp2(1, form=Format.FULL, cpu_offload=True), fsdp1(1)),
    Cell(fsdp2(1, bf16=True, reshard_after_forward=False), fsdp2(1, form=Format.FULL, bf16=True)),
    # FSDP1 with CPUOffload(offload_params=True), which needs an accelerator: skipped on CPU, with torch's reason.
    Cell(fsdp1(1, cpu_offload=True), fsdp1(1, form=Format.FULL, use_orig_params=True, cpu_offload=True)),
)


def _valid(make: Callable[..., _Made], *args, **kwargs) -> _Made | None:
    """The configuration or cell, or None where configs.py rules it out (hybrid sharding with LOCAL, say)."""
    try:
        return make(*args, **kwargs)
    except ConfigError:
        return None


def _configs(forms: tuple[Format, ...], one_d: int, two_d: int) -> list[TrainConfig]:
    """Every wrapper with every option, 1-D layouts at ``one_d`` ranks and 2 x k ones at ``two_d``."""
    both = (False, True)
    candidates: list[TrainConfig | None] = []
    for form in forms:
        candidates += [_valid(plain, form=form), _valid(ddp, one_d, form=form)]
        candidates += [_valid(fsdp1, two_d if sharding.hybrid else one_d, form=form, sharding=sharding,
                              auto_wrap=wrap, use_orig_params=orig)
                       for sharding, wrap, orig in product(Sharding, AutoWrap, both)]
        # FSDP1 FULL_SHARD under MixedPrecision, every wrap (each moves the alignment padding differently), and
        # with CPUOffload (CUDA only).
        candidates += [_valid(fsdp1, one_d, form=form, auto_wrap=wrap, use_orig_params=orig, param_dtype=dtype)
                       for dtype, wrap, orig in product((ParamDtype.BF16, ParamDtype.FP16), AutoWrap, both)]
        candidates += [_valid(fsdp1, one_d, form=form, use_orig_params=orig, cpu_offload=True) for orig in both]
        candidates += [_valid(fsdp2, two_d if hsdp else one_d, form=form, hsdp=hsdp, bf16=bf16, cpu_offload=offload,
                              reshard_after_forward=reshard)
                       for hsdp, bf16, offload, reshard in product(both, both, both, both)]
    return [c for c in candidates if c is not None]


def full() -> tuple[Cell, ...]:
    """Every configuration as a source (saved at 2 ranks, or 2 x 2), resumed by FSDP2 at 3 from DCP and by a
    plain model from torch.save; and every configuration as a target (at 3 ranks, or 2 x 2) of an FSDP2
    DCP checkpoint saved at 2, or for LOCAL targets of an FSDP1 LOCAL checkpoint sharded and wrapped the
    same way."""
    cells: list[Cell | None] = [Cell(source, target)
                                for source in _configs((Format.FULL, Format.SHARDED, Format.LOCAL), one_d=2, two_d=4)
                                for target in (fsdp2(3), plain(form=Format.FULL))]
    for target in _configs((Format.FULL, Format.SHARDED, Format.LOCAL, Format.HF), one_d=3, two_d=4):
        source = fsdp2(2)
        if target.form is Format.LOCAL:
            sharding, auto_wrap, use_orig_params = target.fsdp1_options
            source = fsdp1(2, form=Format.LOCAL, sharding=sharding, auto_wrap=auto_wrap,
                           use_orig_params=use_orig_params, param_dtype=target.param_dtype or ParamDtype.FP32,
                           cpu_offload=bool(target.cpu_offload))
        cells.append(_valid(Cell, source, target))
    return tuple({c.name: c for c in cells if c is not None}.values())


MATRICES: dict[str, Callable[[], tuple[Cell, ...]]] = {"quick": lambda: QUICK, "full": full}


def select(cells: tuple[Cell, ...], pattern: str | None) -> tuple[Cell, ...]:
    """Cells whose name matches the shell-style ``pattern`` anywhere (``fsdp1(hybrid*``, ``*-> plain*``)."""
    if not pattern:
        return cells
    return tuple(c for c in cells if fnmatchcase(c.name, f"*{pattern}*"))


def named(names: tuple[str, ...]) -> tuple[Cell, ...]:
    """The cells of either matrix with exactly these names, in the order given.

    Raises:
        KeyError: a name is in neither matrix.
    """
    cells = {c.name: c for c in (*QUICK, *full())}
    unknown = [n for n in names if n not in cells]
    if unknown:
        raise KeyError(f"no quick or full cell is named {', '.join(map(repr, unknown))}; --list shows the names")
    return tuple(cells[n] for n in dict.fromkeys(names))
