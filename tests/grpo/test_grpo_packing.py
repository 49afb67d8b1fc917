"""ODC's GRPO layout (odc_hf.balance.padded): padded microbatches within the budget, every sample once, never more
microbatches than the old layout (first-fit decreasing by tokens, then split for padding), deterministic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_hf.balance.cost import FlopCostModel, QuadraticCostModel, TokenCostModel
from odc_hf.balance.padded import pack_padded, plan_padded
from odc_hf.balance.planner import pack_first_fit_decreasing, plan_lb_mini
from odc_hf.prediction.workloads import qwen2_5_config

ROOT = Path(__file__).resolve().parents[2]
COST_MODELS = {
    "none": None,  # pack_padded only: padded tokens
    "flop": FlopCostModel.from_config(qwen2_5_config("1.5B")),
    "tokens": TokenCostModel(),
    # the 1.5B / H200 calibration (benchmarks/results/planning/calibration_qwen2.5-1.5B_h200_2026-11-29.json)
    "h200": QuadraticCostModel(a=0.0, b=3.009e-05, c=6.133e-10, floor=0.1829),
}


def old_layout(share, lengths, budget):
    """The layout before pack_padded: first-fit decreasing by token count, then each bin split for padding."""
    out = []
    for mb in pack_first_fit_decreasing(share, np.asarray(lengths, dtype=np.int64), budget):
        parts: list[list[int]] = []
        for i in sorted(mb, key=lambda i: -lengths[i]):
            if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= budget:
                parts[-1].append(i)
            else:
                parts.append([i])
        out += parts
    return out


def padded_cost(mb, lengths, cost_model):
    longest = max(lengths[i] for i in mb)
    return float(longest * len(mb)) if cost_model is None else cost_model.microbatch_cost([longest] * len(mb))


def check_layout(mbs, share, lengths, budget):
    assert sorted(i for mb in mbs for i in mb) == sorted(share), "every sample exactly once"
    for mb in mbs:
        assert mb, "no empty microbatch"
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= budget, (
            "padded microbatch over the budget"
        )


@st.composite
def shares(draw):
    budget = draw(st.sampled_from([64, 1000, 16384]))
    lengths = draw(st.lists(st.integers(0, budget), min_size=0, max_size=48))
    share = [i for i in range(len(lengths)) if draw(st.booleans())]
    return lengths, share, budget, draw(st.sampled_from(sorted(COST_MODELS)))


@settings(max_examples=300, deadline=None)
@given(shares())
def test_pack_padded_fewest_microbatches_within_budget(case):
    lengths, share, budget, name = case
    cost_model = COST_MODELS[name]
    mbs = pack_padded(share, lengths, budget, cost_model)
    check_layout(mbs, share, lengths, budget)
    assert mbs == pack_padded(list(reversed(share)), lengths, budget, cost_model), "a function of the lengths"
    old = old_layout(share, lengths, budget)
    check_layout(old, share, lengths, budget)
    assert len(mbs) <= len(old), "never more microbatches than the old layout"
    if len(mbs) == len(old):  # and then never a higher predicted cost
        ours = sum(padded_cost(mb, lengths, cost_model) for mb in mbs)
        assert ours <= sum(padded_cost(mb, lengths, cost_model) for mb in old) * (1 + 1e-12)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        for k in range(len(partition)):
            yield partition[:k] + [[first, *partition[k]]] + partition[k + 1 :]
        yield [[first], *partition]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=7), st.sampled_from([100, 150, 300]),
       st.sampled_from(["none", "h200", "flop"]))  # fmt: skip
def test_pack_padded_is_optimal_fewest_then_cheapest(lengths, budget, name):
    """Against brute force over all set partitions: the fewest microbatches, then the least padded cost."""
    cost_model = COST_MODELS[name]
    if cost_model is not None and cost_model.floor:  # lengths in the hundreds: scale the floor down to matter
        cost_model = QuadraticCostModel(a=0.0, b=cost_model.b, c=cost_model.c, floor=0.003)
    items = list(range(len(lengths)))
    best = min(
        (len(p), sum(padded_cost(mb, lengths, cost_model) for mb in p))
        for p in set_partitions(items)
        if all(len(mb) * max(lengths[i] for i in mb) <= budget for mb in p)
    )
    mbs = pack_padded(items, lengths, budget, cost_model)
    assert len(mbs) == best[0]
    assert sum(padded_cost(mb, lengths, cost_model) for mb in mbs) == pytest.approx(best[1], rel=1e-9)


def test_pack_padded_beats_token_packing_then_splitting():
    # FFD by tokens fills one bin with 600 + 400, which padding must split again: 3 microbatches where 2 do
    lengths = [400, 400, 600]
    assert old_layout([0, 1, 2], lengths, 1000) == [[2], [0], [1]]
    assert pack_padded([0, 1, 2], lengths, 1000) == [[2], [0, 1]]
    # same count: the layout with less padding (8192 + 8192 vs 2 x 8192 + 2 x 4000 padded tokens)
    lengths = [8192, 8000, 4000, 3000]
    assert pack_padded([0, 1, 2, 3], lengths, 16384) == [[0, 1], [2, 3]]
    assert pack_padded([0, 1, 2, 3], lengths, 16384, COST_MODELS["h200"]) == [[0, 1], [2, 3]]


@st.composite
def generation_batches(draw):
    budget = draw(st.sampled_from([64, 4096, 16384]))
    lengths = draw(st.lists(st.integers(0, budget), min_size=0, max_size=64))
    return lengths, draw(st.integers(1, 5)), budget, draw(st.sampled_from(["flop", "tokens", "h200"])), \
        draw(st.sampled_from(["lb_mini", "lb_micro", "none"]))  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(generation_batches())
def test_plan_padded_covers_every_sample_once_within_budget(case):
    lengths, world, budget, name, balance = case
    cost_model = COST_MODELS[name]
    plan = plan_padded(lengths, world, budget, cost_model, balance)
    assert plan.world_size == world
    check_layout([mb for mbs in plan.microbatches for mb in mbs], range(len(lengths)), lengths, budget)
    assert plan == plan_padded(lengths, world, budget, cost_model, balance), "deterministic"
    for mbs, costs in zip(plan.microbatches, plan.microbatch_costs):
        assert costs == sorted(costs, reverse=True), "costliest first"
        for mb, cost in zip(mbs, costs):
            assert cost == pytest.approx(padded_cost(mb, lengths, cost_model), rel=1e-9)
    assert plan.predicted_odc_time >= plan.lower_bound * (1 - 1e-9)
    if balance == "lb_mini":  # balancing by padded cost never ends worse than packing the planner's shares
        planned = plan_lb_mini(lengths, world, budget, cost_model)
        shares = [[i for mb in mbs for i in mb] for mbs in planned.microbatches]
        before = max((rank_cost(share, lengths, budget, cost_model) for share in shares), default=0.0)
        assert plan.predicted_odc_time <= before * (1 + 1e-9)


def test_plan_padded_rank_share_is_packed_whole():
    """A rank's microbatches are pack_padded of its whole share (not of the planner's microbatches one by one)."""
    lengths = [8000, 7000, 3000, 2900, 2800, 300, 200, 100] * 2
    plan = plan_padded(lengths, 2, 16384, COST_MODELS["h200"])
    for mbs in plan.microbatches:
        share = [i for mb in mbs for i in mb]
        assert sorted(map(sorted, mbs)) == sorted(
            map(sorted, pack_padded(share, lengths, 16384, COST_MODELS["h200"]))
        )


def test_benchmark_predicts_fewer_microbatches_and_a_faster_step():
    """grpo_e2e --predict (CPU): on the benchmark's rollouts ODC's layout beats TRL's in the cost model."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "benchmarks.grpo.e2e", "--predict", "--warmup", "0", "--steps", "4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "calibration_qwen2.5-1.5B_h200_2026-11-29.json" in last, last
    ratio = float(last.split("predicted ODC / FSDP ")[1].split("x")[0])
    odc, fsdp = (
        int(x) for x in last.split("microbatches ")[1].replace(" (odc) vs ", " ").split(" (fsdp)")[0].split()
    )
    assert ratio > 1.15 and odc < fsdp, last


