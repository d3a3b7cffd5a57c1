"""What every bench script shares: measurements, percentiles, tables and plots."""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
EOG_IDS = (0, 2, 4)  # SmolLM2's end-of-generation tokens, banned to make every request equal work
NO_EOG = {token: float("-inf") for token in EOG_IDS}

_TOPICS = [
    "a dragon who learned to bake bread",
    "the history of the printing press",
    "ten tips for a good night's sleep",
    "a letter to my younger self",
    "the recipe for a perfect pancake",
    "cities in the year 3000",
    "the rules of chess",
    "a lighthouse keeper and a storm",
    "how volcanoes form",
    "a robot that paints portraits",
    "the first day at a new school",
    "why the sky is blue",
    "a journey across the desert",
    "the life of a honeybee",
    "a detective in a rainy city",
    "building a wooden boat",
]


def prompts(n: int, tag: str) -> list[str]:
    """``n`` distinct short prompts; ``tag`` makes each run's prompts unique, so no
    system gets a prefix-cache hit from an earlier run."""
    return [f"[{tag}.{i}] Write about {_TOPICS[i % len(_TOPICS)]}:" for i in range(n)]


def run_threads(targets: Sequence[Callable[[], None]]) -> None:
    """Run every target in its own thread at once; the first exception is raised
    after all of them end."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Measurement:
    """One system at one concurrency, pooled over rounds."""

    system: str
    concurrency: int
    tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)

    def add(self, other: Measurement) -> None:
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.ttft_ms += other.ttft_ms
        self.itl_ms += other.itl_ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def row(self) -> list[str]:
        return [
            self.system,
            str(self.concurrency),
            f"{self.tokens_per_s:.1f}",
            f"{percentile(self.ttft_ms, 50):.0f}",
            f"{percentile(self.ttft_ms, 95):.0f}",
            f"{percentile(self.itl_ms, 50):.1f}",
            f"{percentile(self.itl_ms, 95):.1f}",
        ]


def timings_to_measurement(
    system: str, concurrency: int, t_start: float, requests: Sequence[tuple[float, Sequence[float]]]
) -> Measurement:
    """Build a measurement from per-request (t_sent, token arrival times) in seconds."""
    m = Measurement(system, concurrency)
    t_end = t_start
    for t_sent, arrivals in requests:
        if not arrivals:
            continue
        m.tokens += len(arrivals)
        m.ttft_ms.append((arrivals[0] - t_sent) * 1000.0)
        m.itl_ms += [(b - a) * 1000.0 for a, b in itertools.pairwise(arrivals)]
        t_end = max(t_end, arrivals[-1])
    m.wall_s = t_end - t_start
    return m


def machine() -> str:
    """One line naming the machine the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{datetime.date.today().isoformat()}, {cores} cores, {cpu}, Python {platform.python_version()}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_result(name: str, text: str, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(text)
    return path


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib's pyplot on a file-only back end, or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, title: str = "") -> None:
    """Title the figure with the machine, write it as a PNG and free it."""
    fig.suptitle(f"{title}{machine()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
