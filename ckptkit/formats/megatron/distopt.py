"""megatron-core's ``DistributedOptimizer`` state, saved ``dp_reshardable``, as per-parameter optimizer state.

megatron-core 0.16's ``DistributedOptimizer.sharded_state_dict`` with ``distrib_optim_sharding_type=
"dp_reshardable"`` saves its internal buffers as they are: for each bucket of each grad buffer, one 1-D tensor
per state (``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(<param>, <grad>).bucket_idx_<k>.
{param,exp_avg,exp_avg_sq}``) of the bucket's unpadded size, beside the ``per_bucket_numel`` /
``per_bucket_numel_unpadded`` objects and ``optimizer`` (the inner optimizer's param groups, ``step`` among
their fields). Where each parameter lies in a bucket follows ``_ParamAndGradBuffer.__init__``
(``distributed/param_and_grad_buffer.py``):

- the parameters of a buffer are the model's ``named_parameters()`` taken in **reverse** order;
- with the distributed optimizer, each starts at a multiple of 64 elements (``_pad_start_of_param_if_needed``);
- a bucket closes after the parameter that brings it to its size, and the next starts after the bucket's
  padding (to ``lcm(dp, 128)``): bucket ``k`` holds ``per_bucket_numel_unpadded[k]`` elements from its first
  parameter's start to its last one's end, and ``per_bucket_numel[k]`` with the padding.

The model's parameter order is not recorded as such. Two orders are tried, and the first that lays out
every bucket as saved is taken: the order the checkpoint lists its model tensors in (the model's
``sharded_state_dict`` order, a layer-stacked tensor once for all layers, expanded layer by layer), and
megatron-core's ``GPTModel`` module order with the local spec (:data:`_LAYER`), for a fully parallel save
(Megatron-LM's default), which lists each rank's tensors in turn. "As saved" means every bucket's unpadded
size, and every chunk megatron-core saved (one per parameter, padding run or rank boundary) lying within one
parameter or one padding run. A checkpoint neither order fits is refused rather than read in a guessed
order. Two parameters of the same size in swapped places (a layer's two norms) fit either way: the orders
tried are the model's own, not searched for.

Each parameter's state is then a byte range of its bucket's tensor, as chunks of the parameter's shape (a
layer-stacked tensor's layers side by side): nothing is read. The ``param`` state (the fp32 main parameters)
is left out and said so: torch's AdamW keeps no such state. Which parameter is in which param group is
megatron-core's default rule (``get_standard_config_overrides``: 1-D parameters and biases in the
``wd_mult=0`` group); other groupings are refused by name.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import Any

from ...core.boxes import range_boxes
from ...core.manifest import Chunk, Manifest, ObjectEntry, Span, TensorEntry
from ...core.tree import flatten
from ...errors import FormatError
from ..base import object_value, plain_object

__all__ = ["SECTION", "aligned", "has_buckets", "split_buckets"]

PREFIX = "optimizer.distributed."
SECTION = "optimizer"
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.*)\)\.bucket_idx_(\d+)"
                     r"\.(\w+)")
_SHARDING = "optimizer.param_state_sharding_type"
_PARAM_ALIGN = 64  # _pad_start_of_param_if_needed
_STACKED = re.compile(r"decoder\.layers\.(?!\d)")
_LEFT_OUT_SLOTS = ("param",)


def aligned(at: int) -> int:
    """Where a parameter placed after element ``at`` of a bucket starts (``_pad_start_of_param_if_needed``)."""
    return -(-at // _PARAM_ALIGN) * _PARAM_ALIGN


def has_buckets(manifest: Manifest) -> bool:
    """Whether ``manifest`` holds a ``DistributedOptimizer``'s bucket buffers."""
    return any(_BUCKET.fullmatch(t.key) for t in manifest.tensors)


@dataclass(frozen=True)
class _Param:
    """One model parameter as a buffer holds it: ``key`` (a checkpoint tensor), ``layer`` (its index along a
    layer-stacked tensor's dim 0, or None), ``shape`` (the parameter's own)."""

    key: str
    layer: int | None
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def undecayed(self) -> bool:
        """In megatron-core's default grouping, in the group without weight decay: 1-D parameters and biases."""
        return len(self.shape) == 1 or self.key.endswith(".bias")


