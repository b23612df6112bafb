"""``ckptkit`` command line: a thin shell over the library.

Exit codes: 0 success, 1 ``verify`` found differences, 2 bad input or usage (one line, no traceback unless
``--debug``), 130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM, as Slurm and Kubernetes send at a
time-out). An interrupted or terminated run removes its staging directory on the way out; a closed pipe
(``ckptkit verify A B | head``) ends the run quietly.

Options are shared decorators, each listed under a heading of ``--help`` (:class:`_Option`'s ``section``):
a command's own options first, then the common ones, LOCAL-only ones last. Every option can also be set from
the environment: ``CKPTKIT_<COMMAND>_<OPTION>`` (click's ``auto_envvar_prefix``), and the common ones from
``CKPTKIT_<OPTION>`` for every command at once.
"""

from __future__ import annotations

import _thread
import inspect as _pyinspect
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import click

from ._startup import handle
from ._version import __version__
from .errors import CheckpointError

__all__ = ["main"]

MAPPING = "Key mapping (applied in this order)"
PARALLEL = "Parallel writing"
COMMON = "Common options"
LOCAL = "LOCAL checkpoints (FSDP1 LOCAL_STATE_DICT)"
_SECTIONS = (None, MAPPING, PARALLEL, COMMON, LOCAL)
"""Headings in --help order; None is the command's own options. A heading not listed goes before COMMON."""
_DEBUG = "ckptkit.debug"



class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that every ``with`` and ``finally`` on the way out runs."""


class _Interrupted(BaseException):
    """Ctrl-C, past click (which would print an empty line before its own "Aborted!")."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated()


def _unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """A Ctrl-C or SIGTERM whose exception was raised inside a callback (a weakref's, a ``__del__``, as a
    thread pool's clean-up runs them), where Python can only print it and go on: the run would carry on as if
    never stopped. Another thread sends the signal again to this one (the main thread, where Python raises a
    signal's exception), so that its handler raises in the program itself, cutting short a wait; sent from
    here, the handler would run at once, inside this hook, and be ignored again. Should it land in a callback
    again, this runs again."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, (KeyboardInterrupt, _Terminated)):
        signum = signal.SIGINT if issubclass(unraisable.exc_type, KeyboardInterrupt) else signal.SIGTERM
        _thread.start_new_thread(signal.pthread_kill, (_thread.get_ident(), signum))  # (Thread.start() would wait)
        return
    sys.__unraisablehook__(unraisable)


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from .ops.convert import parse_size

    return parse_size(value, "--" + (param.name or "").replace("_", "-"))


class _Option(click.Option):
    """An option that ``--help`` lists under the heading ``section`` (None: the command's own options)."""

    def __init__(self, *args, section: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def _option(*decls: str, section: str | None = None, **kwargs):
    return click.option(*decls, cls=_Option, section=section, **kwargs)


def _help_text(command: click.Command) -> str:
    """The first paragraph of a command's help, whole: the command list shows it untruncated."""
    return " ".join(_pyinspect.cleandoc(command.help or "").split("\n\n")[0].split())


class _Command(click.Command):
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
        rank = {s: i for i, s in enumerate(_SECTIONS)}
        for section in sorted(groups, key=lambda s: rank.get(s, rank[COMMON] - 0.5)):
            with formatter.section(section or "Options"):
                formatter.write_dl(groups[section])

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:  # verbatim: commands must not be re-wrapped
                    formatter.write(f"{'':>{formatter.current_indent}}{line}\n")


_LIBRARY_WORDS = ((" (overwrite=True)", ""),)
"""The library's messages name its keyword beside the flag ("pass --overwrite (overwrite=True)"); a command
line user sees the flag alone."""


def _cli_words(message: str) -> str:
    for library, cli in _LIBRARY_WORDS:
        message = message.replace(library, cli)
    return message


class _Group(click.Group):
    command_class = _Command

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None
        except BrokenPipeError:
            _quiet_stdout()
            ctx.exit(0)
        except (CheckpointError, OSError) as e:
            if ctx.params.get("debug") or ctx.meta.get(_DEBUG):
                traceback.print_exc()  # and the same exit code: scripts tell bad input (2) from "different" (1)
            else:
                # One line, whatever the message quotes from a damaged file.
                click.echo(f"ckptkit: error: {_cli_words(' '.join(str(e).splitlines()))}", err=True)
            ctx.exit(2)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _help_text(cmd)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group("ckptkit", cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100,
                                           "auto_envvar_prefix": "CKPTKIT"},
             epilog="Every option can be set from the environment: CKPTKIT_<COMMAND>_<OPTION> (e.g. "
                    "CKPTKIT_EXPORT_HF_DTYPE=bf16), and the common options for every command from CKPTKIT_<OPTION> "
                    "(CKPTKIT_MAX_MEMORY=4GiB, CKPTKIT_QUIET=1). Shell completion: "
                    "eval \"$(_CKPTKIT_COMPLETE=bash_source ckptkit)\" (zsh_source, fish_source for other shells).")
@click.option("--debug", is_flag=True, help="Show tracebacks (also accepted after the command).")
@click.version_option(__version__, prog_name="ckptkit")
def cli(debug: bool) -> None:
    """Convert, re-shard, export and verify PyTorch FSDP checkpoints, streaming tensor by tensor."""


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_DEBUG] = True  # ``meta`` is shared by the group's context, which reports errors


