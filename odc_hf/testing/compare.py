"""Comparing two runs' per-step records (losses, gradient norms) within the CPU tests' tolerances, and the markdown
table of such checks: shared by benchmarks/sft/trainer_checks.py and tests/benchmark_runs/test_trainer_checks.py."""

from __future__ import annotations

import math

LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-7, 1e-4


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(name: str, a: list[dict], b: list[dict], steps=None) -> dict:
    """Per-step loss / grad_norm relative differences of two log histories (optionally only ``steps``)."""
    a = {h["step"]: h for h in a if steps is None or h["step"] in steps}
    b = {h["step"]: h for h in b if steps is None or h["step"] in steps}
    if not a or sorted(a) != sorted(b):
        return {"name": name, "ok": False, "why": f"steps differ: {sorted(a)} vs {sorted(b)}"}
    # relative differences where the loss is not ~0 (GRPO's first on-policy step is 0 up to rounding), else absolute
    loss = max((rel(a[s]["loss"], b[s]["loss"]) for s in a if abs(b[s]["loss"]) > LOSS_ATOL), default=0.0)
    loss_abs = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    grad = max(rel(a[s]["grad_norm"], b[s]["grad_norm"]) for s in a if "grad_norm" in a[s])
    finite = all(math.isfinite(a[s]["loss"]) and math.isfinite(b[s]["loss"]) for s in a)
    close = all(abs(a[s]["loss"] - b[s]["loss"]) <= max(LOSS_RTOL * abs(b[s]["loss"]), LOSS_ATOL) for s in a)
    ok = finite and close and grad <= GRAD_RTOL
    return {"name": name, "ok": ok, "steps": len(a), "max_rel_loss": loss, "max_abs_loss": loss_abs,
            "max_rel_grad_norm": grad, "losses": [a[s]["loss"] for s in sorted(a)],
            "reference_losses": [b[s]["loss"] for s in sorted(b)],
            "why": "" if ok else (f"loss {loss:.2e} rel / {loss_abs:.2e} abs (<= {LOSS_RTOL} rel or {LOSS_ATOL} abs), "
                                  f"grad norm {grad:.2e} (<= {GRAD_RTOL}), finite {finite}")}  # fmt: skip


def check_rows(results: list[dict]) -> list[list[str]]:
    """One table row per check: ``[name, ok, max rel. loss diff, max abs. loss diff, max rel. grad-norm diff, notes]``,
    for a :func:`compare` result or any dict with ``name``, ``ok`` and optional notes."""
    rows = []
    for r in results:
        notes = []
        if "uneven_steps" in r:
            notes.append(f"{r['uneven_steps']} steps with uneven microbatch counts")
        if "exact" in r:
            notes.append("bitwise equal" if r["exact"] else "not bitwise equal")
        if r.get("warm_up"):
            w = r["warm_up"]
            notes.append(f"{w['shapes']} shapes planned in {w['seconds']:.1f} s ({w['dtype']})")
        if "losses" in r and "reference_losses" not in r:
            notes.append("losses " + ", ".join(f"{x:.3g}" for x in r["losses"]))
        if r.get("microbatches"):
            notes.append(f"microbatches per rank {r['microbatches']}")
        if r.get("why"):
            notes.append(r["why"])
        cells = [f"{r[k]:.1e}" if k in r else "—" for k in ("max_rel_loss", "max_abs_loss", "max_rel_grad_norm")]
        rows.append([r["name"], "yes" if r["ok"] else "**no**", *cells, "; ".join(notes)])
    return rows
