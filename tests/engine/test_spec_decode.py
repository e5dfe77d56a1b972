"""Speculative decoding through the engine: greedy output equals plain decoding with every proposer, under
the request's own sampling rules, with prefix caching, chunked prefill, preemption and n > 1."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.spec_decode.draft_model import DraftModelProposer
from pagedserve.services.engine.spec_decode.ngram import NgramProposer
from pagedserve.services.engine.spec_decode.proposers import make_speculative_decoding
from pagedserve.shared.config import Config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# [9] * 12 makes the tiny model repeat a token at first: the n-gram drafts of that stretch are accepted.
PROMPTS = [[9] * 12, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [100, 3, 4, 100, 3, 4, 100, 3], [17, 33, 250, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def other_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama of the same shape with other random weights: a draft that is mostly wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.5,
    )
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-draft")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _engine(model_dir: Path, model: CausalLM, spec: dict | None = None, **settings: object) -> Engine:
    settings = {"num_kv_blocks": 128, "block_size": 4, **settings}
    if spec is not None:
        settings["speculative_config"] = json.dumps(spec)
    return Engine(Config.of(model=str(model_dir), **settings), model=model)


def _outputs(engine: Engine, params: SamplingParams | Sequence[SamplingParams], prompts=PROMPTS) -> list:
    return [[c.token_ids for c in r.choices] for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(tiny_model: CausalLM, tiny_model_dir: Path) -> list:
    """Plain greedy decoding's output: what every proposer must reproduce."""
    return _outputs(_engine(tiny_model_dir, tiny_model), GREEDY)


def test_ngram_greedy_equals_plain_decoding(tiny_model: CausalLM, tiny_model_dir: Path, plain: list) -> None:
    engine = _engine(tiny_model_dir, tiny_model, NGRAM)
    assert isinstance(engine.speculative and engine.speculative.proposer, NgramProposer)
    assert not engine.is_async and make_speculative_decoding(Config.of(), engine.runner, engine.kv_cache) is None
    assert _outputs(engine, GREEDY) == plain
    stats = engine.stats()
    assert stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens > 0  # both paths ran: accept and reject
    assert stats.num_spec_accepted_tokens_per_pos[0] >= stats.num_spec_accepted_tokens_per_pos[-1]


def test_draft_model_of_the_same_weights_is_always_accepted(
    tiny_model: CausalLM, tiny_model_dir: Path, plain: list
) -> None:
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    engine = _engine(tiny_model_dir, tiny_model, spec)
    assert isinstance(engine.speculative and engine.speculative.proposer, DraftModelProposer)
    assert _outputs(engine, GREEDY) == plain
    stats = engine.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    assert stats.num_steps < 16  # 16 tokens in well under one step each


def test_a_poor_draft_model_changes_nothing_but_speed(
    tiny_model: CausalLM, tiny_model_dir: Path, other_tiny_model_dir: Path, plain: list
) -> None:
    spec = {"method": "draft_model", "model": str(other_tiny_model_dir), "num_speculative_tokens": 3}
    engine = _engine(tiny_model_dir, tiny_model, spec)
    n2 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    assert _outputs(engine, n2, PROMPTS[:2]) == [choices * 2 for choices in plain[:2]]
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens / 4


