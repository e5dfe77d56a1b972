"""Pooling (services/engine/pooler.py): the pure functions against plain torch, and a pooling engine's
embeddings against HF transformers' final hidden states, pooled the same way, chunked prefill included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.pooler import finish_vector, pool_step, to_host
from pagedserve.services.engine.pooling_config import PoolingParams
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import ScheduledRequest
from pagedserve.shared.config import Config
from tests.engine.engine_helpers import make_request

PROMPTS = [[1, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 5], [1, 200, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]


def _plain(rows: torch.Tensor, pooling_type: str, dimensions: int | None = None) -> torch.Tensor:
    """The oracle: plain torch over a whole prompt's rows."""
    vector = {"LAST": rows[-1], "MEAN": rows.sum(0) / rows.shape[0], "CLS": rows[0]}[pooling_type]
    vector = vector[:dimensions] if dimensions else vector
    return vector / vector.norm()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pool_step_over_prompt_chunks_matches_plain_torch(pooling_type) -> None:
    # A: 10 prompt tokens in chunks of 4, 4, 2 over three steps; B: 3 tokens, whole, in the first step;
    # C (no pooling) shares the steps. Only the step that ends a prompt gives its vector.
    torch.manual_seed(0)
    rows_a, rows_b, rows_c = torch.randn(10, 8), torch.randn(3, 8), torch.randn(3, 8)
    a = make_request(list(range(3, 13)))
    b = make_request([5, 6, 7])
    c = make_request([7, 8, 9])
    a.pooling = PoolingParams(pooling_type)
    b.pooling = PoolingParams(pooling_type, dimensions=5)
    steps = [
        ([ScheduledRequest(b, 0, 3, False), ScheduledRequest(a, 0, 4, False)], torch.cat([rows_b, rows_a[:4]])),
        ([ScheduledRequest(c, 0, 3, True), ScheduledRequest(a, 4, 4, False)], torch.cat([rows_c, rows_a[4:8]])),
        ([ScheduledRequest(a, 8, 2, False)], rows_a[8:]),
    ]
    finished = [pool_step(hidden, scheduled) for scheduled, hidden in steps]
    assert [[chunk.request for chunk in step] for step in finished] == [[b], [], [a]]
    assert torch.allclose(finished[0][0].vector, _plain(rows_b, pooling_type, 5), atol=1e-6)
    assert torch.allclose(finished[2][0].vector, _plain(rows_a, pooling_type), atol=1e-6)
    assert a.pooled_state is None and b.pooled_state is None  # nothing kept once pooled
    host = to_host([finished[0][0], finished[2][0]])  # one copy for vectors of different sizes
    assert [request for request, _ in host] == [b, a] and [len(vector) for _, vector in host] == [5, 8]
    assert host[1][1] == pytest.approx(finished[2][0].vector.tolist())


def test_finish_vector_truncates_then_normalizes() -> None:
    vector = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_vector(vector, None, normalize=True), vector / 13)
    assert torch.allclose(finish_vector(vector, 2, normalize=True), torch.tensor([0.6, 0.8]))
    assert torch.equal(finish_vector(vector, 2, normalize=False), vector[:2])


def _hf_hidden(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()  # the decoder stack, final norm included
    with torch.no_grad():
        return hf(torch.tensor([prompt])).last_hidden_state[0]


def _pooling_engine(model: CausalLM, model_dir: Path, pooling_type: str, **overrides) -> Engine:
    config = Config.of(
        model=str(model_dir),
        runner="pooling",
        pooler_config=f'{{"pooling_type": "{pooling_type}"}}',
        **{"num_kv_blocks": 64, "block_size": 4, **overrides},
    )
    return Engine(config, model=model)


@pytest.mark.parametrize(
    ("pooling_type", "is_async"), [("LAST", False), ("MEAN", False), ("CLS", False), ("MEAN", True)]
)
def test_pooling_engine_matches_hf_hidden_states(
    tiny_model: CausalLM, tiny_model_dir: Path, pooling_type, is_async: bool
) -> None:
    # 4 tokens a step: the long prompts are pooled over several chunks, batched with the short one; async
    # scheduling (the CUDA default) launches a step before the previous one's results are read
    engine = _pooling_engine(
        tiny_model, tiny_model_dir, pooling_type, max_num_batched_tokens=4, async_scheduling=is_async
    )
    got = engine.embed(PROMPTS)
    for prompt, vector in zip(PROMPTS, got):
        expected = _plain(_hf_hidden(tiny_model_dir, prompt), pooling_type)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
    assert engine.kv_cache.num_free_blocks == 64  # every block came back: nothing decodes after the prompt
    engine.kv_cache.check_invariants()
    assert engine.stats().num_generated_tokens == 0  # nothing was sampled


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_dimensions_truncate_then_normalize_and_prefix_cache_is_safe(tiny_model, tiny_model_dir, pooling_type) -> None:
    engine = _pooling_engine(tiny_model, tiny_model_dir, pooling_type)
    full = torch.tensor(engine.embed([PROMPTS[0]])[0])
    again = engine.embed([PROMPTS[0], PROMPTS[0]], dimensions=8)  # the same prompt: its blocks are cached now
    rows = _hf_hidden(tiny_model_dir, PROMPTS[0])
    assert torch.allclose(full, _plain(rows, pooling_type), atol=1e-5)
    for vector in again:
        assert torch.allclose(torch.tensor(vector), _plain(rows, pooling_type, 8), atol=1e-5)
    assert engine.stats().num_prefix_cache_hit_tokens == (16 if pooling_type == "LAST" else 0)  # MEAN: none


def test_pooling_and_generation_engines_refuse_each_other(engine: Engine, tiny_model, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"^model:"):
        engine.add_embedding_request("e", [1, 2, 3])
    pooling = _pooling_engine(tiny_model, tiny_model_dir, "LAST")
    with pytest.raises(ValueError, match=r"^model:"):
        pooling.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^dimensions:"):
        pooling.add_embedding_request("d", [1, 2, 3], dimensions=65)  # the hidden size is 64
    with pytest.raises(ValueError, match=r"^input:"):
        pooling.add_embedding_request("long", [1] * 1024)  # the whole context: no longer than the limit
    assert not pooling.has_unfinished()


def test_a_bare_qwen3_decoder_checkpoint_pools_by_itself(tmp_path: Path) -> None:
    """`Qwen3Model` weights (no `model.` prefix, no LM head), as embedding checkpoints ship: loaded, and
    served for pooling with no flag (--runner auto), last token, normalized, as HF computes it."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.25,
    )
    torch.manual_seed(0)
    Qwen3Model(config).save_pretrained(tmp_path)
    engine = Engine(Config.of(model=str(tmp_path), num_kv_blocks=64, block_size=4))
    assert engine.pooling is not None and engine.pooling.pooling_type == "LAST"
    got = engine.embed(PROMPTS)
    for prompt, vector in zip(PROMPTS, got):
        expected = _plain(_hf_hidden(tmp_path, prompt), "LAST")
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
