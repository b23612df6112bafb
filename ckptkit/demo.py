"""``ckptkit demo``: the whole story on an embedded default, no files of the user's needed.

1. FSDP2 trains a small transformer on 4 gloo ranks and saves model + AdamW state with torch's DCP.
2. ckptkit inspects it, re-shards it for 3 ranks offline, and verifies the two bit for bit.
3. 3 fresh ranks load the re-sharded checkpoint with torch's own loader and train on.
4. ckptkit exports the model as HF safetensors, converts that back to a torch.save file, verifies both.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import click

from .errors import CheckpointError

__all__ = ["demo_model", "run_demo"]

STEPS = 3


def demo_model():
    """The demo's model: a small LLaMA (rotary positions), so that its export loads in ``LlamaForCausalLM``,
    which the config.json it is exported with names."""
    from .harness.model import TinyConfig

    return TinyConfig(rope=True)


def _build(rank: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    from .harness.model import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(demo_model())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_and_save(rank: int, world: int, path: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .harness.model import batch

    model, opt = _build(rank)
    losses = []
    for step in range(STEPS):
        loss = model.loss(batch(model.cfg, step, rank=rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": STEPS}, checkpoint_id=path)
    return losses


def _load_and_train(rank: int, world: int, path: str) -> tuple[int, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .harness.model import batch

    model, opt = _build(rank)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loss = model.loss(batch(model.cfg, state["step"], rank=rank))
    loss.backward()
    opt.step()
    return state["step"], loss.item()


def run_demo(workdir: Path | None = None) -> None:
    from . import convert, export_hf, inspect, reshard, verify
    from .harness.launch import run_ranks
    from .ops.inspect import render, summary

    say = click.echo
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ckptkit-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        src, r3, hf, back = root / "fsdp2-4ranks", root / "dcp-3ranks", root / "hf", root / "model.pt"
        for p in (src, r3, hf, back):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        say(f"[1/4] FSDP2 trains a {demo_model().layers}-layer LLaMA on 4 gloo ranks, saves with torch DCP")
        losses = run_ranks(_train_and_save, 4, str(src))
        say(f"      rank 0 losses: {', '.join(f'{loss:.4f}' for loss in losses[0])}")
        say("\n".join("      " + line for line in render(summary(inspect(src))).splitlines()[:3]))

        say("[2/4] ckptkit reshard -> 3 ranks (offline: no process group), then verify bit for bit")
        say("\n".join("      " + line for line in reshard(src, r3, world_size=3).lines()))
        _check(verify(src, r3), say)

        say("[3/4] 3 fresh FSDP2 ranks load the re-sharded checkpoint with torch.distributed.checkpoint.load")
        for rank, (step, loss) in enumerate(run_ranks(_load_and_train, 3, str(r3))):
            say(f"      rank {rank}: resumed at step {step}, next loss {loss:.4f}")

        say("[4/4] export-hf, convert the export back to torch.save, verify each against its source")
        assets = root / "assets"
        assets.mkdir(exist_ok=True)
        (assets / "config.json").write_text(json.dumps(demo_model().hf_config(), indent=2))
        say("\n".join("      " + line for line in export_hf(r3, hf, hf_assets=assets, overwrite=True).lines()))
        say("\n".join("      " + line for line in convert(hf, back, to="full").lines()))
        _check(verify(hf, back), say)
        files = ", ".join(sorted(p.name for p in hf.iterdir()))
        say(f"demo OK: checkpoints under {root} ({hf.name}/ holds {files})" if workdir else "demo OK")
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _check(report, say) -> None:
    if not report.ok:
        raise CheckpointError("the demo's verify found differences: "
                              + "; ".join(f"{d.key}: {d.what}" for d in report.differences))
    say(f"      verify: identical ({report.tensors} tensors, {report.bytes:,} bytes, {report.objects} other entries)")
