"""Host time of a new request's first engine call on an idle engine (the "until scheduled" part of TTFT).

    python -m bench.first_step_host --model DIR [--prompt-lens 32,512] [--requests 40] [--cprofile out.txt]

One request at a time, as a single-stream client sends them: add_request, then the step() call that schedules
and launches its prefill (with async scheduling it returns right after the launch), then the calls until it
finishes. Prints medians of the add and first-call times, the first call's phases from the engine's step
profile (schedule, prepare, forward, sample, ...), and with --cprofile the top functions of the first calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config


def measure(engine: Engine, prompt_len: int, requests: int, profiler: cProfile.Profile | None) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    add_ms, first_ms, phases = [], [], []
    for i in range(requests + 5):  # the first 5: warm-up
        prompt = [(7 * i + j) % 400 + 10 for j in range(prompt_len)]  # a new first block each time: no cache hit
        engine.profile.reset()
        start = time.perf_counter()
        engine.add_request(f"p{prompt_len}-{i}", prompt, params)
        added = time.perf_counter()
        if profiler is not None and i >= 5:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        launched = time.perf_counter()
        # the call's host phases (read directly: with async scheduling no step has finished yet to count)
        call_phases: dict[str, float] = {}
        for kind in engine.profile.host_s.values():
            for phase, sec in kind.items():
                call_phases[phase] = call_phases.get(phase, 0.0) + 1e3 * sec
        while engine.has_unfinished():
            engine.step()
        if i >= 5:
            add_ms.append((added - start) * 1e3)
            first_ms.append((launched - added) * 1e3)
            phases.append(call_phases)
    names = sorted({p for ph in phases for p in ph})
    return {
        "prompt_len": prompt_len,
        "add_ms_p50": round(statistics.median(add_ms), 3),
        "first_call_ms_p50": round(statistics.median(first_ms), 3),
        "first_call_phase_ms_p50": {p: round(statistics.median(ph.get(p, 0.0) for ph in phases), 3) for p in names},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-lens", default="32,512")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cprofile", type=Path, help="write the first calls' top functions (cumulative) here")
    args = parser.parse_args()
    engine = Engine(Config.of(model=args.model, device=args.device, profile_steps=True))
    profiler = cProfile.Profile() if args.cprofile else None
    rows = [measure(engine, int(n), args.requests, profiler) for n in args.prompt_lens.split(",")]
    print(f"async scheduling: {engine.is_async}; medians in ms")
    for row in rows:
        phases = ", ".join(f"{p} {ms}" for p, ms in row["first_call_phase_ms_p50"].items())
        first = row["first_call_ms_p50"]
        print(f"prompt {row['prompt_len']:5d}: add {row['add_ms_p50']}, first call {first} ({phases})")
    if profiler is not None and args.cprofile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
        args.cprofile.write_text(out.getvalue())
    if args.json:
        args.json.write_text(json.dumps({"async_scheduling": engine.is_async, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
