"""`pagedserve gateway`: the HTTP front door."""

from __future__ import annotations

import uvicorn

from services.gateway.app import build_app
from services.gateway.drain import DrainingServer
from shared.settings import GatewaySettings


def main(settings: GatewaySettings) -> None:
    app = build_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level="info", access_log=False,
        timeout_graceful_shutdown=5,  # after our own drain (drain.py) only idle connections are left
    )
    DrainingServer(config, app.state.frontend, settings.drain_timeout_s).run()
