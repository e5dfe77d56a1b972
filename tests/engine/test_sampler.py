"""Sampler on synthetic logits: each parameter against its definition, no model needed."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampler import Sampler, apply_logit_edits, sampling_probs
from pagedserve.services.engine.sampling_metadata import build_sampling_metadata
from pagedserve.services.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_request

VOCAB = 8
CPU = torch.device("cpu")


def sample(logits: torch.Tensor, requests: list[Request], seed: int = 0):
    return Sampler(CPU, seed)(logits.clone(), build_sampling_metadata(requests, logits.shape[1], CPU))


def many(params: SamplingParams, logits_row: torch.Tensor, num_rows: int = 20000) -> torch.Tensor:
    """Token frequencies over num_rows independent draws from one distribution: [vocab]."""
    requests = [make_request([1], params) for _ in range(num_rows)]
    tokens = sample(logits_row.expand(num_rows, -1), requests).sampled_token_ids
    return torch.bincount(tokens, minlength=logits_row.shape[0]).float() / num_rows


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0])


def test_greedy_and_top_k_1_take_the_argmax() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(dim=-1)
    greedy = [make_request([1], SamplingParams(temperature=0.0)) for _ in range(64)]
    top1 = [make_request([1], SamplingParams(temperature=1.5, top_k=1)) for _ in range(64)]
    assert torch.equal(sample(logits, greedy).sampled_token_ids, argmax)
    assert torch.equal(sample(logits, top1).sampled_token_ids, argmax)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    freq = many(SamplingParams(temperature=temperature), LOGITS)
    expected = torch.softmax(LOGITS / temperature, dim=0)
    assert (freq - expected).abs().sum() < 0.04


def test_top_k_keeps_the_k_best_renormalized() -> None:
    freq = many(SamplingParams(top_k=3), LOGITS)
    keep = torch.tensor([7, 0, 1])
    expected = torch.zeros(VOCAB)
    expected[keep] = torch.softmax(LOGITS[keep], dim=0)
    assert freq[[2, 3, 4, 5, 6]].sum() == 0
    assert (freq - expected).abs().sum() < 0.04


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.softmax(LOGITS, dim=0)
    order = probs.argsort(descending=True)
    top_p = float(probs[order[:3]].sum()) - 0.01  # the 3 best reach p; 2 do not
    freq = many(SamplingParams(top_p=top_p), LOGITS)
    expected = torch.zeros(VOCAB)
    expected[order[:3]] = probs[order[:3]] / probs[order[:3]].sum()
    assert freq[order[3:]].sum() == 0
    assert (freq - expected).abs().sum() < 0.04


def reference_support(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Which tokens may be sampled, by the definitions, with a full sort (slow and plain)."""
    probs = torch.softmax(logits / params.temperature, dim=0)
    keep = probs >= params.min_p * probs.max()
    probs = probs * keep
    order = probs.argsort(descending=True)
    if params.top_k > 0:
        keep[order[params.top_k :]] = False
    probs = probs * keep
    if params.top_p < 1.0:
        sorted_probs = probs[order]
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep[order[(mass_before >= params.top_p * probs.sum()).nonzero()[:, 0]]] = False
        keep[order[0]] = True
    return keep


def test_filters_match_a_full_sort_reference_on_wide_vocabularies() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab = 3000  # wider than the top_p candidate set, so flat rows take the sorting fallback
    scales = [0.05, 0.5, 3.0, 8.0]  # from nearly flat to peaked
    logits = torch.cat([torch.randn(4, vocab, generator=gen) * scale for scale in scales])
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m)
        for t, p, k, m in [(1.0, 0.9, 0, 0.0), (0.7, 0.5, 50, 0.0), (1.3, 0.95, 0, 0.05), (1.0, 1.0, 2000, 0.0)]
    ] * len(scales)
    requests = [make_request([1], p) for p in params]
    probs = sampling_probs(logits.clone(), build_sampling_metadata(requests, vocab, CPU))
    for row, p in enumerate(params):
        expected = reference_support(logits[row], p)
        assert torch.equal(probs[row] > 0, expected), f"row {row}: {p}"


