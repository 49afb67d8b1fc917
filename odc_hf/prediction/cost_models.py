"""Cost models in seconds for the step-time model (:mod:`.simulate`): the H200 calibration shipped in
``odc_hf/assets``, a user's calibration JSON, and both carried to other model shapes by FLOPs.

:func:`load_cost_model` is what ``python -m odc_hf.estimate --cost-model`` and the simulators read: ``"h200"`` (the
shipped calibration, scaled by :func:`scale_cost_model`), ``"flop"`` (:func:`flop_cost_model`) or a JSON path
(:func:`calibration_from_dict`); :func:`h200_overheads` gives the per-step overheads measured with it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..balance.cost import QuadraticCostModel
from .cluster import ModelShape, StepOverheads

__all__ = [
    "calibration_from_dict",
    "flop_cost_model",
    "flop_rate",
    "h200_calibration",
    "h200_overheads",
    "load_cost_model",
    "scale_cost_model",
]

H200_ASSET = "h200_calibration_qwen2.5-1.5B.json"


def h200_calibration() -> dict:
    """The measured H200 calibration shipped with odc_hf (Qwen2.5-1.5B shape, odc_hf's default compute path):
    timings, their fit (``a, b, c, floor``), provenance, overheads."""
    return json.loads(resources.files("odc_hf").joinpath("assets", H200_ASSET).read_text())


def calibration_from_dict(data: dict, *, where: str = "cost model") -> QuadraticCostModel:
    """The JSON forms ``ODCConfig.cost_model`` accepts: ``a, b, c[, floor]``; ``lengths`` + ``seconds``;
    ``microbatches`` + ``seconds`` (a run's ``odc_microbatch_timings.json``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if all(k in data for k in "abc"):
        return QuadraticCostModel.from_dict(data)
    if "lengths" in data and "seconds" in data:
        return QuadraticCostModel.fit(data["lengths"], data["seconds"])
    if "microbatches" in data and "seconds" in data:
        return QuadraticCostModel.fit_microbatches(data["microbatches"], data["seconds"])
    raise ValueError(
        f"{where}: expected a JSON object with a, b, c and optionally floor (or lengths and seconds, or "
        f"microbatches and seconds, to fit); got keys {sorted(data)}"
    )


def scale_cost_model(
    model: QuadraticCostModel, reference: ModelShape, target: ModelShape
) -> QuadraticCostModel:
    """A calibration measured on ``reference`` carried to ``target`` by the FLOP model's ratios.

    ``b`` (seconds per token) scales with the matmul parameters N, ``c`` (per token²) with layers x heads x
    head_dim, ``a`` and ``floor`` (launch-bound host time: kernels per layer) with the number of layers. Same
    device, same kernels, same efficiency: larger matmuls usually run at a higher fraction of peak (7B vs 1.5B
    on one H200: 59 % vs 52 % MFU), so for larger models this over-estimates compute by about that ratio.
    """
    layers = target.num_layers / reference.num_layers
    return QuadraticCostModel(
        a=model.a * layers,
        b=model.b * target.num_matmul_params / reference.num_matmul_params,
        c=model.c * (target.num_layers * target.attn_dim) / (reference.num_layers * reference.attn_dim),
        floor=model.floor * layers,
    )


def flop_rate(reference_model: QuadraticCostModel, reference: ModelShape, *, length: int = 32768) -> float:
    """FLOP/s the reference calibration reaches on one ``length``-token sequence: its FLOPs
    ``6·N·s + 6·L·d·s²`` divided by the seconds ``reference_model`` prices that sequence at."""
    if length <= 0:
        raise ValueError(f"flop_rate: length must be > 0, got {length}")
    flops = (
        6.0 * reference.num_matmul_params * length
        + 6.0 * reference.num_layers * reference.attn_dim * length**2
    )
    return flops / reference_model.microbatch_cost([length])


def flop_cost_model(
    reference_model: QuadraticCostModel, reference: ModelShape, target: ModelShape, *, length: int = 32768
) -> QuadraticCostModel:
    """Pure FLOPs ``6·N·s + 6·L·d·s²`` at the throughput the reference calibration reaches on long sequences:
    :func:`flop_rate` at ``length`` tokens (the calibration's longest length; 32,768 for the shipped one). No
    launch floor, no per-microbatch overhead.

    Not ``6·N_ref / b_ref``: a fit with a per-microbatch intercept ``a`` has a smaller per-token ``b`` than the
    long-sequence throughput implies (the shipped 2026-12-02 fit gives 661 TFLOP/s that way, above what the GPU
    reached; at 32,768 tokens the fit gives 528 TFLOP/s and the measured row 530)."""
    flops_per_s = flop_rate(reference_model, reference, length=length)
    return QuadraticCostModel(
        a=0.0,
        b=6.0 * target.num_matmul_params / flops_per_s,
        c=6.0 * target.num_layers * target.attn_dim / flops_per_s,
    )


def load_cost_model(spec: str, shape: ModelShape) -> tuple[QuadraticCostModel, str]:
    """``(cost model in seconds, description)`` for ``spec``: ``"h200"`` (the shipped calibration, scaled to
    ``shape`` by FLOPs when the shape differs), ``"flop"`` (:func:`flop_cost_model` at the calibration's rate on its
    longest sequence, :func:`flop_rate`), or a calibration JSON path
    (used as is: it was measured on your model and GPU)."""
    if spec in ("h200", "flop"):
        asset = h200_calibration()
        reference = ModelShape(**asset["model_shape"])
        measured = calibration_from_dict(asset)
        if spec == "flop":
            length = max(asset["lengths"])
            model = flop_cost_model(measured, reference, shape, length=length)
            rate = flop_rate(measured, reference, length=length) / 1e12
            return (
                model,
                f"FLOP model at {rate:.0f} TFLOP/s (the H200 calibration's rate on one {length:,}-token sequence): "
                f"{model.describe()}",
            )
        same = (reference.num_matmul_params, reference.num_layers, reference.attn_dim) == (
            shape.num_matmul_params,
            shape.num_layers,
            shape.attn_dim,
        )
        if same:
            return measured, f"H200 calibration of {reference.name} ({asset['date']}): {measured.describe()}"
        model = scale_cost_model(measured, reference, shape)
        return model, (
            f"H200 calibration of {reference.name} ({asset['date']}) scaled by FLOPs to {shape.name}: "
            f"{model.describe()}"
        )
    if spec == "tokens":
        raise ValueError("cost model 'tokens' has no time unit: use 'h200', 'flop' or a calibration .json")
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"cost model {spec!r} is neither 'h200', 'flop' nor an existing calibration .json file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{spec}: not valid JSON ({err})") from None
    model = calibration_from_dict(data, where=spec)
    if isinstance(data, dict) and isinstance(data.get("model_shape"), dict):
        # a calibration that names its model (benchmarks/planning/calibration.py): scaled by FLOPs to other shapes, as the
        # shipped one is
        reference = ModelShape(**data["model_shape"])
        if (reference.num_matmul_params, reference.num_layers, reference.attn_dim) != (
            shape.num_matmul_params,
            shape.num_layers,
            shape.attn_dim,
        ):
            model = scale_cost_model(model, reference, shape)
            return model, f"calibration {path.name} of {reference.name} scaled by FLOPs to {shape.name}: {model.describe()}"
        return model, f"calibration {path.name} of {reference.name}: {model.describe()}"
    return model, f"your calibration {path.name}: {model.describe()}"


def h200_overheads() -> StepOverheads:
    """Per-parameter step overheads shipped with the calibration: measured on 2 x H200 (2026-11-29, old compute path;
    the optimizer step does not depend on it), see the asset's ``step_overhead.source``."""
    data = h200_calibration()["step_overhead"]
    per_gpu = data["params_per_gpu"]
    return StepOverheads(
        odc_s_per_param=data["odc_s"] / per_gpu,
        fsdp_s_per_param=data["fsdp2_s"] / per_gpu,
        source=data["source"],
    )
