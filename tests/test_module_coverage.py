"""Every shipped module is imported by some test, or started by one as a process (`-m module`).

A module no test names is code no test can break. `NOT_YET_TESTED` was the debt this started with; it
is empty now and must stay so: a new module comes with a test.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("services", "kernels", "shared")
GENERATED = ("_pb2",)  # gRPC stubs written by grpcio-tools

# Modules no test names yet: none, and none may be added (a module on it that a test imports fails below).
NOT_YET_TESTED: frozenset[str] = frozenset()


def shipped_modules() -> set[str]:
    modules = set()
    for top in SHIPPED:
        for path in (ROOT / top).rglob("*.py"):
            if any(g in path.name for g in GENERATED) or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules.add(".".join(["pagedserve", *parts]))
    return modules


def named_by_tests() -> tuple[set[str], set[str]]:
    """(what the tests import: modules and `module.name`, every string constant in the tests)."""
    imported: set[str] = set()
    strings: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path.resolve() == Path(__file__).resolve() or path.name == "test_boundaries.py":
            continue  # these files name modules without testing them (this list; the import rules)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return imported, strings


def untested(modules: set[str]) -> set[str]:
    imported, strings = named_by_tests()

    def is_tested(module: str) -> bool:
        return (
            module in imported or module in strings or any(name.startswith(module + ".") for name in imported)
        )  # a package, through its modules

    return {m for m in modules if not is_tested(m)}


def test_every_shipped_module_has_a_test() -> None:
    missing = untested(shipped_modules()) - NOT_YET_TESTED
    assert not missing, "modules no test imports or starts (add a test):\n" + "\n".join(sorted(missing))


def test_the_untested_list_only_shrinks() -> None:
    modules = shipped_modules()
    gone = NOT_YET_TESTED - modules
    assert not gone, "NOT_YET_TESTED names modules that no longer exist:\n" + "\n".join(sorted(gone))
    now_tested = NOT_YET_TESTED - untested(modules)
    assert not now_tested, "tested now, take them off NOT_YET_TESTED:\n" + "\n".join(sorted(now_tested))
