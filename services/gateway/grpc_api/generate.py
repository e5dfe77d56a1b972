"""Regenerate the checked-in stubs from pagedserve.proto: `python3 -m pagedserve.services.gateway.grpc_api.generate`.

Run from the repository root, so that the generated modules import each other by their package path.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

# Through the pagedserve/ link, so the stubs import each other as pagedserve.services.gateway.grpc_api.
PROTO = Path("pagedserve/services/gateway/grpc_api/pagedserve.proto")


def main() -> None:
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto ship with grpcio-tools
    args = [
        "grpc_tools.protoc",
        "-I.",
        f"-I{well_known}",
        "--python_out=.",
        "--pyi_out=.",
        "--grpc_python_out=.",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


if __name__ == "__main__":
    main()
