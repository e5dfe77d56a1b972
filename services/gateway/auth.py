"""Bearer API keys on every route but liveness/readiness, compared in constant time.

Plain ASGI middleware (Starlette's BaseHTTPMiddleware would break streaming).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.services.gateway.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app, self.keys = app, [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self.keys
            and scope["path"] not in OPEN_PATHS
            and not self.is_authorized(dict(scope["headers"]).get(b"authorization", b""))
        ):
            error = APIError(
                401,
                "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def is_authorized(self, header: bytes) -> bool:
        return is_authorized(header, self.keys)


def is_authorized(header: bytes, keys: list[bytes]) -> bool:
    """Whether an `authorization` header (HTTP, or gRPC metadata) carries one of the keys."""
    token = header[7:].strip() if header[:7].lower() == b"bearer " else b""
    # Compare against every key (no early exit), so timing says nothing about which one matched.
    matches = [hmac.compare_digest(token, key) for key in keys]
    return bool(token) and any(matches)
