"""Models with global and sliding-window layers (Gemma 2, gpt-oss) through the engine with a hybrid KV cache:
the sliding layers' blocks are their own and go back once out of the window, so a sequence holds a bounded
number of them however long it runs, and the greedy tokens stay HF's (window 8, blocks of 4, chunked prefill,
prefix hits). The CUDA test runs the same through the Triton kernels and the decode graphs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine import attention
from pagedserve.services.engine.cuda_graphs import graph_shapes
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.hybrid_kv_cache import HybridKVCacheManager
from pagedserve.services.engine.input_batch import InputBuffers
from pagedserve.services.engine.kv_cache_groups import blocks_per_sliding_sequence, max_context
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.engine.test_async_steps import EagerGraph, EagerGraphs
from tests.models.tiny_models import build_tiny_model, hf_greedy, hf_ignores_the_config

HYBRID_CASES = ["gemma2-window8-softcaps", "gpt_oss-sinks-window8-yarn-clamped-experts"]
BLOCK, WINDOW, CHUNK, NUM_BLOCKS, MAX_SEQS = 4, 8, 16, 48, 2


@pytest.fixture(autouse=True)
def torch_backend_after() -> Iterator[None]:
    yield
    attention.use_backend("torch")


def tiny_hf(case: str, model_dir: Path) -> torch.nn.Module:
    hf: torch.nn.Module = build_tiny_model(case, model_dir)
    if reason := hf_ignores_the_config(hf):
        pytest.skip(reason)
    return hf


def hybrid_engine(model_dir: Path, device: str = "cpu", **overrides: object) -> Engine:
    config = Config.of(
        model=str(model_dir),
        dtype="float32",
        device=device,
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=MAX_SEQS,
        **overrides,
    )
    return Engine(config)


def run_holding(engine: Engine, prompts: list[list[int]], num_new: int) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs of the prompts run together, and the most sliding blocks any one held after each step."""
    greedy = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy)
    requests = list(engine.scheduler.waiting)
    kv = engine.kv_cache
    assert isinstance(kv, HybridKVCacheManager)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    held = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        held.append(max(max(kv.num_held_group_blocks(r)[1:]) for r in requests))
        kv.check_invariants()
    return [tokens[f"r{i}"] for i in range(len(prompts))], held


