"""The one in-memory description every format reads into and writes from.

A :class:`Manifest` lists tensors and non-tensor objects. A tensor is described by its global shape and the
chunks that hold it; a chunk is a box of the global tensor (``offsets``/``sizes``, as in DCP's
``ChunkStorageMetadata``) whose bytes lie in one :class:`Span` of one file. Nothing here reads a file:
readers build manifests, the planner turns them into byte copies.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import IncompleteCheckpointError
from .boxes import extent, overlapping
from .dtypes import DType, by_name

__all__ = ["Chunk", "Derived", "Format", "FormName", "Manifest", "ObjectEntry", "Span", "TensorEntry", "TensorRef",
           "key_of", "map_tensor_refs"]

Path_ = tuple  # a state-dict path: str keys and int list indices, e.g. ("optim", "param_groups", 0, "lr")


class Format(str, enum.Enum):
    FULL = "full"
    SHARDED = "sharded"
    LOCAL = "local"
    HF = "hf"
    HF_SHARDS = "hf-shards"
    VERL = "verl"
    DEEPSPEED = "deepspeed"
    DEEPSPEED_UNIVERSAL = "deepspeed-universal"
    MEGATRON_LEGACY = "megatron-legacy"


FormName = Literal["full", "sharded", "local", "hf"]
"""The forms ckptkit writes, as :class:`Format` values."""


@dataclass(frozen=True, slots=True)
class Span:
    """``length`` bytes at ``offset`` in ``file`` (an absolute path)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """A box of the global tensor and where its bytes lie.

    ``strides`` (in elements, into ``span``) is None for row-major storage, which is what every sharded
    format writes; ``torch.save`` of a transposed view is the one source of other strides.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    span: Span
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class Derived:
    """A tensor computed from others rather than copied: ``op`` over ``inputs``, region by region.

    - ``"transpose"``: the one 2-D input's transpose (or a 3-D input's last two dims swapped);
    - ``"dequant_fp8"``: ``inputs[0]`` (a float8 weight) times ``inputs[1]`` (its ``weight_scale_inv``, one float
      per ``block`` x ``block`` tile), in float32, then the entry's dtype;
    - ``"dequant_mxfp4"``: ``inputs[0]`` (MXFP4 blocks, ``[..., rows, groups, 16]`` uint8) times 2 to the power of
      ``inputs[1]`` (e8m0 scales, ``[..., rows, groups]``) less 127, as ``[..., rows, groups x 32]``;
    - ``"quant_fp8"``: ``inputs[0]`` divided by its ``block`` x ``block`` tile's scale, as float8;
      ``"fp8_scale"``: those scales, each tile's largest magnitude / 448 (float32);
    - ``"rows"``: rows ``[a, b)`` of input ``i`` for each ``(i, a, b)`` of ``ranges``, one after another (a split or
      join of computed tensors, which have no byte ranges to take);
    - ``"stack"``: the inputs stacked along a new dim 0;
    - ``"interleave"``: the one input's last dim, two halves one after the other, as their elements taken in turn
      (``out[..., 2i + t] = in[..., t·half + i]``: GPT-OSS's gate and up columns); ``"deinterleave"``: the
      inverse;
    - ``"zeros"``: no inputs, every element zero (a buffer a framework's model initialises to zeros, written
      where the source has no tensor for it).

    :mod:`ckptkit.io.compute` computes any box of such an entry from the matching boxes of its inputs, so it
    streams in tiles bounded by the memory setting."""

    op: Literal["transpose", "dequant_fp8", "dequant_mxfp4", "quant_fp8", "fp8_scale", "rows", "stack", "zeros",
                "interleave", "deinterleave"]
    inputs: tuple[TensorEntry, ...]
    block: int = 128
    ranges: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class TensorEntry:
    key: str
    path: Path_
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    sidecar: str | None = None
    """As for :attr:`ObjectEntry.sidecar`: the file beside the checkpoint's own that holds this tensor."""
    rows: tuple[int, ...] | None = None
    """A row gather: row ``i`` of this tensor is row ``rows[i]`` of the tensor its chunks describe (a key
    mapping's rotary q/k permutation); None: the chunks' own order. Byte copies honour it
    (:func:`ckptkit.core.plan.plan_copies`), so it streams like any other tensor."""
    derived: Derived | None = None
    """Set where the tensor is computed from other tensors (a transpose, an FP8 dequantization); ``chunks``
    is then empty."""
    by_row: tuple | None = field(default=None, init=False, compare=False, repr=False)
    """The chunks ordered down dim 0, made on first use by :mod:`ckptkit.core.plan` (a reshard to N ranks
    looks each tensor's chunks up N times). Kept here, it goes when the entry goes."""

    def __post_init__(self) -> None:
        if self.rows is not None and (not self.shape or sorted(self.rows) != list(range(self.shape[0]))):
            raise IncompleteCheckpointError(f"tensor {self.key!r}: a row gather must permute the "
                                            f"{self.shape[0] if self.shape else 0} rows of shape {list(self.shape)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def validate(self) -> None:
        """Chunks must lie inside the tensor and tile it exactly; identical replicas (HSDP) count once."""
        if self.derived is not None:
            for source in self.derived.inputs:
                source.validate()
            return
        problems: list[str] = []
        boxes: dict[tuple, None] = {}  # distinct non-empty boxes, in chunk order
        covered = 0  # their elements
        shape, rank, itemsize, prod = self.shape, len(self.shape), self.dtype.itemsize, math.prod
        dims = range(rank)  # indexing beats zip(..., strict=True) here: this loop runs once per chunk
        for c in self.chunks:  # loops rather than generators: a tensor may have a million chunks
            offsets, sizes = c.offsets, c.sizes
            if len(offsets) != rank or len(sizes) != rank:
                problems.append(f"chunk in {c.span.file} has rank {len(sizes)}, tensor has rank {rank}")
                continue
            for d in dims:
                if offsets[d] < 0 or offsets[d] + sizes[d] > shape[d]:
                    problems.append(f"chunk at {list(offsets)} size {list(sizes)} in {c.span.file} "
                                    f"exceeds shape {list(shape)}")
                    break
            else:
                numel = prod(sizes)
                need = (numel if c.strides is None else extent(sizes, c.strides)) * itemsize
                if c.span.length < need:
                    problems.append(f"chunk at {list(offsets)} in {c.span.file} holds {c.span.length} bytes, "
                                    f"needs {need}")
                if numel:
                    known = len(boxes)
                    boxes[(offsets, sizes)] = None
                    covered += numel if len(boxes) > known else 0
        if len(boxes) > 1:
            distinct = list(boxes)
            problems += [f"chunks at {list(distinct[i][0])} and {list(distinct[j][0])} overlap"
                         for i, j in overlapping(distinct)]
        if not problems and covered != math.prod(shape):
            problems.append(f"chunks cover {covered} of {self.numel} elements (a rank file or chunk is missing)")
        if problems:
            raise IncompleteCheckpointError(f"tensor {self.key!r}: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor found inside a pickled object (an RNG state, a tensor in a tuple): small, read whole."""

    dtype: DType
    shape: tuple[int, ...]
    span: Span
    strides: tuple[int, ...] | None = None

    def as_entry(self, path: Path_) -> TensorEntry:
        chunk = Chunk((0,) * len(self.shape), self.shape, self.span, self.strides)
        return TensorEntry(key_of(path), path, self.dtype, self.shape, (chunk,))


def map_tensor_refs(value: Any, fn: Callable[[TensorRef], Any]) -> Any:
    """``value`` with every :class:`TensorRef` leaf replaced by ``fn(leaf)``; containers keep their type."""
    if isinstance(value, TensorRef):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, map_tensor_refs(v, fn)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensor_refs(v, fn) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor entry (step, param_groups, scheduler state). ``value`` may hold :class:`TensorRef` leaves.

    ``blob`` is where a format keeps the entry's serialized ``torch.save`` bytes (DCP does): a writer of the
    same format copies them verbatim, and the reader layer decodes ``value`` from them on demand
    (:func:`ckptkit.formats.object_value`).
    """

    key: str
    path: Path_
    value: Any = None
    blob: Span | None = None
    sidecar: str | None = None
    """The file beside the checkpoint's own files that holds this entry instead (Lightning's ``meta.pt``
    beside a DCP directory); a writer of the same format puts it back there."""


def bytes_entry(span: Span, key: str = "<bytes>") -> TensorEntry:
    """A byte span as a 1-D uint8 tensor, so that opaque blobs copy through the same byte-range machinery."""
    return TensorEntry(key, (key,), by_name("uint8"), (span.length,), (Chunk((0,), (span.length,), span),))


def key_of(path: Path_) -> str:
    return ".".join(str(p) for p in path)


@dataclass(frozen=True)
class Manifest:
    format: Format
    root: str
    tensors: tuple[TensorEntry, ...]
    objects: tuple[ObjectEntry, ...] = ()
    world_size: int | None = None
    details: tuple[tuple[str, str | int], ...] = ()
    """Format-specific facts for ``inspect`` (e.g. ``("layout", "FSDP2 Shard(0)")``); a ``"left out"`` fact
    names what the reader did not read, and conversions repeat it in their report."""
    hf_assets: str | None = None
    """A directory of Hugging Face config and tokenizer files the checkpoint carries (verl's ``huggingface/``),
    which ``export_hf`` copies when it is given none."""
    _by_key: dict[str, TensorEntry | ObjectEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_key: dict[str, TensorEntry | ObjectEntry] = {}
        for e in self.entries:
            if e.key in by_key:
                raise IncompleteCheckpointError(f"{self.root}: key {e.key!r} appears twice")
            by_key[e.key] = e
        object.__setattr__(self, "_by_key", by_key)

    def __getitem__(self, key: str) -> TensorEntry | ObjectEntry:
        return self._by_key[key]

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    @property
    def keys(self) -> list[str]:
        return list(self._by_key)

    @property
    def entries(self) -> tuple[TensorEntry | ObjectEntry, ...]:
        """The tensors, then the objects."""
        return (*self.tensors, *self.objects)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
