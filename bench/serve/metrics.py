"""Summary metrics of one run, as `vllm bench serve` defines them.

TTFT: sending to the first content chunk. ITL: gaps between content chunks. TPOT per request:
(latency - TTFT) / (output tokens - 1). E2E: sending to the stream's end. Throughputs are over the
run's wall-clock span, from the first send to the last end. Goodput: requests/s of the requests
that met every SLO given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.serve.client import RequestResult

PERCENTILES = (50, 90, 99)


def tpot(result: RequestResult) -> float | None:
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": round(float(ms.mean()), 3), **{f"p{p}": round(float(np.percentile(ms, p)), 3) for p in PERCENTILES}}


def meets_slo(result: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and result.ttft * 1e3 > slo_ttft_ms:
        return False
    per_token = tpot(result)
    return not (slo_tpot_ms is not None and per_token is not None and per_token * 1e3 > slo_tpot_ms)


def summarize(
    results: Sequence[RequestResult], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    if results:
        first = min(r.start_wall for r in results)
        last = max(r.start_wall + r.latency for r in results)
        duration = max(last - first, 1e-9)
    else:
        duration = float("nan")
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output_len for r in results),
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(output_tokens / duration, 1),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 1),
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution_ms([r.latency for r in ok]),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
        summary["goodput"] = {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "good_requests": good,
            "request_goodput": round(good / duration, 3),
        }
    return summary
