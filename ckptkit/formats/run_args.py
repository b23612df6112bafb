"""The run arguments training frameworks pickle beside their state, admitted as data.

Megatron-LM saves its ``args`` (an ``argparse.Namespace``, naming the attention backend by a megatron-core
enum) in ``common.pt``, its legacy rank files and, once converted, a DCP's objects; Lightning saves
``hparams`` the same way in ``meta.pt``. A ``Namespace`` is built as a record (NEWOBJ + BUILD, never called) and
the enum member looked up by value: nothing of the checkpoint's runs.
"""

from __future__ import annotations

from ..codecs.pickle_read import EnumStandIn, allow_plain_records, keep_call

__all__ = ["RUN_ARGS_GLOBALS"]

_ATTN_BACKENDS = {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5}
_ENUMS = "megatron.core.transformer.enums"
RUN_ARGS_GLOBALS = {
    **allow_plain_records("argparse", "Namespace"),
    (_ENUMS, "AttnBackend"): EnumStandIn(_ATTN_BACKENDS, keep_call(_ENUMS, "AttnBackend")),
}
"""The globals a run's arguments name, as data (extra globals for :func:`ckptkit.codecs.torchzip_read.read_archive`)."""
