"""What the ODC trainers plan their microbatches with: the cost model ``ODCConfig.cost_model`` names."""

from __future__ import annotations

import json
from pathlib import Path

from odc_hf.balance import CostModel, FlopCostModel, QuadraticCostModel, TokenCostModel
from odc_hf.integrations.compute_path import ComputePath, check_recorded


def cost_model(choice: str, model=None, compute: ComputePath | None = None) -> CostModel:
    """The cost model of ``ODCConfig.cost_model`` = ``choice``: ``flop`` (from ``model``'s config), ``tokens``, or a
    JSON file: coefficients, single-document timings, or a run's ``odc_microbatch_timings.json`` (fitted here). A
    file measured on another compute path than ``compute`` is a warning (:func:`~odc_hf.integrations.compute_path.
    check_recorded`)."""
    if choice == "flop":
        return FlopCostModel.from_config(model.config)
    if choice == "tokens":
        return TokenCostModel()
    data = json.loads(Path(choice).read_text())
    check_recorded(data, compute, choice)
    if all(k in data for k in "abc"):
        return QuadraticCostModel.from_dict(data)
    if "lengths" in data and "seconds" in data:  # raw timings: fit them
        return QuadraticCostModel.fit(data["lengths"], data["seconds"])
    if "microbatches" in data and "seconds" in data:  # a run's odc_microbatch_timings.json
        return QuadraticCostModel.fit_microbatches(data["microbatches"], data["seconds"])
    raise ValueError(
        f"{choice}: expected a JSON object with a, b, c and optionally floor (or lengths and seconds, or "
        "microbatches and seconds, to fit)"
    )
