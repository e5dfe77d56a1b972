"""Parse the configuration tree once: flags > PAGEDSERVE_* environment > --config file > defaults.

Flags are flat and named as vLLM names them (`--max-model-len`, `-tp`, `--api-key`), grouped by section in
--help. An unknown flag gets an error naming the nearest flag; vLLM flags that have no meaning here are
accepted with a warning (VLLM_IGNORED) and those we cannot honour are refused with the reason (VLLM_REFUSED).
A parent hands the parsed tree to its children whole, as JSON in PAGEDSERVE_CONFIG (`child_env`): a child
takes it as it is and re-reads no other PAGEDSERVE_* variable.

Argparse rather than pydantic-settings' CliApp: vLLM's flat flag names, short aliases and per-section help
groups are what a `vllm serve` user types, and CliApp names nested fields `--section.field`. pydantic checks
and coerces the merged values into the stdlib dataclasses of `pagedserve.shared.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from pagedserve.shared.config import FLAT_NAMES, SECTIONS, Config

log = logging.getLogger(__name__)

ENV_PREFIX = "PAGEDSERVE_"
CONFIG_ENV = "PAGEDSERVE_CONFIG"  # the parent's whole tree, as JSON

# vLLM flags accepted and ignored (with a warning): flag -> (number of values it takes, why it does not apply).
VLLM_IGNORED: dict[str, tuple[int, str]] = {
    "--trust-remote-code": (0, "pagedserve runs no code from checkpoints; its own model families load them"),
    "--disable-log-stats": (0, "engine stats are metrics, not log lines"),
    "--disable-frontend-multiprocessing": (0, "the gateway is its own process(es)"),
    "--swap-space": (1, "preempted requests are recomputed, not swapped"),
    "--tokenizer-mode": (1, "the checkpoint's fast tokenizer is always used"),
    "--max-log-len": (1, "request contents are never logged"),
    "--distributed-executor-backend": (1, "tensor parallelism always uses worker processes"),
    "--response-role": (1, "the role is always assistant"),
    "--uvicorn-access-log": (0, "access logs follow --uvicorn-log-level"),
}
# vLLM flags refused, with the reason: they would change results or resources in ways we cannot honour.
VLLM_REFUSED: dict[str, str] = {
    "--pipeline-parallel-size": "pipeline parallelism is not supported; use --tensor-parallel-size or replicas",
    "-pp": "pipeline parallelism is not supported; use --tensor-parallel-size or replicas",
    "--cpu-offload-gb": "CPU weight offload is not supported",
}


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(annotation: Any) -> Any:
    """int for `int | None`, list for `list[str]`, ..."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (types.UnionType, typing.Union) and len(args) == 1:
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


def _is_optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _flag_of(flat: str, meta: Mapping[str, Any]) -> str:
    return "--" + str(meta.get("flag") or flat).replace("_", "-")


def _field_specs() -> list[tuple[str, str, dataclasses.Field[Any], Any]]:
    """(section, flat name, field, annotation) for every field, in tree order."""
    flat_of = {v: k for k, v in FLAT_NAMES.items()}
    specs = []
    for section, cls in SECTIONS.items():
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            specs.append((section, flat_of[(section, f.name)], f, hints[f.name]))
    return specs


