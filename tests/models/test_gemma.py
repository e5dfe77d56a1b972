"""Gemma beyond the family comparison: the spec lists the local layers' windows, Gemma 2 (soft-capping) and
Gemma 3 run on the Triton backend, and Gemma 3's vision model is refused with a clear error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine import attention
from pagedserve.services.engine.executor.worker import refuse_unsupported_attention
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.parallel.sharding import shard_model
from pagedserve.services.engine.parallel.state import ParallelContext
from tests.models.paged_driver import (
    PagedDriver,
    assert_chunked_steps_match_hf,
    assert_long_prefill_steps_match_hf,
    spy_on_prefill_kernel,
)
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def torch_backend_after() -> Iterator[None]:
    yield
    attention.use_backend("torch")


def test_spec_lists_each_local_layers_window(tmp_path: Path) -> None:
    build_tiny_model("gemma3-window8-qknorm-local-rope", tmp_path)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    assert model.spec.layer_windows == (8, None, 8)
    assert model.spec.max_model_len == 256  # the window no longer caps the context (Mistral's still does)


def lower_attention_softcap(hf: torch.nn.Module, model_dir: Path, cap: float) -> None:
    """Set Gemma 2's attention-logit cap in the saved config and in the HF model built from it."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["attn_logit_softcapping"] = cap
    cfg_path.write_text(json.dumps(cfg))
    for module in hf.modules():
        if hasattr(module, "attn_logit_softcapping"):  # HF's attention layers copy it from the config
            setattr(module, "attn_logit_softcapping", cap)  # noqa: B010 (nn.Module typing refuses a float)


def test_gemma2_runs_on_the_triton_backend(tmp_path: Path, torch_backend_after: None) -> None:
    """Soft-capping and windows in the Triton paged kernel (interpreted on CPU): a prompt 3x the window in two
    chunks (the second beside another prompt), then decodes, as HF computes."""
    pytest.importorskip("triton")
    hf = build_tiny_model("gemma2-window8-softcaps", tmp_path)
    lower_attention_softcap(hf, tmp_path, 0.5)  # the case's 4.0 barely bends this tiny model's logits
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    assert model.spec.layer_windows is not None and 8 in model.spec.layer_windows
    attention.use_backend("triton")
    refuse_unsupported_attention(model)  # accepted: the paged kernel soft-caps
    assert_chunked_steps_match_hf(model, hf, prompt_seed=5, driver_seed=3)


def test_gemma2_long_prefills_take_the_prefill_kernel(
    tmp_path: Path, torch_backend_after: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill-heavy steps of the windowed, soft-capped layers (and the global, capped ones) run in the Triton
    prefill kernel (interpreted on CPU): prompts 8x the window, one after a cached prefix, as HF computes."""
    pytest.importorskip("triton")
    hf = build_tiny_model("gemma2-window8-softcaps", tmp_path)
    lower_attention_softcap(hf, tmp_path, 0.5)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    attention.use_backend("triton")
    launches = spy_on_prefill_kernel(monkeypatch)
    assert_long_prefill_steps_match_hf(model, hf, prompt_seed=6, driver_seed=2)
    assert (8, False, 0.5) in launches and (None, False, 0.5) in launches


def test_a_model_needing_torch_attention_is_refused_at_start(tmp_path: Path, torch_backend_after: None) -> None:
    """No family needs the torch backend today; the start-up check still refuses one that says so."""
    build_tiny_model("gemma2-window8-softcaps", tmp_path)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    assert model.needs_torch_attention is None
    model.needs_torch_attention = "some attention feature"
    refuse_unsupported_attention(model)  # torch: fine
    attention.use_backend("reference")
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM needs some attention feature.*use --device cpu"):
        refuse_unsupported_attention(model)


def test_gemma3_runs_on_the_triton_backend(tmp_path: Path, torch_backend_after: None) -> None:
    """No soft-capping: Gemma 3's windows run in the Triton paged kernel (interpreted on CPU), as HF computes."""
    pytest.importorskip("triton")
    hf = build_tiny_model("gemma3-window8-qknorm-local-rope", tmp_path)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    attention.use_backend("triton")
    refuse_unsupported_attention(model)  # accepted
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    driver = PagedDriver(model)
    got = torch.cat([*driver.step({0: prompt[:11]}), *driver.step({0: prompt[11:]})])
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gemma3_vision_is_refused(tmp_path: Path) -> None:
    build_tiny_model("gemma3-window8-qknorm-local-rope", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": cfg,
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration: the vision tower is not supported"):
        load_model(tmp_path, "float32", "cpu", show_progress=False)


def test_tensor_parallel_is_refused(tmp_path: Path) -> None:
    build_tiny_model("gemma2-window8-softcaps", tmp_path)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM does not support tensor parallelism"):
        shard_model(model, ParallelContext(rank=0, world_size=2, device=torch.device("cpu")))


@pytest.mark.parametrize(("window", "softcap"), [(4, None), (None, 2.0), (3, 2.0)])
def test_torch_attention_window_and_softcap_match_plain_math(window: int | None, softcap: float | None) -> None:
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    gen = torch.Generator().manual_seed(0)
    seq_len, heads, head_dim, block = 11, 2, 8, 4
    q, k, v = (torch.randn(seq_len, heads, head_dim, generator=gen) for _ in range(3))
    kv_cache = torch.zeros(2, 3, block, heads, head_dim)
    kv_cache[0].view(-1, heads, head_dim)[:seq_len], kv_cache[1].view(-1, heads, head_dim)[:seq_len] = k, v
    starts, lens, tables = torch.tensor([0, seq_len]), torch.tensor([seq_len]), torch.tensor([[0, 1, 2]])
    got = paged_attention_padded(q, kv_cache, starts, lens, tables, seq_len, seq_len, 0.5, 1.0, 1.0, window, softcap)
    logits = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    pos = torch.arange(seq_len)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    expected = torch.einsum("hqk,khd->qhd", logits.masked_fill(~visible, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(got, expected)
