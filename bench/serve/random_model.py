"""A model directory with random bf16 weights of a real shape, that `pagedserve serve --model DIR` loads.

    python -m bench.serve.random_model --shape llama-3.1-8b --out build/random-models/llama-3.1-8b \\
        --tokenizer-dir ~/.cache/pagedserve/models/SmolLM2-135M-Instruct

The weights are bench/throughput.py's (`build_models`: same seed, same shapes, on the GPU), so the
served engine and `bench.serve --offline-shape` run identical models. The tokenizer is SmolLM2's;
for a larger vocabulary (Llama-3's 128,256) its BPE vocabulary is padded with plain-text entries
`<xN>` that no text encodes to but every sampled id decodes to, so no generated token streams as
empty text (the server would then send no chunk for it, and TTFT/ITL would count the next one).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def pad_vocab(tokenizer_json: Path, vocab_size: int) -> int:
    """Extend the BPE vocabulary to `vocab_size` ids; returns how many entries were added."""
    data = json.loads(tokenizer_json.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    added = 0
    for token_id in range(vocab_size):
        if token_id not in taken:
            vocab[f"<x{token_id}>"] = token_id  # ASCII: byte-level decoding keeps it as is
            added += 1
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))
    return added


def add_tokenizer(out: Path, tokenizer_dir: Path, vocab_size: int) -> int:
    """SmolLM2's tokenizer files into `out`, padded to `vocab_size`; returns how many ids were added."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return pad_vocab(out / "tokenizer.json", vocab_size)


def write_random_model(shape: str, out: Path, tokenizer_dir: Path, max_model_len: int, device: str) -> Path:
    import torch

    from bench import throughput

    throughput.CUDA = torch.device(device)  # "cpu": a smoke test of the serving script on a CPU box

    missing = [name for name in TOKENIZER_FILES[:2] if not (tokenizer_dir / name).exists()]
    if missing:
        raise SystemExit(f"{tokenizer_dir}: no {', '.join(missing)} (pass --tokenizer-dir with SmolLM2's files)")
    hf, ours, scratch = throughput.build_models(shape, max_model_len)
    del ours
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out, max_shard_size="5GB")
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    shutil.rmtree(scratch, ignore_errors=True)
    added = add_tokenizer(out, tokenizer_dir, int(throughput.SHAPES[shape]["vocab_size"]))
    print(f"wrote {out} ({shape}, random bf16 weights; tokenizer padded by {added} ids)")
    return out


def write_config_only(shape: str, out: Path, tokenizer_dir: Path, max_model_len: int) -> Path:
    """A model directory without weights, for `pagedserve engine --load-format random`: each engine (each
    tensor-parallel rank) generates its own random weights, so a 70B shape needs no 140 GB on disk."""
    from bench import tensor_parallel

    model_dir = tensor_parallel.write_model_dir(shape, max_model_len)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "config.json", out / "config.json")
    shutil.rmtree(model_dir, ignore_errors=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    added = add_tokenizer(out, tokenizer_dir, int(tensor_parallel.SHAPES[shape]["vocab_size"]))
    print(f"wrote {out} ({shape}, config only; tokenizer padded by {added} ids)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help="a bench/throughput.py shape, e.g. smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tokenizer-dir", type=Path, default=Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct"
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="no weights (a bench/tensor_parallel.py shape: 8b, 70b); serve it with PAGEDSERVE_LOAD_FORMAT=random",
    )
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out} exists; kept")
        return
    if args.config_only:
        write_config_only(args.shape, args.out, args.tokenizer_dir.expanduser(), args.max_model_len)
        return
    write_random_model(args.shape, args.out, args.tokenizer_dir.expanduser(), args.max_model_len, args.device)


if __name__ == "__main__":
    main()