def test_set_partitions_helper():
    assert sum(1 for _ in set_partitions(list(range(5)))) == 52  # Bell number
    assert all(sorted(i for mb in p for i in mb) == [0, 1, 2] for p in set_partitions([0, 1, 2]))


def test_collate_pads_rows_to_the_multiple_with_masked_completion_columns():
    import torch

    from odc_hf.balance.padded import padded_width
    from odc_hf.integrations.trl.grpo_batch import collate

    assert padded_width(100, 3676, 128) == 3740 and (100 + 3740) % 128 == 0  # 3776 = 64 mod 128 is avoided
    assert padded_width(100, 28, 1) == 28
    samples = [
        {"prompt_ids": torch.arange(1, 6), "completion_ids": torch.arange(1, 60), "completion_mask": torch.ones(59, dtype=torch.long),
         "advantages": torch.tensor(0.5), "weight": 1.0},
        {"prompt_ids": torch.arange(1, 3), "completion_ids": torch.arange(1, 10), "completion_mask": torch.ones(9, dtype=torch.long),
         "advantages": torch.tensor(-0.5), "weight": 1.0},
    ]  # fmt: skip
    plain = collate(samples, 0, "cpu")
    wide = collate(samples, 0, "cpu", pad_to_multiple_of=128)
    assert plain["prompt_ids"].shape[1] + plain["completion_ids"].shape[1] == 64
    assert wide["prompt_ids"].shape[1] + wide["completion_ids"].shape[1] == 128
    assert torch.equal(wide["completion_ids"][:, :59], plain["completion_ids"])
    assert wide["completion_mask"][:, 59:].sum() == 0 and wide["num_label_tokens"] == plain["num_label_tokens"] == 68