def test_tight_cache_chunked_prefill_and_prefix_sharing(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    """Preemption (few blocks), chunked prefill (a small token budget) and a shared prefix hit, all with drafts."""
    prompts = [*PROMPTS, PROMPTS[0] + [9, 9, 9, 9]]  # the last one shares the first one's cached blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = _engine(tiny_model_dir, tiny_model, NGRAM, num_kv_blocks=16, max_num_batched_tokens=8)
    outputs = _outputs(engine, params, prompts)
    assert outputs == _outputs(_engine(tiny_model_dir, tiny_model), params, prompts)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_tokens > 0 and stats.num_spec_accepted_tokens > 0
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


class OracleProposer:
    """Drafts the known answer with every third token wrong: long accepted runs and regular rejections."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers

    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, max_num_tokens):
            done = request.num_output_tokens
            answer = self.answers[tuple(request.prompt_token_ids)][done : done + k]
            drafts.append([(t + 1) % 256 if (done + i) % 3 == 2 else t for i, t in enumerate(answer)])
        return drafts


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=17, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=19, min_tokens=6, logit_bias={7: 3.0}, stop_token_ids=[2]),
    ],
    ids=["penalties-logprobs", "min-tokens-bias-stop"],
)
def test_sampling_rules_hold_over_accepted_drafts(
    tiny_model: CausalLM, tiny_model_dir: Path, params: SamplingParams
) -> None:
    plain = _engine(tiny_model_dir, tiny_model).generate(PROMPTS, params)
    engine = _engine(tiny_model_dir, tiny_model, NGRAM)
    assert engine.speculative is not None
    engine.speculative.proposer = OracleProposer({tuple(r.prompt_token_ids): r.token_ids for r in plain})
    spec = engine.generate(PROMPTS, params)
    assert engine.stats().num_spec_accepted_tokens > len(PROMPTS) * 4
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        if params.logprobs is not None:
            assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(a.token_ids)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


def test_sampled_output_never_runs_past_a_stop_or_max_tokens(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, tiny_model, NGRAM)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=25, stop_token_ids=[254], seed=3)
    results = engine.generate(PROMPTS * 2, params)
    assert engine.stats().num_spec_draft_tokens > 0
    for result in results:
        tokens = result.token_ids
        assert 0 < len(tokens) <= 25
        assert 254 not in tokens[:-1]
        assert result.finish_reason == ("stop" if tokens[-1] == 254 else "length")
        assert result.finish_reason == "stop" or len(tokens) == 25


def test_a_draft_model_that_cannot_load_stops_start_up(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    spec = {"method": "draft_model", "model": str(tiny_model_dir / "missing"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        _engine(tiny_model_dir, tiny_model, spec)


def test_structured_output_decodes_beside_drafted_sequences(smollm2_dir: Path, smol_model: CausalLM) -> None:
    """A grammar sequence gets no drafts; in verify steps beside a drafted sequence it decodes as it does alone
    (one engine: its grammar compiles once)."""
    from transformers import AutoTokenizer

    from pagedserve.shared.grammar_spec import GrammarSpec

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    passage = "the quick brown fox jumps over the lazy dog near the river bank"
    texts = [f"Repeat this passage exactly:\n\n{passage}", "Give a JSON object with a name."]
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    copy, ask = [list(tokenizer(str(c), add_special_tokens=False)["input_ids"]) for c in chats]
    name = GrammarSpec("regex", r'\{"name": "[a-z]{1,8}"\}')
    grammar = SamplingParams(temperature=0.0, max_tokens=8, structured_output=name)
    engine = _engine(smollm2_dir, smol_model, NGRAM, num_kv_blocks=64, block_size=16)
    alone = _outputs(engine, [grammar], [ask])
    assert engine.stats().num_spec_draft_tokens == 0
    together = _outputs(engine, [SamplingParams(temperature=0.0, max_tokens=8), grammar], [copy, ask])
    assert together[1] == alone[0] and tokenizer.decode(alone[0][0]).startswith('{"name": "')
    assert engine.stats().num_spec_accepted_tokens > 0


class FixedProposer:
    """Drafts the same tokens after any context (likely ones: often accepted, often not)."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        return [self.drafts[:k] for k in max_num_tokens]


def test_sampling_with_drafts_keeps_the_models_distribution(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    """The first three sampled tokens (top_k 2, so 8 outcomes) of 800 choices, with and without drafts:
    one distribution (chi-square test of homogeneity)."""
    from scipy.stats import chi2_contingency

    prompt, num_samples = [17, 33, 250, 4], 800
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, n=num_samples)
    settings = {"num_kv_blocks": 4 * num_samples, "max_num_seqs": num_samples}
    greedy = _engine(tiny_model_dir, tiny_model, **settings).generate([prompt], GREEDY)[0].token_ids
    plain = _engine(tiny_model_dir, tiny_model, **settings).generate([prompt], params)[0]
    engine = _engine(tiny_model_dir, tiny_model, NGRAM, **settings)
    assert engine.speculative is not None
    engine.speculative.proposer = FixedProposer(greedy[1:3])
    spec = engine.generate([prompt], params)[0]
    stats = engine.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens > 0.2
    outcomes = sorted({tuple(c.token_ids) for c in plain.choices + spec.choices})
    table = [[sum(tuple(c.token_ids) == o for c in r.choices) for o in outcomes] for r in (plain, spec)]
    assert chi2_contingency(table).pvalue > 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU phases are timed by CUDA events")
def test_profiled_verify_steps_time_their_gpu_phases(tiny_model_dir: Path) -> None:
    """--profile-steps with drafts: a verify step records every GPU mark (reading them raised before)."""
    config = Config.of(
        model=str(tiny_model_dir),
        device="cuda",
        num_kv_blocks=128,
        speculative_config=json.dumps(NGRAM),
        profile_steps=True,
    )
    engine = Engine(config)
    _outputs(engine, GREEDY)
    summary = engine.profile.summary()
    assert engine.stats().num_spec_drafts > 0
    assert sum(kind["steps"] for kind in summary.values()) > 0
    assert all(kind["gpu_ms"]["sample"] >= 0 for kind in summary.values())