_debug = _option("--debug", is_flag=True, expose_value=False, callback=_set_debug, section=COMMON,
                 envvar="CKPTKIT_DEBUG", help="Show tracebacks.")
_quiet = _option("--quiet", "-q", is_flag=True, section=COMMON, envvar="CKPTKIT_QUIET",
                 help="No progress bar or report.")
_overwrite = _option("--overwrite", is_flag=True, section=COMMON, help="Replace DST if it exists.")
_memory = _option("--max-memory", default="1GiB", show_default=True, metavar="SIZE", callback=_size,
                  section=COMMON, envvar="CKPTKIT_MAX_MEMORY",
                  help="Budget for tensor bytes held in memory (dtype casts, verify): 1GiB, 500MB, 1000000.")
_fsync = _option("--fsync", is_flag=True, section=COMMON, envvar="CKPTKIT_FSYNC",
                 help="fsync every written file before the final rename (durable across power loss; slower).")
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


_workers = _option("--workers", default="auto", show_default=True, callback=_worker_count, metavar="N|auto",
                   section=PARALLEL, envvar="CKPTKIT_WORKERS",
                   help="Processes on this machine that write the output, each its share (about equal bytes; a "
                        "large file is cut into byte ranges), --max-memory shared out among them; this process "
                        "writes one share and publishes. auto: as many as pay for the plan's bytes and tensors on "
                        "the cores this process may use (1 for a small job); the report says how many and why. "
                        "Several machines: run the "
                        "command under torchrun (torchrun --nnodes M --nproc-per-node K ... -m ckptkit COMMAND ...): "
                        "each rank writes its share, rank 0 publishes; DST must be on a filesystem they all share.")
_dry_run = _option("--dry-run", is_flag=True, section=COMMON,
                   help="Print the plan (files and sizes, keys renamed, left out and cast, assets copied) and "
                        "write nothing.")


def _presets_help() -> str:
    from .ops.presets import PRESETS

    return ("A model family's adapter (names, stacked experts, transforms): auto (the default for HF output): "
            "the family's, detected from config.json's model_type and the keys; none: no mapping; "
            + "; ".join(f"{p.name}: {p.summary}" for p in PRESETS.values()) + ".")


def _preset_names() -> list[str]:
    from .ops.presets import PRESETS

    return ["auto", "none", *PRESETS]


