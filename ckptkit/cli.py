"""``ckptkit`` command line: a thin shell over the library.

Exit codes: 0 success, 1 ``verify`` found differences, 2 bad input or usage (one line, no traceback unless
``--debug``), 130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM, as Slurm and Kubernetes send at a
time-out). An interrupted or terminated run removes its staging directory on the way out; a closed pipe
(``ckptkit verify A B | head``) ends the run quietly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import click

from ._startup import handle
from .errors import CheckpointError

__all__ = ["main"]


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that every ``with`` and ``finally`` on the way out runs."""


class _Interrupted(BaseException):
    """Ctrl-C, past click (which would print an empty line before its own "Aborted!")."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated()


def _size(value: str) -> int:
    from .ops.convert import parse_size

    return parse_size(value, "--max-memory")


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None
        except BrokenPipeError:
            _quiet_stdout()
            ctx.exit(0)
        except (CheckpointError, OSError) as e:
            if ctx.params.get("debug"):
                raise
            # One line, whatever the message quotes from a damaged file.
            click.echo(f"ckptkit: error: {' '.join(str(e).splitlines())}", err=True)
            ctx.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="ckptkit")
def cli(debug: bool) -> None:
    """Convert, re-shard, export and verify PyTorch FSDP checkpoints, streaming tensor by tensor."""


_quiet = click.option("--quiet", "-q", is_flag=True, help="No progress bar or report.")
_overwrite = click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
_memory = click.option("--max-memory", default="1GiB", show_default=True, callback=lambda c, p, v: _size(v),
                       help="Budget for bytes held in memory (dtype casts, verify).")
_fsync = click.option("--fsync", is_flag=True,
                      help="fsync every written file before the final rename (durable across power loss; slower).")
_storage = click.option(
    "--storage-options", metavar="JSON", callback=lambda c, p, v: _storage_options(v),
    help="For s3://, gs://, az://, hf:// paths: keyword arguments of their fsspec filesystem, e.g. "
         "'{\"endpoint_url\": \"http://127.0.0.1:9000\"}' or '{\"profile\": \"prod\"}' for s3fs (default: "
         "AWS_ENDPOINT_URL, AWS_PROFILE, ... as each library reads them).")


def _storage_options(value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        options = json.loads(value)
    except ValueError as e:
        raise click.BadParameter(f"expected a JSON object, got {value!r} ({e})", param_hint="--storage-options") from e
    if not isinstance(options, dict):
        raise click.BadParameter(f"expected a JSON object, got {value!r}", param_hint="--storage-options")
    return options


def _assets_dir(value: str | None) -> str | None:
    from .io.remote import is_url

    if value is not None and not is_url(value) and not Path(value).is_dir():
        raise click.BadParameter(f"directory {value!r} does not exist", param_hint="--hf-assets")
    return value


_LOCAL = (
    click.option("--rank-files", metavar="PATTERN",
                 help="LOCAL: rank file names with {rank} for the rank, e.g. 'shard_{rank}.pt' "
                      "(default: found by name; output: the source's, or rank{rank}.pt)."),
    click.option("--model", metavar="PKG.MODULE:FACTORY",
                 help="LOCAL: builds the FSDP1 model, to derive the flat-parameter layout where no "
                      "flat_layout.json has it."),
    click.option("--auto-wrap", default="none", show_default=True, metavar="POLICY",
                 help="LOCAL: FSDP auto-wrap policy of --model: none, size:<min_num_params> or "
                      "block:<module.path:Class>."),
    click.option("--use-orig-params/--no-use-orig-params", default=None,
                 help="LOCAL: whether FSDP wraps --model with use_orig_params (default: told by the saved sizes; "
                      "off for output)."),
    click.option("--param-dtype", type=click.Choice(["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
                 help="LOCAL: the dtype FSDP computes --model in: MixedPrecision(param_dtype=...), else the "
                      "parameters' dtype at wrap time. With use_orig_params FSDP aligns parameters to 16 bytes "
                      "of it (default: the dtype --model builds)."),
)


def _local(f):
    for option in reversed(_LOCAL):
        f = option(f)
    return f


def _local_options(rank_files, model, auto_wrap, use_orig_params, param_dtype):
    from .formats import LocalOptions

    return LocalOptions(rank_files=rank_files, model=model, auto_wrap=auto_wrap, use_orig_params=use_orig_params,
                        param_dtype=param_dtype)


def _report(report, quiet: bool) -> None:
    if not quiet:
        click.echo("\n".join(report.lines()))


@cli.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_local
@_storage
def inspect(path: str, as_json: bool, storage_options, **local) -> None:
    """Show format, world size, tensors with shapes and chunking, and other entries."""
    from .ops.inspect import inspect as _inspect, render, summary

    s = summary(_inspect(path, local=_local_options(**local), storage_options=storage_options))
    click.echo(json.dumps(s, indent=2) if as_json else render(s))


@cli.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--to", "to", required=True, type=click.Choice(["full", "sharded", "local", "hf"]), help="Target format.")
@click.option("--world-size", default=1, show_default=True, type=click.IntRange(min=1), help="Ranks (sharded, local).")
@click.option("--max-shard-size", default=None, help="Largest output file, e.g. 5GB (hf, full).")
@_local
@_overwrite
@_memory
@_fsync
@_quiet
@_storage
def convert(src, dst, to, world_size, max_shard_size, overwrite, max_memory, fsync, quiet, storage_options,
            **local) -> None:
    """Convert SRC (any format) to DST in format --to."""
    from .ops.convert import convert as _convert

    _report(_convert(src, dst, to=to, world_size=world_size, max_shard_size=max_shard_size, overwrite=overwrite,
                     max_memory=max_memory, fsync=fsync, progress=not quiet, local=_local_options(**local),
                     storage_options=storage_options), quiet)


@cli.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--world-size", required=True, type=click.IntRange(min=1), help="Ranks to lay the checkpoint out for.")
@_local
@_overwrite
@_memory
@_fsync
@_quiet
@_storage
def reshard(src, dst, world_size, overwrite, max_memory, fsync, quiet, storage_options, **local) -> None:
    """Re-lay-out the sharded checkpoint SRC for --world-size ranks (no GPUs, no process group)."""
    from .ops.convert import reshard as _reshard

    _report(_reshard(src, dst, world_size=world_size, overwrite=overwrite, max_memory=max_memory,
                     fsync=fsync, progress=not quiet, local=_local_options(**local),
                     storage_options=storage_options), quiet)


@cli.command("export-hf")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--model-key", default="auto", show_default=True,
              help="Where the model sits, as a dotted path (model, ema.model, state_dict.net); 'auto' finds it: "
                   "a model/state_dict/model_state_dict/module section, else the tensors beside the training state.")
@click.option("--dtype", default="keep", show_default=True, type=click.Choice(["keep", "bf16", "fp16", "fp32"]),
              help="Cast floating tensors; integer and bool tensors keep their dtype.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file.")
@click.option("--strip-prefix", "strip_prefixes", multiple=True,
              help="Also strip this leading key prefix (repeatable).")
@click.option("--keep-wrapper-prefixes", is_flag=True,
              help="Do not strip module., _orig_mod., _fsdp_wrapped_module., _checkpoint_wrapped_module.")
@click.option("--hf-assets", metavar="DIR", callback=lambda c, p, v: _assets_dir(v),
              help="HF model directory to copy config.json and tokenizer files from (config.json names the dtype "
                   "written; its tie_word_embeddings decides whether lm_head.weight is left out).")
@_local
@_overwrite
@_memory
@_fsync
@_quiet
@_storage
def export_hf(src, dst, model_key, dtype, max_shard_size, strip_prefixes, keep_wrapper_prefixes, hf_assets,
              overwrite, max_memory, fsync, quiet, storage_options, **local) -> None:
    """Write the model part of SRC as Hugging Face safetensors in DST."""
    from .ops.export import export_hf as _export

    _report(_export(src, dst, model_key=model_key, dtype=dtype, max_shard_size=max_shard_size,
                    strip_prefixes=strip_prefixes, strip_wrappers=not keep_wrapper_prefixes, hf_assets=hf_assets,
                    overwrite=overwrite, max_memory=max_memory, fsync=fsync, progress=not quiet,
                    local=_local_options(**local), storage_options=storage_options), quiet)


@cli.command()
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str), required=False)
@click.option("--model-only", is_flag=True,
              help="Compare only the model part, found and named as export-hf finds and names it.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_local
@_memory
@_quiet
@_storage
def verify(a, b, model_only, as_json, max_memory, quiet, storage_options, **local) -> None:
    """Compare A and B (any formats) key by key and byte by byte; exit 1 if they differ.

    With A alone: check A against the checksums its ckptkit.json recorded when ckptkit.save wrote it (exit 1
    on a mismatch), or, without one, read every chunk and entry of A through.
    """
    from .ops.verify import verify as _verify

    r = _verify(a, b, model_only=model_only, max_memory=max_memory, progress=not quiet,
                local=_local_options(**local), storage_options=storage_options)
    code = 0 if r.ok else 1
    try:
        if as_json:
            click.echo(json.dumps(r.to_json(), indent=2))
        elif not quiet or not r.ok:
            if b is None:
                how = "checked against its ckptkit.json" if r.checksums else "read through (no ckptkit.json)"
                click.echo(f"{r.a} ({r.format_a.value}): {r.tensors} tensors ({r.bytes:,} bytes) and {r.objects} "
                           f"other entries {how}")
                click.echo("ok" if r.ok else f"{len(r.differences)} differences:")
            else:
                click.echo(f"{a} ({r.format_a.value}) vs {b} ({r.format_b.value if r.format_b else '?'}): "
                           f"{r.tensors} tensors ({r.bytes:,} bytes) and {r.objects} other entries compared")
                click.echo("identical" if r.ok else f"{len(r.differences)} differences:")
            for d in r.differences:
                click.echo(f"  {d.key}: {d.what}")
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
    sys.exit(code)


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the demo's checkpoints here (default: a temporary directory, removed after).")
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
    try:
        try:
            returned = cli.main(args=argv, prog_name="ckptkit", standalone_mode=False)
            code = returned if isinstance(returned, int) else 0  # ctx.exit(n) comes back as n
        except click.exceptions.Exit as e:
            code = e.exit_code
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
