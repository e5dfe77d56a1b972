"""Read compose.yaml the way `docker compose` does (YAML anchors and merge keys, ${VAR:-default}
interpolation, `$$` escapes), and turn a service's command and healthcheck into plain local
processes: service hostnames become 127.0.0.1 (or a test's own endpoint), container paths become
local ones, and the pagedserve image's entrypoint becomes `python -m pagedserve.services.cli`."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR; `$$` is a literal `$`."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(3)
            found = variables.get(name)
            return found if found else (m.group(2) or "")

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    return value


def load_compose(variables: dict[str, str]) -> dict[str, Any]:
    return dict(interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), variables))


@dataclass
class LocalService:
    """One compose service as local argv/env/shell commands."""

    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None = None  # argv (sh -c for CMD-SHELL)
    replaced: dict[str, str] = field(default_factory=dict)


def _is_pagedserve(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("pagedserve:")


def _entrypoint(service: dict[str, Any], python: str) -> list[str]:
    if "entrypoint" in service:
        entry = list(service["entrypoint"])
        return [python if entry[0] == "python" else entry[0], *entry[1:]]
    if _is_pagedserve(service):
        return [python, "-m", "pagedserve.services.cli"]  # the Dockerfile's ENTRYPOINT ["pagedserve"]
    return []


def localize(
    name: str,
    service: dict[str, Any],
    *,
    python: str,
    hosts: dict[str, str],
    paths: dict[str, str],
    env_overrides: dict[str, str],
) -> LocalService:
    """`hosts`: "name" or "name:port" -> local replacement; `paths`: container path -> local path."""

    def fix(text: str) -> str:
        for old, new in sorted(paths.items(), key=lambda kv: -len(kv[0])):  # the longest path first
            text = re.sub(rf"(?<![\w.]){re.escape(old)}(?=/|$|\s|\")", new, text)
        for old, new in sorted(hosts.items(), key=lambda kv: -len(kv[0])):  # host:port before host
            text = re.sub(rf"(?:(?<=//)|(?<=@)){re.escape(old)}(?=[:/]|$)", new, text)  # in URLs only
        return text

    raw_env = service.get("environment") or {}
    if isinstance(raw_env, list):
        raw_env = dict(item.split("=", 1) for item in raw_env)
    env = {k: fix(str(v)) for k, v in raw_env.items()}
    env.update(env_overrides)
    argv = [fix(str(a)) for a in [*_entrypoint(service, python), *(service.get("command") or [])]]
    check = None
    if "healthcheck" in service:
        test = [str(t) for t in service["healthcheck"]["test"]]
        if test[0] == "CMD-SHELL":
            check = ["sh", "-c", fix(test[1])]
        elif test[0] == "CMD":
            check = [fix(t) for t in test[1:]]
        else:
            raise ValueError(f"{name}: unsupported healthcheck {test[0]}")
    return LocalService(name, argv, env, check)


def command_text(argv: list[str]) -> str:
    return shlex.join(argv)