def _object(manifest: Manifest, name: str) -> Any:
    """The value of ShardedObject ``optimizer.distributed.dp_group_idx_0.<name>`` (megatron-core saves it as a
    one-element list)."""
    entry = next((o for o in manifest.objects if o.key.split("/", 1)[0] == f"{PREFIX}dp_group_idx_0.{name}"), None)
    if entry is None:
        raise FormatError(f"{manifest.root}: the DistributedOptimizer's buckets are saved, but not its "
                          f"'{PREFIX}dp_group_idx_0.{name}' object, which says how they are laid out")
    value = object_value(entry)
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _refuse_layouts(manifest: Manifest, buckets: dict[tuple[int, int, int], dict[str, TensorEntry]]) -> None:
    sharding = next((o for o in manifest.objects if o.key == _SHARDING), None)
    kind = object_value(sharding) if sharding is not None else "dp_reshardable"
    if kind != "dp_reshardable":
        raise FormatError(f"{manifest.root}: {_SHARDING} is {kind!r:.40}; ckptkit splits the DistributedOptimizer's "
                          "buckets of 'dp_reshardable' only")
    groups = sorted({g for g, _, _ in buckets})
    if groups != [0]:
        raise FormatError(f"{manifest.root}: DistributedOptimizer buckets of dp_group_idx {groups}: one data-parallel "
                          "group per tensor- or pipeline-parallel rank (TP or PP above 1), whose buckets hold "
                          "TP-local parameters; ckptkit splits the buckets of TP=1, PP=1 runs only")
    buffers = sorted({b for _, b, _ in buckets})
    if buffers != [0]:
        raise FormatError(f"{manifest.root}: DistributedOptimizer grad buffers {buffers}: expert-parallel or "
                          "mixed-dtype parameters in buffers of their own; ckptkit splits one dense buffer only")
    experts = [t.key for t in manifest.tensors if ".experts." in t.key]
    if experts:
        raise FormatError(f"{manifest.root}: {experts[0]!r} is an expert's: expert parameters live in "
                          "expert-parallel buffers, which ckptkit does not split")


def _listed(model: list[TensorEntry]) -> list[_Param]:
    """The model's parameters in the order the checkpoint lists its tensors, each layer-stacked run of them
    expanded layer by layer where the first of the run stood."""
    stacked = [t for t in model if _STACKED.match(t.key)]
    ids = {id(t) for t in stacked}
    out: list[_Param] = []
    for t in model:
        if id(t) not in ids:
            out.append(_Param(t.key, None, t.shape))
        elif t is stacked[0]:
            out += [_Param(s.key, i, s.shape[1:]) for i in range(t.shape[0]) for s in stacked]
    return out


_TOP = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.", "decoder.final_layernorm.",
        "output_layer.")
_LAYER = tuple(f"{module}.{p}" for module, params in (
    ("input_layernorm", ("weight", "bias")), ("self_attention.linear_qkv", ("layer_norm_weight", "layer_norm_bias")),
    ("self_attention.linear_proj", ("weight", "bias")), ("self_attention.linear_qkv", ("weight", "bias")),
    ("self_attention.q_layernorm", ("weight", "bias")), ("self_attention.k_layernorm", ("weight", "bias")),
    ("pre_mlp_layernorm", ("weight", "bias")), ("mlp.linear_fc1", ("layer_norm_weight", "layer_norm_bias")),
    ("mlp.linear_fc1", ("weight", "bias")), ("mlp.linear_fc2", ("weight", "bias"))) for p in params)
"""A dense GPT layer's parameters in megatron-core's module order with the local spec (the norms are separate
modules, saved under the names the fused TE layers give them), as ``TransformerLayer`` and ``SelfAttention``
register them: ``input_layernorm``, ``linear_proj`` (made by ``Attention``), ``linear_qkv``, the q/k norms,
``pre_mlp_layernorm``, the MLP."""


