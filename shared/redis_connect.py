"""One way to reach Redis for every service: a plain `redis://` / `rediss://` / `unix://` URL, or
`redis+sentinel://` for a master watched by Redis Sentinel.

    redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?sentinel_password=...]

With Sentinel, each new connection asks the sentinels for the current master, and a connection
to a master that was demoted (READONLY) is dropped: after a failover the services' usual
reconnect-and-retry loops land on the new master without further code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_CLIENT_OPTIONS: dict[str, Any] = {
    # A pooled connection Redis dropped (a restart, a failover) fails its next command: retry it on a new
    # connection, so the first publish after Redis is back is not lost. Connection errors only: a command
    # that timed out may have run, and an XADD must not be written twice.
    "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
    "retry_on_error": [RedisConnectionError],
    "decode_responses": False,
    "health_check_interval": 10,
    "socket_connect_timeout": 2,
    "socket_timeout": 10,
}


@dataclass(frozen=True)
class SentinelURL:
    sentinels: list[tuple[str, int]]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None  # the master's (and replicas') password
    sentinel_password: str | None = None
    ssl: bool = False
    options: dict[str, str] = field(default_factory=dict)


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a sentinel URL: {url!r}")
    netloc = parts.netloc.rsplit("@", 1)[-1]
    sentinels = []
    for host_port in netloc.split(","):
        host, _, port = host_port.rpartition(":") if ":" in host_port else (host_port, "", "26379")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or not sentinels or not sentinels[0][0]:
        raise ValueError(f"a sentinel URL names hosts and a service: redis+sentinel://host:26379/mymaster ({url!r})")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return SentinelURL(
        sentinels=sentinels,
        service_name=path[0],
        db=int(path[1]) if len(path) > 1 else 0,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        sentinel_password=query.pop("sentinel_password", None),
        ssl=parts.scheme.startswith("rediss"),
        options=query,
    )


def connect(url: str, max_connections: int = 16) -> aioredis.Redis:
    """An asyncio client for `url` (plain or Sentinel); connections are made lazily, on first use, and
    at most `max_connections` are open: a command beyond them waits for a free one (up to 10 s) rather
    than failing with "Too many connections"."""
    if not is_sentinel_url(url):
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=10, **_CLIENT_OPTIONS
        )
        return aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it
    spec = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {"socket_connect_timeout": 1, "socket_timeout": 2}
    if spec.sentinel_password:
        sentinel_kwargs["password"] = spec.sentinel_password
    sentinel = Sentinel(spec.sentinels, sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(
        spec.service_name,
        redis_class=aioredis.Redis,
        db=spec.db,
        username=spec.username,
        password=spec.password,
        ssl=spec.ssl,
        max_connections=max_connections,
        **_CLIENT_OPTIONS,
    )
