"""Weights into (sharded) models without a process group: `load_sharded` reads each rank's slices, or a
tensor whole where the family reorders it, and fills what `load_weights` fills; `load_random` gives every
tensor-parallel size the same weights, made from (seed, name, shard id) only."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from pagedserve.kernels import expert_quant
from pagedserve.kernels.moe_reference import experts_grouped
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.fp8 import Fp8Linear
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.models.moe import Experts
from pagedserve.services.engine.models.quantized_experts import Fp8Experts, Int4Experts, QuantizedExperts
from pagedserve.services.engine.models.weights import safetensors_files
from pagedserve.services.engine.parallel.fp8 import ColumnParallelFp8, RowParallelFp8
from pagedserve.services.engine.parallel.int4 import ColumnParallelInt4, RowParallelInt4
from pagedserve.services.engine.parallel.linear import ReadSlice
from pagedserve.services.engine.parallel.loading import load_random, load_sharded, random_tensor
from pagedserve.services.engine.parallel.moe import (
    ParallelExperts,
    ParallelFp8Experts,
    ParallelInt4Experts,
    parallel_experts,
)
from pagedserve.services.engine.parallel.state import ParallelContext
from tests.engine.engine_helpers import WholeReads
from tests.models.int4_checkpoints import (
    Quantize,
    awq_tensors,
    fp8_rows,
    gptq_tensors,
    in_hf_layout,
    pack_quantized_config,
    pack_quantized_tensors,
    rewrite_decoder_linears,
    write_quantized_llama,
)
from tests.models.test_int4_moe import _write_4bit
from tests.models.test_quantized_experts import _write_fp8
from tests.models.tiny_models import build_tiny_model

CPU = torch.device("cpu")
QKV = "model.layers.1.self_attn.qkv_proj.weight"


def _ctx(rank: int, world: int) -> ParallelContext:
    return ParallelContext(rank, world, CPU)  # no groups: enough for building and loading


def params(model: CausalLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def checkpoint_names(files: list[Path]) -> list[str]:
    names: list[str] = []
    for path in files:
        with safetensors.safe_open(str(path), framework="pt") as f:
            names += f.keys()
    return names


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama in several safetensors files (read by slices), GPT-NeoX (per-head fused qkv, reordered whole)."""
    cases = ("llama-gqa-tied-llama3rope-sharded", "gpt_neox-parallel-partial-rotary")
    dirs = {case: tmp_path_factory.mktemp(case) for case in cases}
    for case, folder in dirs.items():
        build_tiny_model(case, folder)
    return dirs


@pytest.mark.parametrize(
    ("case", "reordered"),
    [("llama-gqa-tied-llama3rope-sharded", ""), ("gpt_neox-parallel-partial-rotary", ".query_key_value.")],
)
def test_one_rank_loads_what_load_weights_loads(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, case: str, reordered: str
) -> None:
    folder = family_dirs[case]
    expected = params(load_model(folder, "float32", CPU, show_progress=False))  # through load_weights
    model = load_model(folder, "float32", CPU, show_progress=False)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    whole = WholeReads(monkeypatch)
    files = safetensors_files(folder)
    assert len(files) > 1 or not case.endswith("sharded")
    load_sharded(model, files, show_progress=False)
    got = params(model)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    # Only what the family reorders is read whole, each tensor once; everything else by slices.
    assert sorted(whole.names) == sorted(n for n in checkpoint_names(files) if reordered and reordered in n)


def test_reordered_tensors_are_sliced_per_rank_after_reordering(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = family_dirs["gpt_neox-parallel-partial-rotary"]
    full = params(load_model(folder, "float32", CPU, show_progress=False))
    whole = WholeReads(monkeypatch)
    shards = [params(load_model(folder, "float32", CPU, show_progress=False, parallel=_ctx(r, 2))) for r in range(2)]
    assert len(whole.names) == 2 * 2 * 2  # 2 layers' qkv weight and bias, read whole once per rank
    q, k, v = full[QKV].split(64)  # [q | k | v] once reordered: 4 heads of 16, no GQA
    for rank, shard in enumerate(shards):
        rows = slice(rank * 32, (rank + 1) * 32)
        assert torch.equal(shard[QKV], torch.cat([q[rows], k[rows], v[rows]]))
    dense = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[dense] for s in shards], dim=1), full[dense])  # row-parallel: columns split


