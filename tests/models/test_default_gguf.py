"""The default model's GGUF named by an explicit path vs the cached default directory.

The quick test checks resolution and equal outputs; the cold conversion (about 40-100 s on a
2-core machine) runs only with PAGEDSERVE_TEST_COLD_GGUF=1, since every CI run already converts
the default once through `resolve_model_dir(None)`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import CausalLM, load_model
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from pagedserve.shared.model_source import default_gguf_path, resolve_model_dir
from tests.models.paged_driver import PagedDriver

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 2683, 30]]


def assert_same_outputs(dirs: list[Path]) -> None:
    models: list[CausalLM] = [load_model(d, dtype="float32", show_progress=False) for d in dirs]
    logits = [PagedDriver(m).step(dict(enumerate(PROMPTS))) for m in models]
    for a, b in zip(*logits):
        assert torch.equal(a, b)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = [
        [r.token_ids for r in Engine(Config.of(model=str(d), num_kv_blocks=64), model=m).generate(PROMPTS, params)]
        for d, m in zip(dirs, models)
    ]
    assert outputs[0] == outputs[1] and all(len(o) > 0 for o in outputs[0])


def test_explicit_gguf_path_resolves_to_the_cached_default(tmp_path: Path) -> None:
    default_dir = resolve_model_dir(None)
    explicit = resolve_model_dir(str(default_gguf_path()))
    assert explicit == default_dir  # one file, one conversion, whatever it is called
    # A safetensors directory of it elsewhere (what a user would point --model at) loads the same.
    copy = tmp_path / "smollm2-safetensors"
    copy.mkdir()
    for f in default_dir.iterdir():
        if not f.name.startswith("."):
            (copy / f.name).symlink_to(f)
    assert resolve_model_dir(str(copy)) == copy
    assert_same_outputs([explicit, copy])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDSERVE_TEST_COLD_GGUF"), reason="set PAGEDSERVE_TEST_COLD_GGUF=1")
def test_cold_gguf_conversion_equals_the_cached_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default_dir = resolve_model_dir(None)
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copyfile(default_gguf_path(), gguf)  # another file: its own cache entry, converted from scratch
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    start = time.perf_counter()
    converted = resolve_model_dir(str(gguf))
    print(f"cold GGUF conversion: {time.perf_counter() - start:.1f} s")
    assert converted == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (converted / name).exists(), name
    assert_same_outputs([default_dir, converted])
