"""The one TRL version policy of odc_hf, shared by its SFT and GRPO trainers (``odc_hf.integrations.trl.sft_trainer`` and
``odc_hf.integrations.trl.grpo_trainer``): the TRL versions they were tested on and every private TRL name they read."""

from __future__ import annotations

import contextlib

from odc_hf.integrations.upstream.transformers import missing_upstream_methods
from odc_hf.version import TESTED, warn_if_untested

# The one TRL version policy of odc_hf (odc_hf.version's policy applied to TRL). Both trainers read private TRL names
# (SFT: ``_metrics`` and ``_total_train_tokens``, re-aggregated once per step; GRPO: ``_generate_and_score_completions``,
# ``_get_train_sampler``, ``_metrics`` and the batch keys and loss normalisers of ``_compute_loss``). A name that
# disappears is refused by name; one whose meaning changes cannot be detected at run time, so another minor warns
# once, naming the tested ones. Add a minor to odc_hf.version.TESTED once tests/grpo/test_grpo_trl_surface.py and the
# parity tests (tests/trainers/test_trainer_sft_parity.py, tests/grpo/test_grpo_parity.py, tests/models/test_model_zoo.py) pass on it.
TESTED_TRL = TESTED["trl"]

SFT_PRIVATE_ATTRIBUTES = ("_metrics", "_total_train_tokens", "aux_loss_enabled", "router_aux_loss_coef",
                          "maybe_activation_offload_context")
"""What ``ODCSFTTrainer`` reads of TRL's ``SFTTrainer``: its metrics, re-aggregated once per step, its MoE router
loss switch and coefficient (weighed per step: ``odc_hf.integrations.trainer.metrics.weigh_router_loss``), and its
activation-offloading context (entered around each microbatch's forward and backward)."""
GRPO_PRIVATE_METHODS = ("_generate_and_score_completions", "_get_train_sampler", "compute_loss", "_compute_loss",
                        "_get_per_token_logps_and_entropies")
"""TRL ``GRPOTrainer`` methods ``ODCGRPOTrainer`` calls or overrides: generation and scoring, the sampler (one
dataloader batch per optimizer step), the loss and the metrics' recomputation per slice."""
GRPO_PRIVATE_ATTRIBUTES = ("_metrics", "loss_type", "beta", "ref_model", "max_completion_length", "num_iterations",
                           "aux_loss_enabled", "router_aux_loss_coef", "_entropy_bonus_enabled", "entropy_coef",
                           "use_adaptive_entropy", "_last_world_entropy")
"""TRL ``GRPOTrainer`` attributes ``ODCGRPOTrainer`` reads (``_metrics``: aggregated once per step; the entropy
bonus's switch, coefficient and adaptive state: the bonus is applied and updated by ODC, per TRL's definition)."""


def check_trl(trainer, trainer_name: str, *, methods=(), attributes=()) -> None:
    """Warn once on a TRL outside :data:`TESTED_TRL`; refuse a trainer lacking the private ``methods`` /
    ``attributes`` odc_hf reads, naming them and the tested versions."""
    import trl

    warn_if_untested("trl", versions={"trl": trl.__version__})
    missing = missing_upstream_methods(type(trainer), methods)  # TRL's own, not odc_hf's hooks over them
    missing += [n for n in attributes if not hasattr(trainer, n)]
    if missing:
        raise RuntimeError(f"trl {trl.__version__}: {trainer_name} lacks {missing}, private TRL names odc_hf reads; "
                           f"odc_hf was tested on trl {', '.join(TESTED_TRL)}: install one of those")


def check_trl_sft(trainer) -> None:
    """:func:`check_trl` for ``ODCSFTTrainer``."""
    check_trl(trainer, "ODCSFTTrainer", attributes=SFT_PRIVATE_ATTRIBUTES)


def check_trl_grpo(trainer) -> None:
    """:func:`check_trl` for ``ODCGRPOTrainer``."""
    check_trl(trainer, "ODCGRPOTrainer", methods=GRPO_PRIVATE_METHODS, attributes=GRPO_PRIVATE_ATTRIBUTES)


