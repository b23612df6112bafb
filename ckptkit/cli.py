"""``ckptkit`` command line: a thin shell over the library.

Exit codes: 0 success, 1 ``verify`` found differences, 2 bad input or usage (one line, no traceback unless
``--debug``), 130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM, as Slurm and Kubernetes send at a
time-out). An interrupted or terminated run removes its staging directory on the way out; a closed pipe
(``ckptkit verify A B | head``) ends the run quietly.

Options are shared decorators, each listed under a heading of ``--help`` (:class:`Option`'s ``section``):
a command's own options first, then the common ones, LOCAL-only ones last. Every option can also be set from
the environment: ``CKPTKIT_<COMMAND>_<OPTION>`` (click's ``auto_envvar_prefix``), and the common ones from
``CKPTKIT_<OPTION>`` for every command at once.
"""

from __future__ import annotations

import _thread
import dataclasses
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import click

from ._cli_options import (
    DEBUG,
    Command,
    assets_dir,
    debug_option,
    help_text,
    local_from,
    local_options,
    mapping_options,
    memory_option,
    option,
    quiet_option,
    size,
    storage_option,
    writing_options,
)
from ._startup import handle
from ._version import __version__
from .errors import CheckpointError
from .formats import TO

__all__ = ["main"]

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


_LIBRARY_WORDS = ((" (overwrite=True)", ""),)
"""The library's messages name its keyword beside the flag ("pass --overwrite (overwrite=True)"); a command
line user sees the flag alone."""


def _cli_words(message: str) -> str:
    for library, cli in _LIBRARY_WORDS:
        message = message.replace(library, cli)
    return message


def _fail(ctx: click.Context, message: str) -> None:
    if ctx.params.get("debug") or ctx.meta.get(DEBUG):
        traceback.print_exc()  # and the same exit code: scripts tell bad input (2) from "different" (1)
    else:
        click.echo(f"ckptkit: error: {message}", err=True)
    ctx.exit(2)


class _Group(click.Group):
    command_class = Command

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None
        except BrokenPipeError:
            _quiet_stdout()
            ctx.exit(0)
        except (CheckpointError, OSError) as e:
            _fail(ctx, _cli_words(" ".join(str(e).splitlines())))  # one line, whatever it quotes from a damaged file
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click's own: main reports them
        except Exception as e:
            # Not bad input but a failure of the run (a rank of the demo, an environment that lacks a piece):
            # still one line and 2, never 1, which is verify's "different". A rank's message ends in its
            # traceback: its first line says what failed, --debug shows the rest.
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _fail(ctx, f"{type(e).__name__}: {first} (--debug shows the traceback)" if ": " not in first
                  else f"{first} (--debug shows the traceback)")

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text(cmd)) for name in self.list_commands(ctx)
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


def _report(report, quiet: bool, as_json: bool) -> None:
    from ._process import peak_memory, seconds_since_start

    own, children = peak_memory()
    # What the user waited for and what the machine gave: from the process's start, imports included.
    report = dataclasses.replace(report, seconds=seconds_since_start(), peak_memory=own,
                                 peak_memory_workers=children if report.workers > 1 else None)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    elif not quiet or report.dry_run:
        click.echo(str(report))


def _write(op, *args, options, quiet: bool, as_json: bool, **kwargs) -> None:
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
            options = dataclasses.replace(options, workers=1)
        options = dataclasses.replace(options, progress=not quiet and not rank, distributed=rank is not None)
        report = op(*args, options=options, **kwargs)
    if not rank:
        _report(report, quiet, as_json)


@cli.command(examples=(
    "ckptkit inspect ckpt/step-1000",
    "ckptkit inspect ckpt/step-1000 --depth 3 --filter '^model\\.'",
    "ckptkit inspect model.safetensors --json | jq .dtypes",
))
@click.argument("path", type=click.Path(path_type=str))
@option("--depth", type=click.IntRange(min=1), metavar="N",
         help="A table per module instead of per tensor: keys cut to their first N dotted parts, with tensor count, "
              "parameters and bytes.")
@option("--filter", "pattern", metavar="REGEX", help="Only tensors and entries whose key matches (re.search).")
@option("--json", "as_json", is_flag=True,
         help="Machine-readable output (schema_version 1): numbers as numbers, other entries as JSON values.")
