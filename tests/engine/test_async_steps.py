"""Overlapped steps (async scheduling) on the CPU: the same tokens, finish reasons, logprobs and
prefix-cache behaviour as one step at a time, and placeholders that never leak.

The overlap logic is device-independent (on CPU a "launched" step has simply already run), so CI
checks it here; the GPU run in bench/throughput.py checks the device side.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.cuda_graphs import (
    GraphShape,
    QueryKind,
    StepGraphs,
    capture_sizes,
    graph_shapes,
    mixed_token_sizes,
)
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.input_batch import (
    PLACEHOLDER_TOKEN_ID,
    InputBuffers,
    build_host_batch,
    pad_decode_batch,
)
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.outputs import RequestOutput
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import ScheduledRequest
from pagedserve.shared.config import Config
from tests.engine.engine_helpers import make_request

EOS = 2


def make_engine(
    model: CausalLM, model_dir: Path, is_async: bool, num_kv_blocks: int = 64, max_num_batched_tokens: int = 24
) -> Engine:
    config = Config.of(
        model=str(model_dir),
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=is_async,
    )
    return Engine(config, model=model)


def run(engine: Engine, abort_after: dict[int, str] | None = None) -> dict[tuple[str, int], list[RequestOutput]]:
    by_choice: dict[tuple[str, int], list[RequestOutput]] = {}
    num_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            by_choice.setdefault((out.request_id, out.index), []).append(out)
        num_steps += 1
        if abort_after and num_steps in abort_after:
            engine.abort([abort_after[num_steps]])
        assert num_steps < 2000
    engine.kv_cache.check_invariants()
    assert len(engine.placeholders) == 0
    return by_choice


def summary(results: dict[tuple[str, int], list[RequestOutput]]) -> dict[tuple[str, int], tuple]:
    out = {}
    for key, outs in results.items():
        tokens = [t for o in outs for t in o.new_token_ids]
        logprobs = [round(lp.logprob, 4) for o in outs for lp in (o.new_logprobs or [])]
        assert all(o.finish_reason is None for o in outs[:-1]) and outs[-1].finish_reason is not None
        assert outs[-1].num_output_tokens == len(tokens)
        out[key] = (tuple(tokens), outs[-1].finish_reason, tuple(logprobs))
    return out


def workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(9)]
    cases = []
    for i in range(14):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))]
        params = rng.choice(
            [
                SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), ignore_eos=True),
                SamplingParams(temperature=1.0, seed=i, max_tokens=10, logit_bias={EOS: 3.0}),  # EOS stops
                SamplingParams(temperature=0.8, seed=i, max_tokens=9, min_tokens=4, logit_bias={EOS: 4.0}),
                SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[rng.randrange(3, 256)], logprobs=2),
                SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=7, logit_bias={EOS: 2.0}),
                SamplingParams(temperature=1.0, seed=i, max_tokens=6, repetition_penalty=1.3),  # no overlap
            ]
        )
        cases.append((f"r{i}", prompt, params))
    return cases


@pytest.mark.parametrize("num_kv_blocks", [64, 20])  # 20: preemptions
def test_async_matches_sync(tiny_model: CausalLM, tiny_model_dir: Path, num_kv_blocks: int) -> None:
    summaries = []
    for is_async in (False, True):
        engine = make_engine(tiny_model, tiny_model_dir, is_async, num_kv_blocks)
        for request_id, prompt, params in workload(seed=num_kv_blocks):
            engine.add_request(request_id, prompt, params)
        summaries.append(summary(run(engine)))
        if num_kv_blocks == 20:
            assert engine.stats().num_preemptions > 0
    assert summaries[0] == summaries[1]
    assert any(reason == "stop" for _, reason, _ in summaries[0].values())


def test_async_prefix_cache_hits_generated_blocks(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    """Blocks completed by a placeholder are published once the token is known, with the right hash.
    (A sequence that ends at a launch frees its blocks before its last token is known: its last
    block goes unpublished. Here it runs on well past block 4.)"""
    engine = make_engine(tiny_model, tiny_model_dir, is_async=True)
    prompt = [7, 8, 9, 10, 11]
    first = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))[0]
    follow_up = prompt + first.token_ids[:11] + [5]  # 4 full blocks of 4, the 4th ended by a placeholder
    before = engine.stats().num_prefix_cache_hit_tokens
    engine.generate([follow_up], SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.stats().num_prefix_cache_hit_tokens - before == 16


def test_async_abort_in_flight_reports_abort_once(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model, tiny_model_dir, is_async=True)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    results = run(engine, abort_after={3: "a", 4: "b"})  # "a" hit max_tokens at a launch, unreported
    for key in (("a", 0), ("b", 0)):
        reasons = [o.finish_reason for o in results[key] if o.finish_reason]
        assert reasons == ["abort"]
    engine.abort(["a", "b"])  # idempotent
    assert not engine.step()


def test_host_batch_patches_placeholders_and_pads() -> None:
    decode = make_request([3, 4, 5, 6])
    decode.all_token_ids.append(PLACEHOLDER_TOKEN_ID)  # sampled by the step in flight
    decode.num_computed_tokens = 4
    chunk = make_request(list(range(10, 20)))
    scheduled = [ScheduledRequest(decode, 4, 1, True), ScheduledRequest(chunk, 0, 6, False)]
    batch = build_host_batch(scheduled, [[3, 7], [1, 2]], block_size=4, pending_rows={decode: 5, chunk: 0})
    assert batch.patch_rows.tolist() == [0] and batch.patch_src.tolist() == [5]  # chunk: not its last token
    assert batch.input_ids[0] == 0 and batch.input_ids[1:].tolist() == list(range(10, 16))
    assert batch.slot_mapping.tolist() == [7 * 4 + 0, 4, 5, 6, 7, 8, 9]
    assert batch.logits_rows.tolist() == [0] and batch.max_query_len == 6
    with pytest.raises(AssertionError):
        build_host_batch(scheduled, [[3, 7], [1, 2]], block_size=4)  # a placeholder with no source

    only_decode = build_host_batch(scheduled[:1], [[3, 7]], block_size=4, pending_rows={decode: 5})
    padded = pad_decode_batch(only_decode, 4)
    assert padded.num_seqs == 4 and padded.num_tokens == 4
    assert padded.slot_mapping.tolist() == [28, -1, -1, -1] and padded.seq_lens.tolist() == [5, 1, 1, 1]
    assert np.array_equal(padded.query_start_loc, np.arange(5))


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(s % 8 == 0 for s in sizes[3:])


def test_graph_shapes_and_the_choice_of_one() -> None:
    assert mixed_token_sizes(2048)[:9] == [16, 32, 48, 64, 80, 96, 112, 128, 160]
    assert mixed_token_sizes(2048)[-3:] == [1536, 1792, 2048] and mixed_token_sizes(100)[-1] == 100
    sizes = mixed_token_sizes(2048)
    assert all(later <= 1.25 * earlier for earlier, later in itertools.pairwise(sizes[3:]))  # padding <= 25%
    shapes = graph_shapes(max_decode_batch=16, max_mixed_tokens=512, max_num_seqs=64)
    assert GraphShape(16, 16, QueryKind.DECODE) in shapes and GraphShape(512, 64, QueryKind.SHORT) in shapes
    assert GraphShape(512, 16, QueryKind.LONG) in shapes  # 512 // 32: the prefill kernel may take it
    assert not any(s.kind == QueryKind.LONG and s.num_tokens < 64 for s in shapes)
    buffers = InputBuffers(512, 64, 8, torch.device("cpu"))
    graphs = StepGraphs(None, [], buffers, shapes, 128)
    graphs._graphs = dict.fromkeys(range(len(shapes)))  # type: ignore[assignment]

    def chosen(query_lens: list[int]) -> GraphShape | None:
        batch = build_host_batch(
            [ScheduledRequest(make_request(list(range(3, 3 + n))), 0, n, True) for n in query_lens],
            [list(range(-(-n // 4))) for n in query_lens],
            block_size=4,
        )
        graph_id = graphs.choose(batch)
        if graph_id is None:
            return None
        padded = graphs.pad(batch, graph_id)
        shape = shapes[graph_id]
        assert (padded.num_tokens, padded.num_seqs) == (shape.num_tokens, shape.num_seqs)
        return shape

    assert chosen([1, 1, 1]) == GraphShape(4, 4, QueryKind.DECODE)
    assert chosen([1] * 17) is None  # more decodes than the largest decode graph
    assert chosen([5, 1, 1]) == GraphShape(16, 16, QueryKind.SHORT)
    assert chosen([100]) == GraphShape(112, 3, QueryKind.LONG)  # 112 // 32 sequences: the prefill kernel's
    assert chosen([100, *[1] * 10]) == GraphShape(112, 64, QueryKind.LONG)
    assert chosen([400, 200]) is None  # more tokens than the largest mixed graph


class EagerGraph:
    """Stands in for a CUDA graph on the CPU: "replay" reruns the forward pass on the buffers."""

    def __init__(self, graphs: StepGraphs, shape: GraphShape, out: torch.Tensor) -> None:
        self.graphs, self.shape, self.out = graphs, shape, out

    replays: ClassVar[list[GraphShape]] = []

    def replay(self) -> None:
        EagerGraph.replays.append(self.shape)
        self.out.copy_(self.graphs._forward(self.shape))


class EagerGraphs(StepGraphs):
    def capture(self) -> None:
        hidden_size = self.model.spec.hidden_size
        for graph_id, shape in enumerate(self.shapes):
            graph = EagerGraph(self, shape, torch.empty(shape.num_tokens, hidden_size))
            self._graphs[graph_id] = (graph, graph.out, [])  # type: ignore[assignment]

    def _forward(self, shape: GraphShape) -> torch.Tensor:
        """The graph's inputs (padding sequences included) but only the real tokens, with the step's longest
        query and sequence: the torch attention pads to those and takes no token outside a sequence (the
        Triton kernels read neither length and skip such tokens)."""
        ids = self.buffers.device_1d
        starts = ids["query_start_loc"][: shape.num_seqs + 1]
        seq_lens = ids["seq_lens"][: shape.num_seqs]
        num_real = int(starts[-1])
        meta = AttentionMetadata(
            ids["slot_mapping"][:num_real],
            starts,
            seq_lens,
            self.buffers.block_tables[: shape.num_seqs],
            int((starts[1:] - starts[:-1]).max()),
            int(seq_lens.max()),
        )
        groups = [g.for_graph(num_real, shape.num_seqs) for g in self.buffers.groups]  # a hybrid KV cache's
        meta.with_groups(groups, self.buffers.layer_groups)
        hidden = self.model(ids["input_ids"][:num_real], ids["positions"][:num_real], self.kv_caches, meta)
        return torch.cat([hidden, hidden.new_zeros(shape.num_tokens - num_real, hidden.shape[1])])


@pytest.mark.parametrize("max_num_batched_tokens", [24, 128])  # 128: prompts of 64+ tokens (LONG graphs)
def test_persistent_buffers_and_padded_graph_batches_match(
    tiny_model: CausalLM, tiny_model_dir: Path, max_num_batched_tokens: int
) -> None:
    """The CUDA path's input handling (pinned staging, persistent buffers, decode and mixed batches padded
    to a captured shape, placeholders patched from the previous step) run on the CPU gives the same tokens."""
    cases = [(rid, prompt, params) for rid, prompt, params in workload(seed=5) if not params.has_penalties]
    if max_num_batched_tokens > 64:
        cases += [
            (f"long{i}", list(range(3 + i, 3 + i + 70 + 9 * i)), SamplingParams(temperature=0.0, max_tokens=4))
            for i in range(3)
        ]
    summaries = []
    EagerGraph.replays.clear()
    for is_cuda_like in (False, True):
        engine = make_engine(
            tiny_model, tiny_model_dir, is_async=is_cuda_like, max_num_batched_tokens=max_num_batched_tokens
        )
        if is_cuda_like:
            runner = engine.runner
            runner.buffers = InputBuffers(max_num_batched_tokens, 8, -(-engine.max_model_len // 4), torch.device("cpu"))
            shapes = graph_shapes(8, max_num_batched_tokens, 8)
            runner.graphs = EagerGraphs(tiny_model, runner.kv_caches, runner.buffers, shapes, engine.max_model_len)
            runner.capture_graphs()
        for request_id, prompt, params in cases:
            engine.add_request(request_id, prompt, params)
        summaries.append(summary(run(engine)))
    assert summaries[0] == summaries[1]
    kinds = {shape.kind for shape in EagerGraph.replays}
    assert kinds == (
        {QueryKind.DECODE, QueryKind.SHORT, QueryKind.LONG}
        if max_num_batched_tokens > 64
        else {QueryKind.DECODE, QueryKind.SHORT}
    )
    padded_seqs = [s for s in EagerGraph.replays if s.kind != QueryKind.DECODE and s.num_seqs > 1]
    assert padded_seqs  # mixed steps ran with padding sequences
