"""The step-time model's parts one by one (odc_hf.prediction.simulate / cluster / lockstep / cost_models): each
candidate assembled from its planned compute, exposed communication and overhead; the speedup's spread; the bound
of a lockstep plan; calibrations read and carried to other shapes; the shapes, clusters, plans and files they refuse,
by their words."""

import math

import numpy as np
import pytest
import transformers

from odc_hf.balance.cost import QuadraticCostModel
from odc_hf.balance.sampler import ODCBatchSampler
from odc_hf.prediction.cluster import (
    GRAD_BYTES,
    Cluster,
    ModelShape,
    StepOverheads,
    fsdp_full_exposed,
    fsdp_hsdp_exposed,
    odc_all_reduce_seconds,
    rail_collective_seconds,
    sharded_state_bytes,
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
from odc_hf.prediction.lockstep import lockstep_cost_matrix, padded_tokens, padding_waste
from odc_hf.prediction.simulate import makespan_bound, plan_steps, step_times, summarize

SHAPE = ModelShape(name="tiny", num_layers=4, layer_params=1_000_003, root_params=500_001, num_matmul_params=4_000_000,
                   attn_dim=64)  # fmt: skip
COST = QuadraticCostModel(a=0.002, b=1e-4, c=1e-8)
OVERHEADS = StepOverheads(odc_s_per_param=3e-9, fsdp_s_per_param=2e-9)


def _lengths(n, seed=0):
    return np.random.default_rng(seed).integers(50, 4000, size=n)


def test_each_candidate_is_its_planned_compute_plus_its_exposed_communication_plus_its_overhead():
    """Two nodes of 4 GPUs, 3 steps, a lockstep plan (each rank its own samples, one per slot), forward fraction 0.4
    (not the default): FSDP2's compute is the sum over microbatch indices of the slowest rank, its communication each
    microbatch's exposure summed per step, its overhead the parameters held over S GPUs (HSDP) or all N (full);
    ODC's compute the busiest rank, one all-reduce, its overhead over S; the bound the planner's bound plus the least
    overhead (killed: the HSDP overhead over N, the default forward fraction, per-step sums shifted by one)."""
    # microbatches of a few milliseconds on a 1 GB/s network: compute hides part of the queue, how much depends on
    # the forward/backward split
    cluster = Cluster(gpus_per_node=4, num_nodes=2, network_gb_per_s=1.0)
    cost = QuadraticCostModel(a=1e-4, b=1e-6, c=1e-10)
    world, per_rank = 8, 3

    def own_samples(batch):  # rank r runs its own per_rank samples, one per slot
        return [[[r * per_rank + k] for k in range(per_rank)] for r in range(world)]

    lengths = _lengths(world * per_rank * 3)
    steps = plan_steps(lengths, world, per_rank, 4096, cost, shuffle=False, lockstep=own_samples)
    times = step_times(steps, SHAPE, cluster, OVERHEADS, forward_fraction=0.4)
    exposed = {"fsdp2_full": fsdp_full_exposed, "fsdp2_hsdp": fsdp_hsdp_exposed}
    shards = {"fsdp2_full": 8, "fsdp2_hsdp": 4}
    for i, step in enumerate(steps):
        batch = lengths[i * 24 : (i + 1) * 24]
        lock = lockstep_cost_matrix(own_samples(batch), batch, cost)
        for name in ("fsdp2_full", "fsdp2_hsdp"):
            comm = exposed[name](step.fsdp_index_max, SHAPE, cluster, forward_fraction=0.4).sum()
            overhead = OVERHEADS.fsdp(SHAPE, shards[name])
            assert times[name]["compute"][i] == pytest.approx(step.fsdp_index_max.sum(), rel=1e-12)
            assert times[name]["comm"][i] == pytest.approx(comm, rel=1e-12)
            assert times[name]["overhead"][i] == overhead
            assert times[name]["total"][i] == pytest.approx(step.fsdp_index_max.sum() + comm + overhead, rel=1e-12)
            assert times[name]["bubble"][i] == pytest.approx(1 - step.fsdp_busy.mean() / step.fsdp_index_max.sum())
            rebalance = name.replace("fsdp2", "rebalance")
            comm = exposed[name](lock.max(axis=0), SHAPE, cluster, forward_fraction=0.4).sum()
            assert times[rebalance]["total"][i] == pytest.approx(lock.max(axis=0).sum() + comm + overhead, rel=1e-12)
            assert times[rebalance]["bubble"][i] == pytest.approx(1 - lock.sum(axis=1).mean() / lock.max(axis=0).sum())
        odc = step.odc_busy.max() + odc_all_reduce_seconds(SHAPE, cluster) + OVERHEADS.odc(SHAPE, 4)
        assert times["odc_hsdp"]["total"][i] == pytest.approx(odc, rel=1e-12)
        assert times["bound"]["total"][i] == pytest.approx(step.lower_bound + OVERHEADS.fsdp(SHAPE, 8), rel=1e-12)
    assert OVERHEADS.fsdp(SHAPE, 4) != OVERHEADS.fsdp(SHAPE, 8)  # the layouts' overheads differ
    default = step_times(steps, SHAPE, cluster, OVERHEADS)  # the split of compute matters in this regime
    for name in ("fsdp2_full", "fsdp2_hsdp", "rebalance_full", "rebalance_hsdp"):
        assert not np.allclose(default[name]["comm"], times[name]["comm"]), name
    assert len(set(times["rebalance_hsdp"]["comm"].tolist())) == 3  # each step its own exposure
    # the lockstep plans priced packed when asked (each rank's samples in one slot: padding would cost more)
    def one_slot(batch):
        return [[list(range(r * per_rank, (r + 1) * per_rank))] for r in range(world)]

    packed = plan_steps(lengths, world, per_rank, 4096, cost, shuffle=False, lockstep=one_slot, lockstep_layout="packed")
    batch = lengths[:24]
    as_packed = lockstep_cost_matrix(one_slot(batch), batch, cost, layout="packed").sum(axis=1)
    np.testing.assert_allclose(packed[0].lockstep_busy, as_packed)
    assert np.all(as_packed < lockstep_cost_matrix(one_slot(batch), batch, cost).sum(axis=1))
    with pytest.raises(ValueError, match="^no planned steps$"):
        step_times([], SHAPE, cluster, OVERHEADS)
    with pytest.raises(ValueError, match="^steps were planned for 8 ranks, the cluster has 4$"):
        step_times(steps[:1], SHAPE, Cluster(gpus_per_node=4), OVERHEADS)
    import dataclasses

    gap = [dataclasses.replace(steps[0], lockstep_index_max=None, lockstep_busy=None), *steps[1:]]
    with pytest.raises(ValueError, match=r"^lockstep plans must cover the first steps \(plan_steps\(lockstep_max_steps"):
        step_times(gap, SHAPE, cluster, OVERHEADS)


def test_a_step_with_no_compute_has_no_bubble():
    steps = plan_steps(np.zeros(8, dtype=np.int64), 2, 4, 4096, QuadraticCostModel(a=0.0, b=1e-4, c=0.0))
    times = step_times(steps, SHAPE, Cluster(gpus_per_node=2), OVERHEADS)
    for name in ("fsdp2_full", "fsdp2_hsdp", "odc_hsdp"):
        assert times[name]["compute"].tolist() == [0.0] and times[name]["bubble"].tolist() == [0.0]


def test_plan_steps_shuffles_as_the_sampler_does_and_names_bad_input():
    """By default the minibatches are the sampler's epoch-0 minibatches for the same seed (so the estimate plans what
    training runs); a lockstep planner limited to the first steps plans exactly those."""
    lengths = _lengths(48, seed=3)
    steps = plan_steps(lengths, 2, 4, 4096, COST, seed=7)
    sampler = ODCBatchSampler(lengths, world_size=2, rank=0, minibatch_size=8, max_tokens_per_microbatch=4096,
                              cost_model=COST, seed=7)  # fmt: skip
    for k, step in enumerate(steps):
        assert step.tokens == int(lengths[sampler.minibatch_indices(k)].sum())
        np.testing.assert_allclose(step.odc_busy, sampler.plan(k).rank_busy, rtol=1e-12)
    assert [s.tokens for s in plan_steps(lengths, 2, 4, 4096, COST, seed=7, shuffle=False)] == [
        int(lengths[k * 8 : (k + 1) * 8].sum()) for k in range(6)
    ]
    calls = []
    limited = plan_steps(lengths, 2, 4, 4096, COST, lockstep=lambda b: calls.append(1) or [[[0, 1, 2, 3]], [[4, 5, 6, 7]]],
                         lockstep_max_steps=2)  # fmt: skip
    assert len(calls) == 2 and [s.lockstep_busy is not None for s in limited] == [True, True] + [False] * 4
    with pytest.raises(ValueError, match="^lengths must be a 1-D sequence of integer token counts$"):
        plan_steps(np.ones((4, 2), dtype=np.int64), 2, 1, 4096, COST)
    with pytest.raises(ValueError, match="^lengths must be a 1-D sequence of integer token counts$"):
        plan_steps([1.5, 2.0], 1, 1, 4096, COST)
    for name, args in (("world_size", (0, 1, 4096)), ("per_rank", (1, 2.5, 4096)), ("max_tokens", (1, 1, -4))):
        bad = dict(zip(("world_size", "per_rank", "max_tokens"), args))[name]
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got {bad}$"):
            plan_steps(lengths, *args, COST)


def test_the_bound_of_a_lockstep_plan_counts_its_microbatches_overhead_and_its_costliest_document():
    """No plan into m or more microbatches over W ranks beats max((Σ document costs + a·max(m, 1)) / W, the
    costliest document alone)."""
    model = QuadraticCostModel(a=1.0, b=1.0, c=0.0)  # a document of n tokens costs n; a microbatch 1 more
    assert makespan_bound([10, 10, 10, 10], 2, 2, model) == (40 + 2) / 2
    assert makespan_bound([10, 10, 10, 10], 2, 0, model) == (40 + 1) / 2  # at least one microbatch
    assert makespan_bound([10, 10, 10, 10], 8, 4, model) == 1 + 10  # one document on one rank, with its overhead
    assert makespan_bound([], 4, 3, model) == 0.0
    # a lockstep plan of fewer, larger microbatches than the budget allows lowers the step's bound to its own count
    lengths = np.full(8, 100)
    steps = plan_steps(lengths, 2, 4, 200, model, shuffle=False, lockstep=lambda b: [[[0, 1, 2, 3]], [[4, 5, 6, 7]]])
    assert steps[0].lower_bound == makespan_bound(lengths, 2, 2, model) == (800 + 2) / 2


def test_the_speedup_spread_is_the_ratio_estimator_s_standard_error():
    """``speedup_vs_*_se`` against its meaning: over many independent repeats of n steps, the standard deviation of
    Σ baseline / Σ ODC is what one run's standard error estimates (within 10% at n = 40); a hand case at n = 2;
    0 at one step; percentiles 10 and 90 of the per-step ratios."""
    rng = np.random.default_rng(0)

    def times_of(base, odc):
        part = {k: np.zeros_like(odc) for k in ("compute", "comm", "overhead", "bubble")}
        return {"fsdp2_full": {**part, "total": base}, "fsdp2_hsdp": {**part, "total": base},
                "odc_hsdp": {**part, "total": odc}, "bound": {"total": odc * 0.9}}  # fmt: skip

    ratios, errors = [], []
    for _ in range(2000):
        odc = rng.gamma(4.0, 1.0, size=40)
        base = 1.3 * odc + rng.normal(0.0, 0.8, size=40)
        summary = summarize(times_of(base, odc))
        ratios.append(summary["speedup_vs_fsdp2_full"])
        errors.append(summary["speedup_vs_fsdp2_full_se"])
    assert np.mean(errors) == pytest.approx(np.std(ratios), rel=0.1)
    # n = 2: ratio 3, residuals -1 and 1, variance 2, sqrt(2 / 2) / mean(odc) = 1
    two = summarize(times_of(np.array([2.0, 4.0]), np.array([1.0, 1.0])))
    assert two["speedup_vs_fsdp2_full"] == 3.0 and two["speedup_vs_fsdp2_full_se"] == pytest.approx(1.0)
    one = summarize(times_of(np.array([2.0]), np.array([1.0])))
    assert one["speedup_vs_fsdp2_full_se"] == 0.0 and one["speedup_vs_fsdp2_full_steps"] == 1
    per_step = np.arange(1.0, 12.0)  # ratios 1 .. 11 over 11 steps: p10 = 2, median 6, p90 = 10
    summary = summarize(times_of(per_step, np.ones(11)))
    assert summary["speedup_vs_fsdp2_hsdp_p10"] == 2.0 and summary["speedup_vs_fsdp2_hsdp_p90"] == 10.0
    assert summary["speedup_vs_fsdp2_hsdp_median"] == 6.0
    assert summary["fsdp2_full"]["total_p10_s"] == 2.0 and summary["fsdp2_full"]["total_p90_s"] == 10.0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mlp_bias", [True, False])
def test_model_shape_of_a_llama_config_counts_its_biases_as_it_sets_them(bias, mlp_bias):
    """Llama's attention_bias puts biases on q, k, v and the output projection (Qwen2's on q, k, v only: the
    real-parameter test of Qwen2 above); mlp_bias on the three MLP projections. Counted against the model itself."""
    from types import SimpleNamespace

    import torch

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=101, attention_bias=bias,
                                      mlp_bias=mlp_bias)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    s = ModelShape.from_config(config)
    assert s.num_params == sum(p.numel() for p in model.parameters())
    assert s.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert s.name == "LlamaConfig" and ModelShape.from_config(config, name="mine").name == "mine"
    config.name_or_path = "org/llama-tiny"
    assert ModelShape.from_config(config).name == "org/llama-tiny"
    # no attention_bias attribute: biases on q, k, v for a Qwen2 config only (and no model type: none)
    plain = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, vocab_size=101)  # fmt: skip
    qwen2 = SimpleNamespace(**vars(plain), model_type="qwen2")
    assert ModelShape.from_config(qwen2).layer_params - ModelShape.from_config(plain).layer_params == 64 + 2 * 32
    assert ModelShape.from_config(plain).name == "SimpleNamespace"
    assert ModelShape.from_config(plain).root_params == 2 * 101 * 64 + 64  # no tie_word_embeddings: untied


