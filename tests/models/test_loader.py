"""The loader's edges: config variants, dtype choice, length limits, EOS ids and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.services.engine.models import UnsupportedArchitectureError, load_model, resolve_dtype
from pagedserve.services.engine.models.rotary import inverse_frequencies, rope_params_from_config
from pagedserve.services.engine.models.spec import sliding_windows
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 42, 99, 3, 250, 8]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama-mqa-bias-linearrope", model_dir)
    return model_dir


def copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def prompt_logits(model_dir: Path, **kwargs: object) -> torch.Tensor:
    model = load_model(model_dir, show_progress=False, **kwargs)
    return PagedDriver(model).step({0: PROMPT})[0]


def test_unsupported_architecture_names_the_supported_ones(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_with_config(llama_dir, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        load_model(model_dir, show_progress=False)
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM"):
        assert arch in str(info.value)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"method 'bitsandbytes' is not supported \(awq, gptq"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, r"method 'modelopt' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, r"AWQ without zero points"),
        ({"quant_method": "awq", "bits": 4, "group_size": -1}, r"AWQ group_size -1 \(per-channel\) is not supported"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"gptq with 3-bit weights is not supported"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            r"GPTQ checkpoint_format 'marlin' is not supported \(gptq, gptq_v2\)",
        ),
        (
            {"quant_method": "gptq", "bits": 8, "group_size": 128, "checkpoint_format": "bitblas"},
            r"GPTQ checkpoint_format 'bitblas' is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4, "strategy": "tensor_group"}}},
            },
            r"compressed-tensors weights \['float 4-bit tensor_group'\].*not supported: float 8-bit",
        ),
    ],
)
@pytest.mark.parametrize("flag", [None, "fp8"])
def test_weights_no_reader_takes_are_refused_at_start(
    llama_dir: Path, tmp_path: Path, quantization_config: dict[str, object], message: str, flag: str | None
) -> None:
    """Loading them as full precision (or quantizing them online) would serve garbage."""
    model_dir = copy_with_config(llama_dir, tmp_path / "m", quantization_config=quantization_config)
    with pytest.raises(ValueError, match=message):
        load_model(model_dir, show_progress=False, quantization=flag)


def test_a_compressed_tensors_config_without_quantized_weights_loads_full_precision(
    llama_dir: Path, tmp_path: Path
) -> None:
    """An fp8 KV cache's scheme alone (no config group quantizes weights): the weights are as they are."""
    kv_only = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    model_dir = copy_with_config(llama_dir, tmp_path / "m", quantization_config=kv_only)
    torch.testing.assert_close(prompt_logits(model_dir), prompt_logits(llama_dir), rtol=0, atol=0)


def test_max_model_len_is_checked_against_the_config(llama_dir: Path) -> None:
    assert load_model(llama_dir, show_progress=False).spec.max_model_len == 256
    assert load_model(llama_dir, max_model_len=100, show_progress=False).spec.max_model_len == 100
    with pytest.raises(ValueError, match="max_position_embeddings 256"):
        load_model(llama_dir, max_model_len=257, show_progress=False)


def test_a_sliding_window_is_per_layer_not_a_context_cap(tmp_path: Path) -> None:
    build_tiny_model("mistral-gqa-window", tmp_path)
    spec = load_model(tmp_path, show_progress=False).spec
    assert spec.max_model_len == 256 and spec.layer_windows == (8, 8)
    assert [spec.window_of(i) for i in range(spec.num_layers)] == [8, 8]


def test_sliding_windows_follow_transformers_rules() -> None:
    qwen2 = AutoConfig.for_model(
        "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=3
    ).to_dict()
    assert sliding_windows(qwen2, 3) == (None, 16, 16)  # from transformers' own layer_types
    older_qwen2 = {k: v for k, v in qwen2.items() if k != "layer_types"}
    assert sliding_windows(older_qwen2, 3) == (None, 16, 16)  # max_window_layers: layers from 1 on slide
    assert sliding_windows({**qwen2, "use_sliding_window": False}, 3) == ()
    assert sliding_windows({"sliding_window": 4096}, 2) == (4096, 4096)  # Mistral v0.1: every layer
    assert sliding_windows({"sliding_window": None}, 2) == ()


def test_auto_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cpu) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cuda) == torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "float16"}, cuda) == torch.float16
    assert resolve_dtype("auto", {"dtype": "float32"}, cuda) == torch.bfloat16
    assert resolve_dtype("fp16", {}, cpu) == torch.float16
    assert resolve_dtype(torch.bfloat16, {}, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", {}, cpu)


def test_bf16_load_runs_close_to_fp32(llama_dir: Path) -> None:
    model = load_model(llama_dir, dtype="bf16", show_progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    got = PagedDriver(model).step({0: PROMPT})[0]
    want = prompt_logits(llama_dir, dtype="fp32")
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


def test_legacy_rope_keys_load_the_same(llama_dir: Path, tmp_path: Path) -> None:
    legacy = copy_with_config(
        llama_dir,
        tmp_path / "legacy",
        rope_parameters=None,
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    torch.testing.assert_close(prompt_logits(legacy), prompt_logits(llama_dir), atol=0, rtol=0)
    unscaled = copy_with_config(llama_dir, tmp_path / "unscaled", rope_parameters=None, rope_theta=500.0)
    assert not torch.allclose(prompt_logits(unscaled), prompt_logits(llama_dir), atol=1e-3)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_inverse_frequencies_equal_transformers(rope: dict[str, object]) -> None:
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=65536, rope_parameters=rope)
    init = ROPE_INIT_FUNCTIONS.get(str(rope["rope_type"]))
    want = init(config, None)[0] if init else _default_inv_freq(10000.0, 128)
    got = inverse_frequencies(rope_params_from_config(config.to_dict(), head_dim=128))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def test_unsupported_rope_type_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"'mrope' is not supported.*yarn"):  # Qwen2-VL's: not here
        rope_params_from_config({"rope_parameters": {"rope_type": "mrope", "factor": 4.0}}, head_dim=64)


def test_eos_ids_prefer_generation_config(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_with_config(llama_dir, tmp_path / "m", eos_token_id=7)
    gen = {"eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9, "bos_token_id": 1}
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    spec = load_model(model_dir, show_progress=False).spec
    assert spec.eos_token_ids == (2, 5)
    assert spec.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    (model_dir / "generation_config.json").unlink()
    assert load_model(model_dir, show_progress=False).spec.eos_token_ids == (7,)


def test_missing_tensor_is_an_error(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_with_config(llama_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(model_dir, show_progress=False)


def test_gpt_neox_config_and_head_name_variants_load_the_same(tmp_path: Path) -> None:
    """Pythia-style rotary_pct/rotary_emb_base config keys; the head saved as `lm_head` (transformers 5
    module name) instead of `embed_out` (what save_pretrained writes); stale rotary buffers."""
    current = tmp_path / "current"
    build_tiny_model("gpt_neox-sequential-half-rotary", current)
    old = copy_with_config(current, tmp_path / "old", rope_parameters=None, rotary_pct=0.5, rotary_emb_base=10000)
    tensors = load_file(old / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    tensors["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)  # stale buffers are skipped
    save_file(tensors, old / "model.safetensors", metadata={"format": "pt"})
    torch.testing.assert_close(prompt_logits(old), prompt_logits(current), atol=0, rtol=0)