def test_padded_rows_are_rounded_only_where_cudnn_masked_attention_runs_them():
    from odc_hf.integrations.trl.grpo_batch import CUDA_PAD_TO_MULTIPLE_OF, padded_columns_multiple

    assert CUDA_PAD_TO_MULTIPLE_OF == 128
    assert padded_columns_multiple("cuda", "sdpa") == 128
    assert padded_columns_multiple("cuda", "sdpa_varlen") == 128  # padded rows fall back to sdpa with the mask
    assert padded_columns_multiple("cuda", None) == 128
    assert padded_columns_multiple("cuda", "flash_attention_4") == 1  # unpads the rows: no masked kernel
    assert padded_columns_multiple("cuda", "flash_attention_2") == 1
    assert padded_columns_multiple("cpu", "sdpa") == padded_columns_multiple("cpu", "sdpa_varlen") == 1


def test_budget_holds_for_the_real_padded_width():
    """TRL pads rows to the longest prompt plus the longest completion (then to the column multiple): with prompt
    lengths the packing keeps rows x that width within the budget (a lone sample may exceed it)."""
    import random

    from odc_hf.balance.padded import padded_microbatch_width

    lengths, prompts = [1100, 1100], [1000, 100]  # (1000 + 100) and (100 + 1000): together 2 x 2000 columns
    assert pack_padded([0, 1], lengths, 2200) == [[0, 1]]  # by sample length alone they would share
    assert sorted(map(sorted, pack_padded([0, 1], lengths, 2200, prompts=prompts))) == [[0], [1]]
    rng = random.Random(0)
    for _ in range(30):
        n, budget, multiple = rng.randint(1, 40), rng.choice([2048, 4096, 16384]), rng.choice([1, 128])
        prompts = [rng.randint(50, 300) for _ in range(n)]
        lengths = [p + rng.randint(1, 1800) for p in prompts]
        plan = plan_padded(lengths, 2, budget, COST_MODELS["h200"], prompts=prompts, multiple=multiple)
        assert sorted(i for mbs in plan.microbatches for mb in mbs for i in mb) == list(range(n))
        for mbs in plan.microbatches:
            for mb in mbs:
                width = padded_microbatch_width([prompts[i] for i in mb], [lengths[i] - prompts[i] for i in mb], multiple)
                assert len(mb) == 1 or len(mb) * width <= budget
                assert width % multiple == 0