_MAPPING = (
    _option("--key-map", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="FILE.json",
            section=MAPPING, help="A JSON object of old key to new key (null leaves the key out)."),
    _option("--rename", "renames", multiple=True, metavar="REGEX=REPLACEMENT", section=MAPPING,
            help="Rename keys by re.sub (repeatable, applied in order), e.g. '^net\\.=model.' or "
                 "'\\.attn\\.=.self_attn.'; \\1 refers to a group."),
    _option("--preset", type=click.Choice(_preset_names()), section=MAPPING, help=_presets_help()),
    _option("--strict-map", is_flag=True, section=MAPPING,
            help="Refuse keys that neither --key-map nor a --rename maps (a --preset always refuses keys it does "
                 "not know)."),
)


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


_storage = _option(
    "--storage-options", metavar="JSON", callback=_storage_options, section=COMMON,
    envvar="CKPTKIT_STORAGE_OPTIONS",
    help="For s3://, gs://, az://, hf:// paths: keyword arguments of their fsspec filesystem, e.g. "
         "'{\"endpoint_url\": \"http://127.0.0.1:9000\"}' or '{\"profile\": \"prod\"}' for s3fs (default: "
         "AWS_ENDPOINT_URL, AWS_PROFILE, ... as each library reads them).")


def _assets_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from .io.storage import storage_for

    if value is not None and storage_for(value).scheme == "file" and not Path(value).is_dir():
        raise click.BadParameter(f"directory {value!r} does not exist", param_hint="--hf-assets")
    return value


