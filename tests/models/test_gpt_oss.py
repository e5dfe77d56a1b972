"""gpt-oss beyond the family comparison (tests/models/test_families.py): sinks in the torch attention path
vs a direct softmax, YaRN vs HF's own, the clamped experts vs a per-token loop, the engine with prefix
caching and prompt logprobs vs HF on prompts longer than the window, and the Triton paged kernel vs HF."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.services.engine import attention
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.executor.worker import refuse_unsupported_attention
from pagedserve.services.engine.models import CausalLM, load_model
from pagedserve.services.engine.models.gpt_oss import ClampedSwiGLUExperts, GptOssMoE
from pagedserve.services.engine.models.moe import experts_reference
from pagedserve.services.engine.models.rotary import inverse_frequencies, rope_params_from_config
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.paged_driver import (
    assert_chunked_steps_match_hf,
    assert_long_prefill_steps_match_hf,
    spy_on_prefill_kernel,
)
from tests.models.tiny_models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")
CASE = "gpt_oss-sinks-window8-yarn-clamped-experts"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel, CausalLM]:
    model_dir = tmp_path_factory.mktemp("gpt_oss")
    hf = build_tiny_model(CASE, model_dir)
    return model_dir, hf, load_model(model_dir, "float32", "cpu", show_progress=False)


def _direct_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, sinks: torch.Tensor, window: int | None
) -> torch.Tensor:
    """softmax([q.k * scale ... | sink]) without the sink column, times V: the definition, one sequence."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    logits = logits.masked_fill(~visible, float("-inf"))
    sink = sinks[:, None, None].expand(-1, q.shape[0], 1)
    weights = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_a_ragged_batch_match_a_direct_softmax(window: int | None) -> None:
    """One step mixing a whole prompt, a chunk after cached tokens and a decode token (GQA, scattered blocks)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block = 4, 2, 8, 4
    seq_lens, query_lens = [11, 14, 9], [11, 6, 1]
    num_blocks = 16
    kv_cache = torch.zeros(2, num_blocks, block, kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(3, 4, dtype=torch.int32)
    keys, values, queries, expected = [], [], [], []
    sinks = torch.randn(heads, generator=gen) * 2
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        k, v = torch.randn(seq_len, kv_heads, head_dim, generator=gen), torch.randn(seq_len, kv_heads, head_dim)
        q = torch.randn(query_len, heads, head_dim, generator=gen)
        for pos in range(seq_len):
            if pos % block == 0:
                tables[i, pos // block] = free.pop()
            kv_cache[0, tables[i, pos // block], pos % block], kv_cache[1, tables[i, pos // block], pos % block] = (
                k[pos],
                v[pos],
            )
        queries.append(q)
        expected.append(_direct_attention(q, k, v, torch.arange(seq_len - query_len, seq_len), sinks, window))
        keys.append(k)
        values.append(v)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    got = attention._torch_attend(torch.cat(queries), kv_cache, meta, 0.5, window=window, sinks=sinks)
    torch.testing.assert_close(got, torch.cat(expected))
    plain = attention._torch_attend(torch.cat(queries), kv_cache, meta, 0.5, window=window)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks took probability mass away from the keys


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(truncate: bool) -> None:
    rope = dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=truncate,
        original_max_position_embeddings=4096,
    )
    config = AutoConfig.for_model("gpt_oss", head_dim=64, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    params = rope_params_from_config(config.to_dict(), 64)
    assert torch.equal(inverse_frequencies(params), inv_freq)
    assert params.attention_factor == pytest.approx(attention_factor)
    assert attention_factor > 1.3  # 0.1 ln(32) + 1: cos/sin are scaled


def test_clamped_experts_grouped_and_dense_equal_a_per_token_loop(tiny) -> None:
    _, _, ours = tiny
    moe = ours.model.layers[0].mlp
    assert isinstance(moe, GptOssMoE) and isinstance(moe.experts, ClampedSwiGLUExperts)
    x = torch.randn(19, ours.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    top_logits, ids = moe.router(x).topk(moe.top_k, dim=-1)
    weights = top_logits.softmax(-1)
    with torch.inference_mode():
        expected = experts_reference(moe.experts, x, weights, ids)
        torch.testing.assert_close(moe.experts(x, weights, ids), expected)
        torch.testing.assert_close(moe.experts.forward_dense(x, weights, ids), expected)
        gate = torch.nn.functional.linear(x, moe.experts.gate_up_proj[0], moe.experts.gate_up_proj_bias[0])
    assert (gate.abs() > moe.experts.limit).any()  # the clamps do something at this init


def test_engine_prefix_cache_and_prompt_logprobs_match_hf(tiny) -> None:
    """Prompts 3-4x the window; the second shares 20 tokens (5 blocks) with the first and reuses them."""
    model_dir, hf, ours = tiny
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(3, 256, (30,), generator=gen).tolist()
    second = first[:20] + torch.randint(3, 256, (9,), generator=gen).tolist()
    config = Config.of(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    engine = Engine(config, model=ours)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    [one] = engine.generate([first], greedy)
    [two] = engine.generate([second], greedy)
    assert two.num_cached_tokens == 20
    assert one.token_ids == hf_greedy(hf, first, 32)
    assert two.token_ids == hf_greedy(hf, second, 32)

    [scored] = engine.generate([second], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([second])).logits[0, :-1], dim=-1)
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    got = torch.tensor([entry.logprob for entry in scored.prompt_logprobs[1:]])
    of_prompt = expected[torch.arange(len(second) - 1), torch.tensor(second[1:])]
    torch.testing.assert_close(got, of_prompt, atol=1e-4, rtol=0)


def test_other_quantized_checkpoints_are_refused_with_a_clear_error(tiny, tmp_path: Path) -> None:
    """MXFP4 loads (tests/models/test_mxfp4.py); a method gpt-oss has no reader for is named at start."""
    model_dir, _, _ = tiny
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"GptOssForCausalLM: 'bitsandbytes' checkpoints are not supported \(bf16"):
        load_model(tmp_path, "float32", "cpu", show_progress=False)


@pytest.fixture
def torch_backend_after() -> Iterator[None]:
    yield
    attention.use_backend("torch")


def test_triton_backend_matches_hf(tiny, torch_backend_after: None) -> None:
    """The Triton paged kernel's windows and sinks (interpreted on CPU): a prompt 3x the window, a chunk
    after cached tokens beside another prompt, then decodes."""
    pytest.importorskip("triton")
    _, hf, ours = tiny
    assert ours.spec.layer_windows == (8, None, 8)
    attention.use_backend("triton")
    refuse_unsupported_attention(ours)  # accepted: the paged kernel has what gpt-oss needs
    assert_chunked_steps_match_hf(ours, hf, prompt_seed=9, driver_seed=4)


def test_long_prefills_take_the_prefill_kernel(
    tiny, torch_backend_after: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill-heavy steps of the windowed and the global sink layers run in the Triton prefill kernel
    (interpreted on CPU): prompts 8x the window, one after a cached prefix, as HF computes."""
    pytest.importorskip("triton")
    _, hf, ours = tiny
    attention.use_backend("triton")
    launches = spy_on_prefill_kernel(monkeypatch)
    assert_long_prefill_steps_match_hf(ours, hf, prompt_seed=10, driver_seed=5)
    assert (8, True, None) in launches and (None, True, None) in launches