def _module_order(params: list[_Param]) -> list[_Param] | None:
    """``params`` in megatron-core's ``GPTModel`` order (:data:`_TOP`, layers in order, :data:`_LAYER` within
    one); None where a name is not in these tables."""
    ranks = []
    for p in params:
        top = next((i for i, t in enumerate(_TOP) if p.key.startswith(t)), None)
        if top is None:
            return None
        layer, rest = p.layer or 0, p.key[len(_TOP[top]):]
        if _TOP[top] == "decoder.layers." and p.layer is None:
            index, _, rest = rest.partition(".")
            layer = int(index) if index.isdigit() else -1
        table = _LAYER if _TOP[top] == "decoder.layers." else ("weight", "bias")
        if rest not in table:
            return None
        ranks.append((top, layer, table.index(rest)))
    return [p for _, p in sorted(zip(ranks, params, strict=True), key=lambda rp: rp[0])]


def _order(manifest: Manifest, buckets: list[dict[str, TensorEntry]], unpadded: list[int]
           ) -> list[list[tuple[_Param, int]]]:
    """Each bucket's parameters with their start in it. The parameter order is not saved as such: the order the
    checkpoint lists its tensors in (the model's sharded state dict's, unless a fully parallel save listed each
    rank's in turn), then megatron-core's ``GPTModel`` order, whichever lays out every bucket as saved.

    Raises:
        FormatError: neither does.
    """
    model = [t for t in manifest.tensors if not t.key.startswith("optimizer.") and t.sidecar is None]
    layers = sorted({t.shape[0] for t in model if _STACKED.match(t.key)})
    if len(layers) > 1:
        raise FormatError(f"{manifest.root}: layer-stacked tensors of {layers} layers; the parameter order of the "
                          "DistributedOptimizer's buckets cannot be recovered from them")
    listed = _listed(model)
    reasons = []
    for name, params in (("the order the checkpoint lists its tensors in", listed),
                         ("megatron-core's GPTModel order (local spec)", _module_order(listed))):
        if params is None:
            reasons.append(f"{name}: it has tensors outside its tables")
            continue
        placed = _layout(params, unpadded)
        why = placed if isinstance(placed, str) else next(
            (w for k, b in enumerate(placed) for t in buckets[k].values() if (w := _check_chunks(t, b))), None)
        if why is None:
            return placed  # type: ignore[return-value]
        reasons.append(f"{name}: {why}")
    raise FormatError(f"{manifest.root}: the model's parameter order (its named_parameters(), which the "
                      f"DistributedOptimizer's buckets follow) cannot be recovered from this checkpoint: "
                      + "; ".join(reasons))


def _layout(params: list[_Param], unpadded: list[int]) -> list[list[tuple[_Param, int]]] | str:
    """Each bucket's parameters with their start in it, laid out as ``_ParamAndGradBuffer`` does; or why they
    do not fill the buckets."""
    out: list[list[tuple[_Param, int]]] = [[]]
    at = 0
    for p in reversed(params):
        if len(out) > len(unpadded):
            break
        at = aligned(at)
        out[-1].append((p, at))
        at += p.numel
        if at == unpadded[len(out) - 1]:
            out.append([])
            at = 0
        elif at > unpadded[len(out) - 1]:
            break
    if out[-1] or len(out) != len(unpadded) + 1 or sum(map(len, out)) != len(params):
        return f"its {len(params)} parameters do not fill buckets of {unpadded} elements"
    return out[:-1]


def _check_chunks(bucket: TensorEntry, placed: list[tuple[_Param, int]]) -> str | None:
    """Why ``bucket``'s chunks do not fit ``placed``: every chunk megatron-core saved lies within one parameter
    or one padding run, so a parameter order other than the one it saved shows as a chunk across an edge."""
    starts = [a for _, a in placed]
    for c in bucket.chunks:
        a, n = c.offsets[0], c.sizes[0]
        i = bisect.bisect_right(starts, a) - 1
        end = placed[i][1] + placed[i][0].numel if i >= 0 else 0
        limit = end if a < end else starts[i + 1] if i + 1 < len(starts) else bucket.shape[0]
        if a + n > limit:
            return f"{bucket.key!r} holds a chunk at [{a}, {a + n}) across a parameter's edge at {limit}"
    return None


