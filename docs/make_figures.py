"""Draw the figures of docs/how_odc_works.md into docs/images/ (deterministic; needs matplotlib only).

    python docs/make_figures.py

The timelines are schematic: costs are in arbitrary units, communication time is not drawn, and each
microbatch is drawn as ``LAYERS`` forward blocks then ``LAYERS`` backward blocks (backward = 2x forward).
The samples are the same in both panels; only the semantics differ:

* FSDP2 + LB-Micro: every rank runs the same number of microbatches, and all ranks meet at every layer
  (an all-gather before each layer, a reduce-scatter after each layer's backward), so each layer lasts as
  long as the slowest rank's;
* ODC + LB-Mini: each rank runs its own share (here 2 and 3 microbatches of equal total cost) without
  meeting the other, then both meet once (finish_minibatch), step, and meet again after publishing.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle  # noqa: E402

OUT = Path(__file__).resolve().parent / "images"
LAYERS = 3
FWD, BWD, IDLE, STEP, BARRIER = "#9ecae1", "#3182bd", "#e0e0e0", "#74c476", "#d62728"
STEP_COST = 0.6
# Samples of one minibatch (cost units): 4, 2, 2, 1, 1 -> 10 in all, 5 per rank at best.
FSDP_PLAN = [[4.0, 2.0], [2.0, 2.0]]  # LB-Micro: 2 microbatches each, similar costs per index
ODC_PLAN = [[4.0, 1.0], [2.0, 2.0, 1.0]]  # LB-Mini: equal compute, 2 and 3 microbatches
SAVE = dict(dpi=130, metadata={"Software": None})  # no version string: same bytes on every run


def _blocks(cost: float) -> list[tuple[float, str]]:
    """(duration, colour) of each layer block of one microbatch: forward layers, then backward layers."""
    fwd = cost / 3.0 / LAYERS
    return [(fwd, FWD)] * LAYERS + [(2.0 * fwd, BWD)] * LAYERS


def _bar(ax, rank: int, start: float, width: float, colour: str, hatch: str | None = None) -> None:
    ax.add_patch(Rectangle((start, rank - 0.3), width, 0.6, facecolor=colour, edgecolor="white", lw=0.6,
                           hatch=hatch))  # fmt: skip


def _fsdp(ax) -> float:
    t = 0.0
    for index in range(len(FSDP_PLAN[0])):
        per_rank = [_blocks(FSDP_PLAN[r][index]) for r in range(2)]
        for b in range(len(per_rank[0])):
            longest = max(per_rank[r][b][0] for r in range(2))
            for r in range(2):
                width, colour = per_rank[r][b]
                _bar(ax, r, t, width, colour)
                if width < longest:
                    _bar(ax, r, t + width, longest - width, IDLE, "///")
            t += longest
            ax.plot([t, t], [-0.45, 1.45], color="black", lw=0.6, ls=":")
    for r in range(2):
        _bar(ax, r, t, STEP_COST, STEP)
    return t + STEP_COST


def _odc(ax) -> float:
    ends = []
    for r in range(2):
        t = 0.0
        for cost in ODC_PLAN[r]:
            for width, colour in _blocks(cost):
                _bar(ax, r, t, width, colour)
                t += width
            ax.plot([t, t], [r - 0.3, r + 0.3], color="white", lw=2.0)  # microbatch boundary
        ends.append(t)
    barrier = max(ends)
    for r in range(2):
        if ends[r] < barrier:
            _bar(ax, r, ends[r], barrier - ends[r], IDLE, "///")
        _bar(ax, r, barrier, STEP_COST, STEP)
    labels = (
        (barrier, "finish_minibatch(): minibatch barrier ", "right"),
        (barrier + STEP_COST, " publish(): publish barrier", "left"),
    )
    for x, label, align in labels:
        ax.plot([x, x], [-0.75, 1.45], color=BARRIER, lw=2.2)
        ax.text(x, -0.6, label, ha=align, va="center", fontsize=8, color=BARRIER)
    for r in range(2):
        ax.text(barrier + STEP_COST + 0.1, r, f"{len(ODC_PLAN[r])} microbatches", va="center", fontsize=8)
    return barrier + STEP_COST


def timeline() -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.6), sharex=True)
    fsdp_end = _fsdp(axes[0])
    odc_end = _odc(axes[1])
    busy = sum(sum(p) for p in FSDP_PLAN) / 2
    titles = (
        f"FSDP2 (LB-Micro, 2 microbatches per rank): all ranks meet at every layer; step {fsdp_end:.1f}, "
        f"idle {1 - (busy + STEP_COST) / fsdp_end:.0%}",
        f"ODC (LB-Mini, 2 and 3 microbatches): one meeting per minibatch; step {odc_end:.1f}",
    )
    for ax, title in zip(axes, titles):
        ax.set_ylim(1.6, -0.9)
        ax.set_yticks([0, 1], ["rank 0", "rank 1"])
        ax.set_title(title, fontsize=10, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlim(0, max(fsdp_end, odc_end) + 0.2)
    axes[1].set_xlabel("time (cost units; communication not drawn)")
    handles = [Patch(facecolor=FWD, label="forward (one block per layer)"),
               Patch(facecolor=BWD, label="backward (one block per layer)"),
               Patch(facecolor=IDLE, hatch="///", label="idle: waiting for the other rank"),
               Patch(facecolor=STEP, label="clip + optimizer step"),
               plt.Line2D([], [], color="black", ls=":", label="per-layer collective (FSDP2)"),
               plt.Line2D([], [], color=BARRIER, lw=2.2, label="ODC barrier")]  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = OUT / "timeline_fsdp_vs_odc.png"
    fig.savefig(path, **SAVE)
    plt.close(fig)
    return path


def _box(ax, x, y, w, h, text, colour, *, fontsize=8.5, bold=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=colour,
                                edgecolor="#444444", lw=0.8))  # fmt: skip
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
            fontweight="bold" if bold else "normal")  # fmt: skip
    return (x, y, w, h)


def _arrow(ax, start, end, text="", *, colour="#333333", rad=0.0, text_xy=None, ls="-"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=colour, lw=1.4,
                                 connectionstyle=f"arc3,rad={rad}", linestyle=ls))  # fmt: skip
    if text:
        x, y = text_xy if text_xy is not None else ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(x, y, text, ha="center", va="center", fontsize=8, color=colour,
                bbox=dict(facecolor="white", edgecolor="none", pad=1.0))  # fmt: skip


def data_path() -> Path:
    fig, ax = plt.subplots(figsize=(11, 6.4))
    ax.set_xlim(0, 11.4)
    ax.set_ylim(0, 6.4)
    ax.axis("off")
    # Two ranks; the buffers of one FSDP unit (one transformer block, say).
    for x0, rank in ((0.2, 0), (6.6, 1)):
        ax.add_patch(Rectangle((x0, 0.2), 4.6, 5.55, facecolor="#fafafa", edgecolor="#999999", lw=1.0))
        ax.text(x0 + 2.3, 5.45, f"rank {rank}", ha="center", fontsize=11, fontweight="bold")
    x, w, h = 0.9, 3.6, 0.75
    param0 = _box(ax, x, 4.35, w, h, "sharded parameter (fp32 master)\nowned by the optimizer", "#fff2cc")
    stage0 = _box(ax, x, 3.3, w, h, "staging buffer (param dtype, e.g. bf16)\npeers read it", "#dae8fc")
    accum0 = _box(ax, x, 2.25, w, h, "fp32 accumulator = param.grad\n(after finish_minibatch)", "#f8cecc")
    ax.text(x + w, 1.98, "FSDP's per-layer buffers (transient)", ha="right", fontsize=7.5, color="#666666")
    ag0 = _box(ax, x, 1.15, w, 0.7, "", "#ffffff")
    rs0 = _box(ax, x, 0.35, w, 0.7, "", "#ffffff")
    for (bx, by, bw, bh), name in ((ag0, "all-gather output"), (rs0, "reduce-scatter input")):
        ax.plot([bx + bw / 2, bx + bw / 2], [by, by + bh], color="#444444", lw=0.8)
        ax.text(bx + bw / 4, by + bh / 2, f"{name}\nrow 0", ha="center", va="center", fontsize=7.5)
        ax.text(bx + 3 * bw / 4, by + bh / 2, f"{name}\nrow 1", ha="center", va="center", fontsize=7.5)
    x1 = 7.1
    param1 = _box(ax, x1, 4.35, w, h, "sharded parameter (fp32 master)", "#fff2cc")
    stage1 = _box(ax, x1, 3.3, w, h, "staging buffer", "#dae8fc")
    accum1 = _box(ax, x1, 2.25, w, h, "fp32 accumulator", "#f8cecc")
    ax.text(x1 + w / 2, 1.2, "rank 1 runs the same data path\ntowards rank 0 (not drawn)", ha="center",
            fontsize=8, color="#666666")  # fmt: skip

    def top(b, f=0.5):
        return (b[0] + b[2] * f, b[1] + b[3])

    def bottom(b, f=0.5):
        return (b[0] + b[2] * f, b[1])

    def left(b, f=0.5):
        return (b[0], b[1] + b[3] * f)

    def right(b, f=0.5):
        return (b[0] + b[2], b[1] + b[3] * f)

    blue, red, green, purple = "#1f4e99", "#b22222", "#2e7d32", "#7b3294"
    for param, stage in ((param0, stage0), (param1, stage1)):
        _arrow(ax, bottom(param, 0.12), top(stage, 0.12), colour=green)
        ax.text(param[0] + param[2] * 0.12 + 0.12, (param[1] + stage[1] + stage[3]) / 2,
                "1 publish(): cast + copy", ha="left", va="center", fontsize=7.5,
                color=green)  # fmt: skip
    _arrow(ax, left(stage1, 0.35), right(ag0, 0.75), "2 gather: one-sided read of\nrank 1's published shard",
           colour=blue, text_xy=(5.7, 2.55))  # fmt: skip
    _arrow(ax, right(rs0, 0.4), bottom(accum1, 0.2), "3 scatter-accumulate:\nrow 1 added into rank 1's\n"
           "fp32 accumulator", colour=red, rad=0.25, text_xy=(5.7, 0.8))  # fmt: skip
    _arrow(ax, left(rs0, 0.5), left(accum0, 0.5), colour=red, rad=-0.5)
    ax.text(x - 0.1, 2.04, "3 own row too", fontsize=7.5, color=red, ha="left", va="center")
    _arrow(ax, right(accum0, 0.7), right(param0, 0.3), "4 finish_minibatch():\nbarrier, then\nparam.grad = view",
           colour=purple, rad=0.55, text_xy=(5.15, 3.85))  # fmt: skip
    ax.text(5.7, 6.05, "Per minibatch: 2 and 3 for every layer of every microbatch (any count per rank), 4 once, "
            "then clip, optimizer.step(), 1 + publish barrier", ha="center", fontsize=8.5)  # fmt: skip
    path = OUT / "data_path.png"
    fig.savefig(path, bbox_inches="tight", **SAVE)
    plt.close(fig)
    return path


def memory() -> Path:
    """Bytes per parameter on each rank at the optimizer step (divide by the world size W), AdamW, fp32 master
    weights, bf16 all-gathers, fp32 reduce (FSDP reduce_dtype = parameter dtype, so the accumulator replaces
    FSDP2's gradient shard): FSDP2 vs ODC on CUDA. Activations and transient per-layer buffers not included."""
    rows = {
        "FSDP2": [("fp32 params", 4, "#fff2cc"), ("fp32 grad shard", 4, "#f4cccc"), ("AdamW state", 8, "#d9ead3")],
        "ODC (CUDA,\nfp32 reduce)": [("fp32 params", 4, "#fff2cc"), ("fp32 accumulator\n(= the grad)", 4, "#f8cecc"),
                       ("AdamW state", 8, "#d9ead3"), ("bf16\nstaging", 2, "#dae8fc")],
    }  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 2.4))
    for y, parts in enumerate(rows.values()):
        x = 0.0
        for label, nbytes, colour in parts:
            ax.barh(y, nbytes, left=x, color=colour, edgecolor="#444444", lw=0.6)
            ax.text(x + nbytes / 2, y, f"{label}\n{nbytes} B", ha="center", va="center", fontsize=7.5)
            x += nbytes
        ax.text(x + 0.2, y, f"{x:g} B / W", va="center", fontsize=9)
    ax.set_yticks([0, 1], list(rows))
    ax.set_ylim(1.6, -0.6)
    ax.set_xlim(0, 21)
    ax.set_xticks(range(0, 21, 2))
    ax.set_xlabel(
        "bytes per model parameter on each of W ranks at the optimizer step (activations not included)"
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    path = OUT / "memory.png"
    fig.savefig(path, **SAVE)
    plt.close(fig)
    return path


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for make in (timeline, data_path, memory):
        print(f"wrote {make().relative_to(OUT.parent.parent)}")


if __name__ == "__main__":
    main()
