"""Resolve and load a model, print its spec and how long each stage took (no engine, no Redis).

    python -m pagedserve.services.engine.models [MODEL] [--dtype auto|bf16|fp16|fp32] [--device cpu|cuda]
                                     [--max-model-len N] [--json PATH]

MODEL is a directory, a .gguf file, a hub id in the local HF cache, or nothing (the default model).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch

from pagedserve.services.engine.models import load_model
from pagedserve.shared.model_source import model_name_for, resolve_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.services.engine.models", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the timings and spec here")
    args = parser.parse_args()

    start = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    resolved = time.perf_counter()
    model = load_model(model_dir, args.dtype, args.device, max_model_len=args.max_model_len)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    loaded = time.perf_counter()
    spec = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(model.spec).items()}
    num_params = sum(p.numel() for p in model.parameters())
    report: dict[str, object] = {
        "model": model_name_for(args.model),
        "model_dir": str(model_dir),
        "resolve_s": round(resolved - start, 3),
        "load_s": round(loaded - resolved, 3),
        "num_params": num_params,
        "spec": spec,
    }
    print(f"{'model':<10}{report['model']}  ({model_dir})")
    print(f"{'resolve':<10}{report['resolve_s']:.2f} s   (GGUF conversion included when not cached)")
    print(f"{'load':<10}{report['load_s']:.2f} s   ({num_params / 1e6:.1f} M parameters)")
    for key, value in spec.items():
        print(f"  {key:<26}{value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
