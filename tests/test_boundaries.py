"""The layout's import boundaries, checked on the source with `ast` (nothing is imported):

- services talk only through Redis: services.gateway, services.tokenizer and services.engine never import
  each other (services/cli.py is the launcher and may start any of them);
- kernels/ and shared/ sit below the services and import none of them;
- nothing shipped imports tests/ or bench/, and bench/ does not import tests/;
- no two first-party modules import each other, directly or around a longer circle.

Every import counts: module level, inside functions (lazy) and under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("services", "kernels", "shared", "bench", "tests")
SERVICES = ("services.gateway", "services.tokenizer", "services.engine")
LAUNCHERS = frozenset({"services", "services.cli"})
_SKIP_DIRS = {".venv", "build", "results", "__pycache__", ".git"}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported} ({self.rule})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, str]:
    """Module name -> source of every first-party .py file."""
    files: dict[str, str] = {}
    for top in FIRST_PARTY:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not _SKIP_DIRS & set(path.relative_to(ROOT).parts):
                files[module_name(path)] = path.read_text()
    return files


def imports_of(module: str, source: str, is_package: bool = False) -> Iterator[tuple[str, int]]:
    """(absolute imported name, line) for each import in `source`; `from a import b` yields a.b (a module
    or a name in a: callers resolve which)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield (f"{base}.{alias.name}" if alias.name != "*" else base), node.lineno


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _service_of(name: str) -> str | None:
    return next((s for s in SERVICES if _within(name, s)), None)


def check_module(module: str, source: str, is_package: bool = False) -> list[Violation]:
    """The layer rules (not cycles) for one module's imports."""
    found = []
    own_service = _service_of(module)
    for imported, line in imports_of(module, source, is_package):
        if imported.split(".")[0] not in FIRST_PARTY:
            continue
        rule = None
        target_service = _service_of(imported)
        if module in LAUNCHERS or _within(module, "tests"):
            rule = None
        elif _within(module, "bench"):
            if _within(imported, "tests"):
                rule = "bench never imports tests"
        elif _within(imported, "tests") or _within(imported, "bench"):
            rule = "shipped code never imports tests or bench"
        elif _within(module, "kernels") or _within(module, "shared"):
            if _within(imported, "services"):
                rule = "kernels and shared import no service"
        elif own_service is not None and target_service is not None and target_service != own_service:
            rule = "services never import each other (they talk through Redis)"
        elif own_service is not None and _within(imported, "services.cli"):
            rule = "a service never imports the launcher"
        if rule is not None:
            found.append(Violation(module, line, imported, rule))
    return found


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """Module -> first-party modules it imports (`from a import b` counts as a.b when that is a module)."""
    packages = {m for m in files if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    graph: dict[str, set[str]] = {}
    for module, source in files.items():
        edges = graph.setdefault(module, set())
        for imported, _ in imports_of(module, source, module in packages):
            target = imported if imported in files else imported.rpartition(".")[0]
            if target in files and target != module:
                edges.add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _violations(files: dict[str, str]) -> list[Violation]:
    packages = {m for m in files if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    return [v for module, source in files.items() for v in check_module(module, source, module in packages)]


def _fmt(items: Iterable[object]) -> str:
    return "\n".join(str(i) for i in items)


# --- the real tree ----------------------------------------------------------------------------------


def test_the_tree_is_found() -> None:
    files = source_files()
    for expected in ("services.gateway.app", "services.engine.engine", "kernels.triton_backend", "shared.prompts",
                     "bench.serve_latency", "services.cli"):
        assert expected in files


def test_no_import_crosses_a_boundary() -> None:
    violations = _violations(source_files())
    assert not violations, "imports across the layout's boundaries:\n" + _fmt(violations)


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph(source_files()))
    assert not cycles, "modules that import each other:\n" + _fmt(" <-> ".join(c) for c in cycles)


# --- the checker itself fails on bad imports ----------------------------------------------------------


def test_a_service_importing_another_service_is_caught() -> None:
    bad = "from services.tokenizer.prompts import chat_prompt_ids\n"
    [violation] = check_module("services.gateway.schemas", bad)
    assert violation.imported == "services.tokenizer.prompts.chat_prompt_ids"
    assert "services never import each other" in violation.rule
    lazy = "def f():\n    import services.gateway.app\n"
    assert [v.line for v in check_module("services.engine.service", lazy)] == [2]
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.engine import engine\n"
    assert check_module("services.tokenizer.processor", type_only)


def test_relative_imports_are_resolved() -> None:
    assert check_module("services.gateway.app", "from ..engine import engine\n")
    assert check_module("services.gateway", "from ..tokenizer import service\n", is_package=True)
    assert not check_module("services.gateway.app", "from . import schemas\nfrom .frontend import Frontend\n")


def test_kernels_shared_and_bench_rules_are_caught() -> None:
    assert check_module("kernels.triton_backend", "from services.engine.attention import AttentionMetadata\n")
    assert check_module("shared.streams", "import services.engine.engine\n")
    assert check_module("bench.serve_latency", "from tests.conftest import wait_ready\n")
    assert check_module("services.engine.engine", "from bench.servers import start_servers\n")
    assert check_module("services.engine.engine", "from services.cli import main\n")


def test_allowed_imports_pass() -> None:
    assert not check_module("services.cli", "from services.gateway.main import main\nimport services.engine.main\n")
    assert not check_module("services.gateway.app", "from shared.prompts import chat_prompt_ids\nimport redis\n")
    assert not check_module("kernels.triton_backend", "from kernels.attention_metadata import AttentionMetadata\n")
    assert not check_module("bench.serve_latency", "from bench.servers import start_servers\nimport shared\n")
    assert not check_module("tests.e2e.test_x", "from services.gateway.app import build_app\n")


def test_a_cycle_is_caught() -> None:
    files = {
        "services.engine.engine": "from services.engine.offline import generate\n",
        "services.engine.offline": "from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from services.engine.engine import Engine\n",
        "services.engine.outputs": "",
    }
    assert find_cycles(import_graph(files)) == [["services.engine.engine", "services.engine.offline"]]
    files["services.engine.offline"] = "from services.engine.outputs import Choice\n"
    assert find_cycles(import_graph(files)) == []