def test_random_tensors_depend_on_seed_name_and_shard_only() -> None:
    name, shape = "model.layers.0.mlp.gate_up_proj.weight", (64, 32)
    gate = random_tensor(name, "gate", shape, 1, CPU)
    assert torch.equal(gate, random_tensor(name, "gate", shape, 1, CPU))  # reproducible
    for other in (
        random_tensor(name, "up", shape, 1, CPU),
        random_tensor(name, "gate", shape, 2, CPU),
        random_tensor("model.layers.1.mlp.gate_up_proj.weight", "gate", shape, 1, CPU),
    ):
        assert not torch.equal(gate, other)
    assert gate.dtype == torch.bfloat16 and 0.015 < gate.float().std().item() < 0.025  # N(0, 0.02) in bf16
    assert abs(gate.float().mean().item()) < 0.005
    for norm in (
        "model.norm.weight",
        "model.layers.3.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert torch.equal(random_tensor(norm, None, (8,), 1, CPU), torch.ones(8))
    assert torch.equal(random_tensor("model.layers.0.self_attn.qkv_proj.bias", "q", (8,), 1, CPU), torch.zeros(8))


def test_random_weights_are_identical_for_one_rank_and_two(tiny_model_dir: Path) -> None:
    seed = 7
    model = load_model(tiny_model_dir, "float32", CPU, show_progress=False)
    checkpoint = params(model)
    load_random(model, seed)
    full = params(model)
    assert all(not torch.equal(full[n], checkpoint[n]) for n in full if "norm" not in n)  # every tensor rewritten

    def rand(name: str, shard: str | None, shape: tuple[int, ...]) -> torch.Tensor:
        return random_tensor(name, shard, shape, seed, CPU).float()

    assert torch.equal(full["model.embed_tokens.weight"], rand("model.embed_tokens.weight", None, (256, 64)))
    assert torch.equal(
        full[QKV], torch.cat([rand(QKV, "q", (64, 64)), rand(QKV, "k", (32, 64)), rand(QKV, "v", (32, 64))])
    )
    assert torch.equal(full["model.norm.weight"], torch.ones(64))

    shards = [
        params(load_model(tiny_model_dir, "float32", CPU, parallel=_ctx(r, 2), random_weights_seed=seed))
        for r in range(2)
    ]
    assert torch.equal(torch.cat([s["model.embed_tokens.weight"] for s in shards]), full["model.embed_tokens.weight"])
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in shards]), full["lm_head.weight"])
    q, k, v = full[QKV].split([64, 32, 32])  # 4 query heads and 2 KV heads of 16: one KV head per rank
    for rank, shard in enumerate(shards):
        expected = torch.cat(
            [q[rank * 32 : (rank + 1) * 32], k[rank * 16 : (rank + 1) * 16], v[rank * 16 : (rank + 1) * 16]]
        )
        assert torch.equal(shard[QKV], expected)
        assert torch.equal(shard["model.norm.weight"], full["model.norm.weight"])  # replicated
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[down] for s in shards], dim=1), full[down])


def test_a_checkpoint_missing_a_parameter_or_naming_an_unknown_one_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = load_model(tiny_model_dir, "float32", CPU, show_progress=False)
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    missing = {n: t for n, t in tensors.items() if n != "model.norm.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"lacks parameters: \['model.norm.weight'\]"):
        load_sharded(model, [tmp_path / "missing.safetensors"], show_progress=False)
    extra = {**tensors, "model.layers.9.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"].clone()}
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.9\.mlp\.gate_up_proj\.weight"):
        load_sharded(model, [tmp_path / "extra.safetensors"], show_progress=False)


def test_kv_cache_scales_in_a_sharded_load_go_to_every_ranks_attention(tmp_path: Path) -> None:
    """A checkpoint with kv_cache_scheme's scales (bf16 weights beside them) loads tensor-parallel too."""
    build_tiny_model("llama-gqa-tied-llama3rope-sharded", tmp_path)
    files = safetensors_files(tmp_path)
    extra = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.v_scale": torch.tensor(2.0),
    }
    save_file(extra, str(tmp_path / "kv_scales.safetensors"))
    model = load_model(tmp_path, "float32", CPU, show_progress=False)  # the files' weights; scales below
    load_sharded(model, [*files, tmp_path / "kv_scales.safetensors"], show_progress=False)
    attentions = [m for m in model.modules() if hasattr(m, "k_scale")]
    assert [(a.k_scale, a.v_scale) for a in attentions] == [(0.5, 1.0), (1.0, 2.0)]