def test_min_p_drops_tokens_below_a_share_of_the_best() -> None:
    probs = torch.softmax(LOGITS, dim=0)
    min_p = 0.3
    freq = many(SamplingParams(min_p=min_p), LOGITS)
    kept = probs >= min_p * probs.max()
    assert freq[~kept].sum() == 0 and freq[kept].min() > 0
    assert (freq - probs * kept / probs[kept].sum()).abs().sum() < 0.04


def test_logit_bias_bans_and_forces_tokens() -> None:
    banned = many(SamplingParams(temperature=1.0, logit_bias={7: -100.0}), LOGITS, 4000)
    forced = many(SamplingParams(temperature=1.0, logit_bias={6: 100.0}), LOGITS, 4000)
    assert banned[7] == 0 and banned[0] > 0
    assert forced[6] == 1.0


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[0])
    pending = make_request([1], params, eos_token_ids=frozenset({7}))
    done = make_request([1], params, eos_token_ids=frozenset({7}))
    done.all_token_ids += [3, 3]  # already has 2 output tokens
    out = sample(LOGITS.expand(2, -1), [pending, done]).sampled_token_ids.tolist()
    assert out == [1, 7]  # 7 (EOS) and 0 (stop) banned for the first row only


def test_penalties_match_their_definitions() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.8),
    ]
    requests = [make_request([1, 2], p) for p in params]
    for r in requests:
        r.all_token_ids += [3, 3, 5]
    meta = build_sampling_metadata(requests, VOCAB, CPU)
    edited = logits.clone()
    apply_logit_edits(edited, meta)
    expected = logits.clone()
    for t in (1, 2, 3, 5):  # repetition: prompt and output tokens
        x = expected[0, t]
        expected[0, t] = x / 1.7 if x > 0 else x * 1.7
    expected[1, 3] -= 1.5
    expected[1, 5] -= 1.5
    expected[2, 3] -= 0.8 * 2
    expected[2, 5] -= 0.8
    assert torch.allclose(edited, expected)


def test_seeded_rows_ignore_their_neighbours() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(5))

    def draws(seed: int, num_neighbours: int, sampler_seed: int) -> list[int]:
        """20 steps of one seeded request, at a moving row among unseeded neighbours."""
        request = make_request([1], SamplingParams(temperature=1.0, seed=seed))
        sampler, noise = Sampler(CPU, sampler_seed), torch.Generator().manual_seed(sampler_seed)
        tokens = []
        for step in range(20):
            row = step % (num_neighbours + 1)
            batch = [make_request([1], SamplingParams(temperature=1.0)) for _ in range(num_neighbours)]
            batch.insert(row, request)
            rows = torch.randn(num_neighbours + 1, 100, generator=noise)
            rows[row] = logits
            out = sampler(rows, build_sampling_metadata(batch, 100, CPU))
            tokens.append(int(out.sampled_token_ids[row]))
        return tokens

    alone = draws(1234, 0, 0)
    assert draws(1234, 5, 99) == alone
    assert draws(1234, 2, 7) == alone
    assert len(set(alone)) > 1  # it really samples
    assert draws(4321, 2, 7) != alone


def test_logprobs_are_raw_log_softmax_with_top_k() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(7))
    requests = [
        make_request([1], SamplingParams(temperature=0.7, logprobs=4, logit_bias={0: 5.0})),
        make_request([1], SamplingParams(temperature=0.0)),  # no logprobs
        make_request([1], SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = sample(logits, requests)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    expected = torch.log_softmax(logits, dim=-1)  # before bias and temperature
    sampled = out.sampled_token_ids
    rows = [0, 2]
    assert out.logprobs.shape == (2, 5)
    for i, row in enumerate(rows):
        assert int(out.logprob_token_ids[i, 0]) == int(sampled[row])
        assert math.isclose(float(out.logprobs[i, 0]), float(expected[row, sampled[row]]), abs_tol=1e-5)
    top = expected[0].topk(4)
    assert out.logprob_token_ids[0, 1:].tolist() == top.indices.tolist()
    assert torch.allclose(out.logprobs[0, 1:], top.values)
