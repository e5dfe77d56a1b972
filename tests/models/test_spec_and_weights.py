"""The checkpoint readers under the loader: config keys, EOS ids, the safetensors file list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.services.engine.models.spec import eos_token_ids, first_key
from pagedserve.services.engine.models.weights import iter_checkpoint, safetensors_files
from tests.models.tiny_models import build_tiny_model


def test_first_key_takes_the_first_name_a_family_uses() -> None:
    cfg = {"n_head": 4, "num_attention_heads": None, "n_layer": 2}
    assert first_key(cfg, "num_attention_heads", "n_head") == 4  # None counts as absent
    assert first_key(cfg, "missing", default=7) == 7


def test_eos_ids_come_from_generation_config_then_config(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, {"eos_token_id": 2}) == (2,)
    assert eos_token_ids(tmp_path, {}) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert eos_token_ids(tmp_path, {"eos_token_id": 2}) == (7, 8)


def test_a_sharded_checkpoint_lists_the_files_its_index_names(tmp_path: Path) -> None:
    for name in ("b.safetensors", "a.safetensors", "stray.safetensors"):
        save_file({f"w.{name[0]}": torch.ones(2)}, str(tmp_path / name))
    index = {"weight_map": {"w.a": "a.safetensors", "w.b": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in safetensors_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    assert dict(iter_checkpoint(safetensors_files(tmp_path), show_progress=False)).keys() == {"w.a", "w.b"}
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        safetensors_files(tmp_path / "nothing-here")


def test_every_tensor_of_a_saved_model_is_read(tmp_path: Path) -> None:
    hf = build_tiny_model("llama-mqa-bias-linearrope", tmp_path)
    names = {name for name, _ in iter_checkpoint(safetensors_files(tmp_path), show_progress=False)}
    assert names == set(hf.state_dict())
