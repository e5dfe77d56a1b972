"""Every metric the Grafana dashboard queries is one the services register (read from the code's own
registries, no stack started); the e2e Prometheus test checks the same against live scrapes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from pagedserve.services.engine.metrics import EngineMetrics
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.tokenizer.metrics import TokenizerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/pagedserve.json"
_METRIC = re.compile(r"\b(?:pagedserve_|vllm:)[A-Za-z0-9_:]+")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {name for p in panels for t in p.get("targets", []) for name in _METRIC.findall(t["expr"])}


def scraped_names(registry: CollectorRegistry) -> set[str]:
    """The series names a scrape of `registry` can show (a counter `x` is scraped as `x_total`)."""
    return {family.name + suffix for family in registry.collect() for suffix in _SUFFIXES.get(family.type, ("",))}


def exported_metrics() -> set[str]:
    registries = [GatewayMetrics().registry, EngineMetrics("m", "e0").registry, TokenizerMetrics("m").registry]
    return set().union(*(scraped_names(r) for r in registries))


def test_dashboard_queries_only_exported_metrics() -> None:
    used = dashboard_metrics()
    assert len(used) >= 15  # the regex found the dashboard's queries
    assert used <= exported_metrics(), f"dashboard metrics not exported: {sorted(used - exported_metrics())}"


def test_dashboard_uses_vllm_names_for_the_common_set() -> None:
    used = dashboard_metrics()
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        assert name in used, name


def test_the_check_catches_a_name_nobody_exports() -> None:
    assert "vllm:made_up_total" not in exported_metrics()
    assert {"vllm:request_success_total", "pagedserve_requests_total"} <= exported_metrics()