def test_shapes_clusters_and_state_bytes_by_their_words():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"^config SimpleNamespace lacks \['num_hidden_layers', 'num_attention_heads', "
                                         r"'intermediate_size', 'vocab_size'\]: not a dense decoder config; the estimate "
                                         r"needs one; build a ModelShape\(\.\.\.\) directly for other shapes$"):  # fmt: skip
        ModelShape.from_config(SimpleNamespace(hidden_size=64))
    for field in ("num_layers", "layer_params", "num_matmul_params", "attn_dim"):
        for bad in (0, -1):
            with pytest.raises(ValueError, match=rf"^ModelShape\.{field} must be > 0, got {bad}$"):
                ModelShape(**{"name": "x", "num_layers": 1, "layer_params": 1, "root_params": 0,
                              "num_matmul_params": 1, "attn_dim": 1, field: bad})  # fmt: skip
    assert ModelShape(name="x", num_layers=1, layer_params=1, root_params=0, num_matmul_params=1, attn_dim=1).num_params == 1
    with pytest.raises(ValueError, match=r"^ModelShape\.root_params must be >= 0, got -1$"):
        ModelShape(name="x", num_layers=1, layer_params=1, root_params=-1, num_matmul_params=1, attn_dim=1)
    for name in ("gpus_per_node", "num_nodes"):
        for bad in (0, 1.5):
            with pytest.raises(ValueError, match=rf"^Cluster\.{name} must be a positive integer, got {bad}$"):
                Cluster(**{name: bad})
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^Cluster\.network_gb_per_s must be > 0 \(GB/s per GPU\), got"):
            Cluster(network_gb_per_s=bad)
    assert Cluster(gpus_per_node=8).describe() == "1 node x 8 GPUs"
    assert Cluster(gpus_per_node=8, num_nodes=2, network_gb_per_s=25).describe() == (
        "2 nodes x 8 GPUs = 16 GPUs, 25 GB/s network per GPU")  # fmt: skip
    assert SHAPE.describe() == "tiny (0.00B parameters, 4 layers)"
    big = ModelShape(name="b", num_layers=2, layer_params=10**9, root_params=5 * 10**8, num_matmul_params=1, attn_dim=1)
    assert big.describe() == "b (2.50B parameters, 2 layers)"
    # fp32 parameters, gradients and two AdamW moments per parameter held; ODC's bf16 staging shard on top
    held = 4 * math.ceil(1_000_003 / 4) + math.ceil(500_001 / 4)
    assert sharded_state_bytes(SHAPE, 4, odc=False) == 16 * held
    assert sharded_state_bytes(SHAPE, 4, odc=True) == 18 * held
    assert rail_collective_seconds(GRAD_BYTES * 10**9, Cluster(gpus_per_node=8)) == 0.0  # one node: NVLink
    # two nodes: long microbatches hide every cross-node all-reduce but the last block's and the root's
    two = Cluster(gpus_per_node=4, num_nodes=2, network_gb_per_s=50.0)
    block = 2 * (2 - 1) / 2 * GRAD_BYTES * math.ceil(1_000_003 / 4) / 50e9
    root = 2 * (2 - 1) / 2 * GRAD_BYTES * math.ceil(500_001 / 4) / 50e9
    assert fsdp_hsdp_exposed([10.0], SHAPE, two)[0] == pytest.approx(block + root, rel=1e-12)
    assert fsdp_hsdp_exposed([10.0], SHAPE, Cluster(gpus_per_node=4))[0] == 0.0