class GRPOHooks:
    """The private ``GRPOTrainer`` methods ``ODCGRPOTrainer`` overrides, each handed to a public ``odc_*`` method
    (with TRL's own as ``parent`` where ODC falls back to it): the one place those names are written. Goes right
    before ``GRPOTrainer`` in the trainer's bases."""

    def _get_train_sampler(self, dataset=None):
        return self.odc_train_sampler(dataset)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return self.odc_per_token_logps_and_entropies(super()._get_per_token_logps_and_entropies, model, input_ids,
                                                      attention_mask, logits_to_keep, *args, **kwargs)  # fmt: skip


def generate_and_score_completions(trainer, inputs) -> dict:
    """TRL's generation and scoring of a batch of prompts (``GRPOTrainer._generate_and_score_completions``)."""
    return trainer._generate_and_score_completions(inputs)


def token_entropies(trainer, model, input_ids, attention_mask, logits_to_keep):
    """The per-token entropies of the completions, as TRL's loss computes them
    (``GRPOTrainer._get_per_token_logps_and_entropies``, through ODC's override of it)."""
    return trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                      compute_entropy=True)[1]  # fmt: skip


def logged_metrics(trainer, mode: str = "train") -> dict:
    """TRL's per-step metric lists of a trainer (``_metrics[mode]``), which odc_hf re-aggregates once per step."""
    return trainer._metrics[mode]


def entropy_bonus_enabled(trainer) -> bool:
    """``GRPOTrainer._entropy_bonus_enabled``: TRL's switch of the entropy bonus (``entropy_coef`` or adaptive)."""
    return trainer._entropy_bonus_enabled


@contextlib.contextmanager
def trl_entropy_bonus_off(trainer):
    """Inside: TRL's ``_compute_loss`` adds no entropy bonus of its own (ODC applies it with its own weights)."""
    enabled, trainer._entropy_bonus_enabled = trainer._entropy_bonus_enabled, False
    try:
        yield
    finally:
        trainer._entropy_bonus_enabled = enabled


def last_world_entropy(trainer) -> float:
    """``GRPOTrainer._last_world_entropy``: the previous step's token mean of the entropy over every rank, which
    gates the adaptive coefficient."""
    return trainer._last_world_entropy


def set_last_world_entropy(trainer, value: float) -> None:
    trainer._last_world_entropy = value


def total_train_tokens(trainer) -> int:
    """``SFTTrainer._total_train_tokens``: the tokens trained so far, TRL's ``num_tokens`` metric."""
    return trainer._total_train_tokens


def set_total_train_tokens(trainer, tokens: int) -> None:
    """Set ``SFTTrainer._total_train_tokens`` (every rank's tokens, once per step)."""
    trainer._total_train_tokens = tokens


VLLM_GENERATION_ATTRIBUTES = ("mode", "llm", "enable_sleep_mode")
"""TRL 1.16 ``VLLMGeneration`` attributes odc_hf's weight sync reads or sets."""
_SLEEP_FLAG = "_llm_weights_sleeping"  # TRL's generate() re-syncs while it is True (sleep level 2)


def missing_generation_attributes(generation) -> list[str]:
    """The names of :data:`VLLM_GENERATION_ATTRIBUTES` (and, under sleep mode, TRL's sleeping-weights flag) that
    TRL's ``VLLMGeneration`` object lacks."""
    missing = [name for name in VLLM_GENERATION_ATTRIBUTES if not hasattr(generation, name)]
    if getattr(generation, "enable_sleep_mode", False) and not hasattr(generation, _SLEEP_FLAG):
        missing.append(_SLEEP_FLAG)
    return missing


def mark_weights_awake(generation) -> None:
    """Tell TRL's ``VLLMGeneration`` that its engine's weights are mapped again (its sleeping flag off)."""
    setattr(generation, _SLEEP_FLAG, False)
