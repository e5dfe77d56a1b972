"""`pagedserve gateway`: the HTTP front door."""

from __future__ import annotations

import uvicorn

from services.gateway.app import build_app
from shared.settings import GatewaySettings


def main(settings: GatewaySettings) -> None:
    uvicorn.run(
        build_app(settings), host=settings.host, port=settings.port, log_level="info",
        timeout_graceful_shutdown=30, access_log=False,
    )
