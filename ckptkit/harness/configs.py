"""What a harness run trains under and how it saves or loads: pure, torch-free descriptions.

A :class:`TrainConfig` is one side of a matrix cell: the wrapper (plain, DDP, FSDP1, FSDP2) with its
options, the world size, and the :class:`Format` the state is saved in (source side) or loaded from (target
side). A :class:`Cell` pairs a source with a target. Every combination torch would refuse, or that would
test nothing, is rejected here with a message that names the field, so a matrix cannot hold a cell that
fails for a reason other than ckptkit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..core.manifest import Format

__all__ = ["WRAP_MIN_NUM_PARAMS", "AutoWrap", "Cell", "ConfigError", "Format", "ParamDtype", "Sharding", "TrainConfig",
           "Wrapper", "ddp", "fsdp1", "fsdp2", "plain"]


class ConfigError(ValueError):
    """A training configuration or cell that cannot run as described."""


class Wrapper(str, enum.Enum):
    PLAIN = "plain"
    DDP = "ddp"
    FSDP1 = "fsdp1"
    FSDP2 = "fsdp2"


class Sharding(str, enum.Enum):
    """FSDP1's ``ShardingStrategy``; each value is the torch member's name (torch keeps ZeRO-2 hybrid private)."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"

    @property
    def hybrid(self) -> bool:
        return self in (Sharding.HYBRID_SHARD, Sharding.HYBRID_SHARD_ZERO2)


class AutoWrap(str, enum.Enum):
    """FSDP1 auto-wrap policy: none (one root unit), by parameter count, or one unit per ``Block``."""

    NONE = "none"
    SIZE = "size"
    BLOCK = "block"