class ConfigArgumentParser(argparse.ArgumentParser):
    """An unknown flag is an error that names the nearest known flag."""

    def error(self, message: str) -> typing.NoReturn:
        if "unrecognized arguments" in message:
            unknown = [a.split("=")[0] for a in message.split(":", 1)[1].split() if a.startswith("-")]
            known = _option_strings(self)
            hints = []
            for flag in unknown:
                near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                hints.append(f"{flag}: did you mean {near[0]}?" if near else f"{flag}: no such flag")
            message += "\n  " + "\n  ".join(hints)
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of this parser and of its subcommands' parsers."""
    found: list[str] = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return found


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field, grouped by section; only flags given on the command line land in the namespace."""
    parser.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE",
        help="a YAML (or JSON) file of settings: flat flag names or sections; flags and "
        "PAGEDSERVE_* variables override it",
    )
    groups: dict[str, Any] = {}
    for section, flat, f, annotation in _field_specs():
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(f"{section} options"))
        meta = f.metadata
        names = [_flag_of(flat, meta), *meta.get("aliases", ())]
        if "short" in meta:
            names.insert(0, meta["short"])
        kind = _base_type(annotation)
        default = f.default if f.default is not dataclasses.MISSING else "[]"
        help_text = f"{meta.get('help', '')} (default: {default}; env {ENV_PREFIX}{flat.upper()})".replace("%", "%%")
        common: dict[str, Any] = {"dest": flat, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif "nargs" in meta:  # vLLM's `--lora-modules a=p b=q`: several values after one flag, or repeated
            group.add_argument(*names, action="extend", nargs=meta["nargs"], **common)
        elif kind is list or meta.get("repeatable"):
            group.add_argument(*names, action="append", **common)
        else:
            choices = meta.get("choices")
            group.add_argument(
                *names,
                type=kind if kind in (int, float) else str,
                metavar=flat.upper(),
                choices=choices if choices and not _is_optional(annotation) else None,
                **common,
            )


def _from_file(path: str | Path) -> dict[str, Any]:
    """Flat keys (`max-model-len` or `max_model_len`, as vLLM's --config takes them) and/or section tables."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"pagedserve: --config {path}: expected a mapping of settings")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            flat.update({_flat_for(name, str(k).replace("-", "_"), path): v for k, v in value.items()})
        else:
            flat[_known(name, f"--config {path}")] = value
    return flat


def _flat_for(section: str, field_name: str, source: object) -> str:
    for flat, owner in FLAT_NAMES.items():
        if owner == (section, field_name):
            return flat
    raise SystemExit(f"pagedserve: {source}: unknown setting {section}.{field_name}")


def _known(name: str, source: str) -> str:
    if name not in FLAT_NAMES:
        near = difflib.get_close_matches(name, list(FLAT_NAMES), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise SystemExit(f"pagedserve: {source}: unknown setting {name!r}{hint}")
    return name


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    specs = {flat_name: annotation for _, flat_name, _, annotation in _field_specs()}
    for name, annotation in specs.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if _base_type(annotation) is list:
            flat[name] = [item.strip() for item in raw.split(",") if item.strip()]
        elif raw.strip().lower() in ("", "none", "null") and _is_optional(annotation):
            flat[name] = None
        else:
            flat[name] = raw
    return flat


def nest(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    nested: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in flat.items():
        section, field_name = FLAT_NAMES[name]
        nested[section][field_name] = value
    return nested


_ADAPTER = pydantic.TypeAdapter(Config)


def validate(nested: Mapping[str, Any]) -> Config:
    try:
        return _ADAPTER.validate_python(nested)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise SystemExit(f"pagedserve: invalid configuration: {problems}") from None


def build_config(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Config:
    """The tree from a parsed namespace: flags > environment > --config file > defaults (or, in a child, the
    parent's tree from PAGEDSERVE_CONFIG with this process's own flags on top)."""
    environ = os.environ if environ is None else environ
    flags = {name: value for name, value in vars(args).items() if name in FLAT_NAMES}
    flags.update(overrides or {})
    if environ.get(CONFIG_ENV):
        base = json.loads(environ[CONFIG_ENV])
        for name, value in flags.items():
            section, field_name = FLAT_NAMES[name]
            base[section][field_name] = value
        return validate(base)
    merged: dict[str, Any] = {}
    if getattr(args, "config_file", None):
        merged.update(_from_file(args.config_file))
    merged.update(_from_env(environ))
    merged.update(flags)
    return validate(nest(merged))


def child_env(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: the parent's, plus the whole tree."""
    return {**(os.environ if environ is None else environ), CONFIG_ENV: json.dumps(config.to_dict())}


def strip_vllm_only_flags(argv: Sequence[str]) -> list[str]:
    """Drop vLLM flags that do not apply here (warning once each); refuse those we cannot honour."""
    kept: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        flag = arg.split("=", 1)[0]
        if flag in VLLM_REFUSED:
            raise SystemExit(f"pagedserve: {flag} is not supported: {VLLM_REFUSED[flag]}")
        if flag in VLLM_IGNORED:
            num_values, why = VLLM_IGNORED[flag]
            print(f"pagedserve: ignoring {flag} ({why})", file=sys.stderr)
            skip = num_values if "=" not in arg else 0
            continue
        kept.append(arg)
    return kept
