"""Llama-family layers with fused kernels (add+RMSNorm, SiLU*mul, rotary+KV write) vs the unfused layers.

Both run the Triton attention backend (interpreted on CPU); only `fused_ops`' mode differs. Prefill, a
chunked piece and decodes go through the paged driver, and greedy tokens plus logits must agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.services.engine import attention
from pagedserve.services.engine.models import fused_ops, load_model
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

_gen = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 256, (n,), generator=_gen).tolist() for n in (1, 6, 17)]


@pytest.fixture
def triton_backend() -> Iterator[None]:
    previous_backend, previous_mode = attention.backend_name(), fused_ops.fusion_mode()
    attention.use_backend("triton")
    yield
    attention.use_backend(previous_backend)
    fused_ops.set_fusion(previous_mode)


@pytest.mark.usefixtures("triton_backend")
# mistral: a sliding window of 8 (the fused path hands it to the paged kernel) under prompts of 17 tokens.
@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        *[
            (case, dtype)
            for case in ("llama-gqa-tied-llama3rope-sharded", "qwen3-qknorm-headdim")
            for dtype in ("fp32", "fp16")
        ],
        ("mistral-gqa-window", "fp32"),
    ],
)
def test_fused_layers_match_unfused(case: str, dtype: str, device: torch.device, tmp_path: Path) -> None:
    build_tiny_model(case, tmp_path)
    model = load_model(tmp_path, dtype=dtype, device=device, show_progress=False)
    results = {}
    for mode in ("off", "on"):
        fused_ops.set_fusion(mode)
        assert fused_ops.is_fused(model.model.embed_tokens.weight) == (mode == "on")
        driver = PagedDriver(model, block_size=8)
        prefill = driver.step(dict(enumerate(PROMPTS)))
        tokens = [[int(lg[-1].argmax())] for lg in prefill]
        decode = driver.step({i: t for i, t in enumerate(tokens)})
        results[mode] = (torch.cat(prefill), torch.cat(decode), driver.kv_caches)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "fp32" else dict(atol=3e-2, rtol=3e-2)
    for got, want in zip(results["on"][:2], results["off"][:2]):
        torch.testing.assert_close(got, want, **tol)
        # fp16: the fused kernels round once where torch rounds per op, so a near-tie may flip.
        agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        assert agreement == 1.0 if dtype == "fp32" else agreement >= 0.9
    for got_cache, want_cache in zip(results["on"][2], results["off"][2]):
        torch.testing.assert_close(got_cache, want_cache, **tol)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("lens", [(5, 12), (70, 37)], ids=["paged-kernel", "prefill-kernel"])
def test_padding_tokens_change_nothing(lens: tuple[int, int], device: torch.device, tmp_path: Path) -> None:
    """An eager CUDA step runs padded to a bucket of tokens (model_runner, `pad_eager_batch`): tokens past
    the last sequence, with slot -1, must leave the real rows' logits and the KV cache as they were."""
    import numpy as np

    from pagedserve.services.engine.attention import AttentionMetadata
    from pagedserve.services.engine.input_batch import HostBatch, eager_token_bucket, pad_eager_batch

    build_tiny_model("llama-gqa-tied-llama3rope-sharded", tmp_path)
    model = load_model(tmp_path, dtype="fp32", device=device, show_progress=False)
    fused_ops.set_fusion("on")
    block_size, num_blocks = 4, 48
    blocks_per_seq = [-(-n // block_size) for n in lens]
    order = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(lens), max(blocks_per_seq)), dtype=np.int32)
    tables[0, : blocks_per_seq[0]] = order[: blocks_per_seq[0]]
    tables[1, : blocks_per_seq[1]] = order[blocks_per_seq[0] : sum(blocks_per_seq)]
    positions = np.concatenate([np.arange(n) for n in lens])
    seq_of = np.repeat(np.arange(len(lens)), lens)
    ids = torch.randint(3, 256, (sum(lens),), generator=torch.Generator().manual_seed(3)).numpy()
    batch = HostBatch(
        input_ids=ids.astype(np.int64),
        positions=positions,
        slot_mapping=tables[seq_of, positions // block_size].astype(np.int64) * block_size + positions % block_size,
        query_start_loc=np.array([0, lens[0], sum(lens)], dtype=np.int32),
        seq_lens=np.array(lens, dtype=np.int32),
        block_tables=tables,
        logits_rows=np.array([lens[0] - 1, sum(lens) - 1]),
        patch_rows=np.zeros(0, dtype=np.int64),
        patch_src=np.zeros(0, dtype=np.int64),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    assert eager_token_bucket(16) == 16 and eager_token_bucket(17) == 32 and eager_token_bucket(2049) == 2304

    def run(b: HostBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        shape = (2, num_blocks, block_size, model.spec.num_kv_heads, model.spec.head_dim)
        caches = [torch.zeros(shape, device=device) for _ in range(model.spec.num_layers)]

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        meta = AttentionMetadata(
            t(b.slot_mapping), t(b.query_start_loc), t(b.seq_lens), t(b.block_tables), b.max_query_len, b.max_seq_len
        )
        with torch.inference_mode():
            hidden = model(t(b.input_ids), t(b.positions), caches, meta)
            return model.compute_logits(hidden[t(b.logits_rows)]), caches

    want_logits, want_caches = run(batch)
    num_padded = eager_token_bucket(sum(lens))
    padded = pad_eager_batch(batch, num_padded)
    assert num_padded > sum(lens) and padded.num_seqs == 2 and (padded.slot_mapping[sum(lens) :] == -1).all()
    got_logits, got_caches = run(padded)
    torch.testing.assert_close(got_logits, want_logits)
    for got, want in zip(got_caches, want_caches):
        torch.testing.assert_close(got, want)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fused_prefill_kernel_matches_unfused(
    dtype: str, device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts long enough for the prefill kernel (new K/V read from the qkv output), then a chunk after
    each cached prefix, then decodes (paged kernel): fused logits must match the unfused path's."""
    from pagedserve.kernels import triton_backend

    launches: list[int] = []
    prefill = triton_backend.prefill_attention

    def counting_prefill(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(1)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_attention", counting_prefill)
    build_tiny_model("llama-gqa-tied-llama3rope-sharded", tmp_path)
    model = load_model(tmp_path, dtype=dtype, device=device, show_progress=False)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (70, 37)]
    chunks = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (64, 29)]
    results = {}
    for mode in ("off", "on"):
        fused_ops.set_fusion(mode)
        driver = PagedDriver(model, block_size=8)
        first = driver.step(dict(enumerate(prompts)))
        second = driver.step(dict(enumerate(chunks)))
        decode = driver.step({i: [int(lg[-1].argmax())] for i, lg in enumerate(second)})
        results[mode] = [torch.cat(first), torch.cat(second), torch.cat(decode)]
    assert launches, "the fused path never reached the prefill kernel"
    # fp16: ~1e-3 rounding per op over 70-token softmaxes leaves a rare logit 3e-2 off (one in 27k seen).
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "fp32" else dict(atol=5e-2, rtol=5e-2)
    for got, want in zip(results["on"], results["off"]):
        torch.testing.assert_close(got, want, **tol)
