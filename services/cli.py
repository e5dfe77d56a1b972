"""The `pagedserve` command: `serve` runs everything on one machine; one subcommand per service.

    pagedserve serve [MODEL ...] [--host H] [--port P] [--gpus 0,1,...] [-tp N] [--<setting> VALUE ...]
    pagedserve gateway | tokenizer | engine [--<setting> VALUE ...]
    pagedserve status [--redis-url URL]

Every subcommand takes every setting of the one configuration tree (pagedserve/shared/config.py), named as
vLLM names its flags; `serve` parses it once and hands it whole to the processes it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from pagedserve.services.readiness import local_url, missing_models
from pagedserve.services.status import status_text
from pagedserve.shared.config import Config
from pagedserve.shared.config_cli import (
    ConfigArgumentParser,
    add_config_flags,
    build_config,
    child_env,
    strip_vllm_only_flags,
)
from pagedserve.shared.model_source import model_name_for, resolve_model_dir
from pagedserve.shared.redis_server import PrivateRedis
from pagedserve.shared.telemetry import setup_logging, setup_tracing

log = logging.getLogger("pagedserve")
SERVICES = ("gateway", "tokenizer", "engine")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    parser = ConfigArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ConfigArgumentParser)
    serve_parser = sub.add_parser("serve", help="run Redis (if none is configured), tokenizer, engine and gateway")
    serve_parser.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="models to serve, as --model takes them (default: SmolLM2-135M-Instruct)",
    )
    for name in (serve_parser, *(sub.add_parser(s, help=f"run one {s} process") for s in SERVICES)):
        add_config_flags(name)
    status = sub.add_parser("status", help="live models, engines, load and stream lag, from Redis")
    status.add_argument("--redis-url", default=os.environ.get("PAGEDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return parser


def _models_of(args: argparse.Namespace) -> list[str | None]:
    """serve: positional models and repeated --model flags; None = the default model."""
    given = [*getattr(args, "models", []), *(args.model if isinstance(getattr(args, "model", None), list) else [])]
    return list(dict.fromkeys(given)) or [None]


def parse_config(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    args = build_parser().parse_args(strip_vllm_only_flags(sys.argv[1:] if argv is None else argv))
    if args.command == "status":
        return args, Config()
    models = _models_of(args)
    if args.command != "serve" and len(models) > 1:
        raise SystemExit(f"pagedserve {args.command}: one --model per process (got {len(models)})")
    return args, build_config(args, overrides={"model": models[0]} if models != [None] else None)


def main(argv: list[str] | None = None) -> None:
    args, config = parse_config(argv)
    if args.command == "status":
        print(asyncio.run(status_text(args.redis_url)))
        return
    setup_logging(args.command, config.observability.log_level)
    if args.command == "serve":
        serve(config, _models_of(args))
        return
    warn_if_open(config)
    setup_tracing(args.command, console=config.observability.trace_console)
    if args.command == "gateway":
        from pagedserve.services.gateway.main import main as run_gateway

        run_gateway(config)
    elif args.command == "tokenizer":
        from pagedserve.services.tokenizer.main import main as run_tokenizer

        run_tokenizer(config)
    elif args.command == "engine":
        from pagedserve.services.engine.main import main as run_engine

        run_engine(config)


def warn_if_open(config: Config) -> None:
    if config.gateway.host not in LOOPBACK and not config.gateway.api_keys:
        log.warning(
            "listening on %s without an API key: anyone who can reach this address can use the server "
            "(set --api-key, or --host 127.0.0.1)",
            config.gateway.host,
        )


def serve(config: Config, models: list[str | None]) -> None:
    """Everything on one machine, stopped together on Ctrl-C or SIGTERM."""
    private_redis = None
    if not config.routing.redis_url:
        private_redis = PrivateRedis().start()
        config.routing.redis_url = private_redis.url
        print(f"pagedserve: no Redis configured; started a private redis-server at {private_redis.url}", flush=True)
    for model in models:  # convert/download-check once, before several processes race to do it
        print(
            f"pagedserve: model {model or 'SmolLM2-135M-Instruct (default)'} -> {resolve_model_dir(model)}", flush=True
        )
    if len(models) > 1 and config.model.served_model_name:
        raise SystemExit("pagedserve: --served-model-name names one model; serve several under their own names")
    warn_if_open(config)
    children = [subprocess.Popen(cmd, env=env) for cmd, env in service_commands(config, models)]
    host, port = config.gateway.host, config.gateway.port
    print(
        f"pagedserve: starting on http://{host}:{port}; a line follows once every model has a live "
        f"engine (Ctrl-C stops everything)",
        flush=True,
    )
    names = [served_model_name(config.replace(model=m)) for m in models]
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
                key = config.gateway.api_keys[0] if config.gateway.api_keys else None
                is_ready = missing_models(local_url(host, port), names, api_key=key) == []
                if is_ready:
                    print(f"pagedserve: ready on http://{host}:{port} (models: {', '.join(names)})", flush=True)
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


def service_commands(config: Config, models: list[str | None]) -> list[tuple[list[str], dict[str, str]]]:
    """(command line, environment) of every process `serve` starts: per model its tokenizers and engine
    replicas, then the gateway (last: it is stopped first)."""
    me = [sys.executable, "-m", "pagedserve"]
    commands: list[tuple[list[str], dict[str, str]]] = []
    num_gateways = config.gateway.workers or default_gateway_workers()
    num_tokenizers = config.tokenizer.tokenizer_workers or max(1, num_gateways // 2)
    for model in models:
        model_config = config.replace(model=model)
        commands += [([*me, "tokenizer"], child_env(model_config))] * num_tokenizers
        for replica_config, replica_env in engine_replicas(model_config):
            commands.append(([*me, "engine"], {**child_env(replica_config), **replica_env}))
    commands.append(([*me, "gateway"], child_env(config.replace(workers=num_gateways))))
    return commands


def engine_replicas(config: Config) -> list[tuple[Config, dict[str, str]]]:
    """The engine replicas `serve` starts for a model, as (config, extra environment): with --gpus, one replica
    per group of --tensor-parallel-size GPUs, each seeing only its own GPUs (--data-parallel-size, where
    given, must be that many); without, --data-parallel-size replicas (default 1) on one device, which on
    CUDA only --gpus may share out."""
    parallel = config.parallel
    replicas = parallel.data_parallel_size
    if not parallel.gpus:
        if (replicas or 1) > 1 and parallel.device != "cpu":
            raise SystemExit(
                "pagedserve: --data-parallel-size above 1 needs --gpus (a GPU per replica), or --device cpu"
            )
        return [(config, {})] * (replicas or 1)
    gpus = [g.strip() for g in parallel.gpus.split(",") if g.strip()]
    size = parallel.tensor_parallel_size
    if len(gpus) % size:
        raise SystemExit(f"pagedserve: --gpus lists {len(gpus)} GPUs, not a multiple of --tensor-parallel-size {size}")
    groups = [gpus[i : i + size] for i in range(0, len(gpus), size)]
    if replicas is not None and replicas != len(groups):
        raise SystemExit(
            f"pagedserve: --data-parallel-size {replicas} but --gpus makes {len(groups)} replicas "
            f"of --tensor-parallel-size {size}"
        )
    on_cuda = config.replace(device="cuda")
    return [(on_cuda, {"CUDA_VISIBLE_DEVICES": ",".join(group)}) for group in groups]


def default_gateway_workers() -> int:
    # One gateway process streams ~17k tokens/s; leave most cores to tokenizers, engines and clients.
    return min(4, max(1, (os.cpu_count() or 1) // 4))


def served_model_name(config: Config) -> str:
    return config.model.served_model_name or model_name_for(config.model.model)


if __name__ == "__main__":
    main()
