"""`python -m bench NAME [ARGS...]`: run one benchmark (`python -m bench` lists them; each takes --help)."""

from __future__ import annotations

import ast
import difflib
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """Name -> the first line of its docstring, for every module or package here with a `main()`."""
    found: dict[str, str] = {}
    for path in sorted(HERE.glob("*.py")) + sorted(HERE.glob("*/cli.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            continue
        name = path.stem if path.parent == HERE else path.parent.name
        doc = ast.get_docstring(ast.parse((path.parent / "__init__.py").read_text())) if path.name == "cli.py" else None
        found[name] = ((doc or ast.get_docstring(tree) or "").strip().splitlines() or [""])[0]
    return found


def main(argv: list[str]) -> int:
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, known))
        print(__doc__.strip().splitlines()[0], "\n")
        print("\n".join(f"  {name:<{width}}  {line}" for name, line in known.items()))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in known:
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        print(f"bench: no benchmark named {name!r}{hint} (python -m bench lists them)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}.cli" if (HERE / name / "cli.py").exists() else f"bench.{name}")
    sys.argv = [f"python -m bench {name}", *rest]
    module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
