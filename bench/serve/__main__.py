"""`python -m bench.serve --url URL --model MODEL ...` (see bench/serve/cli.py)."""

from __future__ import annotations

from bench.serve.cli import main

if __name__ == "__main__":
    main()
