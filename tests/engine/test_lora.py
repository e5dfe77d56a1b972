"""Multi-LoRA in the engine: outputs equal PEFT's merged weights with three adapters and the base model in one
batch, a step with no adapter token runs the base model alone, adapters never share prefix-cache blocks, and the
slot pool evicts the least recently used unpinned adapter (requests wait when every slot is pinned)."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from pagedserve.services.engine.cuda_graphs import GraphShape, StepGraphs, graph_shapes
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.input_batch import InputBuffers
from pagedserve.services.engine.lora.layers import LoRABatch, LoRALinear
from pagedserve.services.engine.lora.manager import UnknownAdapterError
from pagedserve.services.engine.lora.weights import read_adapter
from pagedserve.services.engine.lora_control import LoRAControl
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.service import EngineService
from pagedserve.shared.config import Config
from pagedserve.shared.lora_adapters import LoRAAdapterError, inspect_adapter
from pagedserve.shared.protocol import GenerateRequest, LoRAUpdate
from tests.engine.engine_helpers import run, tokens_of
from tests.engine.test_async_steps import EagerGraph, EagerGraphs
from tests.lora_helpers import build_adapter, merged_model

PROMPT = [1, *range(40, 76)]  # 37 tokens: two full 16-token blocks
NUM_NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r4": build_adapter(tiny_model_dir, root / "r4", rank=4, seed=1),
        "r8-rslora": build_adapter(tiny_model_dir, root / "r8", rank=8, seed=2, use_rslora=True),
        "r16-attn": build_adapter(tiny_model_dir, root / "r16", rank=16, seed=3, target_modules=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, tuple[list[int], torch.Tensor]]:
    """Per adapter (None: base), HF's greedy tokens and their log-probabilities, merged weights."""
    out: dict[str | None, tuple[list[int], torch.Tensor]] = {}
    for name, path in [(None, None), *adapters.items()]:
        model = merged_model(tiny_model_dir, path)
        with torch.no_grad():
            prompt = torch.tensor([PROMPT])
            gen = model.generate(
                prompt, max_new_tokens=NUM_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        tokens = gen.sequences[0, len(PROMPT) :].tolist()
        logprobs = torch.stack([torch.log_softmax(step[0], -1)[t] for step, t in zip(gen.logits, tokens, strict=True)])
        out[name] = (tokens, logprobs)
    return out


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # cuda: the Triton kernels and graphs


def _engine(
    model_dir: Path, adapters: dict[str, Path], max_loras: int, max_lora_rank: int = 16, device: str = "cpu"
) -> Engine:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    config = Config.of(
        model=str(model_dir),
        device=device,
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        lora_modules=modules,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
    )
    return Engine(config)


def _submit(engine: Engine, request_id: str, lora_name: str | None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    engine.add_request(request_id, PROMPT, params, lora_name=lora_name)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_equals_peft_merged_weights(
    tiny_model_dir: Path, adapters: dict[str, Path], expected, device: str
) -> None:
    engine = _engine(tiny_model_dir, adapters, max_loras=3, device=device)
    names: list[str | None] = [None, *adapters]
    for name in names:  # one batch: base and three adapters share every step
        _submit(engine, f"req-{name}", name)
    outputs = run(engine)
    for name in names:
        got = outputs[(f"req-{name}", 0)]
        want_tokens, want_logprobs = expected[name]
        assert tokens_of(got) == want_tokens, name
        got_logprobs = torch.tensor([lp.logprob for out in got for lp in out.new_logprobs or []])
        # CUDA: the kernels' fp32 dots run in tf32. On an H100 one logprob of six was 0.052 off, with the LoRA code
        # before and after the launch fusion alike (2026-11-26), the tokens equal: tf32's noise at this tiny shape
        tol = 1e-4 if device == "cpu" else 6e-2
        torch.testing.assert_close(got_logprobs, want_logprobs, atol=tol, rtol=tol)
    # The adapters matter: each one's tokens differ from the base model's.
    assert all(expected[name][0] != expected[None][0] for name in adapters)


def test_adapters_never_share_cached_blocks(tiny_model_dir: Path, adapters: dict[str, Path], expected) -> None:
    engine = _engine(tiny_model_dir, {"r4": adapters["r4"]}, max_loras=1)
    _submit(engine, "base", None)
    run(engine)
    _submit(engine, "base-again", None)
    _submit(engine, "adapter", "r4")
    outputs = run(engine)
    assert outputs[("base-again", 0)][-1].num_cached_tokens == 32  # the base prompt's two full blocks
    assert outputs[("adapter", 0)][-1].num_cached_tokens == 0
    assert tokens_of(outputs[("adapter", 0)]) == expected["r4"][0]


def test_slot_pool_evicts_the_least_recently_used_unpinned(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model_dir, adapters, max_loras=2)
    lora = engine.lora
    assert lora is not None
    a, b = lora.acquire("r4"), lora.acquire("r8-rslora")
    assert a is not None and b is not None
    assert lora.acquire("r16-attn") is None  # both slots pinned by live requests
    lora.release(b)
    lora.acquire("r4")  # r4 used again: r8 is now the least recently used...
    lora.release(a)
    lora.release(a)  # ...and both unpinned
    assert lora.acquire("r16-attn") == b
    assert lora.resident == ["r4", "r16-attn"]
    lora.release(b)


def test_requests_wait_for_a_slot_and_match_peft(tiny_model_dir: Path, adapters: dict[str, Path], expected) -> None:
    """Three adapters through one slot: each request waits for the one before it to end."""
    engine = _engine(tiny_model_dir, adapters, max_loras=1)
    for name in adapters:
        _submit(engine, name, name)
    assert engine.num_wanted() == engine.config.scheduler.num_max_waiting - 3  # those waiting for a slot count
    outputs = run(engine)
    for name in adapters:
        assert tokens_of(outputs[(name, 0)]) == expected[name][0], name


def test_a_request_whose_adapter_is_unloaded_while_it_waits_ends(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = _engine(tiny_model_dir, adapters, max_loras=1)
    _submit(engine, "first", "r4")
    _submit(engine, "waits", "r8-rslora")  # the one slot is pinned by "first"
    assert engine.remove_lora("r8-rslora")
    outputs = run(engine)
    assert [o.finish_reason for o in outputs[("waits", 0)]] == ["abort"]
    assert len(tokens_of(outputs[("first", 0)])) == NUM_NEW


def test_bad_adapters_and_names(tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    engine = _engine(tiny_model_dir, {}, max_loras=1)
    with pytest.raises(UnknownAdapterError, match="'nope' does not exist"):
        _submit(engine, "x", "nope")
    with pytest.raises(LoRAAdapterError, match="rank 16 exceeds --max-lora-rank 8"):
        _engine(tiny_model_dir, {"big": adapters["r16-attn"]}, max_loras=1, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match=r"no readable adapter_config\.json"):
        engine.add_lora("missing", str(tmp_path))
    engine.add_lora("r4", str(adapters["r4"]))
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        engine.add_lora("r4", str(adapters["r4"]))
    assert engine.lora_names == ["r4"] and engine.remove_lora("r4") and not engine.remove_lora("r4")


def test_batch_groups_tokens_by_slot() -> None:
    batch = LoRABatch(max_num_tokens=10, max_loras=3, device=torch.device("cpu"))
    batch.prepare(np.array([1, -1, 0, 1, 2, -1, 0, 1]))
    assert batch.slot_starts.tolist() == [0, 2, 5, 6]  # slot 0: 2 tokens, slot 1: 3, slot 2: 1
    assert batch.sorted_token_ids[:6].tolist() == [2, 6, 0, 3, 7, 4]
    assert batch.applies
    batch.prepare(np.array([-1, -1]))
    assert batch.slot_starts.tolist() == [0, 0, 0, 0] and not batch.applies  # a base-only step skips the kernels


class CountingOps:
    """The LoRA ops a LoRABatch runs, counting the calls (kernel launches on CUDA) of each."""

    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops
        self.calls = {"lora_shrink": 0, "lora_expand": 0}

    def __getattr__(self, name: str) -> Any:
        if name not in ("lora_shrink", "lora_expand"):
            return getattr(self.ops, name)

        def call(*args: Any) -> None:
            self.calls[name] += 1
            getattr(self.ops, name)(*args)

        return call


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_without_adapter_tokens_runs_the_base_model_only(
    tiny_model_dir: Path, adapters: dict[str, Path], expected, device: str
) -> None:
    """LoRA on, base requests only: no shrink/expand runs (CUDA: the base graphs replay) and the tokens are the
    base model's; a step with an adapter token runs one shrink and one expand per projection (q|k|v fused)."""
    engine = _engine(tiny_model_dir, adapters, max_loras=3, device=device)
    assert engine.lora is not None
    counting = CountingOps(engine.lora.batch.ops)
    engine.lora.batch.ops = counting  # type: ignore[assignment]  # duck-typed: the module's two functions
    graphs = engine.runner.graphs
    replays: list[bool] = []
    if graphs is not None:  # CUDA: which variant each replayed step took
        replay = graphs.replay

        def recording_replay(graph_id: int, uses_lora: bool = False) -> torch.Tensor:
            replays.append(uses_lora)
            return replay(graph_id, uses_lora)

        graphs.replay = recording_replay  # type: ignore[method-assign]
    for i in range(2):
        _submit(engine, f"base-{i}", None)
    outputs = run(engine)
    assert counting.calls == {"lora_shrink": 0, "lora_expand": 0} and not any(replays)
    for i in range(2):
        assert tokens_of(outputs[(f"base-{i}", 0)]) == expected[None][0]
    replays.clear()
    _submit(engine, "base", None)
    _submit(engine, "adapter", "r4")
    outputs = run(engine)
    assert tokens_of(outputs[("adapter", 0)]) == expected["r4"][0]
    assert tokens_of(outputs[("base", 0)]) == expected[None][0]
    num_projections = 4 * engine.runner.spec.num_layers  # qkv, o, gate_up, down
    num_eager_forwards = counting.calls["lora_shrink"] // num_projections
    assert counting.calls == {"lora_shrink": num_eager_forwards * num_projections} | {
        "lora_expand": num_eager_forwards * num_projections
    }
    assert all(replays) and num_eager_forwards + len(replays) >= NUM_NEW  # every step of the batch ran LoRA...
    if device == "cpu":
        assert num_eager_forwards == NUM_NEW  # ...the prompts' step and 5 decode steps


def test_decode_steps_share_one_zeroed_workspace_and_match_the_reference() -> None:
    """The Triton path of LoRALinear (the interpreter on CPU): a decode-sized step splits the shrink's K and adds
    into its columns of the step-wide workspace, which only the first projection zeroes; two projections over
    steps with different adapters must equal the torch reference, the stale workspace notwithstanding."""
    triton_lora = pytest.importorskip("pagedserve.kernels.lora")
    hidden, inter, max_loras, max_rank = 1024, 64, 3, 16
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled Triton reads CUDA tensors only
    assert triton_lora._split_k(4, hidden) > 1
    outputs = {}
    for name, ops in (("reference", None), ("triton", triton_lora)):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        batch = LoRABatch(max_num_tokens=8, max_loras=max_loras, device=dev, ops=ops)
        qkv_like = [(0, inter), (inter, inter), (2 * inter, inter)]
        first = LoRALinear(
            torch.nn.Linear(hidden, 3 * inter, bias=False).to(dev),
            hidden,
            qkv_like,
            max_loras,
            max_rank,
            batch,
            torch.float32,
            dev,
        )
        second = LoRALinear(
            torch.nn.Linear(3 * inter, hidden, bias=False).to(dev),
            3 * inter,
            [(0, hidden)],
            max_loras,
            max_rank,
            batch,
            torch.float32,
            dev,
        )
        batch.allocate_workspace()
        assert (ops is None or batch.workspace is not None) and first.zeroes_workspace
        assert not second.zeroes_workspace
        for layer in (first, second):
            layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=gen))
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) * 0.1)
        x = torch.randn(4, hidden, generator=gen).to(dev)
        steps = []
        for token_slots in ([0, -1, 2, 0], [1, 1, -1, 2], [-1, -1, -1, -1]):
            batch.prepare(np.array(token_slots))
            with torch.no_grad():
                steps.append(second(first(x)))
        outputs[name] = steps
    for got, want in zip(outputs["triton"], outputs["reference"], strict=True):
        tol = 1e-4 if dev.type == "cpu" else 2e-2  # CUDA: the kernels' fp32 dots run in tf32
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_peft_tensors_map_onto_fused_projections(adapters: dict[str, Path]) -> None:
    weights = read_adapter(inspect_adapter(adapters["r8-rslora"], max_rank=16))
    assert weights.info.scaling == pytest.approx(16 / math.sqrt(8))  # rslora: alpha / sqrt(r)
    a, b = weights.slices[("model.layers.1.self_attn.qkv_proj", 2)]  # v_proj: the third slice
    assert a.shape == (8, 64) and b.shape == (32, 8)  # 2 KV heads of 16
    assert {index for module, index in weights.slices if module.endswith("gate_up_proj")} == {0, 1}
    only_qv = read_adapter(inspect_adapter(adapters["r16-attn"], max_rank=16))
    assert sorted({index for _, index in only_qv.slices}) == [0, 2]
    assert only_qv.info.target_modules == ("q_proj", "v_proj")