def test_lockstep_plans_edges():
    """An empty slot costs nothing and the slots after it still count; padded tokens and waste of a plan with no
    tokens; a position equal to the number of lengths is outside; the errors by their words."""
    model = QuadraticCostModel(a=0.0, b=1.0, c=0.0)
    plan = [[[0], [], [1, 2]], [[3], [4], []]]
    lengths = [5, 3, 7, 2, 4]
    assert lockstep_cost_matrix(plan, lengths, model).tolist() == [[5.0, 0.0, 14.0], [2.0, 4.0, 0.0]]
    assert lockstep_cost_matrix(plan, lengths, model, layout="packed").tolist() == [[5.0, 0.0, 10.0], [2.0, 4.0, 0.0]]
    assert padded_tokens(plan, lengths).tolist() == [[5, 0, 14], [2, 4, 0]] and padded_tokens(plan, lengths).dtype == np.int64
    assert padding_waste(plan, lengths) == pytest.approx(1 - 21 / 25)
    assert padding_waste([[[0]], [[1]]], [0, 0]) == 0.0
    with pytest.raises(ValueError, match=r"^rank 1: sample position 5 is outside the 5 lengths given$"):
        lockstep_cost_matrix([[[0]], [[5]]], lengths, model)
    with pytest.raises(ValueError, match=r"^a lockstep plan needs at least one rank$"):
        lockstep_cost_matrix([], lengths, model)
    with pytest.raises(ValueError, match=r"^layout must be one of \('padded', 'packed'\), got 'dense'$"):
        lockstep_cost_matrix(plan, lengths, model, layout="dense")


