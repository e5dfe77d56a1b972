"""The one configuration tree: flags > PAGEDSERVE_* env > --config file > defaults, vLLM's flag names, and the
tree handed whole to a child process."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.services.cli import build_parser, parse_config
from pagedserve.shared.config import FLAT_NAMES, SECTIONS, Config
from pagedserve.shared.config_cli import CONFIG_ENV, build_config, child_env

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}


def _config(argv: list[str], env: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(argv)
    return build_config(args, environ={**CLEAN_ENV, **(env or {})})


def test_defaults_have_one_home_each() -> None:
    config = _config(["engine"])
    assert config == Config()
    assert config.parallel.device == "auto" and config.gateway.host == "127.0.0.1"
    assert len(FLAT_NAMES) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    file = tmp_path / "pagedserve.yaml"
    file.write_text("max-model-len: 1000\nmax_num_seqs: 10\ncache:\n  block_size: 32\nport: 7000\n")
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "20", "PAGEDSERVE_PORT": "7001"}
    config = _config(["gateway", "--config", str(file), "--port", "7002"], env)
    assert config.model.max_model_len == 1000  # file only
    assert config.cache.block_size == 32  # file, by section
    assert config.scheduler.max_num_seqs == 20  # env beats file
    assert config.gateway.port == 7002  # flag beats env and file
    assert config.cache.gpu_memory_utilization == 0.9  # default


def test_env_values_are_typed() -> None:
    env = {
        "PAGEDSERVE_API_KEYS": "a, b",
        "PAGEDSERVE_ENABLE_PREFIX_CACHING": "false",
        "PAGEDSERVE_NUM_KV_BLOCKS": "64",
        "PAGEDSERVE_GPU_MEMORY_UTILIZATION": "0.5",
        "PAGEDSERVE_TRACE_CONSOLE": "1",
        "PAGEDSERVE_ENGINE_METRICS_PORT": "9400",
        "PAGEDSERVE_TOKENIZER_METRICS_PORT": "9401",
    }
    config = _config(["engine"], env)
    assert config.gateway.api_keys == ["a", "b"]
    assert config.cache.enable_prefix_caching is False and config.cache.num_kv_blocks == 64
    assert config.cache.gpu_memory_utilization == 0.5 and config.observability.trace_console is True
    assert (config.engine.metrics_port, config.tokenizer.metrics_port) == (9400, 9401)


def test_a_child_receives_the_exact_parent_config(tmp_path: Path) -> None:
    _, parent = parse_config(
        [
            "serve",
            "some/model",
            "--max-model-len",
            "777",
            "-tp",
            "2",
            "--api-key",
            "k",
            "--enforce-eager",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--engine-drain-timeout-s",
            "3",
        ]
    )
    # The child's own PAGEDSERVE_* variables would say otherwise: the parent's tree wins whole.
    env = {**child_env(parent, CLEAN_ENV), "PAGEDSERVE_MAX_MODEL_LEN": "5", "PAGEDSERVE_PORT": "1"}
    probe = (
        "import json, os\n"
        "from pagedserve.services.cli import parse_config\n"
        "print(json.dumps(parse_config(['engine'])[1].to_dict()))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert Config.from_dict(json.loads(out.stdout)) == parent
    assert json.loads(env[CONFIG_ENV])["model"]["model"] == "some/model"


# Each flag `vllm serve` users type, with the field it sets and the value it must land as.
VLLM_FLAGS: list[tuple[list[str], str, object]] = [
    (["--host", "0.0.0.0"], "gateway.host", "0.0.0.0"),
    (["--port", "9000"], "gateway.port", 9000),
    (["--api-key", "k1", "--api-key", "k2"], "gateway.api_keys", ["k1", "k2"]),
    (["--served-model-name", "mine"], "model.served_model_name", "mine"),
    (["--max-model-len", "8192"], "model.max_model_len", 8192),
    (["--gpu-memory-utilization", "0.8"], "cache.gpu_memory_utilization", 0.8),
    (["--tensor-parallel-size", "4"], "parallel.tensor_parallel_size", 4),
    (["-tp", "2"], "parallel.tensor_parallel_size", 2),
    (["--dtype", "half"], "model.dtype", "float16"),
    (["--dtype", "bfloat16"], "model.dtype", "bfloat16"),
    (["--kv-cache-dtype", "fp8_e4m3"], "cache.kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "fp8"], "cache.kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "auto"], "cache.kv_cache_dtype", "auto"),
    (["--quantization", "fp8"], "model.quantization", "fp8"),
    (["--max-num-seqs", "64"], "scheduler.max_num_seqs", 64),
    (["--max-num-batched-tokens", "4096"], "scheduler.max_num_batched_tokens", 4096),
    (["--enable-prefix-caching"], "cache.enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "cache.enable_prefix_caching", False),
    (["--enforce-eager"], "runner.enforce_eager", True),
    (["--seed", "7"], "model.seed", 7),
    (["--chat-template", "{{ messages }}"], "model.chat_template", "{{ messages }}"),
    (["--generation-config", "vllm"], "model.generation_config", "vllm"),
    (["--enable-auto-tool-choice"], "gateway.enable_auto_tool_choice", True),
    (["--tool-call-parser", "llama3"], "gateway.tool_call_parser", "llama3"),
    (["--reasoning-parser", "deepseek_r1"], "gateway.reasoning_parser", "deepseek_r1"),
    (["--reasoning-parser", "gpt_oss"], "gateway.reasoning_parser", "gpt_oss"),
    (["--responses-store-ttl-s", "60"], "gateway.responses_store_ttl_s", 60),
    (["--load-format", "dummy"], "model.load_format", "random"),
    (["--load-format", "safetensors"], "model.load_format", "auto"),
    (["--load-format", "gguf"], "model.load_format", "auto"),
    (["--block-size", "32"], "cache.block_size", 32),
    (["--disable-log-requests"], "gateway.disable_log_requests", True),
    (["--uvicorn-log-level", "info"], "gateway.uvicorn_log_level", "info"),
    (["--strict-request-fields"], "gateway.strict_request_fields", True),
    (["--num-gpu-blocks-override", "100"], "cache.num_kv_blocks", 100),
]


@pytest.mark.parametrize(("flags", "path", "expected"), VLLM_FLAGS, ids=[" ".join(f[0]) for f in VLLM_FLAGS])
def test_vllm_flags_set_their_field(flags: list[str], path: str, expected: object) -> None:
    _, config = parse_config(["serve", "Qwen/Qwen3-8B", *flags])
    section, name = path.split(".")
    assert getattr(getattr(config, section), name) == expected
    assert config.model.model == "Qwen/Qwen3-8B"


def test_enforce_eager_turns_cuda_graphs_off() -> None:
    assert _config(["engine", "--enforce-eager"]).runner.num_graph_batch == 0
    assert _config(["engine"]).runner.num_graph_batch == 512


def test_the_issue_command_line_parses() -> None:
    command = "serve Qwen/Qwen3-8B --max-model-len 8192 --gpu-memory-utilization 0.9 -tp 2 --enforce-eager"
    _, config = parse_config(command.split(" "))
    assert (config.model.model, config.model.max_model_len, config.parallel.tensor_parallel_size) == (
        "Qwen/Qwen3-8B",
        8192,
        2,
    )


def test_models_positional_and_repeated() -> None:
    from pagedserve.services.cli import _models_of

    assert _models_of(build_parser().parse_args(["serve", "a", "--model", "b"])) == ["a", "b"]
    assert _models_of(build_parser().parse_args(["serve"])) == [None]
    with pytest.raises(SystemExit):
        parse_config(["engine", "--model", "a", "--model", "b"])


def _stderr_of(argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse_config(argv)
    return err.getvalue()


def test_an_unknown_flag_names_the_nearest() -> None:
    assert "did you mean --max-model-len?" in _stderr_of(["serve", "--max-model-length", "10"])
    assert "did you mean --gpu-memory-utilization?" in _stderr_of(["serve", "--gpu-memory-utilisation", "0.5"])


def test_vllm_flags_without_meaning_here_are_ignored_with_a_warning() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _, config = parse_config(["serve", "--trust-remote-code", "--swap-space", "4", "--max-num-seqs", "3"])
    assert "ignoring --trust-remote-code" in err.getvalue() and "ignoring --swap-space" in err.getvalue()
    assert config.scheduler.max_num_seqs == 3


def test_vllm_flags_we_cannot_honour_are_refused_with_the_reason() -> None:
    with pytest.raises(SystemExit, match="pipeline parallelism is not supported"):
        parse_config(["serve", "--pipeline-parallel-size", "2"])


def test_bad_values_are_refused() -> None:
    for argv in (
        ["engine", "--quantization", "bitsandbytes"],
        ["engine", "--gpu-memory-utilization", "1.5"],
        ["engine", "--block-size", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_config(argv)
    with pytest.raises(SystemExit, match="max_model_len"):
        _config(["engine"], {"PAGEDSERVE_MAX_MODEL_LEN": "lots"})


def test_every_field_is_a_flag_in_help_grouped_by_section() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for section in SECTIONS:
        assert f"{section} options:" in help_text
    for flat in FLAT_NAMES:
        flag = "--api-key" if flat == "api_keys" else "--" + flat.replace("_", "-")
        assert flag in help_text, flag
        assert f"PAGEDSERVE_{flat.upper()}" in help_text


def test_of_and_replace_route_flat_names_to_sections() -> None:
    config = Config.of(model="m", num_kv_blocks=8, max_num_seqs=2)
    assert (config.model.model, config.cache.num_kv_blocks, config.scheduler.max_num_seqs) == ("m", 8, 2)
    changed = config.replace(engine_drain_timeout_s=1.0)
    assert changed.engine.drain_timeout_s == 1.0 and config.engine.drain_timeout_s == 30.0
    with pytest.raises(TypeError):
        Config.of(not_a_setting=1)


def test_chat_template_replaces_the_checkpoints(smollm2_dir: Path, tmp_path: Path) -> None:
    from pagedserve.shared.tokenizer_loader import load_tokenizer, read_chat_template

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template == read_chat_template(template)
    with pytest.raises(ValueError):
        read_chat_template(str(tmp_path / "missing.jinja"))
    tokenizer = load_tokenizer(smollm2_dir, str(tmp_path / "t.jinja"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<<hi>>"
    assert load_tokenizer(smollm2_dir).chat_template != template


def test_an_unknown_reasoning_parser_stops_start_up_listing_the_choices() -> None:
    from pagedserve.shared.config import GatewayConfig

    with pytest.raises(ValueError, match="expected one of deepseek_r1, qwen3, mistral, granite, gpt_oss, openai"):
        GatewayConfig(reasoning_parser="bogus")


def test_lora_flags_as_vllm_writes_them() -> None:
    config = _config(
        ["serve", "--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "4"],
        {"PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )
    lora = config.lora
    assert lora.enable_lora and lora.allow_runtime_lora_updating and (lora.max_loras, lora.max_lora_rank) == (4, 16)
    assert lora.adapters() == {"sql": "/a/sql", "chat": "/a/chat"}
    assert _config(["engine", "--lora-modules", "a=/x", "--lora-modules", "b=/y"]).lora.adapters() == {
        "a": "/x",
        "b": "/y",
    }
    for argv, reason in (
        (["engine", "--lora-modules", "just-a-path"], "expected name=path"),
        (["engine", "--max-lora-rank", "128"], "at most 64"),
        (["engine", "--max-loras", "0"], "max_loras"),
    ):
        with pytest.raises(SystemExit, match=reason):
            _config(argv)
