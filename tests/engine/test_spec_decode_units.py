"""Speculative decoding's parts without a model: rejection sampling keeps the target distribution (chi-square),
n-gram lookup, the verify step's rows and batch layout, the scheduler's roll-back, config errors, metrics."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from scipy.stats import chisquare

from pagedserve.services.engine.input_batch import build_host_batch
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.outputs import EngineStats
from pagedserve.services.engine.sampler import Sampler
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import Scheduler
from pagedserve.services.engine.spec_decode import SpeculativeDecoding
from pagedserve.services.engine.spec_decode.ngram import NgramProposer, find_continuation
from pagedserve.services.engine.spec_decode.rejection_sampler import accept_drafts, num_accepted
from pagedserve.services.engine.spec_decode.verify import row_requests, verify
from pagedserve.services.engine.vllm_metrics import VllmEngineMetrics
from pagedserve.shared.config import Config, parse_speculative_config
from pagedserve.shared.config_cli import add_config_flags, build_config, strip_vllm_only_flags
from tests.engine.engine_helpers import make_request

NUM_SAMPLES = 40_000
P_MIN = 1e-4  # a correct sampler fails this about once in 10,000 runs (fixed seeds: never, in practice)


def _chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability zero was emitted"
    return float(chisquare(counts[kept].numpy(), expected[kept].numpy()).pvalue)


def _residual_draw(residual: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), 1, generator=generator)[:, 0]


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "one-hot-draft"])
def test_rejection_sampling_emits_the_target_distribution(point_mass: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])  # the target (one zero: it must never appear)
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])  # a poor draft distribution
    if point_mass:
        drafts = torch.full((NUM_SAMPLES,), 3)  # always the same guess (an n-gram's one-hot q)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, NUM_SAMPLES, replacement=True, generator=generator)
        draft_probs = q.expand(NUM_SAMPLES, -1)
    target = p.expand(NUM_SAMPLES, -1)
    uniform = torch.rand(NUM_SAMPLES, generator=generator)
    accepted, residual = accept_drafts(target, drafts, uniform, draft_probs)
    emitted = torch.where(accepted, drafts, _residual_draw(residual, generator))
    assert _chi_square_p(emitted, p) > P_MIN
    expected_rate = float(p[3]) if point_mass else float(torch.minimum(p, q).sum())  # sum of min(p, q)
    assert float(accepted.double().mean()) == pytest.approx(expected_rate, abs=0.01)


def test_a_bonus_row_draws_from_the_target_itself() -> None:
    p = torch.tensor([[0.1, 0.6, 0.3]])
    accepted, residual = accept_drafts(p, torch.tensor([-1]), torch.tensor([0.0]))
    assert not accepted[0] and torch.equal(residual, p)


def test_num_accepted_counts_leading_acceptances_per_sequence() -> None:
    # rows: seq A (2 drafts + bonus), seq B (no draft: its bonus row only), seq C (3 drafts + bonus)
    accepted = [True, False, False, False, True, True, False, True, False]
    assert num_accepted(accepted, [2, 0, 3]) == [1, 0, 2]


def test_verify_samples_each_position_from_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine's own verify step, temperature 0.7 and top_k 3: the first token's marginal is the
    target's first row; given the first draft was accepted, the second token follows the second row."""
    vocab, num_seqs = 8, 6000
    torch.manual_seed(0)
    rows = torch.randn(3, vocab) * 1.5
    drafts = [int(rows[0].argsort()[-2]), int(rows[1].argmax())]  # likely, but often rejected too
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=8)
    requests = [make_request([1, 2, 3], params) for _ in range(num_seqs)]
    logits = rows.repeat(num_seqs, 1)  # [num_seqs * 3, vocab]: each sequence has 2 drafts + the bonus row
    verified = verify(Sampler(torch.device("cpu"), seed=0), logits, requests, [drafts] * num_seqs, vocab)

    def target(row: int) -> torch.Tensor:
        scaled = rows[row] / 0.7
        scaled[scaled < scaled.topk(3).values[-1]] = float("-inf")
        return torch.softmax(scaled, dim=-1)

    first = torch.tensor([t[0] for t in verified.token_ids])
    assert _chi_square_p(first, target(0)) > P_MIN
    second = torch.tensor([t[1] for t in verified.token_ids if len(t) > 1])
    assert len(second) == sum(1 for t in verified.token_ids if t[0] == drafts[0])  # only after an acceptance
    assert _chi_square_p(second, target(1)) > P_MIN
    assert all(len(t) == n + 1 for t, n in zip(verified.token_ids, verified.num_accepted))


def test_verify_greedy_takes_drafts_while_they_are_the_argmax() -> None:
    logits = torch.zeros(4, 5)
    logits[0, 2] = logits[1, 4] = logits[2, 0] = logits[3, 1] = 5.0  # argmax per row: 2, 4, 0, 1
    request = make_request([7, 8], SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))
    verified = verify(Sampler(torch.device("cpu"), 0), logits, [request], [[2, 4, 3]], 5)
    assert verified.token_ids == [[2, 4, 0]] and verified.num_accepted == [2] and verified.num_drafts == [3]
    logprobs = verified.logprobs[0]
    assert logprobs is not None and [lp.token_id for lp in logprobs] == [2, 4, 0]
    assert all(lp.top_logprobs[0][0] == lp.token_id for lp in logprobs)


