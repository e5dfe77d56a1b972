"""--generation-config: which sampling defaults a checkpoint's generation_config.json gives, as vLLM reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.shared.generation_defaults import fill_sampling, read_generation_defaults


def model_dir(tmp_path: Path, generation_config: dict[str, object] | None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_auto_reads_the_checkpoints_sampling_fields(tmp_path: Path) -> None:
    folder = model_dir(
        tmp_path,
        {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_new_tokens": 256,
            "do_sample": True,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
    )
    assert read_generation_defaults("auto", folder) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 256,
    }


def test_transformers_defaults_and_bad_values_are_no_defaults(tmp_path: Path) -> None:
    folder = model_dir(
        tmp_path,
        {
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "min_p": "high",
            "max_new_tokens": 0,
            "do_sample": False,
        },
    )
    assert read_generation_defaults("auto", folder) == {}
    without = tmp_path / "without"
    without.mkdir()
    assert read_generation_defaults("auto", model_dir(without, None)) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults("auto", tmp_path) == {}


def test_vllm_turns_them_off_and_a_folder_replaces_the_models(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    folder = model_dir(tmp_path / "model", {"temperature": 0.6})
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": 5}))
    assert read_generation_defaults("vllm", folder) == {}
    assert read_generation_defaults(str(other), folder) == {"temperature": 0.2, "top_k": 5}
    assert read_generation_defaults("auto", None) == {}
    with pytest.raises(ValueError, match="not a folder"):
        read_generation_defaults(str(tmp_path / "missing"), folder)


def test_defaults_fill_only_omitted_fields() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 256}
    assert fill_sampling({"temperature": 0.0, "n": 1}, defaults) == {"temperature": 0.0, "top_k": 20, "n": 1}
    assert "max_tokens" not in fill_sampling({}, defaults)  # the tokenizer resolves max_tokens
    wire = {"n": 1}
    assert fill_sampling(wire, {}) is wire