class ParamDtype(str, enum.Enum):
    """What FSDP1 computes in: FP32 runs without ``MixedPrecision``; BF16 and FP16 run under
    ``MixedPrecision(param_dtype=..., reduce_dtype=float32, buffer_dtype=float32)``, as real configurations
    (Oumi's ``FSDPParams.mixed_precision``) set it."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_name(self) -> str:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.value]


WRAP_MIN_NUM_PARAMS = 10_000
"""``size_based_auto_wrap_policy(min_num_params=...)`` for AutoWrap.SIZE: with the tiny model's defaults it
wraps each attention and MLP (16k and 18k parameters) and leaves norms to their parents."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One side of a cell. FSDP1-only fields are None unless ``wrapper`` is FSDP1, FSDP2-only ones unless
    it is FSDP2; :func:`plain`, :func:`ddp`, :func:`fsdp1` and :func:`fsdp2` fill in the defaults."""

    wrapper: Wrapper
    world_size: int = 1
    """Ranks; hybrid FSDP1 and HSDP FSDP2 lay them out as a 2 x (world_size / 2) mesh."""
    form: Format = Format.FULL
    """What the source saves, or what the target loads."""
    sharding: Sharding | None = None
    """FSDP1 ShardingStrategy."""
    auto_wrap: AutoWrap | None = None
    """FSDP1 auto-wrap policy."""
    use_orig_params: bool | None = None
    """FSDP1 ``use_orig_params``."""
    param_dtype: ParamDtype | None = None
    """FSDP1 ``MixedPrecision``: see :class:`ParamDtype`."""
    hsdp: bool | None = None
    """FSDP2 on a 2-D (replicate, shard) mesh rather than a 1-D one."""
    bf16: bool | None = None
    """FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``."""
    cpu_offload: bool | None = None
    """FSDP2 ``CPUOffloadPolicy``; FSDP1 ``CPUOffload(offload_params=True)``, which needs an accelerator."""
    reshard_after_forward: bool | None = None
    """FSDP2 ``reshard_after_forward``."""
    perturb_resume: bool = False
    """For the harness's own tests, never in a matrix: a resumed run doubles its learning rate once it has
    loaded and captured its state (:func:`training.perturb_resumed`). It stands for a torch loader that
    restores every byte yet resumes off the trajectory: the drift is in the configuration's own training
    code, so its torch-only control drifts too."""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.world_size, int) or self.world_size < 1:
            problems.append(f"world_size must be an int >= 1, got {self.world_size!r}")
        for name, owners in _OPTIONS.items():
            value = getattr(self, name)
            if self.wrapper in owners and value is None:
                problems.append(f"{self.wrapper.value} needs {name} (use {self.wrapper.value}(...) for the defaults)")
            elif self.wrapper not in owners and value is not None:
                problems.append(f"{name} is an {' or '.join(o.value for o in owners)} option, "
                                f"but wrapper is {self.wrapper.value}")
        if self.wrapper is Wrapper.PLAIN and self.world_size != 1:
            problems.append(f"a plain model syncs no gradients, so world_size must be 1, got {self.world_size}; "
                            "use ddp for data parallel")
        if self.form is Format.LOCAL and self.wrapper is not Wrapper.FSDP1:
            problems.append(f"form local is FSDP1's LOCAL_STATE_DICT, but wrapper is {self.wrapper.value}")
        if self.mesh_shape[0] == 2 and self.world_size % 2:
            problems.append(f"{self.layout} lays ranks out as 2 x k, so world_size must be even, got {self.world_size}")
        if self.form is Format.LOCAL and self.sharding is not None and self.sharding.hybrid:
            problems.append("torch refuses LOCAL_STATE_DICT with a DeviceMesh, which hybrid sharding runs on")
        if problems:  # named without the options: they may be what is wrong
            raise ConfigError(f"{self.wrapper.value}@{self.world_size}:{self.form.value}: " + "; ".join(problems))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(world_size,), or (2, world_size // 2) for hybrid FSDP1 and HSDP FSDP2."""
        two_d = bool(self.hsdp) or (self.sharding is not None and self.sharding.hybrid)
        return (2, self.world_size // 2) if two_d else (self.world_size,)

    @property
    def fsdp1_options(self) -> tuple[Sharding, AutoWrap, bool]:
        """``(sharding, auto_wrap, use_orig_params)``; a :class:`ConfigError` unless ``wrapper`` is FSDP1."""
        if self.sharding is None or self.auto_wrap is None or self.use_orig_params is None:
            raise ConfigError(f"{self.wrapper.value}@{self.world_size} has no FSDP1 options")
        return self.sharding, self.auto_wrap, self.use_orig_params

    @property
    def layout(self) -> str:
        # An FSDP1 config without sharding is one __post_init__ is rejecting; it names the layout among the reasons.
        if self.wrapper is Wrapper.FSDP1 and self.sharding is not None:
            return f"FSDP1 {self.sharding.name}"
        return "FSDP2 HSDP" if self.hsdp else self.wrapper.value

    @property
    def name(self) -> str:
        """A short label, e.g. ``fsdp1(hybrid_shard,wrap=block,orig)@4:sharded`` or ``fsdp2(2d,bf16)@4:full``."""
        opts: list[str] = []
        if self.wrapper is Wrapper.FSDP1:
            sharding, auto_wrap, use_orig_params = self.fsdp1_options
            mixed = self.param_dtype if self.param_dtype is not ParamDtype.FP32 else None
            opts = [sharding.name.lower(), f"wrap={auto_wrap.value}"] + (["orig"] if use_orig_params else []) + \
                   ([mixed.value] if mixed else []) + (["offload"] if self.cpu_offload else [])
        elif self.wrapper is Wrapper.FSDP2:
            opts = (["2d"] if self.hsdp else []) + (["bf16"] if self.bf16 else []) + \
                   (["offload"] if self.cpu_offload else []) + ([] if self.reshard_after_forward else ["no-reshard"])
        opts += ["perturb-resume"] if self.perturb_resume else []
        label = f"({','.join(opts)})" if opts else ""
        return f"{self.wrapper.value}{label}@{self.world_size}:{self.form.value}"


_OPTIONS: dict[str, tuple[Wrapper, ...]] = {
    "sharding": (Wrapper.FSDP1,), "auto_wrap": (Wrapper.FSDP1,), "use_orig_params": (Wrapper.FSDP1,),
    "param_dtype": (Wrapper.FSDP1,), "hsdp": (Wrapper.FSDP2,), "bf16": (Wrapper.FSDP2,),
    "cpu_offload": (Wrapper.FSDP1, Wrapper.FSDP2), "reshard_after_forward": (Wrapper.FSDP2,)}
"""Each wrapper-specific option of :class:`TrainConfig` and the wrappers it belongs to."""


def plain(*, form: Format = Format.FULL) -> TrainConfig:
    return TrainConfig(wrapper=Wrapper.PLAIN, world_size=1, form=form)


def ddp(world_size: int, *, form: Format = Format.FULL) -> TrainConfig:
    return TrainConfig(wrapper=Wrapper.DDP, world_size=world_size, form=form)


def fsdp1(world_size: int, *, form: Format = Format.SHARDED, sharding: Sharding = Sharding.FULL_SHARD,
          auto_wrap: AutoWrap = AutoWrap.BLOCK, use_orig_params: bool = False,
          param_dtype: ParamDtype = ParamDtype.FP32, cpu_offload: bool = False) -> TrainConfig:
    return TrainConfig(wrapper=Wrapper.FSDP1, world_size=world_size, form=form, sharding=sharding,
                       auto_wrap=auto_wrap, use_orig_params=use_orig_params, param_dtype=param_dtype,
                       cpu_offload=cpu_offload)


def fsdp2(world_size: int, *, form: Format = Format.SHARDED, hsdp: bool = False, bf16: bool = False,
          cpu_offload: bool = False, reshard_after_forward: bool = True) -> TrainConfig:
    return TrainConfig(wrapper=Wrapper.FSDP2, world_size=world_size, form=form, hsdp=hsdp, bf16=bf16,
                       cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward)


@dataclass(frozen=True)
class Cell:
    """Train and save under ``source``; ckptkit converts the checkpoint to ``target.form`` for
    ``target.world_size`` ranks; fresh ranks load it under ``target`` and train on."""

    source: TrainConfig
    target: TrainConfig

    def __post_init__(self) -> None:
        if self.source.form is Format.HF:
            raise ConfigError(f"{self.name}: HF is a target form only (it holds no optimizer state to train on from)")
        if self.target.form is Format.LOCAL:
            s, t = self.source, self.target
            same = ("auto_wrap", "use_orig_params", "param_dtype")  # what the flat layout depends on
            if s.form is not Format.LOCAL or any(getattr(s, name) != getattr(t, name) for name in same):
                raise ConfigError(f"{self.name}: a LOCAL target needs a LOCAL source with the same auto_wrap, "
                                  "use_orig_params and param_dtype: ckptkit re-lays flat parameters for a new "
                                  "world size, it does not re-wrap them")
            if t.sharding is Sharding.NO_SHARD:
                raise ConfigError(f"{self.name}: ckptkit writes LOCAL as sharded FSDP1 ranks hold it (a slice of "
                                  "each flat parameter per rank); NO_SHARD ranks hold them whole")

    @property
    def name(self) -> str:
        return f"{self.source.name} -> {self.target.name}"

    @property
    def operation(self) -> str:
        """The ckptkit call that turns the source checkpoint into the target's: ``reshard`` (sharded to
        sharded, LOCAL to LOCAL), ``export_hf``, or ``convert``."""
        s, t = self.source.form, self.target.form
        if t is Format.HF:
            return "export_hf"
        return "reshard" if s is t and s in (Format.SHARDED, Format.LOCAL) else "convert"

    @property
    def low_precision(self) -> bool:
        """Either side computes in bf16 or fp16 (FSDP2 ``bf16``, FSDP1 ``MixedPrecision``)."""
        return any(c.bf16 or c.param_dtype not in (None, ParamDtype.FP32) for c in (self.source, self.target))
