"""`python -m bench serve_multiturn` against the real services (session fixture): each turn's prompt extends
the last one with the server's own reply, and the hit rate it reports is the server's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from bench.serve.client import ClientConfig
from bench.serve_multiturn import Workload, conversations, run
from tests.conftest import RunningServices

ROOT = Path(__file__).resolve().parents[2]
SMALL = Workload(system_prompts=2, system_len=48, users=3, turns=3, user_len=8, output_len=4)


def test_each_turn_extends_the_conversation_with_the_servers_reply(services: RunningServices) -> None:
    convs = conversations(list(range(1000, 3000)), SMALL)
    assert convs[0].history == convs[2].history != convs[1].history  # users share system prompts in turn
    starts = [list(c.history) for c in convs]
    config = ClientConfig(services.base_url, services.model, extra_body={"return_token_ids": True})
    asyncio.run(run(config, convs, SMALL, max_concurrency=3))
    for conv, start in zip(convs, starts):
        assert [r.ok for r in conv.results] == [True] * 3, [r.error for r in conv.results]
        assert all(len(r.output_ids) == 4 for r in conv.results)  # the streamed token ids
        # the last prompt was everything before it: system, then each turn's message and reply
        expected = list(start)
        for message, result in zip(conv.messages, conv.results):
            expected += message
            assert result.prompt_len == len(expected)
            expected += result.output_ids
        assert conv.history == expected
        assert conv.results[-1].cached_tokens >= 48  # its history was cached by the turn before


def test_the_cli_reports_the_hit_rate_the_engine_saw(services: RunningServices, tmp_path: Path) -> None:
    assert services.metrics_ports is not None
    metrics = f"http://127.0.0.1:{services.metrics_ports['engine']}/metrics"
    command = [sys.executable, "-m", "bench", "serve_multiturn", "--url", services.base_url, "--model", services.model]
    command += ["--system-prompts", "1", "--system-len", "64", "--users", "2", "--turns", "2", "--user-len", "8"]
    command += ["--output-len", "3", "--metrics-url", metrics, "--result-dir", str(tmp_path), "--result-name", "mt"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "mt.json").read_text())["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert 0 < summary["prefix_hit_rate"] < 1 and 0 < summary["server_prefix_hit_rate"] < 1
    assert "prefix hit rate" in (tmp_path / "mt.md").read_text()
