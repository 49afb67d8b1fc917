"""The SFT step harness that benchmarks/sft/e2e.py and benchmarks/sft/microbatch_probe.py share: the model config, the
seeded sample tokens, the single-GPU cost calibration, the FSDP2 / ODC model, and one timed training step.

``args`` is the benchmark's argparse namespace (``model``, ``max_tokens``, ``lr``, ``timeout``,
``calibration_lengths``, ``calibration_repeats``).
"""

from __future__ import annotations

import time


def model_config(args):
    """Qwen2.5-shaped config (or odc_hf's tiny one for CPU runs) with per-document attention on packed rows."""
    from odc_hf.attention import VARLEN_ATTENTION
    from odc_hf.prediction.workloads import qwen2_5_config
    from odc_hf.testing.data import tiny_qwen2_config

    max_positions = max(32768, args.max_tokens)
    if args.model == "tiny":
        config = tiny_qwen2_config(512, max_position_embeddings=max_positions)
    else:
        config = qwen2_5_config(args.model)
        config.tie_word_embeddings, config.use_cache = True, False
        config.max_position_embeddings = max_positions
    config._attn_implementation = VARLEN_ATTENTION
    return config


def sample_ids(seed: int, step: int, index: int, length: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + index)
    return torch.randint(1, vocab, (int(length),), generator=g).tolist()


def compute_path(model, kernels: str, checkpointed: int) -> None:
    """A variant's compute path on a not yet sharded model: Liger kernels, TRL SFTTrainer's fused head, AC."""
    from odc_hf.integrations.compute import activation_checkpointing as ac
    from odc_hf.integrations.compute import fused_head as cp

    if kernels == "liger":
        cp.apply_liger_kernels(model, fused_linear_cross_entropy=False)
    cp.install_fused_head(model, outputs=cp.SFT_HEAD_OUTPUTS)
    ac.enable_checkpointing(model, checkpointed)


