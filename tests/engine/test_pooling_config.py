"""Which engines pool and how (services/engine/pooling_config.py): --runner, --pooler-config, and a
sentence-transformers checkpoint's own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.services.cli import build_parser
from pagedserve.services.engine.pooling_config import PoolingParams, parse_pooler_config, resolve_pooling
from pagedserve.shared.config import ModelConfig
from pagedserve.shared.config_cli import build_config


def _sentence_transformers(path: Path, mode: str, normalize: bool) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode: True}))
    return path


def test_runner_flags_and_defaults(tmp_path: Path) -> None:
    assert resolve_pooling(ModelConfig(), tmp_path) is None  # auto, plain checkpoint: generate
    assert resolve_pooling(ModelConfig(runner="pooling"), tmp_path) == PoolingParams("LAST", True)
    config = ModelConfig(runner="pooling", pooler_config='{"pooling_type": "mean", "normalize": false}')
    assert resolve_pooling(config, tmp_path) == PoolingParams("MEAN", False)
    argv = ["engine", "--runner", "pooling", "--override-pooler-config", '{"normalize": false}']
    args = build_parser().parse_args(argv)
    flags = build_config(args, environ={}).model  # vLLM's older flag name is an alias
    assert (flags.runner, resolve_pooling(flags, tmp_path)) == ("pooling", PoolingParams("LAST", False))


def test_sentence_transformers_checkpoint_is_detected(tmp_path: Path) -> None:
    path = _sentence_transformers(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    assert resolve_pooling(ModelConfig(), path) == PoolingParams("MEAN", False)
    assert resolve_pooling(ModelConfig(runner="generate"), path) is None  # the flag wins
    override = ModelConfig(pooler_config='{"pooling_type": "LAST", "normalize": true}')
    assert resolve_pooling(override, path) == PoolingParams("LAST", True)


def test_lasttoken_with_normalize(tmp_path: Path) -> None:  # Qwen3-Embedding's files
    path = _sentence_transformers(tmp_path, "pooling_mode_lasttoken", normalize=True)
    assert resolve_pooling(ModelConfig(), path) == PoolingParams("LAST", True)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"pooling_type": "MAX"}', "pooling_type"),
        ('{"normalize": "yes"}', "normalize"),
        ('{"softmax": true}', "unsupported keys"),
    ],
)
def test_bad_pooler_config_is_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_pooler_config(text)


def test_unknown_runner_is_refused() -> None:
    with pytest.raises(ValueError, match="runner"):
        ModelConfig(runner="embed")