_LOCAL = (
    _option("--rank-files", metavar="PATTERN", section=LOCAL,
            help="Rank file names with {rank} for the rank, e.g. 'shard_{rank}.pt' "
                 "(default: found by name; output: the source's, or rank{rank}.pt)."),
    _option("--model", metavar="PKG.MODULE:FACTORY", section=LOCAL,
            help="Builds the FSDP1 model, to derive the flat-parameter layout where no "
                 "flat_layout.json has it."),
    _option("--auto-wrap", default="none", show_default=True, metavar="POLICY", section=LOCAL,
            help="FSDP auto-wrap policy of --model: none, size:<min_num_params> or "
                 "block:<module.path:Class>."),
    _option("--use-orig-params/--no-use-orig-params", default=None, section=LOCAL,
            help="Whether FSDP wraps --model with use_orig_params (default: told by the saved sizes; "
                 "off for output)."),
    _option("--param-dtype", type=click.Choice(["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
            section=LOCAL,
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


_local = _apply(*_LOCAL)
_mapping = _apply(*_MAPPING)
_writing = _apply(_workers, _dry_run, _overwrite, _memory, _fsync, _quiet, _storage, _debug)
"""The common options of every command that writes a checkpoint."""


def _local_options(rank_files, model, auto_wrap, use_orig_params, param_dtype):
    from .formats import LocalOptions

    return LocalOptions(rank_files=rank_files, model=model, auto_wrap=auto_wrap, use_orig_params=use_orig_params,
                        param_dtype=param_dtype)


def _report(report, quiet: bool) -> None:
    if not quiet or report.dry_run:
        click.echo(str(report))


def _write(op, *args, quiet: bool, **kwargs) -> None:
    """Run ``op`` (convert, reshard, export_hf) in this process, or on this rank of torchrun's ranks: all of them
    then write, and rank 0 reports."""
    from .io.parallel import torchrun_group
    from .io.storage import storage_for

    with torchrun_group() as rank:
        source = click.get_current_context().get_parameter_source("workers")
        one_writer = rank is not None or not storage_for(args[1]).shared_writes
        if source is click.core.ParameterSource.ENVIRONMENT and one_writer:
            # CKPTKIT_WORKERS, set for a machine's runs, does not apply where workers cannot: under torchrun
            # (the ranks split the files) or to an object store (one process writes). --workers N still says so.
            kwargs["workers"] = 1
        report = op(*args, progress=not quiet and not rank, distributed=rank is not None, **kwargs)
    if not rank:
        _report(report, quiet)


@cli.command(examples=(
    "ckptkit inspect ckpt/step-1000",
    "ckptkit inspect ckpt/step-1000 --depth 3 --filter '^model\\.'",
    "ckptkit inspect model.safetensors --json | jq .dtypes",
))
@click.argument("path", type=click.Path(path_type=str))
@_option("--depth", type=click.IntRange(min=1), metavar="N",
         help="A table per module instead of per tensor: keys cut to their first N dotted parts, with tensor count, "
              "parameters and bytes.")
@_option("--filter", "pattern", metavar="REGEX", help="Only tensors and entries whose key matches (re.search).")
@_option("--json", "as_json", is_flag=True,
         help="Machine-readable output (schema_version 1): numbers as numbers, other entries as JSON values.")
@_debug
@_storage
@_local
def inspect(path: str, depth: int | None, pattern: str | None, as_json: bool, storage_options,
            **local) -> None:
    """Show format, world size, sizes, parameters and dtypes, then tensors (or modules) and other entries."""
    from .ops.detect import family_of
    from .ops.inspect import inspect as _inspect, render, summary

    manifest = _inspect(path, local=_local_options(**local), storage_options=storage_options)
    found = family_of(manifest, path)
    s = summary(manifest, depth=depth, filter=pattern, family=(found.preset, found.why))
    click.echo(json.dumps(s, indent=2) if as_json else render(s))


@cli.command(examples=(
    "ckptkit convert ckpt/step-1000 model.pt --to full",
    "ckptkit convert ckpt/step-1000 hf-out --to hf --max-shard-size 2GB",
    "ckptkit convert Llama-3.2-1B titan-init --to sharded --world-size 8 --preset torchtitan-llama",
))
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@_option("--to", "to", required=True, type=click.Choice(["full", "sharded", "local", "hf", "megatron"]),
         help="Target format (megatron: megatron-core's torch_dist, from an HF model).")
@_option("--world-size", type=click.IntRange(min=1),
         help="Ranks to lay the output out for (sharded, local, megatron; default: the source's world size).")
@_option("--max-shard-size", default=None, metavar="SIZE", callback=_size,
         help="Largest output file, e.g. 5GB (hf, full).")
@_option("--hf-assets", metavar="DIR", callback=_assets_dir,
         help="HF model directory whose config.json gives a --preset the head counts (default: SRC's own "
              "config.json, or params.json beside it).")
@_mapping
@_writing
@_local
def convert(src, dst, to, world_size, max_shard_size, hf_assets, key_map, renames, preset, strict_map, workers,
            dry_run, overwrite, max_memory, fsync, quiet, storage_options, **local) -> None:
    """Convert SRC (any format) to DST in format --to; with a key mapping, the model part under new names."""
    from .ops.convert import convert as _convert

    _write(_convert, src, dst, to=to, world_size=world_size, max_shard_size=max_shard_size, overwrite=overwrite,
           max_memory=max_memory, fsync=fsync, local=_local_options(**local), preset=preset, renames=renames,
           key_map=key_map, strict_map=strict_map, hf_assets=hf_assets, dry_run=dry_run, workers=workers,
           storage_options=storage_options, quiet=quiet)


@cli.command(examples=(
    "ckptkit reshard ckpt/step-1000 ckpt/step-1000-16 --world-size 16",
    "ckptkit reshard local-ckpt local-ckpt-2 --world-size 2 --model mypkg.model:build --auto-wrap size:1000000",
))
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@_option("--world-size", required=True, type=click.IntRange(min=1), help="Ranks to lay the checkpoint out for.")
@_writing
@_local
def reshard(src, dst, world_size, workers, dry_run, overwrite, max_memory, fsync, quiet, storage_options,
            **local) -> None:
    """Re-lay-out the sharded checkpoint SRC for --world-size ranks (no GPUs, no process group)."""
    from .ops.convert import reshard as _reshard

    _write(_reshard, src, dst, world_size=world_size, overwrite=overwrite, max_memory=max_memory, fsync=fsync,
           local=_local_options(**local), dry_run=dry_run, workers=workers,
           storage_options=storage_options, quiet=quiet)


@cli.command("export-hf", examples=(
    "ckptkit export-hf ckpt/step-1000 hf-out --hf-assets base-model/ --dtype bf16",
    "ckptkit export-hf outputs/checkpoint/step-3000 hf-out --preset torchtitan-llama --hf-assets Llama-3.1-8B/ "
    "--dry-run",
    "ckptkit export-hf run/epoch=3.ckpt hf-out --rename '^net\\.=model.' --max-shard-size 2GB",
))
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@_option("--hf-assets", metavar="DIR", callback=_assets_dir,
         help="HF model directory whose every file but weights, training state and caches is copied: config, "
              "tokenizer, generation config, sentence-transformers modules, model card (config.json names the dtype "
              "written; its tie_word_embeddings decides whether lm_head.weight is left out; a --preset takes "
              "its head counts).")
@_option("--dtype", default="keep", show_default=True,
         type=click.Choice(["keep", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
         help="Cast floating tensors; integer and bool tensors keep their dtype.")
@_option("--keep-fp32", "keep_fp32", multiple=True, metavar="REGEX",
         help="Under --dtype bf16|fp16, write floating tensors whose HF name matches in float32 (repeatable). "
              "Modules the --hf-assets model class keeps in float32 (_keep_in_fp32_modules) are kept too.")
@_option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE", callback=_size,
         help="Largest safetensors file.")
@_option("--model-key", default="auto", show_default=True,
         help="Where the model sits, as a dotted path (model, ema.model, state_dict.net); 'auto' finds it: "
              "a model/state_dict/model_state_dict/module section, else the tensors beside the training state.")
@_option("--strip-prefix", "strip_prefixes", multiple=True, metavar="PREFIX",
         help="Also strip this leading key prefix (repeatable).")
@_option("--keep-wrapper-prefixes", is_flag=True,
         help="Do not strip module., _orig_mod., _fsdp_wrapped_module., _checkpoint_wrapped_module.")
@_mapping
@_writing
@_local
def export_hf(src, dst, model_key, dtype, keep_fp32, max_shard_size, strip_prefixes, keep_wrapper_prefixes, hf_assets,
              key_map, renames, preset, strict_map, workers, dry_run, overwrite, max_memory, fsync, quiet,
              storage_options,
              **local) -> None:
    """Write the model part of SRC as Hugging Face safetensors in DST, with the files of --hf-assets."""
    from .ops.export import export_hf as _export

    _write(_export, src, dst, model_key=model_key, dtype=dtype, max_shard_size=max_shard_size,
           strip_prefixes=strip_prefixes, strip_wrappers=not keep_wrapper_prefixes, hf_assets=hf_assets,
           preset=preset or "auto", renames=renames, key_map=key_map, strict_map=strict_map, keep_fp32=keep_fp32,
           overwrite=overwrite, max_memory=max_memory, fsync=fsync, local=_local_options(**local), dry_run=dry_run,
           workers=workers, storage_options=storage_options, quiet=quiet)


@cli.command(examples=(
    "ckptkit verify ckpt/step-1000 ckpt/step-1000-16",
    "ckptkit verify ckpt/step-1000 hf-out --model-only --atol 1e-2 --rtol 1e-2   # a bf16 export of fp32 weights",
    "ckptkit verify runs/exp1   # against the checksums ckptkit.save recorded",
))
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str), required=False)
@_option("--atol", type=click.FloatRange(min=0), metavar="X",
         help="Compare values, not bits: both sides upcast (dtypes may differ), equal when |a - b| <= atol + rtol * "
              "|b| (NaN equals NaN).")
@_option("--rtol", type=click.FloatRange(min=0), metavar="X", help="Relative tolerance of that comparison.")
@_option("--model-only", is_flag=True,
         help="Compare only the model part, found and named as export-hf finds and names it.")
@_option("--strip-prefix", "strip_prefixes", multiple=True, metavar="PREFIX",
         help="Strip this leading key prefix on both sides first (repeatable), e.g. model. of a Lightning module.")
@_option("--rename", "renames", multiple=True, metavar="REGEX=REPLACEMENT",
         help="Rename both sides' keys by re.sub first (repeatable, in order).")
@_option("--json", "as_json", is_flag=True,
         help="Machine-readable output (schema_version 1): per differing tensor max_abs_diff, max_rel_diff, "
              "mismatched of total, first_index with value_a and value_b.")
@_memory
@_quiet
@_debug
@_storage
@_local
def verify(a, b, atol, rtol, model_only, strip_prefixes, renames, as_json, max_memory, quiet, storage_options,
           **local) -> None:
    """Compare A and B (any formats) key by key, bit for bit or within --atol/--rtol; exit 1 if they differ.

    With A alone: check A against the checksums its ckptkit.json recorded when ckptkit.save wrote it (exit 1
    on a mismatch), or, without one, read every chunk and entry of A through.
    """
    from .ops.verify import verify as _verify

    r = _verify(a, b, model_only=model_only, atol=atol, rtol=rtol, strip_prefixes=strip_prefixes, renames=renames,
                max_memory=max_memory, progress=not quiet, local=_local_options(**local),
                storage_options=storage_options)
    code = 0 if r.ok else 1
    try:
        if as_json:
            click.echo(json.dumps(r.to_json(), indent=2))
        elif not quiet or not r.ok:
            click.echo(str(r))
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
    sys.exit(code)


@cli.command(examples=("ckptkit demo", "ckptkit demo --workdir /tmp/demo"))
@_option("--workdir", type=click.Path(file_okay=False, path_type=Path),
         help="Keep the demo's checkpoints here (default: a temporary directory, removed after).")
@_debug
def demo(workdir) -> None:
    """Train a small transformer on 4 gloo ranks, then reshard, export, convert back and verify."""
    from .demo import run_demo

    run_demo(workdir)


from .harness.cli import harness  # noqa: E402  (torch-free until a cell runs)

cli.add_command(harness)


def _quiet_stdout() -> None:
    """After the reader of our stdout went away: send the rest (and the flush at exit) nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> None:
    """The ``ckptkit`` console script: every failure is one line on stderr and an exit code (see above)."""
    handle(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on (see _startup)
    handle(signal.SIGTERM, _terminate)
    sys.unraisablehook = _unraisable
    try:
        try:
            returned = cli.main(args=argv, prog_name="ckptkit", standalone_mode=False)
            code = returned if isinstance(returned, int) else 0  # ctx.exit(n) comes back as n
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.exceptions.NoArgsIsHelpError as e:
            # No command: the help, as git and hf print it, on stdout (ready for a pager); exit 2 as for any
            # command line that asks for nothing ckptkit can do.
            click.echo(e.format_message())
            code = 2
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"ckptkit: error: {' '.join(e.format_message().split())}{hint}", err=True)
            code = 2
        except click.ClickException as e:
            click.echo(f"ckptkit: error: {' '.join(e.format_message().split())}", err=True)
            code = 2
        sys.stdout.flush()
    except (KeyboardInterrupt, _Interrupted, click.exceptions.Abort):
        click.echo("ckptkit: interrupted", err=True)
        code = 130
    except _Terminated:
        click.echo("ckptkit: terminated", err=True)
        code = 143
    except BrokenPipeError:
        _quiet_stdout()
        code = 0
    # The outcome is decided: a signal while the interpreter shuts down must not turn it into a kill by signal.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    main()