def calibrate_cost_model(rank, world_size, args, device, config, kernels="none", checkpointed=None):
    """Fit a + b·s + c·s² to single-GPU fwd+bwd timings of an unsharded bf16 copy on a compute path (grid split over
    ranks); ``checkpointed`` layers (default all: SFTConfig's full checkpointing)."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM

    from odc_hf.balance.cost import QuadraticCostModel
    from odc_hf.prediction.calibrate import time_lengths

    grid = sorted({min(s, args.max_tokens) for s in args.calibration_lengths})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    compute_path(model, kernels, config.num_hidden_layers if checkpointed is None else checkpointed)
    mine = grid[rank::world_size]
    medians = (time_lengths(model, mine, repeats=args.calibration_repeats, forward_kwargs={"fused_lm_head": True})
               if mine else [])  # fmt: skip
    timings = list(zip(mine, medians))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, timings)
    points = sorted(p for part in gathered for p in part)
    fitted = QuadraticCostModel.fit([p[0] for p in points], [p[1] for p in points])
    return fitted, points


def build_model(kind: str, config, device, args, kernels="none", checkpointing="full"):
    """A sharded model on a compute path; ``checkpointing`` "full" (SFTConfig's default) or "auto" (odc_hf's).
    Returns (model, optimizer, odc handle or None, checkpointed layers)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import Qwen2ForCausalLM

    from odc_hf.fsdp import install_odc, shard_model, sum_reduction
    from odc_hf.integrations.compute import activation_checkpointing as ac
    from odc_hf.integrations.compute import fused_head as cp

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    checkpointed = config.num_hidden_layers
    compute_path(model, kernels, checkpointed)
    if checkpointing == "auto":  # what the ODC trainers do for the token budget (a collective: every rank runs it)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        path = ac.plan_checkpointing(cp.ComputePath(kernels=kernels, loss=cp.TRL_FUSED_HEAD), model, policy="auto",
                                     tokens=args.max_tokens, device=device, compute_dtype=dtype,
                                     world_size=torch.distributed.get_world_size(), odc=kind == "odc",
                                     device_memory_gib=None)  # fmt: skip
        checkpointed = path.checkpointed_layers
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else None
    )
    shard_model(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    odc = None
    if kind == "odc":
        odc = install_odc(model, timeout_s=args.timeout)
        odc.attach_optimizer(optimizer)
    else:  # same loss semantics as ODC: gradients summed over ranks, the loss carries the global normaliser
        sum_reduction(model)
    return model, optimizer, odc, checkpointed


def _retries(device) -> int:
    import torch

    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def run_step(model, optimizer, odc, microbatches, global_labels, device, clock) -> dict:
    import torch
    import torch.distributed as dist

    from odc_hf import attention

    cuda = device.type == "cuda"
    batches = []
    for mb in microbatches:
        batches.append(
            {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items() if k != "num_label_tokens"}
        )
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    retries, calls = _retries(device), dict(attention.CALLS)
    t0 = time.perf_counter()
    start = clock.mark()
    ends = []
    for batch in batches:
        out = model(**batch, fused_lm_head=True, num_items_in_batch=global_labels)
        out.loss.backward()
        ends.append(clock.mark())
        del out
    if odc is not None:
        odc.finish_minibatch()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt_start = clock.mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    opt_end = clock.mark()
    if cuda:
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    ends_s = [clock.seconds(start, e) for e in ends]
    return {
        "wall_s": wall,
        "mb_end_s": ends_s,
        "busy_s": ends_s[-1] if ends_s else 0.0,
        "opt_s": clock.seconds(opt_start, opt_end),
        "transient_bytes": (torch.cuda.max_memory_allocated(device) - base) if cuda else 0,
        "reserved_bytes": torch.cuda.memory_reserved(device) if cuda else 0,
        "alloc_retries": _retries(device) - retries,
        "attention_calls": {k: v - calls.get(k, 0) for k, v in attention.CALLS.items()},
    }


# -- the workload and each variant's plan (sft_e2e.py) ---------------------------------------------
def step_lengths(args, workload: str, per_rank: int, world_size: int, num_steps: int):
    """Per step, the lengths of the global minibatch (same for every variant)."""
    import numpy as np

    from odc_hf.prediction.workloads import generate_lengths

    size = world_size * per_rank
    if workload == "balanced":
        flat = np.full(size * num_steps, args.balanced_length, dtype=np.int64)
    else:
        flat = generate_lengths(workload, size * num_steps, args.seed, max_length=args.max_tokens)
    return [flat[i * size : (i + 1) * size].astype(np.int64) for i in range(num_steps)]


def trl_rows(lengths, budget: int) -> list[list[int]]:
    """Which samples TRL's best-fit-decreasing packing puts in each row (``trl.pack_dataset``)."""
    from datasets import Dataset
    from trl import pack_dataset

    ds = Dataset.from_dict({"input_ids": [[i] * int(n) for i, n in enumerate(lengths)]})
    packed = pack_dataset(ds, seq_length=budget, strategy="bfd")
    rows = []
    for row in packed["input_ids"]:
        members = list(dict.fromkeys(row))  # the samples in order of appearance
        rows.append(members)
    if sorted(i for r in rows for i in r) != list(range(len(lengths))):
        raise RuntimeError("TRL packing dropped or split samples; lengths must fit the budget")
    return rows


def plans_for_step(lengths, world_size: int, budget: int, cost_model, variants, cost_model_d=None,
                   hf_grad_accum: int = 1) -> dict:  # fmt: skip
    """Per variant, each rank's microbatches (lists of positions in ``lengths``) and the Plan when there is one.

    ``cost_model_d``: D's own (its compute path's) cost model; default ``cost_model``. H (A_hf) is transformers'
    ``BatchRebalanceSampler`` with ``hf_grad_accum`` microbatches per rank, as ``SFTTrainer`` with
    ``train_sampling_strategy="batch_rebalance"`` builds it; its microbatches are priced padded."""
    from odc_hf.balance.plan import Plan
    from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini

    out = {}
    micro = plan_lb_micro(lengths, world_size, budget, cost_model, truncate=True)
    mini = plan_lb_mini(lengths, world_size, budget, cost_model_d or cost_model, truncate=True)
    for v in variants:
        if v in ("B", "C"):
            out[v] = (micro.microbatches, micro)
        elif v == "D":
            out[v] = (mini.microbatches, mini)
        elif v == "A":
            rows = trl_rows(lengths, budget)
            dealt = [rows[r::world_size] for r in range(world_size)]
            width = max(len(d) for d in dealt)
            dealt = [d + [[] for _ in range(width - len(d))] for d in dealt]
            costs = [[cost_model.microbatch_cost(lengths[mb]) for mb in mbs] for mbs in dealt]
            plan = Plan(mode="trl_packing", microbatches=dealt, microbatch_costs=costs,
                        lower_bound=micro.lower_bound, cost_model=cost_model.describe())  # fmt: skip
            out[v] = (dealt, plan)
        elif v == "H":
            import numpy as np

            from odc_hf.prediction.batch_rebalance import rebalance_plan
            from odc_hf.prediction.lockstep import lockstep_cost_matrix

            clipped = np.minimum(np.asarray(lengths), budget)
            rows = rebalance_plan(clipped, world_size, hf_grad_accum)
            costs = lockstep_cost_matrix(rows, clipped, cost_model, layout="padded").tolist()
            plan = Plan(mode="batch_rebalance", microbatches=rows, microbatch_costs=costs,
                        lower_bound=micro.lower_bound, cost_model=cost_model.describe())  # fmt: skip
            out[v] = (rows, plan)
    return out


def padded_rows(examples: list[dict], pad_token_id: int = 0) -> list[dict]:
    """A padded microbatch as packed documents: every row right-padded to the widest, pads labelled -100.

    Each padded row is one document of the packed row (position_ids restart per document), so the compute is the
    padded batch's (rows x widest, attention over the widest per row) and, with causal attention and right padding,
    the loss is the padded batch's too: real tokens never attend to the pads after them.
    """
    widest = max((len(e["input_ids"]) for e in examples), default=0)
    out = []
    for e in examples:
        ids = list(e["input_ids"])
        pad = widest - len(ids)
        out.append({"input_ids": ids + [pad_token_id] * pad, "labels": ids + [-100] * pad})
    return out