def test_padded_reference_log_probs_keep_the_kl_term_finite():
    import torch

    from odc_hf.integrations.trl.grpo_batch import collate

    samples = [
        {"prompt_ids": torch.arange(1, 4), "completion_ids": torch.arange(1, 6), "completion_mask": torch.ones(5, dtype=torch.long),
         "ref_per_token_logps": torch.full((5,), -2.0), "advantages": torch.tensor(1.0), "weight": 1.0},
        {"prompt_ids": torch.arange(1, 4), "completion_ids": torch.arange(1, 3), "completion_mask": torch.ones(2, dtype=torch.long),
         "ref_per_token_logps": torch.full((2,), -2.0), "advantages": torch.tensor(1.0), "weight": 1.0},
    ]  # fmt: skip
    batch = collate(samples, 0, "cpu", pad_to_multiple_of=16)
    ref, mask = batch["ref_per_token_logps"], batch["completion_mask"]
    logp = torch.where(mask.bool(), -2.5, -95.0)  # masked columns: a very unlikely token
    kl = torch.exp(ref - logp) - (ref - logp) - 1  # TRL's k3 estimator, evaluated before masking
    assert torch.isfinite(kl * mask).all() and torch.isfinite(kl).all()


def test_packed_rows_give_trl_s_padded_log_probs_entropies_and_gradients():
    """The packed layout's forward (odc_hf.integrations.trl.grpo_batch.pack_rows on sdpa_varlen) gives the per-token
    log-probs and entropies TRL's padded forward gives (sdpa with the padding mask, TRL's labels, its fused head), in
    TRL's (rows, completion columns) layout: left-padded prompts, right-padded completions, a completion masked out
    whole (mask_truncated_completions) and one ending early; and the same gradients."""
    import torch
    from transformers import Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    import odc_hf.attention  # noqa: F401 - registers "sdpa_varlen"
    from odc_hf.integrations.trl.grpo_batch import pack_rows, scatter_packed
    from odc_hf.testing.data import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(97)
    packed_model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa_varlen", dtype=torch.float32)
    padded_model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    padded_model.load_state_dict(packed_model.state_dict())
    for model in (packed_model, padded_model):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    # a one-token prompt first (its first completion token is scored from packed entry 0), a completion masked out
    # whole, one ending early, and a last row whose completion fills every column (its last token is scored from
    # the row's last entry, next to the zero that unscored columns read)
    prompt_mask = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0] * 7, [1] * 7])
    ids = torch.randint(1, 97, (4, 11))
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = ids.masked_fill(mask == 0, -100)  # as TRL's _get_per_token_logps_and_entropies
    labels[:, :-7] = -100
    ref = padded_model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    packed = pack_rows(ids, mask, 7)
    index = packed.pop("index")
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 8, 11, 22] and packed["max_length_q"] == 11
    out = packed_model(**packed, fused_lm_head=True)
    logps, entropy = scatter_packed(out.log_probs, index), scatter_packed(out.entropy, index)
    # fp32, a 2-layer model: measured 4.8e-7 (RoPE at shifted positions, other matmul shapes); 0 where TRL has 0
    torch.testing.assert_close(logps, ref.log_probs[:, -7:], rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, ref.entropy[:, -7:], rtol=0, atol=2e-6)
    assert not logps[completion_mask == 0].any()
    assert logps[completion_mask == 1].ne(0).all()  # every scored token has its log-prob
    weights = torch.randn(4, 7)
    (logps * weights).sum().backward()
    (ref.log_probs[:, -7:] * weights).sum().backward()
    for (name, a), b in zip(packed_model.named_parameters(), padded_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)  # measured: float32 rounding


@st.composite
def padded_rows(draw):
    """TRL-like padded rows: left-padded prompts (0 to 4 tokens), completions with holes and right padding."""
    rows, prompt_width, completion_width = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    mask = []
    for _ in range(rows):
        prompt = draw(st.integers(0, prompt_width))
        completion = draw(st.lists(st.booleans(), min_size=completion_width, max_size=completion_width))
        mask.append([0] * (prompt_width - prompt) + [1] * prompt + [int(b) for b in completion])
    return mask, completion_width


