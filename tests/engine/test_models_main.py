"""`python -m pagedserve.services.engine.models MODEL`: load a model, print its spec and the stage timings,
and optionally write them as JSON (run in-process on the tiny random Llama)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from pagedserve.services.engine.models.__main__ import main


def run(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m pagedserve.services.engine.models", *args])
    main()


def checkpoint_numel(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118


def test_the_report_names_the_model_its_spec_and_parameter_count(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    run(monkeypatch, str(tiny_model_dir), "--dtype", "bf16", "--max-model-len", "512", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["model"] == tiny_model_dir.name and report["model_dir"] == str(tiny_model_dir)
    assert report["num_params"] == checkpoint_numel(tiny_model_dir)  # fused q/k/v and gate/up hold the same
    assert report["resolve_s"] >= 0 and report["load_s"] > 0
    spec = report["spec"]
    assert spec["dtype"] == "torch.bfloat16" and spec["max_model_len"] == 512
    assert (spec["architecture"], spec["num_layers"], spec["vocab_size"]) == ("LlamaForCausalLM", 2, 256)
    assert (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"], spec["eos_token_ids"]) == (4, 2, 16, [2])

    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:2] == ["model", tiny_model_dir.name]
    assert printed[2].startswith("load") and f"({report['num_params'] / 1e6:.1f} M parameters)" in printed[2]
    assert {line.split()[0] for line in printed[3:]} == set(spec)  # one line per spec field


def test_defaults_without_json(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    run(monkeypatch, str(tiny_model_dir))
    printed = capsys.readouterr().out
    assert "torch.float32" in printed  # dtype auto on CPU
    assert "max_model_len             1024" in printed  # the config's context
    assert list(tmp_path.iterdir()) == []  # no --json: nothing written


def test_bad_arguments_fail_before_or_while_loading(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        run(monkeypatch, str(tiny_model_dir), "--max-model-len", "4096")  # longer than the model's context
    with pytest.raises(ValueError, match="dtype"):
        run(monkeypatch, str(tiny_model_dir), "--dtype", "int3")
    with pytest.raises(SystemExit):
        run(monkeypatch, str(tiny_model_dir), "--max-model-len", "many")