GPTQ = {"quant_method": "gptq", "bits": 4}
AWQ = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}
SPLITTABLE: dict[str, tuple[Quantize, dict[str, object]]] = {  # o_proj's 64 inputs: 32 a rank
    "gptq-g16": (in_hf_layout(gptq_tensors, 16), {**GPTQ, "group_size": 16}),
    "gptq-channel": (in_hf_layout(lambda w: gptq_tensors(w, w.shape[0])), {**GPTQ, "group_size": -1}),
    "awq-g32": (in_hf_layout(awq_tensors, 32), {**AWQ, "group_size": 32}),
    "compressed-tensors-g16-asym": (
        lambda w: pack_quantized_tensors(w, 16, symmetric=False),
        pack_quantized_config(16, symmetric=False),
    ),
    # act order: a row-parallel rank keeps every group's scales and its rows' g_idx
    "gptq-g16-act-order": (in_hf_layout(gptq_tensors, 16, True), {**GPTQ, "group_size": 16, "desc_act": True}),
    "compressed-tensors-g16-act-order": (
        lambda w: pack_quantized_tensors(w, 16, symmetric=True, act_order=True),
        pack_quantized_config(16, symmetric=True, act_order=True),
    ),
}


@pytest.mark.parametrize("case", list(SPLITTABLE))
def test_4bit_shards_hold_their_ranks_slices_of_each_weight(case: str, tmp_path: Path) -> None:
    """Each rank's 4-bit linears, dequantised, are its columns (q/k/v, gate/up) or input rows (o, down) of the
    one-GPU model's, read from slices of the packed tensors (GPTQ rows of 8, AWQ and zero points in packs of 8
    columns, whole groups)."""
    quantize, config = SPLITTABLE[case]
    write_quantized_llama(tmp_path, quantize, config)
    whole = load_model(tmp_path, "float32", CPU, show_progress=False)
    ranks = [load_model(tmp_path, "float32", CPU, show_progress=False, parallel=_ctx(r, 2)) for r in range(2)]
    checked = 0
    for name, full in whole.named_modules():
        if not isinstance(full, Int4Linear):
            continue
        want = full.dequantized()  # [K, N]
        shards = [rank.get_submodule(name) for rank in ranks]
        rows = [m for m in shards if isinstance(m, RowParallelInt4)]
        if rows:
            assert len(rows) == len(shards), name
            got = torch.cat([m.dequantized() for m in rows])  # input rows in rank order
        else:
            assert all(isinstance(m, ColumnParallelInt4) for m in shards), name
            got = torch.empty_like(want)
            for m in shards:
                assert isinstance(m, ColumnParallelInt4)
                for sid, part in m.parts.items():
                    local, size = m.shard_offsets[sid]
                    first = full.shard_offsets[sid][0] if full.shard_offsets else 0
                    got[:, first + part.start : first + part.start + size] = m.dequantized()[:, local : local + size]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        checked += 1
    assert checked == 2 * 4  # q/k/v, o, gate/up, down in each of 2 layers


