"""MXFP4 (gpt-oss's experts): the dequantisation against hand-packed bytes and against transformers' own reader,
our writer's rounding, and a gpt-oss checkpoint in OpenAI's layout served greedily equal to the same model with
the dequantised weights in fp32 (HF), with bad tensors and wrong flags refused by name; its experts kept packed
(the fused-MoE kernel, interpreted here) give the dequantised load's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.utils.quantization_config import Mxfp4Config

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import CausalLM, load_model, mxfp4
from pagedserve.services.engine.models.gpt_oss import ClampedSwiGLUExperts, Mxfp4Experts
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model, hf_greedy, hf_ignores_the_config

pytestmark = pytest.mark.usefixtures("one_thread")
CASE = "gpt_oss-sinks-window8-yarn-clamped-experts"


def test_dequantize_hand_packed_bytes() -> None:
    """Byte 0x92: low nibble 2 (+1.0) first, high nibble 9 (-0.5); byte 0x7F: 15 (-6), 7 (+6); scales 2^1, 2^-2."""
    blocks = torch.zeros((2, 1, 16), dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 15] = 0x92, 0x7F
    blocks[1, 0, 3] = 0x58  # 8 is -0.0, 5 is +3.0
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)
    want = torch.zeros((2, 32))
    want[0, 0], want[0, 1], want[0, 30], want[0, 31] = 2.0, -1.0, -12.0, 12.0
    want[1, 6], want[1, 7] = -0.0, 3.0 / 4
    got = mxfp4.dequantize(blocks, scales)
    assert torch.equal(got, want)
    assert torch.signbit(got[1, 6])


def test_writer_round_trips_representable_values_and_rounds_to_nearest() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 6, 64), generator=gen)
    exponents = torch.randint(-8, 8, (4, 6, 2), generator=gen).float()
    exponents[..., 0] = 0  # a block holding +-6 or +-4 keeps its own scale
    values = torch.tensor(mxfp4.FP4_VALUES)[codes] * torch.exp2(exponents).repeat_interleave(32, -1)
    blocks, scales = mxfp4.quantize(values)
    assert torch.equal(mxfp4.dequantize(blocks, scales), values)
    x = torch.tensor([[0.24, 0.26, 1.24, 2.6, 5.1, -4.9, 0.74] + [0.0] * 24 + [6.0]])  # max 6: scale 2^0
    got = mxfp4.dequantize(*mxfp4.quantize(x))[0, :7]
    assert got.tolist() == [0.0, 0.5, 1.0, 3.0, 6.0, -4.0, 0.5]  # 0.24 -> 0 (ties to the lower: 0.25 -> 0)


def test_our_dequantisation_equals_transformers_reader() -> None:
    """An independent reader of the same bytes: transformers' convert_moe_packed_tensors ([E, cols, rows])."""
    weight = torch.randn(3, 10, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    blocks, scales = mxfp4.quantize(weight)
    ours = mxfp4.dequantize(blocks, scales)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), ours)
    assert float((ours - weight).norm() / weight.norm()) < 0.15  # 4-bit: a coarse but faithful copy


def write_mxfp4_checkpoint(hf: PreTrainedModel, model_dir: Path, out_dir: Path) -> PreTrainedModel:
    """`model_dir`'s gpt-oss saved as OpenAI ships it (experts as blocks/scales, untransposed, the rest as
    is); sets `hf`'s experts to the dequantised weights and returns it: the fp32 oracle."""
    out_dir.mkdir(exist_ok=True)
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        hf_layout = tensors.pop(name)  # [E, in, out]
        blocks, scales = mxfp4.quantize(hf_layout.transpose(1, 2))  # checkpoints keep [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        hf.get_parameter(name).data.copy_(mxfp4.dequantize(blocks, scales).transpose(1, 2))
    save_file(tensors, out_dir / "model.safetensors")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    bf16_dir, out = tmp_path_factory.mktemp("gpt_oss"), tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = build_tiny_model(CASE, bf16_dir)
    return out, write_mxfp4_checkpoint(hf, bf16_dir, out)


