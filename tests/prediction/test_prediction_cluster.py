"""The multi-node step-time model (odc_hf.prediction.cluster / simulate): formulas, limits and monotonicity."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from odc_hf.balance.cost import QuadraticCostModel
from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini
from odc_hf.prediction.cluster import (
    GRAD_BYTES,
    PARAM_BYTES,
    Cluster,
    ModelShape,
    StepOverheads,
    fsdp_full_exposed,
    fsdp_hsdp_exposed,
    odc_all_reduce_seconds,
    rail_collective_seconds,
    ring_all_reduce_seconds,
)
from odc_hf.prediction.cost_models import (
    calibration_from_dict,
    flop_cost_model,
    flop_rate,
    h200_calibration,
    h200_overheads,
    load_cost_model,
    scale_cost_model,
)
from odc_hf.prediction.simulate import plan_steps, step_times, summarize
from odc_hf.prediction.workloads import generate_lengths, qwen2_5_config

COST = QuadraticCostModel(a=0.0, b=3e-5, c=6e-10, floor=0.17)
OVERHEADS = StepOverheads(odc_s_per_param=4e-11, fsdp_s_per_param=2e-11)
BUDGET = 32768
CALIBRATION_2026_12_02 = (
    Path(__file__).parents[2]
    / "benchmarks/results/planning/calibration_qwen2.5-1.5B_h200x1_2026-12-02_flash_attention_4.json"
)


def shape(size="1.5B", tied=True):
    config = qwen2_5_config(size)
    config.tie_word_embeddings = tied
    return ModelShape.from_config(config, name=size)


def planned(world_size, per_rank=4, steps=3, seed=0):
    lengths = generate_lengths("longalign", world_size * per_rank * steps, seed, max_length=BUDGET)
    return lengths, plan_steps(lengths, world_size, per_rank, BUDGET, COST, shuffle=False)


def test_step_time_modules_import_only_numpy_and_stdlib():
    # the step-time model is pure: no torch, transformers, trl, accelerate, datasets (a cheap static check), and
    # so are the cost models in seconds it reads (cost_models.py)
    for name in ("cluster.py", "simulate.py", "cost_models.py"):
        tree = ast.parse((Path(__file__).parents[2] / "odc_hf" / "prediction" / name).read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
        }
        assert roots <= {
            "__future__",
            "math",
            "json",
            "numpy",
            "dataclasses",
            "importlib",
            "pathlib",
            "collections",
        }, roots


@pytest.mark.parametrize("tied", [True, False])
def test_model_shape_counts_the_real_parameters(tied):
    import torch
    import transformers

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=211, tie_word_embeddings=tied)  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    s = ModelShape.from_config(config)
    assert s.num_params == sum(p.numel() for p in model.parameters())
    assert s.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape("1.5B").num_params == 1_543_714_304 and shape("7B", tied=False).num_params == 7_615_616_512


def test_all_reduce_formula_and_odc_shard_bytes():
    assert ring_all_reduce_seconds(1e9, 4, 50.0) == pytest.approx(2 * 3 / 4 * 1e9 / 50e9, rel=1e-15)
    assert ring_all_reduce_seconds(1e9, 1, 50.0) == 0.0
    s, cl = shape(), Cluster(gpus_per_node=8, num_nodes=16, network_gb_per_s=50.0)
    shard_bytes = 4 * (28 * math.ceil(s.layer_params / 8) + math.ceil(s.root_params / 8))
    assert odc_all_reduce_seconds(s, cl) == pytest.approx(2 * 15 / 16 * shard_bytes / 50e9, rel=1e-15)
    _, steps = planned(cl.world_size, per_rank=2, steps=2)
    times = step_times(steps, s, cl, OVERHEADS)
    np.testing.assert_allclose(times["odc_hsdp"]["comm"], odc_all_reduce_seconds(s, cl), rtol=1e-15)


def test_one_node_and_an_infinitely_fast_network_give_the_single_node_planners():
    s = shape()
    lengths, steps = planned(8)
    one = step_times(steps, s, Cluster(gpus_per_node=8, num_nodes=1), OVERHEADS)
    for i in range(len(steps)):
        batch = lengths[i * 32 : (i + 1) * 32]
        odc = plan_lb_mini(batch, 8, BUDGET, COST).predicted_odc_time + OVERHEADS.odc(s, 8)
        fsdp = plan_lb_micro(batch, 8, BUDGET, COST).predicted_fsdp_time + OVERHEADS.fsdp(s, 8)
        assert one["odc_hsdp"]["total"][i] == pytest.approx(odc, rel=1e-12)
        assert one["fsdp2_hsdp"]["total"][i] == pytest.approx(fsdp, rel=1e-12)
        assert one["fsdp2_full"]["total"][i] == pytest.approx(fsdp, rel=1e-12)
    # R nodes with an (almost) infinitely fast network: ODC-HSDP is single-node ODC over all R·S ranks
    _, steps16 = planned(16)
    fast = step_times(steps16, s, Cluster(gpus_per_node=8, num_nodes=2, network_gb_per_s=1e12), OVERHEADS)
    compute = np.array([st.odc_busy.max() for st in steps16])
    np.testing.assert_allclose(fast["odc_hsdp"]["total"], compute + OVERHEADS.odc(s, 8), rtol=1e-9)
    for name in ("fsdp2_full", "fsdp2_hsdp"):
        assert fast[name]["comm"].max() < 1e-9


def test_hsdp_exposure_closed_forms():
    s, cl = shape(), Cluster(gpus_per_node=8, num_nodes=4, network_gb_per_s=50.0)
    block = ring_all_reduce_seconds(GRAD_BYTES * math.ceil(s.layer_params / 8), 4, 50.0)
    root = ring_all_reduce_seconds(GRAD_BYTES * math.ceil(s.root_params / 8), 4, 50.0)
    # long microbatches: each all-reduce hides under the next block's backward except the last block's and root's
    np.testing.assert_allclose(fsdp_hsdp_exposed([10.0], s, cl), block + root, rtol=1e-12)
    # backward per block (0.75 c / L) shorter than one all-reduce: the queue backs up
    c = 0.5 * block * s.num_layers / 0.75
    backward = 0.75 * c / s.num_layers
    expected = s.num_layers * block + root - (s.num_layers - 1) * backward
    np.testing.assert_allclose(fsdp_hsdp_exposed([c], s, cl), expected, rtol=1e-12)


def test_full_sharding_exposure_limits():
    s, cl = shape(), Cluster(gpus_per_node=8, num_nodes=4, network_gb_per_s=50.0)
    gather = rail_collective_seconds(PARAM_BYTES * s.layer_params, cl)
    scatter = rail_collective_seconds(GRAD_BYTES * s.layer_params, cl)
    root_gather = rail_collective_seconds(PARAM_BYTES * s.root_params, cl)
    root_scatter = rail_collective_seconds(GRAD_BYTES * s.root_params, cl)
    n = 32
    assert gather == pytest.approx((n - 1) / n * PARAM_BYTES * s.layer_params / (8 * 50e9), rel=1e-15)
    # no compute: everything on the wire is exposed
    total = root_gather + 2 * s.num_layers * gather + s.num_layers * scatter + root_scatter
    np.testing.assert_allclose(fsdp_full_exposed([0.0], s, cl), total, rtol=1e-12)
    # long compute: only the ends show (root + first block gathers, the backward's first re-gather, last reductions)
    ends = root_gather + 2 * gather + scatter + root_scatter
    np.testing.assert_allclose(fsdp_full_exposed([100.0], s, cl), ends, rtol=1e-9)


def test_monotone_in_bandwidth_and_full_sharding_worse_when_the_network_is_slow():
    s = shape("7B", tied=False)
    _, steps = planned(16, per_rank=2)
    totals = {name: [] for name in ("fsdp2_full", "fsdp2_hsdp", "odc_hsdp")}
    for bw in (0.25, 1.0, 6.25, 25.0, 50.0, 200.0, 1e6):
        times = step_times(steps, s, Cluster(gpus_per_node=8, num_nodes=2, network_gb_per_s=bw), OVERHEADS)
        for name in totals:
            totals[name].append(times[name]["total"])
        if bw <= 1.0:  # communication-bound: full sharding moves (N-1)/N / ((R-1)/R) = 1.875x HSDP's bytes
            assert np.all(times["fsdp2_full"]["total"] > times["fsdp2_hsdp"]["total"])
    for name, series in totals.items():
        assert np.all(np.diff(np.array(series), axis=0) <= 1e-12), name


def test_summary_speedups_are_ratios_of_summed_times():
    s, cl = shape(), Cluster(gpus_per_node=4, num_nodes=2)
    _, steps = planned(8)
    times = step_times(steps, s, cl, OVERHEADS)
    summary = summarize(times)
    for base in ("fsdp2_full", "fsdp2_hsdp"):
        assert summary[f"speedup_vs_{base}"] == pytest.approx(
            times[base]["total"].sum() / times["odc_hsdp"]["total"].sum()
        )
    assert summary["odc_hsdp"]["total_s"] == pytest.approx(times["odc_hsdp"]["total"].mean())
    with pytest.raises(ValueError, match="planned for 8 ranks"):
        step_times(steps, s, Cluster(gpus_per_node=8, num_nodes=2), OVERHEADS)
    with pytest.raises(ValueError, match="do not fill one step"):
        plan_steps(np.arange(1, 10), 8, 4, BUDGET, COST)


def test_shipped_calibration_and_scaling():
    asset = h200_calibration()
    fitted = calibration_from_dict(asset)
    # the new compute path's calibration (2026-12-02, FlashAttention-4): its own fit, a, b, c, floor, as recorded in
    # benchmarks/results and in the asset's provenance: max(0.09925, 0.04798 + 1.4e-05 s + 5.517e-10 s^2)
    assert asset["date"] == "2026-12-02" and fitted == QuadraticCostModel.from_dict(asset)
    assert (fitted.floor, fitted.a) == (pytest.approx(0.09925, abs=5e-6), pytest.approx(0.04798, abs=5e-6))
    assert fitted.b == pytest.approx(1.4004e-5, rel=1e-4) and fitted.c == pytest.approx(5.517e-10, rel=1e-4)
    # the fit is the one of the asset's own timings (what lengths + seconds alone would give)
    refit = QuadraticCostModel.fit(asset["lengths"], asset["seconds"])
    assert refit.to_dict() == pytest.approx(fitted.to_dict(), rel=1e-9)
    # exactly the model the 2026-12-02 simulator reports used (--cost-model <that calibration>)
    for target in (shape("1.5B"), shape("7B", tied=False)):
        shipped, _ = load_cost_model("h200", target)
        assert shipped == load_cost_model(str(CALIBRATION_2026_12_02), target)[0]
    reference = ModelShape(**asset["model_shape"])
    assert {**reference.__dict__, "name": ""} == {**shape("1.5B").__dict__, "name": ""}
    same, text = load_cost_model("h200", shape("1.5B"))
    assert same == fitted and "H200 calibration of Qwen2.5-1.5B (2026-12-02)" in text
    scaled, text = load_cost_model("h200", shape("7B", tied=False))
    assert "scaled by FLOPs" in text
    s7 = shape("7B", tied=False)
    assert scaled.b == pytest.approx(fitted.b * s7.num_matmul_params / reference.num_matmul_params)
    assert scaled.c == pytest.approx(fitted.c * (28 * 3584) / (28 * 1536)) and scaled.floor == fitted.floor
    assert scaled.a == fitted.a  # same number of layers
    identity = scale_cost_model(fitted, reference, reference)  # x N/N: one rounding at most
    assert identity.to_dict() == pytest.approx(fitted.to_dict(), rel=1e-15)
    overheads = h200_overheads()
    assert overheads.odc(reference, 2) == pytest.approx(0.0331) and overheads.fsdp(
        reference, 2
    ) == pytest.approx(0.0153)
    with pytest.raises(ValueError, match="no time unit"):
        load_cost_model("tokens", reference)


def test_a_calibration_file_with_its_model_shape_scales_to_other_shapes(tmp_path):
    # what benchmarks/planning/calibration.py writes: timings, the fit, and the model it timed
    import dataclasses
    import json

    asset = h200_calibration()
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"lengths": asset["lengths"], "seconds": asset["seconds"], **calibration_from_dict(asset).to_dict(),
                                "model_shape": dataclasses.asdict(shape("1.5B"))}))  # fmt: skip
    fitted = calibration_from_dict(asset)
    same, text = load_cost_model(str(path), shape("1.5B"))
    assert same == fitted and "scaled" not in text
    scaled, text = load_cost_model(str(path), shape("7B", tied=False))
    assert "scaled by FLOPs" in text and scaled == scale_cost_model(fitted, shape("1.5B"), shape("7B", tied=False))


def test_flop_cost_model_runs_at_the_calibrations_rate_on_its_longest_sequence():
    asset = h200_calibration()
    fitted, reference = calibration_from_dict(asset), ModelShape(**asset["model_shape"])
    longest = max(asset["lengths"])
    assert longest == 32768
    flops = (
        6.0 * reference.num_matmul_params * longest
        + 6.0 * reference.num_layers * reference.attn_dim * longest**2
    )
    rate = flops / fitted.microbatch_cost([longest])
    assert flop_rate(fitted, reference, length=longest) == pytest.approx(rate, rel=1e-12)
    # below an H200's dense bf16 peak (989 TFLOP/s), and near the measured 32k row's rate (the fit is within 1.2 %
    # there); 6·N / b of a fit with an intercept would give 661 TFLOP/s
    assert rate < 1000e12 and rate == pytest.approx(flops / asset["seconds"][-1], rel=0.012)
    for size, tied in (("1.5B", True), ("7B", False)):
        target = shape(size, tied=tied)
        model, text = load_cost_model("flop", target)
        assert f"{rate / 1e12:.0f} TFLOP/s" in text and "32,768-token" in text
        assert (model.a, model.floor) == (0.0, 0.0)
        assert model.b == pytest.approx(6.0 * target.num_matmul_params / rate, rel=1e-12)
        assert model.c == pytest.approx(6.0 * target.num_layers * target.attn_dim / rate, rel=1e-12)
        # on the reference shape it prices the longest sequence exactly as the calibration does
        if size == "1.5B":
            priced = model.microbatch_cost([longest])
            assert priced == pytest.approx(fitted.microbatch_cost([longest]), rel=1e-12)
    default = flop_cost_model(fitted, reference, reference)
    assert default == flop_cost_model(fitted, reference, reference, length=32768)
    with pytest.raises(ValueError, match="length must be > 0"):
        flop_rate(fitted, reference, length=0)