@debug_option
@storage_option
@local_options
def inspect(path: str, depth: int | None, pattern: str | None, as_json: bool, storage_options,
            **local) -> None:
    """Show format, world size, sizes, parameters and dtypes, then tensors (or modules) and other entries."""
    from .ops.inspect import family_of, inspect as _inspect, render, summary

    manifest = _inspect(path, local=local_from(**local), storage_options=storage_options)
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
@option("--to", "to", required=True, type=click.Choice(TO), metavar="FORM",
         help=f"Target format: {', '.join(TO)} (megatron: megatron-core's torch_dist, from an HF model).")
@option("--world-size", type=click.IntRange(min=1), metavar="N",
         help="Ranks to lay the output out for (default: the source's).")
@option("--max-shard-size", default=None, metavar="SIZE", callback=size,
         help="Largest output file, e.g. 5GB (hf, full).")
@option("--dtype", default="keep", show_default=True,
         type=click.Choice(["keep", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
         metavar="keep|bf16|fp16|fp32",
         help="Cast floating tensors (full, sharded, megatron, hf); FP8 and MXFP4 weights become values.")
@option("--hf-assets", metavar="DIR", callback=assets_dir,
         help="HF model folder whose config.json gives a --preset its head counts (default: SRC's own).")
@mapping_options()
@writing_options
@local_options
def convert(src, dst, to, world_size, max_shard_size, dtype, mapping, options, quiet, as_json, **local) -> None:
    """Convert SRC (any format) to DST in format --to; with a key mapping, the model part under new names."""
    from .ops.convert import ConvertOptions, convert as _convert

    output = ConvertOptions(world_size=world_size, max_shard_size=max_shard_size, dtype=dtype)
    _write(_convert, src, dst, to=to, mapping=mapping, output=output, local=local_from(**local), options=options,
           quiet=quiet, as_json=as_json)


@cli.command(examples=(
    "ckptkit reshard ckpt/step-1000 ckpt/step-1000-16 --world-size 16",
    "ckptkit reshard local-ckpt local-ckpt-2 --world-size 2 --model mypkg.model:build --auto-wrap size:1000000",
))
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@option("--world-size", required=True, type=click.IntRange(min=1), help="Ranks to lay the checkpoint out for.")
@writing_options
@local_options
def reshard(src, dst, world_size, options, quiet, as_json, **local) -> None:
    """Re-lay-out the sharded checkpoint SRC for --world-size ranks (no GPUs, no process group)."""
    from .ops.convert import reshard as _reshard

    _write(_reshard, src, dst, world_size=world_size, local=local_from(**local), options=options, quiet=quiet,
           as_json=as_json)


@cli.command("export-hf", examples=(
    "ckptkit export-hf ckpt/step-1000 hf-out --hf-assets base-model/ --dtype bf16",
    "ckptkit export-hf outputs/checkpoint/step-3000 hf-out --preset torchtitan-llama --hf-assets Llama-3.1-8B/ "
    "--dry-run",
    "ckptkit export-hf run/epoch=3.ckpt hf-out --rename '^net\\.=model.' --max-shard-size 2GB",
))
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@option("--hf-assets", metavar="DIR", callback=assets_dir,
         help="HF model folder whose files but the weights are copied (config, tokenizer, card); its config "
              "decides a tied head and a --preset's head counts.")
@option("--dtype", default="keep", show_default=True, metavar="DTYPE",
         type=click.Choice(["keep", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32", "fp8"]),
         help="Cast floating tensors to bf16, fp16 or fp32; fp8: DeepSeek-V3's 128x128-block form.")
@option("--keep-fp32", "keep_fp32", multiple=True, metavar="REGEX",
         help="Under a cast, keep tensors whose HF name matches in float32 (repeatable; as the class's own).")
@option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE", callback=size,
         help="Largest safetensors file.")
@option("--model-key", default="auto", show_default=True,
         help="Where the model sits, as a dotted path (ema.model); auto finds it.")
@option("--strip-prefix", "strip_prefixes", multiple=True, metavar="PREFIX",
         help="Also strip this leading key prefix (repeatable).")
@option("--keep-wrapper-prefixes", is_flag=True,
         help="Keep module., _orig_mod. and FSDP's wrapper prefixes.")
@mapping_options("auto")
@writing_options
@local_options
def export_hf(src, dst, model_key, dtype, keep_fp32, max_shard_size, strip_prefixes, keep_wrapper_prefixes, mapping,
              options, quiet, as_json, **local) -> None:
    """Write the model part of SRC as Hugging Face safetensors in DST, with the files of --hf-assets."""
    from .ops.export import ExportOptions, export_hf as _export

    output = ExportOptions(model_key=model_key, strip_prefixes=tuple(strip_prefixes),
                           strip_wrappers=not keep_wrapper_prefixes, dtype=dtype, keep_fp32=tuple(keep_fp32),
                           max_shard_size=max_shard_size)
    _write(_export, src, dst, mapping=mapping, output=output, local=local_from(**local), options=options, quiet=quiet,
           as_json=as_json)


@cli.command(examples=(
    "ckptkit verify ckpt/step-1000 ckpt/step-1000-16",
    "ckptkit verify ckpt/step-1000 hf-out --model-only --atol 1e-2 --rtol 1e-2   # a bf16 export of fp32 weights",
    "ckptkit verify runs/exp1   # against the checksums ckptkit.save recorded",
))
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str), required=False)
@option("--atol", type=click.FloatRange(min=0), metavar="X",
         help="Compare values, not bits: both sides upcast (dtypes may differ), equal when |a - b| <= atol + rtol * "
              "|b| (NaN equals NaN).")
@option("--rtol", type=click.FloatRange(min=0), metavar="X", help="Relative tolerance of that comparison.")
@option("--model-only", is_flag=True,
         help="Compare only the model part, found and named as export-hf finds and names it.")
@option("--strip-prefix", "strip_prefixes", multiple=True, metavar="PREFIX",
         help="Strip this leading key prefix on both sides first (repeatable), e.g. model. of a Lightning module.")
@option("--rename", "renames", multiple=True, metavar="REGEX=REPLACEMENT",
         help="Rename both sides' keys by re.sub first (repeatable, in order).")
@option("--json", "as_json", is_flag=True,
         help="Machine-readable output (schema_version 1): per differing tensor max_abs_diff, max_rel_diff, "
              "mismatched of total, first_index with value_a and value_b.")
@memory_option
@quiet_option
@debug_option
@storage_option
@local_options
def verify(a, b, atol, rtol, model_only, strip_prefixes, renames, as_json, max_memory, quiet, storage_options,
           **local) -> None:
    """Compare A and B (any formats) key by key, bit for bit or within --atol/--rtol; exit 1 if they differ.

    With A alone: check A against the checksums its ckptkit.json recorded when ckptkit.save wrote it (exit 1
    on a mismatch), or, without one, read every chunk and entry of A through.
    """
    from .ops.verify import verify as _verify

    r = _verify(a, b, model_only=model_only, atol=atol, rtol=rtol, strip_prefixes=strip_prefixes, renames=renames,
                max_memory=max_memory, progress=not quiet, local=local_from(**local),
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


@cli.command(examples=("ckptkit presets", "ckptkit presets --json | jq '.[].name'"))
@option("--json", "as_json", is_flag=True, help="Machine-readable output: a list of presets with their summaries.")
@debug_option
def presets(as_json: bool) -> None:
    """List the --preset names: framework, model family, direction and what each does to the tensors."""
    from .ops.presets import presets as _presets, render

    rows = _presets()
    click.echo(json.dumps(rows, indent=2) if as_json else render(rows))


@cli.command(examples=("ckptkit demo", "ckptkit demo --workdir /tmp/demo"))
@option("--workdir", type=click.Path(file_okay=False, path_type=Path),
         help="Keep the demo's checkpoints here (default: a temporary directory, removed after).")
@debug_option
def demo(workdir) -> None:
    """Train a small transformer on 4 gloo ranks, then reshard, export, convert back and verify."""
    from .demo import run_demo

    run_demo(workdir)


@cli.command("help", examples=("ckptkit help local", "ckptkit help workers", "ckptkit help export-hf"))
@click.argument("topic", required=False)
@click.pass_context
def help_(ctx: click.Context, topic: str | None) -> None:
    """More help: a topic that the commands' --help leaves out (local, workers), or a command's --help."""
    from ._cli_help import TOPICS, topic as _topic

    group = ctx.find_root().command
    assert isinstance(group, click.Group)
    if topic is None:
        click.echo("Topics:\n" + "".join(f"  {name:<10}{what}\n" for name, what in TOPICS.items())
                   + "Commands: ckptkit help COMMAND is its --help (ckptkit --help lists them).")
        return
    command = group.get_command(ctx, topic)
    if command is not None:
        with command.make_context(topic, ["--help"], parent=ctx.find_root(), resilient_parsing=True) as sub:
            click.echo(command.get_help(sub))
        return
    convert_command = group.get_command(ctx, "convert")
    assert convert_command is not None
    click.echo(_topic(topic, ctx, convert_command), nl=False)


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