def test_transformers_reads_our_checkpoint_as_the_oracle(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    """The layout check: transformers' own MXFP4 loader (dequantising on CPU) gives the oracle's logits."""
    model_dir, hf = checkpoint
    theirs = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    if (dtype := theirs.model.layers[0].mlp.experts.gate_up_proj.dtype) != torch.float32:
        pytest.skip(f"this transformers dequantises MXFP4 to {dtype}, not the fp32 asked for")
    theirs.config._attn_implementation = "eager"
    ids = torch.tensor([list(range(3, 30))])
    with torch.inference_mode():
        torch.testing.assert_close(theirs(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_served_greedy_equals_the_dequantised_model(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    model_dir, hf = checkpoint
    if reason := hf_ignores_the_config(hf):
        pytest.skip(reason)
    config = Config.of(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        quantization="mxfp4",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
    )
    engine = Engine(config)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 19)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf, prompt, 32)


def test_bad_tensors_and_wrong_flags_are_named(checkpoint: tuple[Path, PreTrainedModel], tmp_path: Path) -> None:
    model_dir, _ = checkpoint
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :-1].contiguous()  # one block column short
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks/_scales: .* do not pair"):
        load_model(tmp_path, "float32", "cpu", show_progress=False)
    bf16_dir = tmp_path / "bf16"
    build_tiny_model(CASE, bf16_dir)
    with pytest.raises(ValueError, match=r"quantization 'mxfp4': the checkpoint's weights are 'none'"):
        load_model(bf16_dir, "float32", "cpu", show_progress=False, quantization="mxfp4")
    llama_dir = tmp_path / "llama"
    build_tiny_model("qwen3-qknorm-headdim", llama_dir)
    cfg = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match=r"only gpt-oss's experts load from MXFP4, not LlamaForCausalLM's"):
        load_model(llama_dir, "float32", "cpu", show_progress=False)


def _experts(model: CausalLM) -> list[ClampedSwiGLUExperts]:
    return [m for m in model.modules() if isinstance(m, ClampedSwiGLUExperts)]


def test_packed_experts_give_the_dequantised_logits(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    """mxfp4_packed=True keeps uint8 codes and scales (gate/up rows de-interleaved as the dense load's are) and
    runs the fused-MoE kernel on them; the default on CPU dequantises. Same logits on a prefill, a chunk
    beside a second prompt, and a decode step."""
    pytest.importorskip("triton")
    model_dir, _ = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled, or interpreted on the CPU
    dense = load_model(model_dir, "float32", device, show_progress=False)
    packed = load_model(model_dir, "float32", device, show_progress=False, mxfp4_packed=True)
    assert not any(isinstance(e, Mxfp4Experts) for e in _experts(dense))
    for theirs, ours in zip(_experts(dense), _experts(packed), strict=True):
        assert isinstance(ours, Mxfp4Experts) and ours.gate_up_proj_blocks.dtype == torch.uint8
        assert not hasattr(ours, "gate_up_proj") and not hasattr(ours, "down_proj")
        for e in (0, 5):  # the kernel's layout dequantises to exactly the dense load's weights
            w13, w2 = ours.expert_weights(e)
            assert torch.equal(w13, theirs.gate_up_proj[e]) and torch.equal(w2, theirs.down_proj[e])
    gen = torch.Generator().manual_seed(5)
    long, short = (torch.randint(3, 256, (n,), generator=gen).tolist() for n in (11, 4))
    logits = []
    for model in (dense, packed):
        driver = PagedDriver(model, seed=1)
        steps = driver.step({0: long[:6]}), driver.step({0: long[6:], 1: short}), driver.step({0: [7], 1: [9]})
        logits.append(torch.cat([t for step in steps for t in step]))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_random_weights_fill_packed_experts_with_codes_and_scales(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    """Benchmarks' random weights: bf16 draws would cast to zero bytes, so packed experts get random codes
    and scales near gpt-oss's (|w| up to ~0.1)."""
    model_dir, _ = checkpoint
    model = load_model(model_dir, "float32", "cpu", show_progress=False, random_weights_seed=0, mxfp4_packed=True)
    experts = _experts(model)[0]
    assert isinstance(experts, Mxfp4Experts)
    assert len(experts.down_proj_blocks.unique()) > 200
    assert int(experts.down_proj_scales.min()) >= 118 and int(experts.down_proj_scales.max()) <= 121
    w13, _ = experts.expert_weights(0)
    assert 0.05 < float(w13.abs().max()) <= 6 * 2.0**-6
