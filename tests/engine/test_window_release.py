"""Models whose every layer slides (Mistral v0.1, Phi-3-mini): a running sequence hands back the blocks behind
its window, so it holds ~window tokens of blocks however long it runs; outputs stay HF's."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.engine.engine_helpers import make_request
from tests.models.tiny_models import build_tiny_model, hf_greedy

BLOCK = 4
WINDOW_CASE = "mistral-gqa-window"  # sliding_window 8 on every layer


def test_blocks_wholly_behind_the_window_go_back_once() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, window=8)
    request = make_request(list(range(30)))
    kv.allocate(request, 30)  # 8 blocks
    request.num_computed_tokens = 30  # the next query sits at 30 and sees keys 23..30: blocks from 5 on
    kv.release_out_of_window(request)
    assert kv.num_held_blocks(request) == 8 - 4 and kv.num_free_blocks == 16 - 4  # blocks 0-3 (4 is the spare)
    kv.release_out_of_window(request)  # nothing more until it advances
    assert kv.num_free_blocks == 12
    kv.check_invariants()
    kv.free(request)
    assert kv.num_free_blocks == 16  # the released ones are not released again
    kv.check_invariants()


def test_a_global_layer_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)  # window None
    request = make_request(list(range(30)))
    kv.allocate(request, 30)
    request.num_computed_tokens = 30
    kv.release_out_of_window(request)
    assert kv.num_held_blocks(request) == 8


def test_a_long_generation_holds_a_window_of_blocks_and_equals_hf(tmp_path: Path) -> None:
    """A 30-token prompt (two chunks of at most 16) and 40 new tokens through 12 blocks of 4: 70 tokens would need
    18 blocks, more than the cache (the context limit would be 48 without handing back); the sequence holds 5
    blocks at most once decoding, and its tokens are HF's."""
    hf = build_tiny_model(WINDOW_CASE, tmp_path)
    config = Config.of(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
    )
    engine = Engine(config)
    assert engine.kv_cache.window == 8 and engine.max_model_len == 256  # the model's, not the cache's 48
    prompt = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    [request] = engine.scheduler.waiting
    held: list[int] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
        held.append(engine.kv_cache.num_held_blocks(request))
        engine.kv_cache.check_invariants()
    assert max(held) <= 12 and max(held[3:]) <= 8 // BLOCK + 3
    assert tokens == hf_greedy(hf, prompt, 40)
