"""EAGLE-3 drafting (spec_decode/eagle3.py) with random heads written in the published layout: greedy output
equals plain decoding, the engine's drafts equal a plain-torch EAGLE-3 reference fed by HF's hidden states,
and bad heads stop start-up naming the field."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.spec_decode.eagle3 import Eagle3Proposer
from pagedserve.services.engine.spec_decode.eagle3_head import (
    default_aux_layer_ids,
    load_eagle3_head,
    read_eagle3_config,
)
from pagedserve.shared.config import Config, parse_speculative_config

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB, LAYERS = 64, 4, 2, 16, 256, 160, 8
PROMPTS = [[9] * 12, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [100, 3, 4, 100, 3, 4, 100, 3], [17, 33, 250, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8-layer Llama: enough layers for the default aux layers (2, 4, 5)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle3-target")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir: Path) -> CausalLM:
    return load_model(target_dir, torch.float32, "cpu", show_progress=False)


@pytest.fixture(scope="module")
def hf_target(target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def random_head(seed: int, draft_vocab: int = DRAFT_VOCAB) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's tensors under yuhuili/EAGLE3-*'s names, random but not degenerate."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + w(HIDDEN, std=0.1)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    draft_to_target = torch.sort(torch.randperm(VOCAB, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    return {
        "fc.weight": w(HIDDEN, 3 * HIDDEN, std=0.1),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(q, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": w(kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": w(HIDDEN, q),
        "midlayer.mlp.gate_proj.weight": w(128, HIDDEN),
        "midlayer.mlp.up_proj.weight": w(128, HIDDEN),
        "midlayer.mlp.down_proj.weight": w(HIDDEN, 128),
        "norm.weight": norm(),
        "lm_head.weight": w(draft_vocab, HIDDEN, std=0.5),
        "d2t": draft_to_target - torch.arange(draft_vocab),
        "t2d": t2d,
    }


def head_config(**changes: object) -> dict:
    """config.json as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B publishes it, at the tiny target's sizes."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    config.update(changes)
    return config


def write_head(path: Path, tensors: dict[str, torch.Tensor], naming: str = "midlayer", **changes: object) -> Path:
    """Save in the published layout; naming "layers.0" and "model." are the other exports' spellings."""
    path.mkdir(parents=True, exist_ok=True)
    renamed = {}
    for name, tensor in tensors.items():
        if naming == "layers.0":
            name = name.replace("midlayer.", "layers.0.")
        elif naming == "model." and not name.startswith(("lm_head", "d2t", "t2d")):
            name = "model." + name.replace("midlayer.", "layers.0.")
        renamed[name] = tensor.contiguous()
    save_file(renamed, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head_config(**changes)))
    return path


@pytest.fixture(scope="module")
def head_tensors() -> dict[str, torch.Tensor]:
    return random_head(seed=7)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory, head_tensors: dict[str, torch.Tensor]) -> Path:
    return write_head(tmp_path_factory.mktemp("eagle3-head"), head_tensors)


