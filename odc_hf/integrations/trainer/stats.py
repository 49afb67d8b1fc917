"""Per-step, per-rank timings of an ODC run: what the logs report and the end-of-run timeline shows.

Each rank measures, per optimizer step, its *busy* time (forward/backward of its microbatches, until its
device is idle) and its *wait* time (inside the minibatch barrier, i.e. idle because a peer is still busy).
The numbers of all ranks are gathered once per step. Bubble rate = 1 - mean(busy) / step time, with step
time = max over ranks of busy + wait (docs/design.md's definition).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path

import torch


class DeviceClock:
    """Timestamps on the device's own timeline: CUDA events on GPUs (no host sync until read), perf_counter on CPU.

    ``mark()`` records a point; ``seconds(a, b)`` reads the time between two marks (on CUDA, only after the events
    have completed, e.g. after a ``torch.cuda.synchronize``).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def document_lengths(microbatch: Mapping) -> list[int]:
    """Token counts of the documents packed in a collated microbatch.

    [] (not timed) for an empty dummy microbatch and for batches that are not packed rows (no ``cu_seq_lens_q``,
    e.g. GRPO's padded microbatches), whose cost is not a sum over documents.
    """
    if microbatch.get("num_label_tokens", 1) == 0 and microbatch["input_ids"].numel() <= 1:
        return []
    bounds = microbatch.get("cu_seq_lens_q")
    if bounds is None:
        return []
    offsets = [int(x) for x in bounds.tolist()]
    return [b - a for a, b in zip(offsets, offsets[1:]) if b > a]


class MicrobatchClock:
    """Forward+backward time of each microbatch, on the device's timeline (read after the step's sync).

    Under ODC a rank never waits for a peer inside a minibatch, so these are the microbatches' own costs.
    """

    def __init__(self, device: torch.device):
        self.clock = DeviceClock(device)
        self.marks = [self.clock.mark()]
        self.docs: list[list[int]] = []

    def lap(self, docs: list[int]) -> None:
        self.marks.append(self.clock.mark())
        self.docs.append(docs)

    def laps(self) -> list[tuple[list[int], float]]:
        """(document lengths, seconds) per real microbatch; call after the device is synchronised."""
        return [
            (docs, self.clock.seconds(a, b))
            for docs, a, b in zip(self.docs, self.marks, self.marks[1:])
            if docs
        ]


@dataclasses.dataclass
class StepStats:
    busy_s: list[float]
    wait_s: list[float]
    microbatches: list[int]
    tokens: list[int]

    @property
    def step_s(self) -> float:
        return max(b + w for b, w in zip(self.busy_s, self.wait_s))

    @property
    def bubble(self) -> float:
        step = self.step_s
        return 1.0 - (sum(self.busy_s) / len(self.busy_s)) / step if step > 0 else 0.0

    @classmethod
    def from_gathered(cls, rows: torch.Tensor) -> StepStats:
        rows = rows.reshape(-1, 4).double().cpu()
        return cls(
            rows[:, 0].tolist(),
            rows[:, 1].tolist(),
            [int(x) for x in rows[:, 2]],
            [int(x) for x in rows[:, 3]],
        )


class RunStats:
    """Collects StepStats; summarises them for logging windows and for the end of the run."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self._window_start = 0

    def add(self, step: StepStats) -> None:
        self.steps.append(step)

    def window(self) -> dict[str, float]:
        """Averages over the steps since the last call (one Trainer logging interval)."""
        steps = self.steps[self._window_start :]
        self._window_start = len(self.steps)
        return summarise(steps)

    def total(self) -> dict[str, float]:
        return summarise(self.steps)


def summarise(steps: list[StepStats]) -> dict[str, float]:
    if not steps:
        return {}
    step_time = sum(s.step_s for s in steps)
    tokens = sum(sum(s.tokens) for s in steps)
    world = len(steps[0].busy_s)
    return {
        "odc/bubble_rate": sum(s.bubble * s.step_s for s in steps) / step_time if step_time else 0.0,
        "odc/tokens_per_s": tokens / step_time if step_time else 0.0,
        "odc/tokens_per_s_per_rank": tokens / step_time / world if step_time else 0.0,
        "odc/step_s": step_time / len(steps),
        "odc/busy_s_mean": sum(sum(s.busy_s) / world for s in steps) / len(steps),
        "odc/busy_s_max": sum(max(s.busy_s) for s in steps) / len(steps),
        "odc/wait_s_mean": sum(sum(s.wait_s) / world for s in steps) / len(steps),
        "odc/microbatches_min": min(min(s.microbatches) for s in steps),
        "odc/microbatches_max": max(max(s.microbatches) for s in steps),
    }


def plot_timeline(steps: list[StepStats], path: str | Path, *, title: str = "ODC per-rank timeline") -> Path:
    """Per-rank busy (compute) and idle (waiting for peers) bars, step after step; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = len(steps[0].busy_s) if steps else 1
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.5 * world))
    start = 0.0
    for step in steps:
        for rank in range(world):
            busy, wait = step.busy_s[rank], step.step_s - step.busy_s[rank]
            ax.barh(rank, busy, left=start, color="tab:green", height=0.6)
            ax.barh(rank, wait, left=start + busy, color="lightgray", height=0.6)
        ax.axvline(start, color="black", lw=0.3)
        start += step.step_s
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_xlabel("seconds (green: forward/backward, grey: waiting at the minibatch barrier)")
    bubble = summarise(steps).get("odc/bubble_rate", 0.0)
    ax.set_title(f"{title}: {len(steps)} steps, bubble rate {bubble:.1%}")
    ax.invert_yaxis()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