def _state_chunks(bucket: TensorEntry, ordered: list[Chunk], p: _Param, start: int, chunks: list[Chunk]) -> None:
    """Append to ``chunks`` the chunks of ``p``'s state: elements ``[start, start + numel)`` of ``bucket``
    (whose chunks are ``ordered`` by offset), as boxes of ``p``'s shape (behind its layer's index in a
    layer-stacked tensor)."""
    itemsize = bucket.dtype.itemsize
    stop = start + p.numel
    lead = () if p.layer is None else (p.layer,)
    one = () if p.layer is None else (1,)
    first = max(bisect.bisect_right(ordered, start, key=lambda c: c.offsets[0]) - 1, 0)
    for c in ordered[first:]:
        if c.offsets[0] >= stop:
            break
        a, b = max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])
        if a >= b:
            continue
        offset = c.span.offset + (a - c.offsets[0]) * itemsize
        for offsets, sizes in range_boxes(p.shape, a - start, b - start):
            n = math.prod(sizes) * itemsize
            chunks.append(Chunk((*lead, *offsets), (*one, *sizes), Span(c.span.file, offset, n)))
            offset += n


def _moments(manifest: Manifest, buckets: list[dict[str, TensorEntry]], layout: list[list[tuple[_Param, int]]],
             slot: str) -> list[TensorEntry]:
    """State ``slot`` of every model tensor (of its shape), from the byte ranges of the buckets that hold it."""
    pieces: dict[str, list[Chunk]] = {}
    for k, placed in enumerate(layout):
        bucket = buckets[k].get(slot)
        if bucket is None:
            raise FormatError(f"{manifest.root}: bucket {k} has no {slot!r} state, which another bucket has")
        ordered = sorted(bucket.chunks, key=lambda c: c.offsets[0])
        for p, start in placed:
            _state_chunks(bucket, ordered, p, start, pieces.setdefault(p.key, []))
    shapes = {t.key: t.shape for t in manifest.tensors}
    out = []
    for key, chunks in pieces.items():
        path = (SECTION, "state", key, slot)
        entry = TensorEntry(f"{SECTION}.state.{key}.{slot}", path, buckets[0][slot].dtype, shapes[key], tuple(chunks))
        entry.validate()
        out.append(entry)
    return out


def _groups(manifest: Manifest, params: list[_Param]) -> tuple[list[dict], float]:
    """The param groups with the parameters megatron-core's default rule puts in each, and the step."""
    saved = _object(manifest, "optimizer")
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise FormatError(f"{manifest.root}: {PREFIX}dp_group_idx_0.optimizer holds no param_groups list")
    steps = {g.get("step") for g in groups}
    if len(steps) != 1 or not isinstance(next(iter(steps)), (int, float)):
        raise FormatError(f"{manifest.root}: the param groups' steps are {sorted(map(repr, steps))}; expected one")
    mults = [g.get("wd_mult") for g in groups]
    plain = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    odd = [f"{k}={g.get(k)!r}" for g in groups for k, v in plain.items()
           if g.get(k) != v or type(g.get(k)) is not type(v)]
    args = next((object_value(o) for o in manifest.objects if o.path == ("args",)), None)
    if getattr(args, "apply_wd_to_qk_layernorm", False):  # Megatron-LM's args: q/k norms join the decayed group
        odd.append("apply_wd_to_qk_layernorm=True")
    if odd or sorted(mults, key=str) not in ([0.0, 1.0], [1.0], [0.0]):
        raise FormatError(f"{manifest.root}: param groups with wd_mult {mults} {' '.join(odd)}: which parameter is "
                          "in which group is not saved, and only megatron-core's default grouping (1-D parameters "
                          "and biases apart, wd_mult 0) can be recovered")
    members: list[list[str]] = [[] for _ in groups]
    for p in params:
        match = [i for i, m in enumerate(mults) if (m == 0.0) == p.undecayed] or list(range(len(groups)))[:1]
        if p.key not in members[match[0]]:
            members[match[0]].append(p.key)
    out = [{**{k: v for k, v in g.items() if k != "step"}, "params": m} for g, m in zip(groups, members, strict=True)]
    return out, float(next(iter(steps)))


