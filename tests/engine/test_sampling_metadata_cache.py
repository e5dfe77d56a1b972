"""SamplingMetadataCache: a steady decode batch reuses its metadata; any change rebuilds it."""

from __future__ import annotations

import torch

from pagedserve.services.engine.sampling_metadata import SamplingMetadataCache
from pagedserve.services.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_request

CPU = torch.device("cpu")


def test_same_batch_reuses_and_a_changed_batch_rebuilds() -> None:
    cache = SamplingMetadataCache()
    batch = [make_request([5, 6], SamplingParams(temperature=0.7, top_p=0.9)) for _ in range(3)]
    first = cache.get(batch, 64, CPU)
    assert cache.get(list(batch), 64, CPU) is first  # same sequences, same order
    assert cache.get(batch[::-1], 64, CPU) is not first  # reordered rows
    third = cache.get(batch[:2], 64, CPU)
    assert third is not first and third.num_rows == 2
    lookalike = [*batch[:2], make_request([5, 6], SamplingParams(temperature=0.7, top_p=0.9))]
    assert cache.get(lookalike, 64, CPU) is not cache.get(batch, 64, CPU)  # identity, not equality


def test_per_step_inputs_are_never_cached() -> None:
    cache = SamplingMetadataCache()
    with_penalty = [make_request([5, 6], SamplingParams(repetition_penalty=1.2))]
    assert cache.get(with_penalty, 64, CPU) is not cache.get(with_penalty, 64, CPU)
    pending_min_tokens = [make_request([5, 6], SamplingParams(min_tokens=4))]
    meta = cache.get(pending_min_tokens, 64, CPU)
    assert meta.banned is not None
    assert cache.get(pending_min_tokens, 64, CPU) is not meta
