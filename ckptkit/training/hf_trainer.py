"""An optional ``transformers.Trainer`` integration: export HF safetensors beside every Trainer checkpoint.

``Trainer`` calls ``on_save`` on every process after writing ``checkpoint-<step>/`` (for FSDP runs, a DCP
directory rather than loadable weights). The callback adds ``checkpoint-<step>/<subdir>/`` holding the
model as safetensors, its ``config.json`` and the tokenizer, loadable by ``from_pretrained``.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from .save import save

__all__ = ["ExportHFCallback"]


class ExportHFCallback(TrainerCallback):
    """Add ``checkpoint-<step>/<subdir>/`` to every Trainer checkpoint: HF safetensors, config and tokenizer.

    Args:
        subdir: The name of the folder inside each ``checkpoint-<step>/``.
    """

    def __init__(self, subdir: str = "hf") -> None:
        self.subdir = subdir

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        target = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", self.subdir)
        save(target, model, form="hf")  # every process takes part: FSDP gathers the full weights
        if state.is_world_process_zero:
            inner = getattr(model, "module", model)
            if getattr(inner, "config", None) is not None:
                inner.config.save_pretrained(target)
            if processing_class is not None:
                processing_class.save_pretrained(target)
        return control
