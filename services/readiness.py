"""What `pagedserve serve` polls before it says "ready": the gateway's /ready, and every model it started
listed there (a model is listed once one of its engines heartbeats, i.e. has loaded and serves)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable


def local_url(host: str, port: int) -> str:
    """An address to reach a server bound to `host` from this machine."""
    reachable = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{reachable}:{port}"


def missing_models(
    base_url: str,
    model_names: Iterable[str],
    timeout_s: float = 1.0,
    api_key: str | None = None,
) -> list[str] | None:
    """The models without a live engine yet ([] = all served), or None if the gateway is not ready at all.
    With API keys configured, /ready lists the models only to a caller that sends one."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{base_url}/ready", headers=headers), timeout=timeout_s
        ) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503: Redis down, draining, or no live engine yet
        try:
            body = json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):  # not listening yet, or not our gateway
        return None
    live = set(body.get("models") or [])
    missing = [name for name in model_names if name not in live]
    return missing if body.get("ready") or missing else None