@settings(max_examples=200, deadline=None)
@given(padded_rows())
def test_pack_rows_equals_a_row_by_row_reference(case):
    """pack_rows against its docstring, row by row: the attended tokens back to back; positions count columns from
    the row's first attended token (a hole keeps its distance); labels are the token in a scored column except at a
    sequence start; each scored column reads the shifted entry before its token (the zero past the end when it is
    not attended or is the packed row's first token; a later row's first token reads an entry its -100 label
    leaves at zero); boundaries at every non-empty row. Rows with no attended token, one token, or a one-token
    prompt included."""
    import torch

    from odc_hf.integrations.trl.grpo_batch import pack_rows, scatter_packed

    mask, keep = case
    rows, width = len(mask), len(mask[0])
    ids = torch.arange(1, rows * width + 1).reshape(rows, width) * 10
    tokens, positions, labels, at, sizes = [], [], [], {}, []
    for r in range(rows):
        columns = [c for c in range(width) if mask[r][c]]
        for k, c in enumerate(columns):
            at[r, c] = len(tokens)
            tokens.append(int(ids[r, c]))
            positions.append(c - columns[0])
            labels.append(int(ids[r, c]) if c >= width - keep and k > 0 else -100)
        if columns:
            sizes.append(len(columns))
    total = len(tokens)
    index = [[at[r, c] - 1 if (r, c) in at and at[r, c] > 0 else total - 1 for c in range(width - keep, width)]
             for r in range(rows)]  # fmt: skip
    packed = pack_rows(ids, torch.tensor(mask), keep)
    assert packed["input_ids"].tolist() == [tokens] and packed["position_ids"].tolist() == [positions]
    assert packed["labels"].tolist() == [labels] and packed["index"].tolist() == index
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)
    for side in ("q", "k"):
        assert packed[f"cu_seq_lens_{side}"].tolist() == cu and packed[f"cu_seq_lens_{side}"].dtype == torch.int32
        assert packed[f"max_length_{side}"] == max(sizes, default=0) and type(packed[f"max_length_{side}"]) is int
    if total:  # the shifted values (entry t scores token t + 1) back in TRL's layout, zero where unscored
        shifted = torch.arange(1.0, total)
        out = scatter_packed(shifted.unsqueeze(0), packed["index"])
        assert out.tolist() == [[float(shifted[i]) if i < total - 1 else 0.0 for i in row] for row in index]
    assert scatter_packed(None, packed["index"]) is None


def cuts(n):
    """Every way to cut n ordered samples into consecutive runs: lists of (start, end)."""
    for mask in range(2 ** max(n - 1, 0)):
        edges = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        yield list(zip(edges, edges[1:]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 90)), min_size=1, max_size=9),
       st.sampled_from([150, 300, 600]), st.sampled_from([1, 16]), st.sampled_from(["none", "h200", "flop"]))  # fmt: skip
def test_pack_padded_with_prompts_is_the_best_cut_of_the_sorted_samples(pairs, budget, multiple, name):
    """With prompt lengths, rows are as wide as the longest prompt plus the longest completion, rounded up to the
    column multiple: among every cut of the samples sorted longest first (ties: lower index) into consecutive runs,
    pack_padded takes one with the fewest microbatches within the budget, then the least padded cost (brute force).
    With all prompts empty it is the packing by sample length."""
    from odc_hf.balance.padded import padded_microbatch_width

    cost_model = COST_MODELS[name]
    if cost_model is not None and cost_model.floor:
        cost_model = QuadraticCostModel(a=0.0, b=cost_model.b, c=cost_model.c, floor=0.003)
    prompts, lengths = [p for p, _ in pairs], [p + c for p, c in pairs]
    order = sorted(range(len(pairs)), key=lambda i: (-lengths[i], i))

    def width(run):
        return padded_microbatch_width([prompts[i] for i in run], [lengths[i] - prompts[i] for i in run], multiple)

    def price(run):
        w = width(run)
        return float(w * len(run)) if cost_model is None else cost_model.microbatch_cost([w] * len(run))

    best = min(
        (len(cut), sum(price(order[a:b]) for a, b in cut))
        for cut in cuts(len(order))
        if all(b - a == 1 or (b - a) * width(order[a:b]) <= budget for a, b in cut)
    )
    mbs = pack_padded(range(len(pairs)), lengths, budget, cost_model, prompts=prompts, multiple=multiple)
    assert [i for mb in mbs for i in mb] == order, "consecutive runs of the sorted order, longest first"
    assert len(mbs) == best[0]
    assert sum(price(mb) for mb in mbs) == pytest.approx(best[1], rel=1e-9)
    assert pack_padded(range(len(pairs)), lengths, budget, cost_model, prompts=[0] * len(pairs)) == pack_padded(
        range(len(pairs)), lengths, budget, cost_model
    )
    if multiple == 1:  # the default: no rounding
        assert pack_padded(range(len(pairs)), lengths, budget, cost_model, prompts=prompts) == mbs
    if cost_model is not None:  # one rank's plan prices each microbatch at its real padded width
        plan = plan_padded(lengths, 1, budget, cost_model, prompts=prompts, multiple=multiple)
        assert sorted(map(sorted, plan.microbatches[0])) == sorted(map(sorted, mbs))
        for mb, cost in zip(plan.microbatches[0], plan.microbatch_costs[0]):
            assert cost == pytest.approx(price(mb), rel=1e-12)