def test_rows_of_a_penalized_sequence_see_the_drafts_before_them() -> None:
    plain = make_request([1, 2], SamplingParams(max_tokens=8))
    penalized = make_request([1, 2], SamplingParams(max_tokens=8, presence_penalty=1.0))
    rows = row_requests([plain, penalized], [[5, 6], [5, 6]])
    assert rows[:3] == [plain] * 3
    assert [r.output_token_ids for r in rows[3:]] == [[], [5], [5, 6]]


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert find_continuation(tokens, 1, 4, 3) == [4, 9, 2]  # "1 2 3" (n=3) beats the later "2 3" (n=2)
    assert find_continuation(tokens, 1, 2, 2) == [5, 6]  # n <= 2: the latest "2 3"
    assert find_continuation(np.array([1, 2, 3, 4]), 1, 3, 2) == []
    assert find_continuation(np.array([7, 7]), 1, 3, 4) == [7]  # only what exists after the match
    requests = [make_request([4, 5, 6, 4, 5])]
    assert NgramProposer(2, 3).propose(requests, [5]) == [[6, 4, 5]]


def test_drafts_go_only_to_decoding_sequences_and_fit_max_tokens() -> None:
    class Fixed:
        def propose(self, requests, max_num_tokens):
            return [[11] * k for k in max_num_tokens]

    speculative = SpeculativeDecoding(Fixed(), num_speculative_tokens=4, max_model_len=100)
    decoding = make_request([1, 2, 3], SamplingParams(max_tokens=3))
    decoding.all_token_ids.append(9)  # one output token, the prompt computed
    decoding.num_computed_tokens = 3
    prefilling = make_request([1, 2, 3], SamplingParams(max_tokens=8))
    prefilling.spec_token_ids = [5]  # stale: cleared
    speculative.draft([decoding, prefilling])
    assert decoding.spec_token_ids == [11]  # 3 max_tokens - 1 emitted - 1 for the target's own token
    assert prefilling.spec_token_ids == []


def test_schedule_verify_and_roll_back() -> None:
    """Drafts join the step as query tokens; the batch has logits rows at each; rejected ones are un-computed."""
    kv_cache = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(kv_cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    request = make_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=10), eos_token_ids=frozenset({2}))
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), [7])
    request.spec_token_ids = [8, 9, 10]
    output = scheduler.schedule()
    [item] = output.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, list(item.spec_token_ids)) == (5, 4, [8, 9, 10])
    batch = build_host_batch(output.scheduled, kv_cache.block_tables([request]), 4)
    assert batch.input_ids.tolist() == [7, 8, 9, 10] and batch.positions.tolist() == [5, 6, 7, 8]
    assert batch.logits_rows.tolist() == [0, 1, 2, 3]
    scheduler.update_verified(output, [[8, 11]])  # 8 accepted, 9 rejected: the target said 11
    assert request.output_token_ids == [7, 8, 11] and request.num_computed_tokens == 7  # 5 prompt + 7 + 8
    request.spec_token_ids = [2, 12]  # an EOS draft, accepted: nothing after it
    scheduler.update_verified(scheduler.schedule(), [[2, 12, 13]])
    assert request.output_token_ids == [7, 8, 11, 2] and request.finish_reason == "stop"
    kv_cache.check_invariants()


def test_drafts_that_need_a_block_nobody_has_are_dropped_not_preempting() -> None:
    kv_cache = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv_cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    first, second = make_request([1, 3, 4, 5, 6, 7, 8]), make_request([9, 10, 11, 12, 13, 14, 15])
    for request in (first, second):
        scheduler.add(request)
    scheduler.update(scheduler.schedule(), [20, 21])  # 8 tokens each: all 4 blocks taken
    second.spec_token_ids = [22, 23]  # would need a fifth block
    output = scheduler.schedule()
    assert not output.preempted and [s.num_new_tokens for s in output.scheduled] == [1, 1]
    assert second.spec_token_ids == [] and kv_cache.num_free_blocks == 0


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ("{not json", "speculative_config"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ],
)
def test_a_bad_speculative_config_names_its_field(spec: object, field: str) -> None:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_speculative_config(text)
    with pytest.raises(SystemExit, match=field.replace(".", r"\.")):  # start-up: the CLI's validation
        build_config(_args(speculative_config=text), environ={})


def test_the_vllm_flag_is_accepted_and_parsed() -> None:
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert strip_vllm_only_flags(["--speculative-config", flag]) == ["--speculative-config", flag]
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    config = build_config(parser.parse_args(["--speculative-config", flag]), environ={})
    assert config.runner.speculative == parse_speculative_config(flag)
    assert config.runner.speculative.prompt_lookup_min == 2
    assert Config.of().runner.speculative is None


def _args(**flags: object) -> argparse.Namespace:
    return argparse.Namespace(**flags)


def test_spec_decode_counters_reach_vllm_series() -> None:
    registry = CollectorRegistry()
    metrics = VllmEngineMetrics(registry, "m", "e1")
    first = EngineStats(1, 0, 10, 10, 0, 0, 0, 0, 0, 0)
    later = EngineStats(
        1,
        0,
        10,
        10,
        0,
        0,
        0,
        0,
        0,
        0,
        num_spec_drafts=3,
        num_spec_draft_tokens=12,
        num_spec_accepted_tokens=7,
        num_spec_accepted_tokens_per_pos=(3, 2, 1, 1),
    )
    metrics.observe(first, None)
    metrics.observe(later, first)
    labels = {"model_name": "m", "engine": "e1"}
    assert registry.get_sample_value("vllm:spec_decode_num_drafts_total", labels) == 3
    assert registry.get_sample_value("vllm:spec_decode_num_draft_tokens_total", labels) == 12
    assert registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels) == 7
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [registry.get_sample_value(per_pos, {**labels, "position": str(i)}) for i in range(4)] == [3, 2, 1, 1]
