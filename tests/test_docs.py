"""The documentation: the MkDocs site builds with --strict (no broken link, no stale reference to the code),
its references are generated from the code itself, README.md stays a five-minute read whose links resolve,
and no development history is written into README, docs, package or tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ckptkit.cli import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                         capture_output=True, text=True, env={**_env(), "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_docs_build_strict_lists_every_command_and_its_options(site):
    page = (site / "reference" / "cli" / "index.html").read_text()
    assert isinstance(cli, click.Group)
    for name, command in cli.commands.items():
        if command.hidden:
            continue
        assert f"ckptkit {name}" in page, name
        for param in command.params:
            for opt in getattr(param, "opts", ()):
                if opt.startswith("--"):
                    assert opt in page, f"{name} {opt}"


def test_docs_api_reference_renders_the_public_functions_with_their_arguments(site):
    page = (site / "reference" / "api" / "index.html").read_text()
    for anchor in ("ckptkit.convert", "ckptkit.reshard", "ckptkit.export_hf", "ckptkit.ops.inspect.inspect",
                   "ckptkit.ops.verify.verify", "ckptkit.training.save.save", "ckptkit.training.load.load"):
        start = page.index(f'id="{anchor}"')
        end = page.find('class="doc doc-heading"', start + 200)
        section = page[start:end if end != -1 else len(page)]
        for heading in ("Parameters:", "Returns:", "Raises:"):
            assert heading in section, f"{anchor}: {heading}"


def test_readme_is_a_five_minute_read_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_install_lines_of_readme_and_getting_started_hold_no_placeholder():
    for doc in ("README.md", "docs/getting-started.md"):
        blocks = re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.DOTALL)
        lines = [line for block in blocks for line in block.splitlines() if line.startswith(("pip ", "git "))]
        assert any(line.startswith("pip install ./ckptkit") for line in lines), doc
        assert not [line for line in lines if re.search(r"<[^>]+>", line.split("#")[0])], doc


def test_cli_reference_lists_every_command_and_the_guides_run_the_users_commands():
    synopsis = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "reference" / "cli.md").read_text(), re.DOTALL)
    assert synopsis is not None
    listed = {line.split()[1] for line in synopsis.group(1).splitlines() if line.startswith("ckptkit ")}
    assert listed == {name for name, command in cli.commands.items() if not command.hidden}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        # what a user runs is the command of their environment, not a clone's development venv
        assert ".venv/bin/torchrun" not in text, page
        # a cast computes in numpy: no page says it brings torch in
        assert not re.search(r"a dtype cast (loads|imports) torch|import torch: only a dtype cast",
                             " ".join(text.split())), page


def test_no_development_history_in_readme_docs_package_or_tests():
    pattern = re.compile("this " + "round|issue [0-9]", re.IGNORECASE)
    found = []
    for base in ("README.md", "docs", "ckptkit", "tests"):
        path = ROOT / base
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if file.is_file() and file.suffix in (".md", ".py", ".yml", ".toml"):
                for n, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        found.append(f"{file.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