def prompts_for(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (30, 13)]


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_sliding_layers_hold_a_window_of_blocks_and_tokens_equal_hf(case: str, tmp_path: Path) -> None:
    """A 30-token prompt (chunks of at most 16) beside a 13-token one, 40 new tokens each: 70 + 53 tokens of
    context, 32 blocks in the full group, while each holds at most a window's worth of sliding blocks (all 48
    blocks would hold only 24 + 14 without freeing)."""
    hf = tiny_hf(case, tmp_path)
    engine = hybrid_engine(tmp_path)
    groups = engine.runner.kv_groups
    # Gemma 2 (local, global): one group each; gpt-oss (local, global, local): each local layer a group of its own
    assert [g.window for g in groups] == [None] + [WINDOW] * (len(groups) - 1) and len(groups) in (2, 3)
    caches = engine.runner.kv_caches
    assert all(caches[g.layers[0]] is caches[0] for g in groups)  # layer 0 of each group: one tensor
    assert engine.max_model_len == max_context(groups, NUM_BLOCKS, BLOCK, CHUNK)
    prompts = prompts_for(4)
    outputs, held = run_holding(engine, prompts, 40)
    assert max(held) <= blocks_per_sliding_sequence(WINDOW, BLOCK, CHUNK)
    assert max(held[3:]) <= -(-(WINDOW + 1) // BLOCK) + 3  # decoding: the window, partial ends and the spare
    assert outputs == [hf_greedy(hf, p, 40) for p in prompts]


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_a_prefix_hit_serves_every_group_and_tokens_equal_hf(case: str, tmp_path: Path) -> None:
    """The second prompt shares 20 tokens with the first, finished one: a hit of 5 blocks, which the sliding
    group can serve from its window's 2 cached blocks (the 3 before are fillers)."""
    hf = tiny_hf(case, tmp_path)
    engine = hybrid_engine(tmp_path)
    assert engine.scheduler.max_model_len > 29 + 24
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(3, 256, (30,), generator=gen).tolist()
    second = first[:20] + torch.randint(3, 256, (9,), generator=gen).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    [one] = engine.generate([first], greedy)
    [two] = engine.generate([second], greedy)
    assert two.num_cached_tokens == 20
    assert one.token_ids == hf_greedy(hf, first, 24)
    assert two.token_ids == hf_greedy(hf, second, 24)


def test_the_hybrid_manager_can_be_turned_off(tmp_path: Path) -> None:
    """--disable-hybrid-kv-cache-manager: one group, every layer keeps every block (the tokens are the same)."""
    hf = tiny_hf("gemma2-window8-softcaps", tmp_path)
    engine = hybrid_engine(tmp_path, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(engine.kv_cache, HybridKVCacheManager) and len(engine.runner.kv_groups) == 1
    assert not engine.kv_cache.frees_out_of_window
    prompt = prompts_for(4)[0]
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf, prompt, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", HYBRID_CASES)
def test_hybrid_groups_on_the_triton_backend_with_graphs(case: str, tmp_path: Path) -> None:
    """The same on CUDA: Triton kernels read each layer's group's tables and slots, decode graphs included."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf(case, tmp_path)
    engine = hybrid_engine(tmp_path, device="cuda")
    assert attention.backend_name() == "triton" and engine.runner.graphs is not None
    prompts = prompts_for(4)
    outputs, held = run_holding(engine, prompts, 40)
    assert max(held[3:]) <= -(-(WINDOW + 1) // BLOCK) + 3
    assert outputs == [hf_greedy(hf, p, 40) for p in prompts]


def test_hybrid_groups_on_the_triton_kernel_interpreted(tmp_path: Path) -> None:
    """The Triton paged kernel (interpreted on CPU) reads each layer's group's block tables and slots: a prompt
    past the window in two chunks, then decodes past the point where sliding blocks went back."""
    pytest.importorskip("triton")
    hf = tiny_hf("gpt_oss-sinks-window8-yarn-clamped-experts", tmp_path)
    engine = hybrid_engine(tmp_path)
    attention.use_backend("triton")  # the engine picked torch on CPU; its runner reads the backend per step
    prompt = prompts_for(4)[0][:20]
    outputs, held = run_holding(engine, [prompt], 12)
    assert max(held[2:]) <= -(-(WINDOW + 1) // BLOCK) + 3
    assert outputs == [hf_greedy(hf, prompt, 12)]


def test_persistent_buffers_and_graph_batches_carry_every_groups_tables(tmp_path: Path) -> None:
    """The CUDA input path on the CPU (pinned-style staging, persistent group buffers, overlapped steps, decode
    and mixed batches padded to a captured shape, replayed eagerly): gpt-oss's three groups, tokens still HF's."""
    hf = tiny_hf("gpt_oss-sinks-window8-yarn-clamped-experts", tmp_path)
    engine = hybrid_engine(tmp_path, async_scheduling=True)
    runner = engine.runner
    assert runner.layer_groups == [1, 0, 2]
    max_blocks = -(-engine.max_model_len // BLOCK)
    runner.buffers = InputBuffers(CHUNK, MAX_SEQS, max_blocks, torch.device("cpu"), runner.layer_groups)
    shapes = graph_shapes(2, CHUNK, MAX_SEQS)  # decode graphs of 1 and 2 sequences, mixed ones up to a chunk
    runner.graphs = EagerGraphs(runner.model, runner.kv_caches, runner.buffers, shapes, engine.max_model_len)
    runner.capture_graphs()
    replays = len(EagerGraph.replays)
    prompts = prompts_for(4)
    outputs, held = run_holding(engine, prompts, 40)
    assert len(EagerGraph.replays) > replays + 20
    assert max(held[3:]) <= -(-(WINDOW + 1) // BLOCK) + 3
    assert outputs == [hf_greedy(hf, p, 40) for p in prompts]
