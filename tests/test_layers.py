"""The package's layers, read from its source: imports go one way and form no cycle; torch stays lazy below
``training``, so ``import ckptkit`` and the command line never pay for it.

Every ``import`` statement counts, module-level or inside a function (a lazy import is still a dependency),
except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# From the source tree, without importing it: a cycle would break ``import ckptkit`` before any test ran.
ROOT = Path(__file__).resolve().parents[1] / "ckptkit"

# Lowest first; a module may import its own layer and those before it. ``ckptkit._version`` and
# ``ckptkit.errors`` are usable by all.
LAYERS = ("_version", "errors", "core", "io", "codecs", "formats", "models", "ops", "training", "harness", "top")
# Where torch may only be imported inside a function: ckptkit moves bytes without it.
TORCH_FREE = ("core", "io", "codecs", "formats", "models", "ops")
# torch, and what imports it on import.
TORCH = ("torch", "safetensors.torch", "transformers", "accelerate")


def imports_torch(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TORCH)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    lazy: bool
    """Inside a function: runs when called, not when the module is imported."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if module in ("ckptkit", "ckptkit.__main__", "ckptkit.cli", "ckptkit._cli_options", "ckptkit._cli_help",
                  "ckptkit.demo", "ckptkit._startup", "ckptkit._process"):
        return "top"
    if parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module} belongs to no layer; add its package to LAYERS in {__file__}")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.orelse:  # the ``else:`` branch runs
                yield from _walk(stmt, lazy)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        yield from _walk(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def imports_of(module: str) -> list[Import]:
    """Every module ``module`` imports, by absolute name (``from .x import y`` names ``pkg.x.y`` where that
    is a module of its own)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node, lazy in _walk(ast.parse(path.read_text(), str(path)), False):
        if isinstance(node, ast.Import):
            out += [Import(module, alias.name, node.lineno, lazy) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.append(Import(module, sub if sub in MODULES else base, node.lineno, lazy))
    return list(dict.fromkeys(out))  # one per module named, not per name imported from it


ALL_IMPORTS = [imp for m in MODULES for imp in imports_of(m)]
INTERNAL = [imp for imp in ALL_IMPORTS if imp.imported in MODULES]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.importer].relative_to(ROOT.parent)}:{imp.line} imports {imp.imported}"


def test_layers_every_module_has_a_layer():
    assert len(MODULES) > 40, sorted(MODULES)  # the walk found the package
    for m in MODULES:
        layer(m)


def test_layers_imports_never_go_upward():
    upward = [f"{_where(imp)} ({layer(imp.importer)} -> {layer(imp.imported)})" for imp in INTERNAL
              if LAYERS.index(layer(imp.imported)) > LAYERS.index(layer(imp.importer))]
    assert not upward, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)


def test_layers_errors_imports_nothing_of_ckptkit():
    assert [_where(imp) for imp in INTERNAL if imp.importer == "ckptkit.errors"] == []


def test_layers_module_graph_is_acyclic():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in INTERNAL:
        if imp.imported != imp.importer:
            graph[imp.importer].add(imp.imported)
    # Depth-first search; a back edge closes a cycle, reported as the modules along it.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_layers_torch_is_imported_lazily_below_training():
    eager = [_where(imp) for imp in ALL_IMPORTS
             if imports_torch(imp.imported) and not imp.lazy and layer(imp.importer) in TORCH_FREE]
    assert not eager, "module-level imports of torch where it must be lazy:\n" + "\n".join(eager)


@pytest.mark.parametrize("layers", [
    ("top",),       # import ckptkit, the command line and the demo's module
    TORCH_FREE,     # every module that moves bytes
])
def test_layers_import_without_torch(layers):
    # A fresh interpreter: this one has torch loaded already.
    names = sorted(m for m in MODULES if layer(m) in layers)
    program = ("import importlib, sys\n"
               f"for name in {names!r}:\n"
               "    importlib.import_module(name)\n"
               "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", f"importing the {'/'.join(layers)} modules loaded torch"


def test_formats_registry_names_each_format_its_reader_and_writer_declares():
    # The registry lists the formats without importing them (start-up time): it must say what the classes say.
    from ckptkit import formats

    for fmt, module, name, names in formats._ALL:
        cls = formats._load(module, name)
        assert cls.format is fmt and (fmt in formats.WRITABLE) == cls.writable, (module, name)
        assert cls.names == names and bool(names) == cls.writable, (module, name)
    assert sorted(f.value for f, _, _, _ in formats._ALL) == sorted(f.value for f in formats.Format)  # one reader each
    assert sorted(formats.TO) == sorted(n for *_, names in formats._ALL for n in names)  # --to lists every name


STORAGE = "ckptkit.io.storage"
# The libraries of object stores: only the storage backends reach them.
STORE_LIBRARIES = ("fsspec", "s3fs", "gcsfs", "adlfs")


def _in_storage(module: str) -> bool:
    return module == STORAGE or module.startswith(STORAGE + ".")


def test_layers_only_the_storage_backends_import_object_store_libraries():
    wrong = [_where(imp) for imp in ALL_IMPORTS if not _in_storage(imp.importer)
             and any(imp.imported == lib or imp.imported.startswith(lib + ".") for lib in STORE_LIBRARIES)]
    assert not wrong, "object store libraries imported outside ckptkit/io/storage/:\n" + "\n".join(wrong)


def test_layers_no_module_outside_storage_asks_whether_a_path_is_a_url():
    wrong = []
    for module, path in MODULES.items():
        if _in_storage(module):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                     else None)
            if named == "is_url" or isinstance(node, ast.alias) and node.name == "is_url":
                wrong.append(f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', '?')}")
    assert not wrong, "is_url outside ckptkit/io/storage/ (ask the path's Storage instead):\n" + "\n".join(wrong)


# The packages whose modules keep to each other's public names: a `_private` module is its package's own.
PUBLIC_ONLY = ("formats", "models", "ops")


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _private(module: str) -> bool:
    """A ``_``-prefixed module (not a package's ``__init__``), other than those usable by all."""
    return (layer(module) not in ("_version", "errors") and module.rpartition(".")[2].startswith("_")
            and MODULES[module].name != "__init__.py")


def test_layers_no_package_imports_a_private_module_of_another():
    wrong = [_where(imp) for imp in INTERNAL if layer(imp.importer) in PUBLIC_ONLY and _private(imp.imported)
             and _package(imp.importer) != imp.imported.rpartition(".")[0]]
    assert not wrong, "private modules imported from another package (import its public names):\n" + "\n".join(wrong)


FAMILY_WORDS = ("llama", "qwen", "mixtral", "deepseek", "gpt_oss", "gpt-oss", "kimi", "glimmer")


def test_layers_no_module_of_the_model_layer_or_ops_names_a_family_outside_its_own():
    """A family's facts live in its module under ``models/families/``: the generic code names none."""
    from ckptkit.models.registry import FAMILIES

    words = {*FAMILY_WORDS, *(f.name for f in FAMILIES if len(f.name) > 4)}
    pattern = re.compile("|".join(map(re.escape, sorted(words))), re.IGNORECASE)
    found = [f"{MODULES[m].relative_to(ROOT.parent)}:{n}: {line.strip()[:80]}" for m in MODULES
             if layer(m) in ("models", "ops") and not m.startswith("ckptkit.models.families")
             for n, line in enumerate(MODULES[m].read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "family names outside ckptkit/models/families/:\n" + "\n".join(found)