def _spec(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _engine(model_dir: Path, model: CausalLM, spec: dict | None = None, **settings: object) -> Engine:
    settings = {"num_kv_blocks": 128, "block_size": 4, "device": "cpu", **settings}  # the model is on the CPU
    if spec is not None:
        settings["speculative_config"] = json.dumps(spec)
    return Engine(Config.of(model=str(model_dir), **settings), model=model)


def _outputs(engine: Engine, params: SamplingParams, prompts: Sequence[Sequence[int]] = PROMPTS) -> list:
    return [[c.token_ids for c in r.choices] for r in engine.generate([list(p) for p in prompts], params)]


# --- a plain-torch EAGLE-3 head: the oracle --------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [n, heads, d], HF's rotate_half form
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    half = HEAD_DIM // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_head(t: dict[str, torch.Tensor], embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Pre-norm outputs of every entry (causal), entry j at position j."""
    n = embeds.shape[0]
    positions = torch.arange(n)
    x = torch.cat(
        [_rms(embeds, t["midlayer.input_layernorm.weight"]), _rms(hidden, t["midlayer.hidden_norm.weight"])], -1
    )
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    residual = hidden + out.transpose(0, 1).reshape(n, -1) @ t["midlayer.self_attn.o_proj.weight"].T
    h = _rms(residual, t["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(h @ t["midlayer.mlp.gate_proj.weight"].T) * (h @ t["midlayer.mlp.up_proj.weight"].T)) @ t[
        "midlayer.mlp.down_proj.weight"
    ].T
    return residual + mlp


def reference_drafts(
    t: dict[str, torch.Tensor], hf_target, tokens: list[int], k: int, layer_ids: Sequence[int]
) -> list[int]:
    """From scratch: HF's hidden states entering the aux layers (hidden_states[i] is layer i's input), fc,
    then the head over (token j + 1, hidden j) for every computed j, chained k - 1 times on its own output."""
    with torch.no_grad():
        out = hf_target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in sorted(layer_ids)], -1)
        hidden = aux @ t["fc.weight"].T
        embed = hf_target.get_input_embeddings().weight
        ids = list(tokens[1:])
        drafts: list[int] = []
        for _ in range(k):
            prenorm = reference_head(t, embed[ids], hidden)
            draft = int((_rms(prenorm[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
            drafts.append(draft + int(t["d2t"][draft]))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, prenorm[-1:]])
    return drafts


class RecordingOracle:
    """Records the EAGLE-3 drafts with the context they continue, and hands the engine the known answer with
    every third token wrong instead: long accepted runs and rejections, whatever the random head drafts."""

    def __init__(self, inner: Eagle3Proposer, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.inner, self.answers = inner, answers
        self.calls: list[tuple[list[int], int, list[int]]] = []

    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        drafts = self.inner.propose(requests, max_num_tokens)
        oracle = []
        for request, k, draft in zip(requests, max_num_tokens, drafts):
            self.calls.append((list(request.all_token_ids), k, draft))
            done = request.num_output_tokens
            answer = self.answers[tuple(request.prompt_token_ids)][done : done + k]
            oracle.append([(t + 1) % VOCAB if (done + i) % 3 == 2 else t for i, t in enumerate(answer)])
        return oracle


# --- tests -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(target: CausalLM, target_dir: Path) -> list:
    return _outputs(_engine(target_dir, target), GREEDY)


def test_config_names_the_method_and_its_model() -> None:
    assert parse_speculative_config(json.dumps(_spec(Path("/x")))).method == "eagle3"
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        parse_speculative_config('{"method": "eagle3", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        parse_speculative_config('{"method": "eagle", "model": "x", "num_speculative_tokens": 2}')
    assert default_aux_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B's, as vLLM picks them


def test_greedy_output_equals_plain_decoding(target: CausalLM, target_dir: Path, head_dir: Path, plain: list) -> None:
    engine = _engine(target_dir, target, _spec(head_dir))
    assert isinstance(engine.speculative and engine.speculative.proposer, Eagle3Proposer)
    assert target.aux_hidden_layers == frozenset({2, 4, 5})  # vLLM's default for 8 layers
    assert _outputs(engine, GREEDY) == plain
    assert engine.stats().num_spec_draft_tokens > 0
    n2 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    assert _outputs(engine, n2, PROMPTS[:2]) == [choices * 2 for choices in plain[:2]]
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_tight_cache_and_chunked_prefill(target: CausalLM, target_dir: Path, head_dir: Path) -> None:
    """Preemption (few blocks: reserved draft slots go with the sequence) and prefill in chunks of 8."""
    prompts = [*PROMPTS, PROMPTS[0] + [9, 9, 9, 9]]
    settings = {"num_kv_blocks": 10, "max_num_batched_tokens": 8}
    engine = _engine(target_dir, target, _spec(head_dir, k=4), **settings)
    assert _outputs(engine, GREEDY, prompts) == _outputs(_engine(target_dir, target, **settings), GREEDY, prompts)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_spec_draft_tokens > 0
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_drafts_equal_the_reference_head(
    target: CausalLM,
    target_dir: Path,
    hf_target,
    head_tensors: dict[str, torch.Tensor],
    tmp_path: Path,
    plain: list,
) -> None:
    """Every draft the engine's head makes (batched, paged, caught up step by step over accepted and rejected
    drafts) equals the reference's from scratch; explicit aux layers, names under `model.layers.0.`."""
    layer_ids = [1, 3, 6]
    head = write_head(
        tmp_path / "head", head_tensors, "model.", eagle_config={"eagle_aux_hidden_state_layer_ids": layer_ids}
    )
    engine = _engine(target_dir, target, _spec(head, k=3), enable_prefix_caching=False)
    assert engine.speculative is not None and isinstance(engine.speculative.proposer, Eagle3Proposer)
    oracle = RecordingOracle(engine.speculative.proposer, {tuple(p): o[0] for p, o in zip(PROMPTS, plain)})
    engine.speculative.proposer = oracle
    assert _outputs(engine, GREEDY) == plain
    stats = engine.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert len(oracle.calls) > len(PROMPTS) * 3
    for tokens, k, drafts in oracle.calls:
        assert len(drafts) == k
        assert drafts == reference_drafts(head_tensors, hf_target, tokens, k, layer_ids), tokens


@pytest.mark.parametrize("naming", ["midlayer", "layers.0", "model."])
def test_every_published_naming_loads_the_same_head(
    head_tensors: dict[str, torch.Tensor], tmp_path: Path, naming: str
) -> None:
    path = write_head(tmp_path / naming, head_tensors, naming)
    head = load_eagle3_head(path, read_eagle3_config(path), torch.float32, torch.device("cpu"), 64)
    assert head.embed_tokens is None  # the target's, attached by the proposer
    assert torch.equal(head.fc.weight, head_tensors["fc.weight"])
    qkv = head.layer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[HEADS * HEAD_DIM :][: KV_HEADS * HEAD_DIM], head_tensors["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(head.d2t, head_tensors["d2t"])


def test_sampling_with_eagle3_drafts_stays_within_limits(target: CausalLM, target_dir: Path, head_dir: Path) -> None:
    engine = _engine(target_dir, target, _spec(head_dir))
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, stop_token_ids=[254], seed=3)
    for result in engine.generate([list(p) for p in PROMPTS], params):
        assert 0 < len(result.token_ids) <= 20 and 254 not in result.token_ids[:-1]
    assert engine.stats().num_spec_draft_tokens > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target_hidden_size": 32}, "target_hidden_size"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}, "eagle_aux_hidden_state_layer_ids"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}, "eagle_aux_hidden_state_layer_ids"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"vocab_size": 512}, "vocab_size"),
        ({"num_attention_heads": 2, "head_dim": 8}, "shape"),
        ({"missing": "d2t"}, r"lacks \['d2t'\]"),
        ({"missing": "config.json"}, "no config.json"),
    ],
)
def test_a_bad_head_stops_start_up(
    target: CausalLM,
    target_dir: Path,
    head_tensors: dict[str, torch.Tensor],
    tmp_path: Path,
    change: dict,
    message: str,
) -> None:
    missing = change.pop("missing", None)
    tensors = {n: t for n, t in head_tensors.items() if n != missing}
    head = write_head(tmp_path / "head", tensors, **change)
    if missing == "config.json":
        (head / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"speculative_config\.model: .*{message}"):
        _engine(target_dir, target, _spec(head))
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        _engine(target_dir, target, _spec(tmp_path / "nowhere"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton attention, decode graphs)")
def test_cuda_greedy_output_equals_plain_decoding(target_dir: Path, head_dir: Path) -> None:
    """On the GPU: the Triton backend, fused Llama path (aux states as x + residual) and decode graphs that
    keep the aux states as static outputs; bf16, so the same engine settings with and without drafts."""
    model = load_model(target_dir, torch.bfloat16, "cuda", show_progress=False)
    settings = {"device": "cuda", "dtype": "bfloat16"}
    expected = _outputs(_engine(target_dir, model, **settings), GREEDY)
    engine = _engine(target_dir, model, _spec(head_dir, k=4), **settings)
    assert _outputs(engine, GREEDY) == expected
    assert engine.stats().num_spec_draft_tokens > 0