def _fp8_tensor(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-tensor FP8: one scale for the linear (fused q/k/v then hold three)."""
    scale = weight.abs().amax().float() / 448.0
    q = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _fp8_meaning(linear: torch.nn.Module) -> torch.Tensor:
    assert isinstance(linear, Fp8Linear)
    return linear.weight.float() * linear.weight_scale[:, None]  # [N, K]


@pytest.mark.parametrize("case", ["per-row", "per-tensor", "online"])
def test_fp8_shards_hold_their_ranks_slices_of_each_weight(case: str, tmp_path: Path) -> None:
    """Each rank's FP8 linears are its rows (q/k/v, gate/up) or input columns (o, down) of the one-GPU model's;
    a per-tensor scale holds on every row it covers. Quantised at load (`--quantization fp8` on bf16 weights),
    a row-parallel shard scales its own slice of each row, so there it is close, not equal."""
    if case == "online":
        build_tiny_model("llama-gqa-tied-llama3rope-sharded", tmp_path)
    else:
        write_quantized_llama(tmp_path, fp8_rows if case == "per-row" else _fp8_tensor, FP8)
    quantization = "fp8" if case == "online" else None
    whole = load_model(tmp_path, "float32", CPU, show_progress=False, quantization=quantization)
    ranks = [
        load_model(tmp_path, "float32", CPU, show_progress=False, parallel=_ctx(r, 2), quantization=quantization)
        for r in range(2)
    ]
    checked = 0
    for name, full in whole.named_modules():
        if not isinstance(full, Fp8Linear):
            continue
        want = _fp8_meaning(full)
        shards = [rank.get_submodule(name) for rank in ranks]
        rows = [m for m in shards if isinstance(m, RowParallelFp8)]
        if rows:
            got = torch.cat([_fp8_meaning(m) for m in rows], dim=1)  # input columns in rank order
            tolerance = 0.07 * float(want.abs().max()) if case == "online" else 0.0
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
        else:
            got = torch.full_like(want, float("nan"))
            for m in shards:
                assert isinstance(m, ColumnParallelFp8)
                for sid, part in m.parts.items():
                    local, size = m.shard_offsets[sid]
                    first = full.shard_offsets[sid][0] if full.shard_offsets else 0
                    got[first + part.start : first + part.start + size] = _fp8_meaning(m)[local : local + size]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        checked += 1
    assert checked == 2 * 4


def test_4bit_splits_that_cut_a_group_are_refused_at_start(tmp_path: Path) -> None:
    write_quantized_llama(tmp_path, in_hf_layout(gptq_tensors, 64), {**GPTQ, "group_size": 64})
    with pytest.raises(ValueError, match=r"o_proj splits its 64 inputs at 0\.\.32 .* whole units of 64"):
        load_model(tmp_path, "float32", CPU, show_progress=False, parallel=_ctx(0, 2))


def test_random_4bit_weights_are_the_same_for_one_rank_and_two(tmp_path: Path) -> None:
    """Benchmarks of quantized shapes load random weights in the 4-bit layout (`--load-format dummy`): each rank
    holds its slice of what one GPU holds."""
    quantize, config = SPLITTABLE["gptq-g16"]
    write_quantized_llama(tmp_path, quantize, config)
    whole = load_model(tmp_path, "float32", CPU, show_progress=False, random_weights_seed=3)
    ranks = [
        load_model(tmp_path, "float32", CPU, show_progress=False, parallel=_ctx(r, 2), random_weights_seed=3)
        for r in range(2)
    ]
    down = "model.layers.1.mlp.down_proj"
    full = whole.get_submodule(down)
    assert isinstance(full, Int4Linear)
    got = torch.cat([m.dequantized() for r in ranks if isinstance(m := r.get_submodule(down), RowParallelInt4)])
    torch.testing.assert_close(got, full.dequantized(), rtol=0, atol=0)
    qkv = "model.layers.0.self_attn.qkv_proj"
    full_qkv, rank0 = whole.get_submodule(qkv), ranks[0].get_submodule(qkv)
    assert isinstance(full_qkv, Int4Linear) and isinstance(rank0, ColumnParallelInt4)
    q_rows = rank0.parts["q"].size  # rank 0's query columns are the first of the whole q part
    torch.testing.assert_close(rank0.dequantized()[:, :q_rows], full_qkv.dequantized()[:, :q_rows], rtol=0, atol=0)


def test_quantized_moe_splits_its_experts_dequantised_and_replicates_the_router(tmp_path: Path) -> None:
    """A 4-bit Qwen3-MoE under tensor parallelism: attention's linears stay 4-bit shards, each expert's gate/up
    rows and down columns are its intermediate slice of the dequantised expert, and the router is every rank's."""

    def gptq_g16(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return in_hf_layout(gptq_tensors, 16)(weight)

    rewrite_decoder_linears("qwen3_moe-qknorm-normtopk", tmp_path, gptq_g16, {**GPTQ, "group_size": 16})
    whole = load_model(tmp_path, "float32", CPU, show_progress=False)
    ranks = [load_model(tmp_path, "float32", CPU, show_progress=False, parallel=_ctx(r, 2)) for r in range(2)]
    experts = "model.layers.1.mlp.experts"
    full = whole.get_submodule(experts)
    parts = [p for r in ranks if isinstance(p := r.get_submodule(experts), ParallelExperts)]
    assert isinstance(full, Experts) and len(parts) == 2
    torch.testing.assert_close(torch.cat([p.down_proj for p in parts], dim=2), full.down_proj, rtol=0, atol=0)
    size = parts[0].gate_up_proj.shape[1] // 2
    gate = torch.cat([p.gate_up_proj[:, :size] for p in parts], dim=1)
    assert torch.equal(gate, full.gate_up_proj[:, : gate.shape[1]])
    router = "model.layers.1.mlp.gate.weight"
    assert all(torch.equal(dict(r.named_parameters())[router], dict(whole.named_parameters())[router]) for r in ranks)
    assert isinstance(ranks[0].get_submodule("model.layers.1.self_attn.o_proj"), RowParallelInt4)


def _dequantized_experts(experts: QuantizedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    quant = experts._quant()
    w13 = expert_quant.dequantize(experts.gate_up_proj, quant["w13_scale"], quant["w13_zeros"], torch.float32)
    w2 = expert_quant.dequantize(experts.down_proj, quant["w2_scale"], quant["w2_zeros"], torch.float32)
    return w13, w2


@pytest.mark.parametrize("fmt", ["gptq-g16", "gptq-channel", "fp8-channel", "fp8-tensor"])
def test_quantized_experts_shard_quantized(fmt: str, tmp_path: Path) -> None:
    """Experts kept quantized (as on CUDA) under tensor parallelism: each rank's experts stay 4-bit / fp8, hold
    its gate / up rows and down columns of the one-GPU experts (dequantised, exactly), and the ranks' partial
    outputs sum to the one-GPU experts' output."""
    case = "qwen3_moe-qknorm-normtopk"
    if fmt.startswith("gptq"):
        _write_4bit(case, tmp_path, "gptq", act_order=False, group=16 if fmt == "gptq-g16" else 0)
        kind: type[QuantizedExperts] = ParallelInt4Experts
    else:
        _write_fp8(case, tmp_path, per_tensor=fmt == "fp8-tensor")
        kind = ParallelFp8Experts
    kwargs = dict(dtype="float32", device=CPU, show_progress=False, quantized_experts=True)
    whole = load_model(tmp_path, **kwargs)
    ranks = [load_model(tmp_path, **kwargs, parallel=_ctx(r, 2)) for r in range(2)]
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.experts"
        full = whole.get_submodule(name)
        parts = [p for r in ranks if isinstance(p := r.get_submodule(name), kind)]
        assert isinstance(full, QuantizedExperts) and len(parts) == 2, name
        assert all(p.gate_up_proj.dtype == full.gate_up_proj.dtype for p in parts)  # still uint8 / fp8
        full_w13, full_w2 = _dequantized_experts(full)
        pieces = [_dequantized_experts(p) for p in parts]
        size = full.intermediate_size
        gate = torch.cat([w13[:, : w13.shape[1] // 2] for w13, _ in pieces], dim=1)
        up = torch.cat([w13[:, w13.shape[1] // 2 :] for w13, _ in pieces], dim=1)
        torch.testing.assert_close(gate, full_w13[:, :size], rtol=0, atol=0)
        torch.testing.assert_close(up, full_w13[:, size:], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([w2 for _, w2 in pieces], dim=2), full_w2, rtol=0, atol=0)
        x = torch.randn(5, full.gate_up_proj.shape[2] * (2 if kind is ParallelInt4Experts else 1))
        weights, ids = torch.rand(5, 2), torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]])
        want = experts_grouped(x, full.gate_up_proj, full.down_proj, weights, ids, **full._quant())
        got = sum(experts_grouped(x, p.gate_up_proj, p.down_proj, weights, ids, **p._quant()) for p in parts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["gptq", "fp8"])
def test_random_quantized_experts_fill_each_rank_in_their_format(fmt: str, tmp_path: Path) -> None:
    """Benchmarks' random weights (`--load-format dummy`) under tensor parallelism fill the quantized experts' slices
    piece by piece in their own format: 4-bit zero points 0..15 and fp8 codes, with scales that make the
    dequantised experts about N(0, 0.02) on every rank."""
    case = "qwen3_moe-qknorm-normtopk"
    if fmt == "gptq":
        _write_4bit(case, tmp_path, "gptq", act_order=False, group=16)
    else:
        _write_fp8(case, tmp_path, per_tensor=False)
    kwargs = dict(dtype="float32", device=CPU, show_progress=False, quantized_experts=True, random_weights_seed=3)
    for rank in range(2):
        experts = load_model(tmp_path, **kwargs, parallel=_ctx(rank, 2)).get_submodule("model.layers.1.mlp.experts")
        assert isinstance(experts, ParallelInt4Experts if fmt == "gptq" else ParallelFp8Experts)
        if isinstance(experts, ParallelInt4Experts):
            assert int(experts.gate_up_proj_zeros.max()) <= 15 and int(experts.down_proj_zeros.max()) <= 15
        for w in _dequantized_experts(experts):
            assert 0.005 < float(w.std()) < 0.08, float(w.std())


def _reader(tensor: torch.Tensor) -> ReadSlice:
    return lambda dim, start, size: tensor.narrow(dim, start, size)


@pytest.mark.parametrize("fmt", ["int4-g8", "int4-channel", "fp8"])
def test_fused_quantized_expert_tensors_are_cut_per_rank(fmt: str) -> None:
    """Checkpoints that store every expert in one tensor ([E, 2I, ...] gate_up, [E, hidden, ...] down, or one
    fp8 scale an expert) load into each rank's slice as the per-expert pieces do."""
    num_experts, hidden, intermediate = 3, 16, 32
    gen = torch.Generator().manual_seed(0)
    if fmt == "fp8":
        whole: Fp8Experts | Int4Experts = Fp8Experts(num_experts, hidden, intermediate, "silu")
        tensors = {
            "gate_up_proj": (torch.randn(3, 64, 16, generator=gen) * 50).to(expert_quant.FP8_DTYPE),
            "gate_up_proj_scale": torch.rand(3, generator=gen) + 0.5,  # one an expert
            "down_proj": (torch.randn(3, 16, 32, generator=gen) * 50).to(expert_quant.FP8_DTYPE),
            "down_proj_scale": torch.rand(3, 16, generator=gen) + 0.5,
        }
    else:
        group = 8 if fmt == "int4-g8" else 0
        whole = Int4Experts(num_experts, hidden, intermediate, "silu", group)
        g13, g2 = (2, 4) if group else (1, 1)
        tensors = {
            "gate_up_proj": torch.randint(0, 256, (3, 64, 8), generator=gen, dtype=torch.uint8),
            "gate_up_proj_scale": torch.rand(3, 64, g13, generator=gen),
            "gate_up_proj_zeros": torch.randint(0, 16, (3, 64, g13), generator=gen, dtype=torch.uint8),
            "down_proj": torch.randint(0, 256, (3, 16, 16), generator=gen, dtype=torch.uint8),
            "down_proj_scale": torch.rand(3, 16, g2, generator=gen),
            "down_proj_zeros": torch.randint(0, 16, (3, 16, g2), generator=gen, dtype=torch.uint8),
        }
    whole.to_empty(device=CPU)
    for name, tensor in tensors.items():
        whole.load_weight(name, tensor, None)
    full_w13, full_w2 = _dequantized_experts(whole)
    pieces = []
    for rank in range(2):
        part = parallel_experts(whole, hidden, _ctx(rank, 2))
        assert isinstance(part, (ParallelFp8Experts, ParallelInt4Experts))
        assert part.intermediate_size == intermediate // 2
        part.to_empty(device=CPU)
        for name, tensor in tensors.items():
            part.load_piece(name, None, _reader(tensor))
        pieces.append(_dequantized_experts(part))
    half = intermediate // 2
    torch.testing.assert_close(torch.cat([w13[:, :half] for w13, _ in pieces], 1), full_w13[:, :intermediate])
    torch.testing.assert_close(torch.cat([w13[:, half:] for w13, _ in pieces], 1), full_w13[:, intermediate:])
    torch.testing.assert_close(torch.cat([w2 for _, w2 in pieces], 2), full_w2)
