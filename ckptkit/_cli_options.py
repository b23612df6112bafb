"""The command line's options: the ones commands share, as decorators, and how ``--help`` lists them.

Each option is listed under a heading of ``--help`` (:class:`Option`'s ``section``): a command's own options
first, then the common ones, LOCAL-only ones last. :func:`writing_options` gives a writing command its common
options as one :class:`ckptkit.io.options.WriteOptions`, and :func:`mapping_options` its key mapping as one
:class:`ckptkit.models.mapping.KeyMapping`.
"""

from __future__ import annotations

import functools
import inspect as _pyinspect
import json
from pathlib import Path

import click

__all__ = ["COMMON", "DEBUG", "LOCAL", "MAPPING", "PARALLEL", "SECTIONS", "Command", "Option", "assets_dir",
           "debug_option", "help_text", "local_from", "local_options", "mapping_options", "memory_option", "option",
           "quiet_option", "size", "storage_option", "writing_options"]

MAPPING = "Key mapping (applied in this order)"
PARALLEL = "Parallel writing"
COMMON = "Common options"
LOCAL = "LOCAL checkpoints (FSDP1 LOCAL_STATE_DICT)"
SECTIONS = (None, MAPPING, PARALLEL, COMMON, LOCAL)
"""Headings in --help order; None is the command's own options. A heading not listed goes before COMMON."""
DEBUG = "ckptkit.debug"
"""Where ``--debug`` after the command is kept: the context's ``meta``, which the group's context shares."""



def size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from .ops.convert import parse_size

    return parse_size(value, "--" + (param.name or "").replace("_", "-"))


