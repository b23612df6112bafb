"""accelerate's ``save_state`` directory, which the HF Trainer's ``checkpoint-N/`` is too, as one checkpoint.

Under FSDP with ``SHARDED_STATE_DICT`` accelerate saves the model and the optimizer as two DCP checkpoints side
by side: ``pytorch_model_fsdp_0/`` (``dcp.save({"model": ...})``) and ``optimizer_0/``
(``dcp.save({"optimizer": ...})``), next to its own files (``random_states_R.pkl``, ``scheduler.bin``; the
Trainer's ``rng_state_R.pth``, ``scheduler.pt``, ``trainer_state.json``). Their top-level groups differ, so the
two read as one SHARDED manifest, and a SHARDED output of it is written back the same way, each group into its
own directory, which accelerate's ``load_state`` (and ``ckptkit.load``) read at the new world size.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.manifest import Manifest
from ..errors import FormatError

__all__ = ["LAYOUT", "PARTS", "is_save_state", "merged", "parts_of", "trainer_step"]

PARTS = (("model", "pytorch_model_fsdp_0"), ("optimizer", "optimizer_0"))
"""(top-level group, directory) of each DCP checkpoint of a ``save_state`` directory."""
LAYOUT = "accelerate save_state"
TRAINER_STATE = "trainer_state.json"
_METADATA = ".metadata"
_MAX_STATE = 256 << 20
"""The largest ``trainer_state.json`` read: its log history grows with the run, but not to this."""


def is_save_state(path: Path) -> bool:
    """Whether ``path`` is a ``save_state`` directory: no DCP itself, both of :data:`PARTS` complete in it."""
    return (path.is_dir() and not (path / _METADATA).is_file()
            and all((path / d / _METADATA).is_file() for _, d in PARTS))


def merged(root: Path, parts: list[Manifest]) -> Manifest:
    """One manifest of the ``save_state`` directory ``root`` from its DCP checkpoints' (:data:`PARTS` order),
    naming the files beside them that it leaves to accelerate."""
    apart = sorted(p.name for p in root.iterdir() if p.name not in {d for _, d in PARTS})
    details = [("layout", f"{LAYOUT}: " + ", ".join(f"{g} in {d}/" for g, d in PARTS))]
    if apart:
        details.append(("left out", f"{', '.join(apart)} beside {', '.join(d + '/' for _, d in PARTS)} "
                                    "(accelerate's and the Trainer's own files: copy them beside the output)"))
    worlds = [m.world_size for m in parts if m.world_size]
    return Manifest(parts[0].format, str(root), tuple(t for m in parts for t in m.tensors),
                    tuple(o for m in parts for o in m.objects), max(worlds) if worlds else None,
                    tuple(details) + tuple(d for m in parts for d in m.details))


def parts_of(manifest: Manifest) -> tuple[tuple[str, str], ...] | None:
    """:data:`PARTS`, when ``manifest`` was read from a ``save_state`` directory and holds nothing but their
    groups (so that it is written back the same way); else None."""
    if not any(k == "layout" and str(v).startswith(LAYOUT) for k, v in manifest.details):
        return None
    groups = {str(e.path[0]) for e in manifest.entries}
    return PARTS if groups <= {g for g, _ in PARTS} else None


def trainer_step(path: Path) -> int | None:
    """``global_step`` of the Trainer's ``trainer_state.json`` in ``path``, if there is one.

    Raises:
        FormatError: the file is there but is not JSON that can be read (too deeply nested included).
    """
    file = path / TRAINER_STATE
    try:
        if file.stat().st_size > _MAX_STATE:
            raise FormatError(f"{file}: {file.stat().st_size:,} bytes; the Trainer's state is expected under "
                              f"{_MAX_STATE >> 20} MiB")
        text = file.read_bytes()
    except OSError:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{file}: not the Trainer's state JSON that can be read ({str(e)[:80]}); expected an "
                          "object with global_step") from None
    step = data.get("global_step") if isinstance(data, dict) else None
    return step if isinstance(step, int) else None