def rank_cost(share, lengths, budget, cost_model):
    """A rank's padded cost: its share packed by pack_padded, each microbatch priced at its longest sample."""
    return sum(padded_cost(mb, lengths, cost_model) for mb in pack_padded(share, lengths, budget, cost_model))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=0, max_size=18), st.integers(2, 4), st.sampled_from(["flop", "h200"]))
def test_padded_rebalancing_ends_where_no_move_or_swap_helps_the_busiest_rank(lengths, world, name):
    """LB-Mini's GRPO shares end in a local optimum of the padded costs: no sample moved from the busiest rank
    (ties: the lower rank) to another, and no swap of two samples of different lengths between them, leaves both
    below the busiest rank's cost. LB-Micro and plain sharding keep their planner's shares (only packed)."""
    from odc_hf.balance.planner import PLANNERS

    cost_model, budget = COST_MODELS[name], 4096
    for balance in ("lb_micro", "none"):
        planned = PLANNERS[balance](lengths, world, budget, cost_model).microbatches
        plan = plan_padded(lengths, world, budget, cost_model, balance)
        assert [sorted(i for mb in mbs for i in mb) for mbs in plan.microbatches] == [
            sorted(i for mb in mbs for i in mb) for mbs in planned
        ]
        assert plan.mode == balance and plan.cost_model == cost_model.describe()
    plan = plan_padded(lengths, world, budget, cost_model)
    shares = [[i for mb in mbs for i in mb] for mbs in plan.microbatches]
    loads = [rank_cost(s, lengths, budget, cost_model) for s in shares]
    hi = min(range(world), key=lambda r: (-loads[r], r))
    for lo in (r for r in range(world) if r != hi):
        changes = [(x, None) for x in shares[hi]]
        changes += [(x, y) for x in shares[hi] for y in shares[lo] if lengths[x] != lengths[y]]
        for x, y in changes:
            a = rank_cost([i for i in shares[hi] if i != x] + ([] if y is None else [y]), lengths, budget, cost_model)
            b = rank_cost([i for i in shares[lo] if i != y] + [x], lengths, budget, cost_model)
            assert max(a, b) >= loads[hi] * (1 - 1e-7), (hi, lo, x, y, a, b, loads)


def test_padded_widths_round_only_when_asked_and_one_token_rows_fill_the_budget():
    from odc_hf.balance.padded import padded_microbatch_width, padded_width

    assert padded_width(3, 4) == 4 and padded_microbatch_width([3, 1], [4, 2]) == 7  # multiple 1 by default
    assert padded_width(3, 4, 0) == 4 and padded_microbatch_width([3], [4], 8) == 8
    assert pack_padded(range(64), [1] * 64, 64) == [list(range(64))]  # rows x 1 token <= 64
    assert sorted(map(len, pack_padded(range(65), [1] * 65, 64))) == [1, 64]


def test_padded_rebalancing_stopped_by_its_work_bound_still_covers_every_sample(monkeypatch):
    """The local search stops after a fixed amount of work (a bound on planning time): stopped early, at the first
    evaluation or part-way through its scan, the plan still holds every sample once and is no worse than packing the
    planner's shares."""
    import odc_hf.balance.padded as padded

    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 4096, size=96).tolist()
    cost_model = COST_MODELS["h200"]
    planned = plan_lb_mini(lengths, 4, 4096, cost_model)
    before = max(rank_cost([i for mb in mbs for i in mb], lengths, 4096, cost_model) for mbs in planned.microbatches)
    for work in (1, 500, 5000):
        monkeypatch.setattr(padded, "_SEARCH_WORK", work)
        plan = plan_padded(lengths, 4, 4096, cost_model)
        check_layout([mb for mbs in plan.microbatches for mb in mbs], range(len(lengths)), lengths, 4096)
        assert plan.predicted_odc_time <= before * (1 + 1e-9)
