"""Model name resolution: local dirs, hub ids through the offline HF cache, GGUF conversion caching."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

import pagedserve.shared.model_source as model_source
from pagedserve.shared.model_source import ModelNotFoundError, convert_gguf, model_name_for, resolve_model_dir


def fake_hf_cache(root: Path, repo_id: str, files: dict[str, str]) -> Path:
    """The on-disk layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_hub_id_resolves_through_the_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = fake_hf_cache(tmp_path, "acme/tiny-llama", {"config.json": "{}", "model.safetensors": ""})
    assert resolve_model_dir("acme/tiny-llama") == snapshot
    assert model_name_for("acme/tiny-llama") == "acme/tiny-llama"
    with pytest.raises(ModelNotFoundError, match="acme/absent"):
        resolve_model_dir("acme/absent")


def test_local_directory_must_be_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    assert model_name_for(str(tmp_path)) == tmp_path.name


class FakeConverter:
    def __init__(self) -> None:
        self.sources: list[Path] = []

    def __call__(self, gguf_path: Path, tmp: Path, name: str) -> None:
        self.sources.append(gguf_path)
        time.sleep(0.2)  # long enough for a concurrent caller to arrive while this one converts
        tmp.mkdir()
        (tmp / "config.json").write_text(gguf_path.read_text())


def test_gguf_converts_once_even_when_started_concurrently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    fake = FakeConverter()
    monkeypatch.setattr(model_source, "_convert", fake)
    gguf = tmp_path / "m.gguf"
    gguf.write_text("weights-1")
    out = tmp_path / "cache" / "m"
    threads = [threading.Thread(target=convert_gguf, args=(gguf, out)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.sources == [gguf]
    assert convert_gguf(gguf, out) == out and len(fake.sources) == 1  # cached
    gguf.write_text("weights-2, a different file")  # same name, other content: convert afresh
    convert_gguf(gguf, out)
    assert len(fake.sources) == 2 and (out / "config.json").read_text() == "weights-2, a different file"


def test_the_same_file_at_another_path_shares_the_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two installs (two venvs) see the default GGUF under different paths: one conversion serves both."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    fake = FakeConverter()
    monkeypatch.setattr(model_source, "_convert", fake)
    first, second = tmp_path / "venv-a" / "m.gguf", tmp_path / "venv-b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text("the same weights")
    out = tmp_path / "cache" / "m"
    convert_gguf(first, out)
    convert_gguf(second, out)
    convert_gguf(first, out)
    assert fake.sources == [first]  # converted once, for both paths
    marker = (out / ".pagedserve-converted").read_text()
    assert str(tmp_path) not in marker and marker.startswith("sha256:")  # what the file is, not where


def test_a_marker_of_an_older_release_is_adopted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    fake = FakeConverter()
    monkeypatch.setattr(model_source, "_convert", fake)
    gguf, out = tmp_path / "m.gguf", tmp_path / "cache" / "m"
    gguf.write_text("weights")
    out.mkdir(parents=True)
    (out / ".pagedserve-converted").write_text(f"{gguf.resolve()}\n{gguf.stat().st_size}")
    assert convert_gguf(gguf, out) == out and fake.sources == []  # no reconversion
    assert (out / ".pagedserve-converted").read_text().startswith("sha256:")


def test_explicit_gguf_path_goes_to_its_own_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_source, "_convert", FakeConverter())
    gguf = tmp_path / "Other-Model.Q8_0.gguf"
    gguf.write_text("x")
    assert resolve_model_dir(str(gguf)) == tmp_path / "cache" / "models" / "Other-Model.Q8_0"
    assert model_name_for(str(gguf)) == "Other-Model.Q8_0"
    shutil.rmtree(tmp_path / "cache")