def test_calibration_json_forms_and_their_refusals_by_words(tmp_path):
    """The three forms a calibration file may take (a fit, timings per length, a run's timings per microbatch), each
    read as that form; a file without any of them, a list, bad JSON, a missing path and the unitless 'tokens' named
    with the file's own name; a file that names no model is used as measured, one that names the model at hand too."""
    import dataclasses
    import json


    lengths, seconds = [1024, 4096, 8192, 16384, 32768], [0.12, 0.2, 0.33, 0.65, 1.5]
    assert calibration_from_dict({"lengths": lengths, "seconds": seconds}) == QuadraticCostModel.fit(lengths, seconds)
    microbatches = [[1024, 1024], [4096], [8192, 512], [16384], [32768]]
    assert calibration_from_dict({"microbatches": microbatches, "seconds": seconds}) == (
        QuadraticCostModel.fit_microbatches(microbatches, seconds))  # fmt: skip
    with pytest.raises(ValueError, match=r"^cost model: expected a JSON object with a, b, c and optionally floor \(or "
                                         r"lengths and seconds, or microbatches and seconds, to fit\); got keys "
                                         r"\['lengths'\]$"):  # fmt: skip
        calibration_from_dict({"lengths": lengths})
    with pytest.raises(ValueError, match=r"got keys \['seconds'\]$"):
        calibration_from_dict({"seconds": seconds})
    with pytest.raises(ValueError, match=r"^cost model: expected a JSON object, got list$"):
        calibration_from_dict([1, 2])
    shape15 = ModelShape(**h200_calibration()["model_shape"])
    as_list = tmp_path / "list.json"
    as_list.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"^{as_list}: expected a JSON object, got list$"):
        load_cost_model(str(as_list), shape15)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match=rf"^{broken}: not valid JSON \("):
        load_cost_model(str(broken), shape15)
    with pytest.raises(ValueError, match=r"^cost model 'nowhere\.json' is neither 'h200', 'flop' nor an existing "
                                         r"calibration \.json file$"):  # fmt: skip
        load_cost_model("nowhere.json", shape15)
    with pytest.raises(ValueError, match=r"^cost model 'tokens' has no time unit: use 'h200', 'flop' or a calibration "
                                         r"\.json$"):  # fmt: skip
        load_cost_model("tokens", shape15)
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"lengths": lengths, "seconds": seconds}))
    model, text = load_cost_model(str(mine), SHAPE)
    assert model == QuadraticCostModel.fit(lengths, seconds) and text == f"your calibration mine.json: {model.describe()}"
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"lengths": lengths, "seconds": seconds, "model_shape": dataclasses.asdict(SHAPE)}))
    model, text = load_cost_model(str(named), SHAPE)
    assert model == QuadraticCostModel.fit(lengths, seconds) and text == f"calibration named.json of tiny: {model.describe()}"