class Option(click.Option):
    """An option that ``--help`` lists under the heading ``section`` (None: the command's own options)."""

    def __init__(self, *args, section: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def option(*decls: str, section: str | None = None, **kwargs):
    return click.option(*decls, cls=Option, section=section, **kwargs)


def help_text(command: click.Command) -> str:
    """The first paragraph of a command's help, whole: the command list shows it untruncated."""
    return " ".join(_pyinspect.cleandoc(command.help or "").split("\n\n")[0].split())


class Command(click.Command):
    """``--help`` with options grouped under their headings and an Examples section after them."""

    def __init__(self, *args, examples: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.examples = examples

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str | None, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or isinstance(param, click.Argument):
                continue
            section = COMMON if param is self.get_help_option(ctx) else getattr(param, "section", None)
            groups.setdefault(section, []).append(record)
        rank = {s: i for i, s in enumerate(SECTIONS)}
        for section in sorted(groups, key=lambda s: rank.get(s, rank[COMMON] - 0.5)):
            with formatter.section(section or "Options"):
                formatter.write_dl(groups[section])

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        if any(getattr(p, "section", None) == LOCAL for p in self.params):
            formatter.write_paragraph()
            formatter.write_text("FSDP1 LOCAL_STATE_DICT checkpoints take more options: ckptkit help local.")
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:  # verbatim: commands must not be re-wrapped
                    formatter.write(f"{'':>{formatter.current_indent}}{line}\n")


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[DEBUG] = True  # ``meta`` is shared by the group's context, which reports errors


debug_option = option("--debug", is_flag=True, expose_value=False, callback=_set_debug, section=COMMON,
                 envvar="CKPTKIT_DEBUG", help="Show tracebacks.")
quiet_option = option("--quiet", "-q", is_flag=True, section=COMMON, envvar="CKPTKIT_QUIET",
                 help="No progress bar or report.")
_overwrite = option("--overwrite", is_flag=True, section=COMMON,
                    help="Replace DST if it exists (a model folder keeps its other files).")
memory_option = option("--max-memory", default="1GiB", show_default=True, metavar="SIZE", callback=size,
                  section=COMMON, envvar="CKPTKIT_MAX_MEMORY",
                  help="Tensor bytes held in memory at once (casts, verify): 1GiB, 500MB.")
_fsync = option("--fsync", is_flag=True, section=COMMON, envvar="CKPTKIT_FSYNC",
                 help="fsync the output before publishing it (durable across power loss).")
def _worker_count(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    value = str(value).strip().lower()
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"expected auto or a number of processes of at least 1, got {value!r}")
    return n


_workers = option("--workers", default="auto", show_default=True, callback=_worker_count, metavar="N|auto",
                   section=PARALLEL, envvar="CKPTKIT_WORKERS",
                   help="Processes on this machine that write the output; auto: as many as pay (the report says "
                        "why). Several machines, torchrun: ckptkit help workers.")
_skip_checksums = option("--no-verify-checksums", "skip_checksums", is_flag=True, section=COMMON,
                         envvar="CKPTKIT_NO_VERIFY_CHECKSUMS",
                         help="Read without checking ckptkit.json's CRC-32s.")
_json = option("--json", "as_json", is_flag=True, section=COMMON,
               help="The report as JSON on stdout (schema_version 1).")
_dry_run = option("--dry-run", is_flag=True, section=COMMON,
                   help="Print the plan and what DST would lose or keep; write nothing.")


def _preset_names() -> list[str]:
    from .models.registry import PRESETS

    return ["auto", "none", *PRESETS]


class _PresetName(click.Choice):
    """A preset's name; a misspelt one is answered with the nearest names and where the list is, not all of them."""

    def convert(self, value, param, ctx):
        if value in self.choices:
            return value
        from .models.registry import unknown_preset

        self.fail(f"{value!r}: {unknown_preset(str(value), ('auto', 'none'))}", param, ctx)


_MAPPING = (
    option("--key-map", metavar="JSON|FILE.json", section=MAPPING,
            help="Old key to new key (null leaves it out), as JSON or a .json file."),
    option("--rename", "renames", multiple=True, metavar="REGEX=REPLACEMENT", section=MAPPING,
            help="Rename keys by re.sub (repeatable, in order), e.g. '^net\\.=model.'."),
    option("--preset", type=_PresetName(_preset_names()), section=MAPPING, metavar="NAME",
            help="A model family's table ('ckptkit presets' lists them): auto, the default toward HF, "
                 "detects it; none maps nothing."),
    option("--strict-map", is_flag=True, section=MAPPING,
            help="Refuse keys that neither --key-map nor --rename maps."),
    option("--megatron-args", metavar="JSON", section=MAPPING, callback=lambda c, p, v: _megatron_args(v),
            help="Megatron-LM arguments over SRC's own, for a megatron-* preset: JSON or a .json file."),
)


def _megatron_args(value: str | None) -> dict | None:
    if value is None:
        return None
    from .errors import UsageError
    from .models.mapping import read_inline_json

    try:
        args = read_inline_json(value, "--megatron-args")
    except UsageError as e:
        raise click.BadParameter(str(e).removeprefix("--megatron-args "), param_hint="--megatron-args") from None
    if not isinstance(args, dict):
        raise click.BadParameter(f"expected a JSON object, got {type(args).__name__}", param_hint="--megatron-args")
    return args


def _storage_options(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        options = json.loads(value)
    except ValueError as e:
        raise click.BadParameter(f"expected a JSON object, got {value!r} ({e})", param_hint="--storage-options") from e
    if not isinstance(options, dict):
        raise click.BadParameter(f"expected a JSON object, got {value!r}", param_hint="--storage-options")
    return options


storage_option = option(
    "--storage-options", metavar="JSON", callback=_storage_options, section=COMMON,
    envvar="CKPTKIT_STORAGE_OPTIONS",
    help="fsspec keyword arguments for s3://, gs://, az://, hf:// paths, e.g. '{\"profile\": \"prod\"}'.")


def assets_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from .io.storage import storage_for

    if value is not None and storage_for(value).scheme == "file" and not Path(value).is_dir():
        raise click.BadParameter(f"directory {value!r} does not exist", param_hint="--hf-assets")
    return value


# Kept off each command's --help (ckptkit help local lists them): few checkpoints are LOCAL ones.
_LOCAL = (
    option("--rank-files", metavar="PATTERN", section=LOCAL, hidden=True,
            help="Rank file names with {rank} for the rank, e.g. 'shard_{rank}.pt' "
                 "(default: found by name; output: the source's, or rank{rank}.pt)."),
    option("--model", metavar="PKG.MODULE:FACTORY", section=LOCAL, hidden=True,
            help="Builds the FSDP1 model, to derive the flat-parameter layout where no "
                 "flat_layout.json has it."),
    option("--auto-wrap", default="none", show_default=True, metavar="POLICY", section=LOCAL, hidden=True,
            help="FSDP auto-wrap policy of --model: none, size:<min_num_params> or "
                 "block:<module.path:Class>."),
    option("--use-orig-params/--no-use-orig-params", default=None, section=LOCAL, hidden=True,
            help="Whether FSDP wraps --model with use_orig_params (default: told by the saved sizes; "
                 "off for output)."),
    option("--param-dtype", type=click.Choice(["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
            section=LOCAL, hidden=True,
            help="The dtype FSDP computes --model in: MixedPrecision(param_dtype=...), else the "
                 "parameters' dtype at wrap time. With use_orig_params FSDP aligns parameters to 16 bytes "
                 "of it (default: the dtype --model builds)."),
)


def _apply(*options):
    """One decorator of several, applied so that --help lists them in the order given."""
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


local_options = _apply(*_LOCAL)


def mapping_options(default: str | None = None):
    """The key-mapping options, given to the command as one :class:`ckptkit.models.mapping.KeyMapping`,
    ``mapping``, with the command's own ``--hf-assets`` (``default``: the preset without ``--preset``)."""
    def decorate(command):
        @functools.wraps(command)
        def run(*args, key_map, renames, preset, strict_map, megatron_args, hf_assets, **kwargs):
            from .models.mapping import key_mapping

            mapping = key_mapping(preset=preset or default, renames=renames, key_map=key_map, strict=strict_map,
                                  hf_assets=hf_assets, megatron_args=megatron_args)
            return command(*args, mapping=mapping, **kwargs)

        return _apply(*_MAPPING)(run)

    return decorate


def writing_options(command):
    """The common options of every command that writes a checkpoint, given to ``command`` as one
    :class:`ckptkit.io.options.WriteOptions`, ``options`` (progress and ranks are the run's to decide), and
    ``quiet``."""
    @functools.wraps(command)
    def run(*args, workers, dry_run, overwrite, max_memory, fsync, storage_options, skip_checksums, **kwargs):
        from .io.options import WriteOptions

        options = WriteOptions(overwrite=overwrite, max_memory=max_memory, fsync=fsync, dry_run=dry_run,
                               storage_options=storage_options, workers=workers, verify_checksums=not skip_checksums)
        return command(*args, options=options, **kwargs)

    return _apply(_workers, _dry_run, _overwrite, memory_option, _fsync, _skip_checksums, quiet_option, _json,
                  storage_option, debug_option)(run)


def local_from(rank_files, model, auto_wrap, use_orig_params, param_dtype):
    from .formats import LocalOptions

    return LocalOptions(rank_files=rank_files, model=model, auto_wrap=auto_wrap, use_orig_params=use_orig_params,
                        param_dtype=param_dtype)
