"""The `pagedserve` command: `serve` runs everything on one machine; one subcommand per service.

    pagedserve serve [--model NAME_OR_PATH ...] [--host H] [--port P] [--gpus 0,1,...] [--workers N]
    pagedserve gateway | tokenizer | engine [--<setting> VALUE ...]
    pagedserve status [--redis-url URL]

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
    serve.add_argument("--gpus", default=None, help="comma-separated GPU indexes: one engine per GPU per model "
                       "(e.g. 0,1,2,3); default: one engine on --device")
    serve.add_argument("--workers", type=int, default=None,
                       help="gateway processes sharing the port (default: a quarter of the CPU cores, 1 to 4)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--tensor-parallel-size", type=int, default=None, help="GPUs (processes) per engine replica")
    serve.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: FP8 weights (Llama family)")
    serve.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None, help="fp8: an e4m3 KV cache")
    for name, cls in _SERVICES.items():
        _add_settings_flags(sub.add_parser(name, help=f"run one {name} process"), cls)
    status = sub.add_parser("status", help="live models, engines, load and stream lag, from Redis")
    status.add_argument("--redis-url", default=os.environ.get("PAGEDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "status":
        import asyncio

        from services.status import status_text

        print(asyncio.run(status_text(args.redis_url)))
        return
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
    from services.readiness import local_url, missing_models
    from shared.model_source import model_name_for, resolve_model_dir
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
    commands: list[tuple[list[str], dict[str, str]]] = []  # (command line, extra environment)
    for model in models:
        model_args = ["--model", model] if model else []
        length_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
        tp_args = ["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size else []
        tp_args += ["--quantization", args.quantization] if args.quantization else []
        tp_args += ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
        commands.append(([*me, "tokenizer", *model_args, *length_args], {}))
        for device_args, replica_env in engine_replicas(args):
            commands.append(([*me, "engine", *model_args, *length_args, *device_args, *tp_args], replica_env))
    keys = [arg for key in args.api_key for arg in ("--api-key", key)]
    workers = args.workers or default_gateway_workers()
    commands.append(([*me, "gateway", "--host", args.host, "--port", str(args.port), "--workers", str(workers),
                      *keys], {}))
    children = [subprocess.Popen(cmd, env={**env, **extra}) for cmd, extra in commands]
    print(f"pagedserve: starting on http://{args.host}:{args.port}; a line follows once every model has a live "
          f"engine (Ctrl-C stops everything)", flush=True)
    names = [model_name_for(m) for m in models]
    is_ready, next_check = False, 0.0
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping and all(c.poll() is None for c in children):
            if not is_ready and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                is_ready = missing_models(local_url(args.host, args.port), names) == []
                if is_ready:
                    print(f"pagedserve: ready on http://{args.host}:{args.port} (models: {', '.join(names)})",
                          flush=True)
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


def engine_replicas(args: argparse.Namespace) -> list[tuple[list[str], dict[str, str]]]:
    """The engine replicas `serve` starts for each model, as (device flags, environment): with --gpus, one
    replica per group of --tensor-parallel-size GPUs, each seeing only its own GPUs."""
    if not args.gpus:
        return [(["--device", args.device] if args.device else [], {})]
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    size = args.tensor_parallel_size or 1
    if len(gpus) % size:
        raise SystemExit(f"pagedserve: --gpus lists {len(gpus)} GPUs, not a multiple of --tensor-parallel-size {size}")
    groups = [gpus[i : i + size] for i in range(0, len(gpus), size)]
    return [(["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ",".join(group)}) for group in groups]


def default_gateway_workers() -> int:
    # One gateway process streams ~17k tokens/s; leave most cores to tokenizers, engines and clients.
    return min(4, max(1, (os.cpu_count() or 1) // 4))


if __name__ == "__main__":
    main()
