"""Compare multi-turn runs (bench/serve_multiturn.py results) against issue 22's goals: one table, the TTFT
and ITL CDFs, and each goal met or missed.

    python -m bench multiturn_report DIR --runs one,pull,prefix [--tier-runs tier_off,tier_on]

Each run is DIR/multiturn_{run}.json. The goals: prefix routing's hit rate >= 95% of one engine's, its TTFT
p50 <= 0.5x pull's, its throughput >= pull's, each replica's requests within 15% of the mean.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load(directory: Path, runs: list[str]) -> dict[str, dict[str, Any]]:
    return {run: json.loads((directory / f"multiturn_{run}.json").read_text()) for run in runs}


def table(reports: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| run | ok / failed | prefix hit rate | TTFT p50 / p99 ms | later-turn TTFT p50 / p99 | ITL p50 / p99 ms "
        "| req/s | out tok/s | requests per replica |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run, report in reports.items():
        s = report["summary"]
        t, lt, itl = s["ttft_ms"], s["ttft_ms_later_turns"], s["itl_ms"]
        per_replica = sorted(s.get("requests_per_engine", {}).values())
        lines.append(
            f"| {run} | {s['completed']} / {s['failed']} | {s['prefix_hit_rate']:.1%} "
            f"| {t['p50']:.1f} / {t['p99']:.1f} | {lt['p50']:.1f} / {lt['p99']:.1f} "
            f"| {itl['p50']:.2f} / {itl['p99']:.2f} | {s['request_throughput']:.2f} "
            f"| {s['output_throughput']:,.0f} | {per_replica} |"
        )
    return lines


def balance(report: dict[str, Any]) -> float:
    """The largest relative distance of a replica's request count from the mean."""
    counts = [n for n in report["summary"].get("requests_per_engine", {}).values() if n > 0]
    if not counts:
        return float("nan")
    mean = sum(counts) / len(counts)
    return max(abs(n - mean) for n in counts) / mean


def routing_goals(one: dict[str, Any], pull: dict[str, Any], prefix: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for issue 22's routing goals."""
    o, pu, pr = one["summary"], pull["summary"], prefix["summary"]
    hit_ratio = pr["prefix_hit_rate"] / o["prefix_hit_rate"] if o["prefix_hit_rate"] else float("nan")
    ttft_ratio = pr["ttft_ms"]["p50"] / pu["ttft_ms"]["p50"]
    spread = balance(prefix)
    return [
        ("prefix hit rate >= 95% of one engine's", f"{hit_ratio:.1%}", hit_ratio >= 0.95),
        ("prefix TTFT p50 <= 0.5x pull's", f"{ttft_ratio:.2f}x", ttft_ratio <= 0.5),
        (
            "prefix throughput >= pull's",
            f"{pr['request_throughput']:.2f} vs {pu['request_throughput']:.2f} req/s",
            pr["request_throughput"] >= pu["request_throughput"],
        ),
        ("each replica's load within 15% of the mean (prefix)", f"{spread:.1%} at most", spread <= 0.15),
        (
            "pull's hit rate lower than prefix's",
            f"{pu['prefix_hit_rate']:.1%}",
            pu["prefix_hit_rate"] < pr["prefix_hit_rate"],
        ),
    ]


def plots(reports: dict[str, dict[str, Any]], stem: Path) -> list[Path]:
    try:
        from bench.serve import plots as serve_plots
    except ImportError:  # no matplotlib on a bare GPU machine: tables only
        return []
    with_samples = {run: r["samples"] for run, r in reports.items() if "samples" in r}
    if not with_samples:
        return []
    title = next(iter(reports.values())).get("label", "")
    return [
        serve_plots.cdf_plot(
            {run: s[metric] for run, s in with_samples.items()},
            metric.removesuffix("_ms").upper(),
            f"{metric.removesuffix('_ms').upper()} CDF, multi-turn: {title}"[:110],
            stem.with_name(f"{stem.name}_{metric.removesuffix('_ms')}_cdf.png"),
        )
        for metric in ("ttft_ms", "itl_ms")
    ]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--runs", default="one,pull,prefix", help="the one-engine, pull and prefix runs, in this order")
    p.add_argument("--tier-runs", default="", help="host tier off and on (same limited device cache), in this order")
    p.add_argument("--name", default="comparison")
    args = p.parse_args(argv)
    lines: list[str] = []
    runs = [r for r in args.runs.split(",") if r]
    reports = load(args.directory, runs)
    lines += ["## Routing", "", *table(reports), ""]
    if len(runs) == 3:
        lines += ["| goal | measured | met |", "| --- | --- | --- |"]
        goals = routing_goals(*reports.values())
        lines += [f"| {goal} | {value} | {'yes' if met else '**no**'} |" for goal, value, met in goals]
        lines.append("")
    paths = plots(reports, args.directory / f"{args.name}_routing")
    tier_runs = [r for r in args.tier_runs.split(",") if r]
    if tier_runs:
        tier = load(args.directory, tier_runs)
        lines += ["## Host-memory KV tier", "", *table(tier), ""]
        rate = tier[tier_runs[-1]]["summary"]["prefix_hit_rate"]
        lines += [f"Host tier on: hit rate {rate:.1%} (goal >= 80%: {'met' if rate >= 0.8 else '**missed**'}).", ""]
        paths += plots(tier, args.directory / f"{args.name}_host_tier")
    lines += [f"![{path.stem}]({path.name})" for path in paths]
    text = "\n".join(lines) + "\n"
    (args.directory / f"{args.name}.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
