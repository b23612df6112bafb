"""``bin/bench save``: ``ckptkit.save`` in a training loop against torch's ``dcp.save`` of the same state.

Each contender is a training process of its own (one CPU process, no process group): a stack of linear layers
in float32 with its AdamW state, about ``--size`` bytes in all, a training step between saves, ``--saves``
saves timed one by one (after an untimed first). ``ckptkit.save(run, model, optimizer=opt, step=i,
keep_last=2)`` stages, writes the DCP with its checksums, publishes (``ckptkit.json``, completion marker,
rename, ``latest``) and rotates; the ``dcp.save`` loop writes ``get_state_dict``'s state to a directory per step
and keeps the two most recent, deleting the older in a thread as torchtitan's checkpointer purges. Both fsync
their files (``dcp.save``'s default). The table shows the median time of one save, each process's peak RSS (the
model and optimizer included), the ratio to ``dcp.save``, and a ``cp -r`` of one saved step (the same bytes).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

from .runner import cp, remove, run, time_rows
from .table import cores, load

__all__ = ["bench_save", "save_ratio"]

_LOOP = """
import json, os, shutil, sys, threading, time, warnings
import torch
from torch import nn
how, root, dim, layers, saves = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
warnings.filterwarnings("ignore")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False))
                        for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if how == "ckptkit":
    import ckptkit

    def save(i):
        ckptkit.save(root, model, optimizer=opt, step=i, keep_last=2).wait()
else:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    purging = []

    def save(i):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"step-{i:08d}"))
        for t in purging:
            t.join()
        old = os.path.join(root, f"step-{i - 2:08d}")
        if os.path.exists(old):
            purging[:] = [threading.Thread(target=shutil.rmtree, args=(old,))]
            purging[0].start()
times = []
for i in range(saves + 1):
    model(torch.randn(2, dim)).sum().backward()
    opt.step()
    opt.zero_grad()
    os.sync()
    start = time.perf_counter()
    save(i)
    if i:
        times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def _layers(size: int, dim: int) -> int:
    return max(1, size // (3 * 4 * 8 * dim * dim))  # float32 weights and two moments, 8 dim^2 a layer


def save_ratio(size: int, saves: int, repeat: int, root: Path) -> tuple[list[tuple[str, float, float]], float]:
    """Run both loops ``repeat`` times, interleaved: per contender (name, median seconds a save, peak RSS), and
    ckptkit's ratio to ``dcp.save``; then a ``cp -r`` of one step of the same bytes."""
    dim = 1024
    layers = _layers(size, dim)
    found: dict[str, tuple[list[float], list[float]]] = {"dcp.save": ([], []), "ckptkit.save": ([], [])}
    log = root / "save.log"
    for _ in range(repeat):
        for name, how in (("dcp.save", "dcp"), ("ckptkit.save", "ckptkit")):
            run_dir = root / f"run-{how}"
            _, rss = run([sys.executable, "-c", _LOOP, how, str(run_dir), str(dim), str(layers), str(saves)], log)
            found[name][0].extend(json.loads(Path(f"{log}.out").read_text()))
            found[name][1].append(rss)
            if how == "dcp":
                step = sorted(run_dir.glob("step-*"))[-1]
                remove(root / "step")
                step.rename(root / "step")
            remove(run_dir)
    copy = cp(root / "step")
    time_rows([copy], repeat, root)
    rows = [(name, statistics.median(t), max(r)) for name, (t, r) in found.items()]
    rows.append((copy.name + " (one step)", statistics.median(w for w, _ in copy.runs), max(r for _, r in copy.runs)))
    return rows, rows[1][1] / rows[0][1]


def bench_save(size: int, saves: int, repeat: int, root: Path) -> None:
    rows, ratio = save_ratio(size, saves, repeat, root)
    nbytes = sum(p.stat().st_size for p in (root / "step").iterdir())
    click.echo(f"state: {nbytes / 1e9:.2f} GB as DCP files (float32 linear layers with AdamW); {cores()} cores, "
               f"load {load()}; median of {repeat} x {saves} saves, each process its own")
    click.echo(f"{'what':<40} {'s a save':>9} {'peak RSS MB':>12} {'x dcp.save':>11} {'x cp':>6}")
    for name, wall, rss in rows:
        click.echo(f"{name:<40} {wall:9.2f} {rss / 2**20:12.0f} {wall / rows[0][1]:11.2f} {wall / rows[2][1]:6.2f}")
    click.echo(f"ckptkit.save against dcp.save: {ratio:.2f}x")
