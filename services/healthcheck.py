"""`python -m pagedserve.services.healthcheck URL`: exit 0 when URL answers 2xx within 3 s, else 1.

The container images have Python but no curl: compose healthchecks and Kubernetes exec probes use this."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def check(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= int(response.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pagedserve.services.healthcheck URL", file=sys.stderr)
        return 2
    ok = check(argv[0])
    if not ok:
        print(f"unhealthy: {argv[0]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
