"""The one TRL version policy of odc_hf, shared by its SFT and GRPO trainers (``odc_hf.integrations.sft_trainer`` and
``odc_hf.integrations.grpo_trainer``): the TRL versions they were tested on and every private TRL name they read."""

from __future__ import annotations

from packaging.version import Version

# The one TRL version policy of odc_hf: its TRL trainers run only on the TRL minor versions they were tested on.
# Both read private TRL names (SFT: ``_metrics`` and ``_total_train_tokens``, re-aggregated once per step; GRPO:
# ``_generate_and_score_completions``, ``_get_train_sampler``, ``_metrics`` and the batch keys and loss normalisers of
# ``_compute_loss``). A name that disappears can be detected, one whose meaning changes cannot: it would give wrong
# losses or metrics without an error. So another minor is refused with a message saying what to install; add it
# here once tests/test_grpo_trl_surface.py and the parity tests (tests/test_*parity.py) pass on it.
TESTED_TRL = ("1.16",)

SFT_PRIVATE_ATTRIBUTES = ("_metrics", "_total_train_tokens")
"""What ``ODCSFTTrainer`` reads of TRL's ``SFTTrainer``: its metrics, re-aggregated once per step."""
GRPO_PRIVATE_METHODS = ("_generate_and_score_completions", "_get_train_sampler", "compute_loss", "_compute_loss",
                        "_get_per_token_logps_and_entropies")
"""TRL ``GRPOTrainer`` methods ``ODCGRPOTrainer`` calls or overrides: generation and scoring, the sampler (one
dataloader batch per optimizer step), the loss and the metrics' recomputation per slice."""
GRPO_PRIVATE_ATTRIBUTES = ("_metrics", "loss_type", "beta", "ref_model", "max_completion_length", "num_iterations")
"""TRL ``GRPOTrainer`` attributes ``ODCGRPOTrainer`` reads (``_metrics``: aggregated once per step)."""


def check_trl(trainer, trainer_name: str, *, methods=(), attributes=()) -> None:
    """Refuse a TRL outside :data:`TESTED_TRL`, or a trainer lacking the private ``methods`` / ``attributes`` odc_hf
    reads, with a message saying what to install."""
    import trl

    version = Version(trl.__version__)
    if f"{version.major}.{version.minor}" not in TESTED_TRL:
        raise RuntimeError(
            f"{trainer_name} reads private parts of TRL's trainers and was written for trl {TESTED_TRL}; found trl "
            f"{trl.__version__}. Install trl=={TESTED_TRL[-1]}.* (or test odc_hf on this TRL and add it to "
            "TESTED_TRL in odc_hf/integrations/trl_version.py)"
        )
    missing = [n for n in methods if not callable(getattr(trainer, n, None))]
    missing += [n for n in attributes if not hasattr(trainer, n)]
    if missing:
        raise RuntimeError(f"trl {trl.__version__}: {trainer_name} lacks {missing}; odc_hf was tested on trl {TESTED_TRL}")


def check_trl_sft(trainer) -> None:
    """:func:`check_trl` for ``ODCSFTTrainer``."""
    check_trl(trainer, "ODCSFTTrainer", attributes=SFT_PRIVATE_ATTRIBUTES)


def check_trl_grpo(trainer) -> None:
    """:func:`check_trl` for ``ODCGRPOTrainer``."""
    check_trl(trainer, "ODCGRPOTrainer", methods=GRPO_PRIVATE_METHODS, attributes=GRPO_PRIVATE_ATTRIBUTES)
