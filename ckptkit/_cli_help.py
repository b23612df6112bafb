"""``ckptkit help TOPIC``: what each command's ``--help`` leaves out to stay on one screen, for those who need it.

Topics: ``local``, the options of FSDP1 ``LOCAL_STATE_DICT`` checkpoints (listed from the options themselves,
which every command that reads or writes a checkpoint accepts); ``workers``, how the writing of an output is
split between processes and machines. ``ckptkit help COMMAND`` is that command's ``--help``.
"""

from __future__ import annotations

import copy

import click

from ._cli_options import LOCAL
from .errors import UsageError

__all__ = ["TOPICS", "topic"]

_WORKERS = """\
--workers N|auto (convert, reshard, export-hf): the processes on this machine that write the
output, each its share, about equal bytes. A large file that is cast is cut into byte ranges;
one of copied bytes is written by one process. --max-memory is shared out among them; this
process writes one share and publishes the output.

auto (the default) starts as many as pay for the plan's bytes and tensors on the cores this
process may use: 1 for a small job. The report says how many, and why. CKPTKIT_WORKERS sets it
for a machine's runs (it does not apply under torchrun or to an object store, which one process
writes).

Several machines: run the command under torchrun, and each rank writes its share; rank 0
publishes. DST must be on a filesystem they all share:

    torchrun --nnodes M --nproc-per-node K ... -m ckptkit COMMAND SRC DST ...
"""

_LOCAL_INTRO = """\
FSDP1 LOCAL_STATE_DICT checkpoints (one file per rank, each holding the rank's flat parameters)
need to know how the model was wrapped, unless the checkpoint carries flat_layout.json (ckptkit
writes one). Every command that reads or writes a checkpoint takes these options:
"""

TOPICS = {"local": "the options of FSDP1 LOCAL_STATE_DICT checkpoints",
          "workers": "how --workers and torchrun split the writing of an output"}
"""Each topic, in a few words (the list ``ckptkit help`` prints)."""


def topic(name: str, ctx: click.Context, command: click.Command) -> str:
    """The text of topic ``name``; ``command`` is one that takes the LOCAL options (their help is its own).

    Raises:
        UsageError: no such topic.
    """
    if name == "workers":
        return _WORKERS
    if name != "local":
        raise UsageError(f"no help topic {name!r}; expected a command or one of {', '.join(TOPICS)}")
    formatter = ctx.make_formatter()
    formatter.write(_LOCAL_INTRO)
    rows = []
    for param in command.params:
        if isinstance(param, click.Option) and getattr(param, "section", None) == LOCAL:
            shown = copy.copy(param)
            shown.hidden = False  # each command's --help leaves it out
            record = shown.get_help_record(ctx)
            if record is not None:
                rows.append(record)
    with formatter.section("Options"):
        formatter.write_dl(rows)
    return formatter.getvalue()
