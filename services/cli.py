"""The `pagedserve` command: `serve` runs everything on one machine; one subcommand per service.

    pagedserve serve [--model NAME_OR_PATH ...] [--host H] [--port P]
    pagedserve gateway | tokenizer | engine [--<setting> VALUE ...]

Every service flag is a field of that service's settings class (shared/settings.py), so a flag,
its environment variable and its default never disagree.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import types
from typing import Any, get_args, get_origin

from pydantic_settings import BaseSettings

from shared.settings import EngineSettings, GatewaySettings, TokenizerSettings
from shared.telemetry import setup_logging, setup_tracing

_SERVICES: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings, "tokenizer": TokenizerSettings, "engine": EngineSettings,
}


def _add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    for name, info in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = info.annotation
        args = [a for a in get_args(annotation) if a is not type(None)]
        if get_origin(annotation) in (types.UnionType,) and len(args) == 1:
            annotation = args[0]
        if get_origin(annotation) is list:
            parser.add_argument(flag.rstrip("s") if name.endswith("s") else flag, dest=name, action="append",
                                help=info.description)
        elif annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind: Any = annotation if annotation in (int, float) else str
            parser.add_argument(flag, dest=name, type=kind, default=None, help=info.description)


def _settings_from(args: argparse.Namespace, cls: type[BaseSettings]) -> Any:
    given = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    return cls(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run Redis (if none is configured), tokenizer, engine and gateway")
    serve.add_argument("--model", action="append", help="model name, HF directory, .gguf file or cached hub id "
                       "(repeat to serve several models; default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--redis-url", default=os.environ.get("PAGEDSERVE_REDIS_URL"))
    serve.add_argument("--api-key", action="append", default=[])
    serve.add_argument("--device", default=None)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: FP8 weights (Llama family)")
    serve.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None, help="fp8: an e4m3 KV cache")
    for name, cls in _SERVICES.items():
        _add_settings_flags(sub.add_parser(name, help=f"run one {name} process"), cls)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.command)
    if args.command != "serve":
        setup_tracing(args.command)
    if args.command == "serve":
        serve(args)
    elif args.command == "gateway":
        from services.gateway.main import main as run_gateway

        run_gateway(_settings_from(args, GatewaySettings))
    elif args.command == "tokenizer":
        from services.tokenizer.main import main as run_tokenizer

        run_tokenizer(_settings_from(args, TokenizerSettings))
    elif args.command == "engine":
        from services.engine.main import main as run_engine

        run_engine(_settings_from(args, EngineSettings))


def serve(args: argparse.Namespace) -> None:
    """Everything on one machine, stopped together on Ctrl-C or SIGTERM."""
    from shared.model_source import resolve_model_dir
    from shared.redis_server import PrivateRedis

    models: list[str | None] = list(args.model or [None])
    private_redis = None
    redis_url = args.redis_url
    if not redis_url:
        private_redis = PrivateRedis().start()
        redis_url = private_redis.url
        print(f"pagedserve: no Redis configured; started a private redis-server at {redis_url}", flush=True)
    for model in models:  # convert/download-check once, before several processes race to do it
        print(f"pagedserve: model {model or 'SmolLM2-135M-Instruct (default)'} -> {resolve_model_dir(model)}",
              flush=True)
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis_url}
    me = [sys.executable, "-m", "services.cli"]
    commands = []
    for model in models:
        model_args = ["--model", model] if model else []
        length_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
        device_args = ["--device", args.device] if args.device else []
        device_args += ["--quantization", args.quantization] if args.quantization else []
        device_args += ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
        commands.append([*me, "tokenizer", *model_args, *length_args])
        commands.append([*me, "engine", *model_args, *length_args, *device_args])
    keys = [arg for key in args.api_key for arg in ("--api-key", key)]
    commands.append([*me, "gateway", "--host", args.host, "--port", str(args.port), *keys])
    children = [subprocess.Popen(cmd, env=env) for cmd in commands]
    print(f"pagedserve: serving on http://{args.host}:{args.port} (Ctrl-C stops everything)", flush=True)

    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping and all(c.poll() is None for c in children):
            time.sleep(0.2)
    finally:
        for child in reversed(children):  # the gateway first: it stops taking requests
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        if private_redis:
            private_redis.stop()
    failed = [c.args for c in children if c.returncode not in (0, -signal.SIGTERM, -signal.SIGINT)]
    if failed and not stopping:
        sys.exit(f"pagedserve: a service exited unexpectedly: {failed[0]!r}")


if __name__ == "__main__":
    main()
