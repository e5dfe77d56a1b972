"""The result files: JSON (everything), Markdown (the tables), and the plots beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.serve import plots


def _dist(d: dict[str, float]) -> str:
    return f"{d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f} ({d['mean']:.2f})"


def _run_rows(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| run | ok / failed | req/s | out tok/s | total tok/s | TTFT ms p50/p90/p99 (mean) "
        "| TPOT ms | ITL ms | E2E ms | goodput req/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in runs.items():
        goodput = s.get("goodput", {}).get("request_goodput", "")
        lines.append(
            f"| {name} | {s['completed']} / {s['failed']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:,.0f} | {s['total_token_throughput']:,.0f} | {_dist(s['ttft_ms'])} | "
            f"{_dist(s['tpot_ms'])} | {_dist(s['itl_ms'])} | {_dist(s['e2e_ms'])} | {goodput} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    env, wl = report["environment"], report["workload"]
    where = f"at {report['url']}" if report["url"] else "(the engine alone)"
    lines = [
        f"# Serving benchmark: {report['model']} {where}",
        "",
        f"{env['date']}, client on {env['client_host']}; server device: {env.get('device') or 'not given'}",
        "",
        f"`{env['command']}`",
        "",
        f"Workload: {wl['dataset']} dataset, {wl['num_prompts']} requests, input {wl['input_len']} / output "
        f"{wl['output_len']} tokens ({wl['length_dist']}, range ratio {wl['range_ratio']}), endpoint "
        f"{wl['endpoint']}, prompts as {wl['prompt_format']}, request rate {wl['request_rate']}, max "
        f"concurrency {wl['max_concurrency']}, ignore_eos {wl['ignore_eos']}, {wl['client_processes']} client "
        f"process(es).",
    ]
    if report["runs"]:
        lines += ["", *_run_rows(report["runs"])]
    offline = report.get("offline")
    if offline:
        lines += [
            "",
            f"## The engine alone ({offline['device']}, same prompts)",
            "",
            f"All {offline['throughput']['requests']} requests at once: "
            f"{offline['throughput']['output_throughput']:,.0f} out tok/s, "
            f"{offline['throughput']['total_token_throughput']:,.0f} total tok/s.",
        ]
        if "single" in offline:
            single = offline["single"]
            lines.append(
                f"One at a time ({single['requests']} requests): time to first token ms p50/p90/p99 (mean) "
                f"{_dist(single['ttft_ms'])}, step time ms {_dist(single['itl_ms'])}."
            )
    if report.get("sweep"):
        lines += ["", "## Concurrency sweep", ""]
        lines += _run_rows({f"concurrency {row['max_concurrency']}": row for row in report["sweep"]})
    tax = report.get("pipeline_tax")
    if tax:
        lines += [
            "",
            "## Pipeline tax (served vs the engine alone, same prompts)",
            "",
            "| metric | served | offline | served / offline or difference |",
            "| --- | --- | --- | --- |",
            f"| output tok/s | {tax['served_output_throughput']:,.0f} | {tax['offline_output_throughput']:,.0f} "
            f"| {tax['served_over_offline']:.1%} |",
        ]
        for key in ("ttft_ms", "itl_ms"):
            row = tax.get(f"single_{key}_p50")
            if row:
                label = key.removesuffix("_ms").upper()
                lines.append(
                    f"| single stream {label} p50 (ms) | {row['served']:.2f} | {row['offline']:.2f} "
                    f"| {row['difference']:+.2f} ms |"
                )
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in report["plots"]]
    return "\n".join(lines) + "\n"


def make_plots(report: dict[str, Any], samples: dict[str, dict[str, list[float]]], stem: Path) -> list[str]:
    """samples: run name -> {"ttft_ms": [...], "itl_ms": [...]}."""
    if not samples:
        return []
    title = f"{report['model']} ({report['environment'].get('device') or report['url']})"
    paths = [
        plots.cdf_plot(
            {name: s["ttft_ms"] for name, s in samples.items()},
            "TTFT",
            f"TTFT CDF: {title}",
            stem.with_name(stem.name + "_ttft_cdf.png"),
        ),
        plots.cdf_plot(
            {name: s["itl_ms"] for name, s in samples.items()},
            "ITL",
            f"ITL CDF: {title}",
            stem.with_name(stem.name + "_itl_cdf.png"),
        ),
    ]
    if report.get("sweep"):
        offline = report.get("offline", {}).get("throughput", {}).get("output_throughput")
        paths.append(
            plots.sweep_plot(
                report["sweep"],
                f"Throughput vs concurrency: {title}",
                stem.with_name(stem.name + "_throughput.png"),
                offline,
            )
        )
    return [str(p) for p in paths]


def write(report: dict[str, Any], samples: dict[str, dict[str, list[float]]], result_dir: Path, name: str) -> Path:
    result_dir.mkdir(parents=True, exist_ok=True)
    stem = result_dir / name
    report["plots"] = make_plots(report, samples, stem)
    json_path = stem.with_name(name + ".json")
    json_path.write_text(json.dumps(report, indent=2))
    stem.with_name(name + ".md").write_text(markdown(report))
    return json_path