def test_runtime_updates_reach_the_engine_and_failures_are_reported(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """What an engine replica does with a LoRAUpdate from its control stream, and what its heartbeat then says."""
    control = LoRAControl(_engine(tiny_model_dir, {}, max_loras=1, max_lora_rank=8))
    assert (control.max_lora_rank, control.adapters, control.resident) == (8, {}, [])
    control.apply(LoRAUpdate("u1", "load", "r4", str(adapters["r4"])))
    control.apply(LoRAUpdate("u2", "load", "r4", str(adapters["r4"])))  # a replay: already done, no error
    control.apply(LoRAUpdate("u3", "load", "big", str(adapters["r16-attn"])))
    control.apply(LoRAUpdate("u4", "load", "none", str(tmp_path)))
    assert control.adapters == {"r4": str(adapters["r4"])}
    assert set(control.errors) == {"u3", "u4"} and "exceeds --max-lora-rank 8" in control.errors["u3"]
    control.engine.add_request("x", PROMPT, SamplingParams(max_tokens=1), lora_name="r4")
    assert control.resident == ["r4"]  # in its slot while the request lives
    run(control.engine)
    control.apply(LoRAUpdate("u5", "unload", "r4"))
    assert control.adapters == {} and control.resident == []


def test_the_service_answers_an_unknown_adapter_with_404(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    """An adapter unloaded after the gateway looked (or never loaded on this replica): 404 model_not_found."""
    engine = _engine(tiny_model_dir, {"r4": adapters["r4"]}, max_loras=1)
    service = EngineService(Config.of(engine_id="eng-test"), "m", engine, model_source=None)
    sent: list[Any] = []
    service._send = sent.append  # type: ignore[method-assign,assignment]  # what the I/O thread publishes
    for request_id, name in (("known", "r4"), ("unknown", "gone")):
        service._add(b"1-0", GenerateRequest(request_id, "gw", "m", PROMPT, {"max_tokens": 2}, lora_name=name))
    assert list(service.active) == ["known"]
    [error] = [item.error for item in sent]
    assert (error.request_id, error.status, error.code, error.param) == ("unknown", 404, "model_not_found", "model")


class EagerVariantGraph(EagerGraph):
    """A CPU stand-in for one variant of a captured graph: it runs LoRA or not as it was captured, whatever the
    step's `LoRABatch.applies` says (a real graph holds the kernels or does not)."""

    def __init__(self, graphs: StepGraphs, shape: GraphShape, out: torch.Tensor, uses_lora: bool) -> None:
        super().__init__(graphs, shape, out)
        self.uses_lora = uses_lora

    def replay(self) -> None:
        assert self.graphs.lora is not None
        self.graphs.lora.applies = self.uses_lora
        super().replay()


class EagerLoRAGraphs(EagerGraphs):
    def capture(self) -> None:
        hidden_size = self.model.spec.hidden_size
        for graph_id, shape in enumerate(self.shapes):
            out = torch.empty(shape.num_tokens, hidden_size)
            self._graphs[graph_id] = (EagerVariantGraph(self, shape, out, False), out, [])  # type: ignore[assignment]
            self._lora_graphs[graph_id] = EagerVariantGraph(self, shape, out, True)  # type: ignore[assignment]


def test_graph_steps_replay_the_lora_variant_only_with_adapter_tokens(
    tiny_model_dir: Path, adapters: dict[str, Path], expected
) -> None:
    """The CUDA path's graph choice on the CPU (graphs replaced by eager stand-ins): base-only steps replay the
    base variant (no shrink/expand, base tokens), steps with an adapter token its LoRA variant (PEFT's tokens)."""
    engine = _engine(tiny_model_dir, adapters, max_loras=3)
    runner, lora = engine.runner, engine.lora
    assert lora is not None
    counting = CountingOps(lora.batch.ops)
    lora.batch.ops = counting  # type: ignore[assignment]
    block_size, cpu = engine.config.cache.block_size, torch.device("cpu")
    runner.buffers = InputBuffers(128, 8, -(-engine.max_model_len // block_size), cpu)
    graphs = EagerLoRAGraphs(
        runner.model, runner.kv_caches, runner.buffers, graph_shapes(8, 128, 8), engine.max_model_len, lora.batch
    )
    runner.graphs = graphs
    runner.capture_graphs()
    replays: list[bool] = []
    replay = graphs.replay

    def recording_replay(graph_id: int, uses_lora: bool = False) -> torch.Tensor:
        replays.append(uses_lora)
        return replay(graph_id, uses_lora)

    graphs.replay = recording_replay  # type: ignore[method-assign]
    _submit(engine, "base", None)
    outputs = run(engine)
    assert tokens_of(outputs[("base", 0)]) == expected[None][0]
    assert len(replays) == NUM_NEW and not any(replays) and counting.calls["lora_shrink"] == 0
    replays.clear()
    _submit(engine, "base-2", None)
    _submit(engine, "adapter", "r8-rslora")
    outputs = run(engine)
    assert tokens_of(outputs[("base-2", 0)]) == expected[None][0]
    assert tokens_of(outputs[("adapter", 0)]) == expected["r8-rslora"][0]
    assert len(replays) == NUM_NEW and all(replays)
    assert counting.calls["lora_shrink"] == counting.calls["lora_expand"] == NUM_NEW * 4 * runner.spec.num_layers
