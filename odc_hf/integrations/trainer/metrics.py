"""Metrics across ranks under uneven microbatch counts: one home for how the ODC trainers aggregate them.

Ranks run different numbers of microbatches in a step, so a collective per microbatch would pair up different
microbatches or deadlock. Inside a step's microbatch loop the libraries' metric collectives stay local
(:class:`LocalGathers`); once per step the trainers aggregate: the step statistics and loss ride on one gather
(:class:`odc_hf.integrations.trainer.observability.ObservabilityPart`), per-microbatch values TRL appends are
gathered in rank order (:func:`every_rank_values`), and a MoE router loss is weighed by the step's microbatches on
every rank (:func:`weigh_router_loss`). TRL's own metrics are re-aggregated by the TRL trainers with these
(``odc_hf.integrations.trl.sft_trainer``; GRPO's per-slice recomputation: ``odc_hf.integrations.trl.grpo_metrics``).
"""

from __future__ import annotations

import torch


class LocalGathers:
    """Stands in for the Accelerator inside the bundle loop: metric gathers stay local.

    Libraries (TRL's ``compute_loss``) gather or reduce metrics once per microbatch; with uneven microbatch counts those
    collectives would pair up different microbatches or deadlock. Inside the loop they return the local value;
    the trainer aggregates once per step instead. Everything else goes to the real Accelerator.
    """

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def gather_for_metrics(self, tensor, use_gather_object=False):
        return tensor.reshape(1) if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 else tensor

    gather = gather_for_metrics

    def reduce(self, tensor, reduction="sum", scale=1.0):  # TRL GRPO's global_masked_mean: local sums
        return tensor * scale if scale != 1.0 else tensor

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def weigh_router_loss(trainer, local_microbatches: int) -> float | None:
    """A Mixture-of-Experts router loss, weighed as TRL weighs it in one process on the same microbatches.

    TRL's SFT and GRPO trainers add ``router_aux_loss_coef * aux_loss / current_gradient_accumulation_steps`` to each
    microbatch's loss, and DDP averages over ranks: a step's router loss is the coefficient times the mean of its
    microbatches' router losses. Under ODC a rank runs its own number of microbatches and gradients are summed over
    ranks, so for the bundle loop the trainer's coefficient becomes ``coef / M``, M the step's microbatches on all
    ranks (one all-reduce, MoE runs only). Returns the coefficient to put back afterwards (None: nothing changed).
    transformers' ``Trainer`` adds the model's own router loss to every microbatch's loss whole (not divided by the
    accumulation steps); ``ODCTrainer`` keeps that, which is what it computes in one process on the same microbatches.
    """
    if not getattr(trainer, "aux_loss_enabled", False):  # TRL's switch (SFTTrainer, GRPOTrainer)
        return None
    coef, accelerator = trainer.router_aux_loss_coef, trainer.accelerator
    count = torch.tensor(float(local_microbatches), device=accelerator.device)
    if accelerator.num_processes > 1:
        count = accelerator.reduce(count, reduction="sum")
    trainer.router_aux_loss_coef = coef / max(count.item(), 1.0)
    return coef


def every_rank_values(accelerator, values: list[float]) -> list[float]:
    """The per-microbatch values of a step on every rank (TRL appends one per microbatch, e.g. ``aux_loss``): one
    object gather, in rank order."""
    if accelerator.num_processes < 2:
        return list(values)
    from accelerate.utils import gather_object

    return [float(x) for part in gather_object([list(values)]) for x in part]
