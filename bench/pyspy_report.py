"""Where the server processes' Python time goes, from bench/serve_gpu.sh's PYSPY samples (py-spy raw format).

    python3 -m bench.pyspy_report DIR        # DIR holds pyspy_processes.txt and pyspy_<pid>.txt (or .txt.gz)

Per process: the share of samples each thread was seen running, then the functions with the most samples
on top of the stack (self) and anywhere in it (inclusive), as a share of that process's samples. py-spy
records running threads only (no --idle), so a thread's share says how busy it was, not how long it lived.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")  # "func (file:line)" -> func, file


def frame_name(frame: str) -> str:
    match = _FRAME.match(frame)
    return f"{match.group(1)} ({match.group(2)})" if match else frame


def read_stacks(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread, frames outermost first, samples) per line of a raw py-spy file."""
    stacks = []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        thread, _, rest = head.partition(";")
        if count.isdigit():
            stacks.append((thread.rpartition(": ")[2], rest.split(";"), int(count)))  # "thread (tid): name"
    return stacks


def report(path: Path, top: int) -> str:
    stacks = read_stacks(path)
    total = sum(n for _, _, n in stacks) or 1
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for thread, frames, n in stacks:
        threads[thread] += n
        names = [frame_name(f) for f in frames if f]
        own[names[-1] if names else "(no Python frame: native code, or a stack py-spy could not read)"] += n
        for name in set(names):
            inclusive[name] += n
    lines = [f"samples {total}; threads: " + ", ".join(f"{t} {n / total:.0%}" for t, n in threads.most_common())]
    lines += ["  self:"] + [f"    {n / total:6.1%}  {name}" for name, n in own.most_common(top)]
    lines += ["  inclusive:"] + [f"    {n / total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    names = {}
    listing = args.dir / "pyspy_processes.txt"
    for line in listing.read_text().splitlines() if listing.exists() else []:
        pid, _, command = line.partition(" ")
        names[pid] = command.strip()
    for path in sorted([*args.dir.glob("pyspy_*.txt"), *args.dir.glob("pyspy_*.txt.gz")]):
        pid = path.name.split(".")[0].removeprefix("pyspy_")
        if pid.isdigit():
            print(f"== {pid}: {names.get(pid, '?')}\n{report(path, args.top)}\n")


if __name__ == "__main__":
    main()
