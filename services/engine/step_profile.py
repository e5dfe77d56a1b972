"""Where a step's time goes: host phases timed with perf_counter, GPU phases with CUDA events.

Off by default (`EngineConfig.profile_steps`). Steps are kept apart by kind, since a decode step
replayed from a CUDA graph and an eager prefill/mixed step have little in common:

    host   schedule | prepare (inputs, copies) | forward (launch) | sample (metadata, launch, copy out)
           | update (scheduler, placeholders) | wait (for the GPU) | output (tokens, stops, deltas)
    gpu    forward | sample          (read once the step's results are on the host: no extra sync)
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

HOST_PHASES = ("schedule", "prepare", "forward", "sample", "update", "wait", "output")
GPU_PHASES = ("forward", "sample")


@dataclass(slots=True)
class GpuMarks:
    """Events around a step's forward and sampling (recorded only when profiling)."""

    start: torch.cuda.Event
    forward_done: torch.cuda.Event
    sample_done: torch.cuda.Event

    @classmethod
    def create(cls) -> GpuMarks:
        return cls(*(torch.cuda.Event(enable_timing=True) for _ in range(3)))

    def elapsed_ms(self) -> dict[str, float]:  # call after the step's results reached the host
        return {
            "forward": self.start.elapsed_time(self.forward_done),
            "sample": self.forward_done.elapsed_time(self.sample_done),
        }


@dataclass(slots=True)
class PhaseClock:
    """Charges the wall time between marks to named phases (`seconds`); does nothing when not enabled."""

    enabled: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _last: float = 0.0

    def start(self) -> None:
        if self.enabled:
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark (or start) to `phase`."""
        if self.enabled:
            now = time.perf_counter()
            self.seconds[phase] += now - self._last
            self._last = now


@dataclass(slots=True)
class StepProfile(PhaseClock):
    """Sums per kind of step ("graph": a decode batch replayed from a CUDA graph, "eager": the rest).
    `seconds` holds the current engine call's phases until `end_call` charges them to its kind.

    An engine call with overlap launches step N+1 and finishes step N; its host time goes to the
    kind of the step it launched (in steady state both have the same kind)."""

    num_steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    num_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    host_s: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    gpu_ms: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    def end_call(self, kind: str) -> None:
        if self.enabled:
            for phase, seconds in self.seconds.items():
                self.host_s[kind][phase] += seconds
            self.seconds.clear()

    def count_step(self, kind: str, num_tokens: int, marks: GpuMarks | None) -> None:
        """A step's results arrived: count it, with its GPU times."""
        if self.enabled:
            self.num_steps[kind] += 1
            self.num_tokens[kind] += num_tokens
            if marks is not None:
                for phase, ms in marks.elapsed_ms().items():
                    self.gpu_ms[kind][phase] += ms

    def reset(self) -> None:
        for table in (self.num_steps, self.num_tokens, self.host_s, self.gpu_ms, self.seconds):
            table.clear()

    def summary(self) -> dict[str, Any]:
        """Per kind: step count, tokens per step, and mean milliseconds per step for every phase."""
        out: dict[str, Any] = {}
        for kind, num in self.num_steps.items():
            host = {p: round(self.host_s[kind][p] * 1e3 / num, 3) for p in HOST_PHASES}
            gpu = {p: round(self.gpu_ms[kind][p] / num, 3) for p in GPU_PHASES if p in self.gpu_ms[kind]}
            out[kind] = {
                "steps": num,
                "tokens_per_step": round(self.num_tokens[kind] / num, 1),
                "host_ms": host,
                "host_total_ms": round(sum(host.values()), 3),
                "gpu_ms": gpu,
            }
        return out


@dataclass(slots=True)
class LoopProfile(PhaseClock):
    """The engine service's loop around `Engine.step` (off unless steps are profiled): what a served step costs
    the compute thread besides the step itself, and the CPU each of the service's two threads used (at exit).
    The service logs both profiles each time it falls idle (one line per busy period) and at exit.

        inbox    taking new requests and aborts from the I/O thread (never counting an idle wait)
        step     Engine.step (its own phases: StepProfile)
        publish  the step's tokens grouped per gateway and handed to the I/O thread, metrics
        room     load snapshot, how many requests to read next, KV events
    """

    num_steps: int = 0
    thread_cpu_s: dict[str, float] = field(default_factory=dict)  # thread name -> CPU seconds, at the end

    def note_thread_cpu(self, name: str) -> None:
        """Called on the thread itself as it ends."""
        if self.enabled:
            self.thread_cpu_s[name] = round(time.thread_time(), 3)

    def reset(self) -> None:
        self.seconds.clear()
        self.num_steps = 0

    def summary(self) -> dict[str, Any]:
        per_step = {p: round(s * 1e3 / max(self.num_steps, 1), 3) for p, s in self.seconds.items()}
        return {"steps": self.num_steps, "ms_per_step": per_step, "thread_cpu_s": dict(self.thread_cpu_s)}