def test_a_calibration_carried_to_another_depth_scales_its_launch_terms_by_layers():
    """scale_cost_model: a and floor (kernels per layer) by the layer ratio, b by matmul parameters, c by layers x
    heads x head_dim; the shipped calibration on its own shape is used as measured and says so, on another depth it is
    scaled and says that; the overheads carry their source."""

    model = QuadraticCostModel(a=0.04, b=1e-5, c=5e-10, floor=0.1)
    reference = ModelShape(name="ref", num_layers=28, layer_params=1000, root_params=0, num_matmul_params=1_000_000,
                           attn_dim=1536)  # fmt: skip
    half = ModelShape(name="half", num_layers=14, layer_params=1000, root_params=0, num_matmul_params=3_000_000,
                      attn_dim=1024)  # fmt: skip
    scaled = scale_cost_model(model, reference, half)
    assert scaled.a == pytest.approx(0.02) and scaled.floor == pytest.approx(0.05)
    assert scaled.b == pytest.approx(3e-5) and scaled.c == pytest.approx(5e-10 * (14 * 1024) / (28 * 1536))
    asset = h200_calibration()
    shipped = ModelShape(**asset["model_shape"])
    measured, text = load_cost_model("h200", shipped)
    assert text == f"H200 calibration of {shipped.name} ({asset['date']}): {measured.describe()}"
    shallow = ModelShape(**{**asset["model_shape"], "num_layers": 14, "name": "shallow"})
    scaled, text = load_cost_model("h200", shallow)
    assert scaled.a == pytest.approx(measured.a / 2) and scaled.floor == pytest.approx(measured.floor / 2)
    assert text == f"H200 calibration of {shipped.name} ({asset['date']}) scaled by FLOPs to shallow: {scaled.describe()}"
    assert h200_overheads().source == asset["step_overhead"]["source"] and h200_overheads().source


def test_flop_rate_of_one_token_and_the_default_length():

    model = QuadraticCostModel(a=0.0, b=1e-6, c=0.0)
    assert flop_rate(model, SHAPE, length=1) == pytest.approx((6.0 * 4_000_000 + 6.0 * 4 * 64) / 1e-6)
    assert flop_rate(model, SHAPE) == flop_rate(model, SHAPE, length=32768)
    assert flop_rate(model, SHAPE) == pytest.approx((6.0 * 4_000_000 * 32768 + 6.0 * 4 * 64 * 32768**2) / (1e-6 * 32768))
    with pytest.raises(ValueError, match=r"^flop_rate: length must be > 0, got 0$"):
        flop_rate(model, SHAPE, length=0)

    curved = QuadraticCostModel(a=0.0, b=1e-6, c=1e-10)  # the rate depends on the length it is taken at
    short = flop_cost_model(curved, SHAPE, SHAPE, length=1024)
    assert short.b == pytest.approx(6.0 * 4_000_000 / flop_rate(curved, SHAPE, length=1024))
    assert short != flop_cost_model(curved, SHAPE, SHAPE)
