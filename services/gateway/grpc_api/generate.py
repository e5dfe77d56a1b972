"""Regenerate the checked-in stubs from pagedserve.proto: `python3 -m services.gateway.grpc_api.generate`.

Run from the repository root, so that the generated modules import each other by their package path.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO = Path("services/gateway/grpc_api/pagedserve.proto")


def main() -> None:
    args = ["grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", str(PROTO)]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


if __name__ == "__main__":
    main()
