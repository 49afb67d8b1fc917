"""The first microbatch of a run checks that the loss divides by ``num_items_in_batch``.

Under ODC each rank runs its own number of packed microbatches, and the gradients of all of them over every rank are
summed. The step's loss is right only when each microbatch's loss is a sum over its label tokens divided by
``num_items_in_batch``, the step's label-token count over all ranks (what odc_hf passes to ``compute_loss``). A
per-microbatch mean (``model(**inputs).loss`` called without ``num_items_in_batch``, a ``compute_loss_func`` that
ignores it, ``loss_is_scaled_for_ga=False``, a model whose ``forward`` takes no ``**kwargs``) would weigh each sample by
the microbatch it landed in and multiply the step's gradient by the number of microbatches: a different model, with no
error anywhere.

So once per run, on the first microbatch with label tokens, the trainer's ``compute_loss`` is run without gradients
with twice ``num_items_in_batch``, under the random state the training forward then draws from (the same dropout
masks), and compared with the training loss: a loss that divides by it halves. A ratio outside 0.25-0.75 is refused,
naming the trainer class and both values. Terms that do not scale (an MoE router loss, a regulariser) move the ratio
by their share of the loss, far less than that margin in any sensible loss. Cost: one forward of one microbatch,
once. A loss of odc_hf's own (its fused LM head, ``ODCTrainer``'s default) is not checked.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check", "probe"]

LOW, HIGH = 0.25, 0.75
"""Bounds of the ratio loss(2N) / loss(N) accepted as a loss divided by N."""


def probe(trainer, model, batch: dict, num_items_in_batch) -> float:
    """The loss ``compute_loss`` gives ``batch`` with twice ``num_items_in_batch``, without gradients; the random
    state is put back as it was, so the training forward that follows draws the same numbers."""
    device = trainer.accelerator.device
    devices = [device] if device.type == "cuda" else []
    restore = trainer.odc_restore_after_probe()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=2 * num_items_in_batch)
    finally:
        restore()
    return float(loss.detach().float().mean())


def check(trainer, doubled: float, loss: torch.Tensor, num_items_in_batch) -> None:
    """Raise unless ``doubled`` (the probe's loss) is about half ``loss`` (the training loss)."""
    value = float(loss.detach().float().mean())
    if not math.isfinite(value) or not math.isfinite(doubled) or abs(value) < 1e-6:
        return  # nothing to compare: a zero or broken loss is reported elsewhere
    ratio = doubled / value
    if LOW <= ratio <= HIGH:
        return
    items = int(num_items_in_batch)
    raise ValueError(
        f"odc_hf: {type(trainer).__name__}.compute_loss gives a loss that does not divide by num_items_in_batch: "
        f"{value:.6g} with num_items_in_batch={items} and {doubled:.6g} with {2 * items}, on the same microbatch. "
        "Under ODC each rank runs its own number of packed microbatches and their gradients are summed, so each "
        "microbatch's loss must be the sum over its label tokens divided by num_items_in_batch (the step's label "
        "tokens over all ranks); a per-microbatch mean would weigh every sample by the microbatch it landed in. Pass "
        "it on to the model (model(**inputs, num_items_in_batch=num_items_in_batch)), or divide your summed loss by "
        "it (a compute_loss_func gets it as a keyword argument)"
    )