def split_buckets(manifest: Manifest) -> Manifest:
    """``manifest`` with its ``DistributedOptimizer`` buckets as per-parameter state (see the module docstring):
    ``optimizer.state.<tensor>.<slot>`` of each model tensor's shape, ``optimizer.state.<tensor>.step`` and
    ``optimizer.param_groups.<i>.<field>`` (``params`` naming the tensors).

    Args:
        manifest: A megatron-core ``torch_dist`` checkpoint's manifest holding ``dp_reshardable`` buckets.

    Returns:
        The manifest with the buckets and the optimizer's objects replaced; a ``left out`` detail names the
        fp32 main parameters.

    Raises:
        FormatError: a layout ckptkit does not split (TP or PP above 1, expert or several buffers, another
            sharding type, other param groups), or a parameter order the buckets do not confirm.
    """
    buckets: dict[tuple[int, int, int], dict[str, TensorEntry]] = {}
    for t in manifest.tensors:
        if m := _BUCKET.fullmatch(t.key):
            buckets.setdefault((int(m[1]), int(m[2]), int(m[4])), {})[m[5]] = t
    _refuse_layouts(manifest, buckets)
    per_buffer = _object(manifest, "per_bucket_numel_unpadded")
    unpadded = next(iter(per_buffer[0].values())) if isinstance(per_buffer, list) and per_buffer and isinstance(
        per_buffer[0], dict) and len(per_buffer[0]) == 1 else None
    if not isinstance(unpadded, list) or len(unpadded) != len(buckets):
        raise FormatError(f"{manifest.root}: per_bucket_numel_unpadded {per_buffer!r:.80} does not list the "
                          f"{len(buckets)} buckets saved")
    if sorted(buckets) != [(0, 0, k) for k in range(len(unpadded))] or any(
            t.shape != (unpadded[k],) for (_, _, k), states in buckets.items() for t in states.values()):
        raise FormatError(f"{manifest.root}: the DistributedOptimizer's buckets {sorted(k for *_, k in buckets)} are "
                          f"not 1-D tensors of the {unpadded} elements per_bucket_numel_unpadded lists")
    layout = _order(manifest, [buckets[0, 0, k] for k in range(len(unpadded))], unpadded)
    params = [p for placed in reversed(layout) for p, _ in reversed(placed)]  # named_parameters() order
    slots = sorted({s for b in buckets.values() for s in b if s not in _LEFT_OUT_SLOTS})
    tensors = [t for slot in slots for t in _moments(manifest, [buckets[0, 0, k] for k in range(len(layout))], layout,
                                                     slot)]
    groups, step = _groups(manifest, params)
    # torch's optimizers keep the step per parameter; Megatron keeps it in the param groups.
    objects = [ObjectEntry(f"{SECTION}.state.{k}.step", (SECTION, "state", k, "step"), step)
               for k in dict.fromkeys(p.key for p in params)]
    objects += [plain_object(path, v, manifest.root)
                for path, v in flatten(groups, lambda v: False, (SECTION, "param_groups"))]
    kept_t = [t for t in manifest.tensors if not t.key.startswith(PREFIX)]
    kept_o = [o for o in manifest.objects if not o.key.startswith(PREFIX) and o.key != _SHARDING]
    names = {t.key: t.dtype.name for t in manifest.tensors}
    weights = {names[p.key] for p in params}
    # For float32 weights megatron-core's main parameters are views of them; otherwise the weights are rounded.
    same = "they are the float32 weights" if weights == {"float32"} else (
        f"the {'/'.join(sorted(weights))} weights written are their rounded copy")
    left = ("left out", f"the DistributedOptimizer's fp32 main parameters ({', '.join(_LEFT_OUT_SLOTS)} state of "
                        f"its buckets), which torch's AdamW does not keep: {same}")
    details = (*manifest.details, ("optimizer", f"DistributedOptimizer buckets ({len(layout)}) split into "
                                                f"{', '.join(slots)} of {len(params)} parameters"), left)
    return Manifest(manifest.format, manifest.root, (*kept_t, *tensors), (*kept_o, *objects), manifest.world_size,
                    details, manifest.hf_assets)
