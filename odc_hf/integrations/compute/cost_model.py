"""What the ODC trainers plan their microbatches with: the cost model ``ODCConfig.cost_model`` names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from odc_hf.balance import CostModel, FlopCostModel, QuadraticCostModel, TokenCostModel
from odc_hf.integrations.compute.fused_head import ComputePath, check_recorded
from odc_hf.integrations.models.family import is_attention_layer, transformers_model


def cost_model(choice: str, model=None, compute: ComputePath | None = None) -> CostModel:
    """The cost model of ``ODCConfig.cost_model`` = ``choice``: ``flop`` (from ``model``'s config), ``tokens``, or a
    JSON file: coefficients, single-document timings, or a run's ``odc_microbatch_timings.json`` (fitted here). A
    file measured on another compute path than ``compute`` is a warning (:func:`~odc_hf.integrations.compute.fused_head.
    check_recorded`)."""
    if choice == "flop":
        return flop_cost_model(model)
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


def flop_cost_model(model) -> FlopCostModel:
    """:class:`~odc_hf.balance.FlopCostModel` of the model in hand, read off its modules rather than its config (any
    family: per-layer head dimensions, MLPs without an ``intermediate_size``, fused experts).

    N counts every 2-D weight outside embeddings (attention, MLP, LM head: the embedding lookup is no matmul), a Mixture-of-Experts
    layer's stacked expert weights (3-D parameters) at the share of experts a token uses (``num_experts_per_tok /
    experts``); the attention term sums each attention layer's query heads x head dimension."""
    base = transformers_model(model)
    text = base.config.get_text_config()
    top_k = getattr(text, "num_experts_per_tok", None)
    matmul = 0
    for module in base.modules():
        if isinstance(module, torch.nn.Embedding):  # a lookup, no matmul (a tied LM head counts as its Linear)
            continue
        for param in module.parameters(recurse=False):
            if param.dim() == 2:  # Linear, GPT-2's Conv1D, ...
                matmul += param.numel()
            elif param.dim() == 3:  # stacked experts (experts, out, in)
                share = min(1.0, top_k / param.shape[0]) if top_k else 1.0 / param.shape[0]
                matmul += int(param.numel() * share)
    widths = [_attention_width(m, text) for m in base.modules() if is_attention_layer(m)]
    widths = [w for w in widths if w]
    if not widths or matmul <= 0:
        return FlopCostModel.from_config(text)
    return FlopCostModel(num_matmul_params=matmul, num_layers=len(widths), attn_dim=max(1, round(sum(widths) / len(widths))))


def _attention_width(module, config) -> int:
    """Query heads x head dimension of one attention layer (0 when it cannot be read)."""
    heads = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
    projection = getattr(module, "q_proj", None)
    if not heads and isinstance(projection, torch.nn.Linear):
        return projection.out_features
    heads = heads or getattr(config, "num_attention_heads", None)
    return int(heads * module.head_dim) if isinstance(heads, int) else 0
