"""TRL SFT with ODC: ``ODCSFTTrainer`` (its arguments: ``ODCSFTConfig``, ``odc_hf.integrations.trl.sft_config``).

TRL's ``SFTTrainer.compute_loss`` gathers its metrics (entropy, token accuracy, token count) once per
microbatch; under ODC ranks run different numbers of microbatches, so the trainer keeps those gathers local
inside the bundle loop (see ``LocalGathers``) and aggregates here, once per step, with one all-reduce.
That reads two private TRL attributes (``_metrics``, ``_total_train_tokens``): they, and the TRL version, are checked
at start-up (:mod:`odc_hf.integrations.upstream.trl`, the one TRL version policy).
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from odc_hf.integrations.trainer.metrics import every_rank_values
from odc_hf.integrations.trainer.mixin import ODCMixin
from odc_hf.integrations.upstream.trl import (
    TESTED_TRL,
    check_trl_sft,
    logged_metrics,
    set_total_train_tokens,
    total_train_tokens,
)

_AVERAGED = ("entropy", "mean_token_accuracy")  # ratios over a step's label tokens in TRL


class _SFTPart:
    """The SFT specifics on top of :class:`~odc_hf.integrations.trainer.mixin.ODCMixin`: checks before TRL prepares the
    data, TRL's fused LM head and loss masks, and the once-per-step aggregation of TRL's SFT metrics that
    ``compute_loss`` recorded per local microbatch.

    TRL computes ``entropy`` and ``mean_token_accuracy`` of a step over all its label tokens (sums over the batch,
    divided by its label-token count). Its per-microbatch values here are ratios over each microbatch's label tokens,
    so each is weighted by that count (``num_label_tokens``) to rebuild the step's ratio; a microbatch without label
    tokens (TRL records 0.0 for it) weighs nothing. ``aux_loss`` (MoE) is one value per microbatch in TRL: every
    rank's values of the step are appended, so that the logged mean is TRL's over the same microbatches.
    """

    def __init__(self, *args, **kwargs):
        # Before TRL prepares the data (main process first, the other ranks waiting): the same error on every rank
        arguments = {k: v for k, v in kwargs.items() if k != "odc_config"}
        training_args = self._odc_argument("args", args, arguments)
        evaluation = self._odc_argument("eval_dataset", args, arguments)
        datasets = {"train_dataset": self._odc_argument("train_dataset", args, arguments)}
        if isinstance(evaluation, dict):
            datasets.update({f"eval_dataset[{key!r}]": value for key, value in evaluation.items()})
        elif evaluation is not None:
            datasets["eval_dataset"] = evaluation
        formatting_func = self._odc_argument("formatting_func", args, arguments)
        for name, dataset in datasets.items():
            check_sft_columns(dataset, training_args, formatting_func, name)
        super().__init__(*args, **kwargs)
        check_trl_sft(self)
        if getattr(self.args, "packing", False):
            raise ValueError(
                "odc_hf packs each microbatch itself (padding-free, per-document position_ids, planned by "
                "the load balancer); set packing=False in SFTConfig"
            )

    def odc_base_fused_head(self) -> bool:  # SFTTrainer.compute_loss runs TRL's fused LM head
        return True

    def odc_mask_keys(self) -> tuple[str, ...]:
        # TRL folds the masks its settings enable into ``labels`` while preparing the dataset (and refuses a dataset
        # whose preparation is skipped that has masks but no labels); its collator then reads ``labels`` only. So
        # does odc_hf's: a mask column TRL left in place (``completion_only_loss`` off, or a dataset that came with
        # labels) is not for training.
        return ()

    def odc_restore_after_probe(self):
        # TRL's compute_loss records its metrics and token count on every call: the probe's call must not count
        metrics, tokens = logged_metrics(self), total_train_tokens(self)
        lengths = {k: len(v) for k, v in metrics.items()}

        def restore():
            for key in list(metrics):
                if key in lengths:
                    del metrics[key][lengths[key] :]
                else:
                    del metrics[key]
            set_total_train_tokens(self, tokens)

        return restore

    def odc_before_bundle(self):
        metrics = logged_metrics(self)
        return {k: len(metrics[k]) if k in metrics else 0 for k in (*_AVERAGED, "aux_loss")}, total_train_tokens(self)

    def odc_after_bundle(self, snapshot, bundle) -> None:
        lengths, tokens_before = snapshot
        metrics = logged_metrics(self)
        label_tokens = [float(mb["num_label_tokens"]) for mb in bundle.microbatches]
        values = []
        for key in _AVERAGED:
            new = metrics[key][lengths[key] :] if key in metrics else []
            if new:
                if len(new) != len(label_tokens):
                    raise RuntimeError(f"odc_hf: TRL recorded {len(new)} {key} values for {len(label_tokens)} "
                                       f"microbatches; expected one per microbatch (trl {TESTED_TRL})")  # fmt: skip
                values += [sum(v * n for v, n in zip(new, label_tokens)), sum(label_tokens)]
            else:
                values += [0.0, 0.0]
        values.append(float(total_train_tokens(self) - tokens_before))
        vector = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            vector = self.accelerator.reduce(vector, reduction="sum")
        vector = vector.tolist()
        for i, key in enumerate(_AVERAGED):
            if key in metrics:
                del metrics[key][lengths[key] :]
            if vector[2 * i + 1] > 0:  # over every label token of every rank
                metrics[key].append(vector[2 * i] / vector[2 * i + 1])
        set_total_train_tokens(self, tokens_before + int(vector[-1]))
        metrics["num_tokens"] = [total_train_tokens(self)]
        if self.aux_loss_enabled:  # MoE: TRL's one value per microbatch, every rank's (a rank may have none)
            local = metrics["aux_loss"][lengths["aux_loss"] :]
            metrics["aux_loss"][lengths["aux_loss"] :] = every_rank_values(self.accelerator, local)


def check_sft_columns(dataset, args, formatting_func, name: str = "train_dataset") -> None:
    """Raise when TRL's SFTTrainer would find no text to read in ``dataset`` (a ``datasets.Dataset``): none of
    ``dataset_text_field`` (``"text"`` by default), ``messages`` / ``conversations`` (conversational), ``prompt`` with
    ``completion``, or an already tokenized ``input_ids``, and no ``formatting_func``. TRL would fail in its dataset
    preparation, which the main process runs first while the other ranks wait: rank 0 with ``KeyError: 'text'``, the
    others with a lost connection that names no cause. Every rank runs this on the same dataset before that, so every
    rank raises this message. Skipped where TRL skips the preparation (``skip_prepare_dataset``, image data)."""
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list) or formatting_func is not None:
        return  # an IterableDataset without known columns, a DatasetDict, ...: TRL's own checks
    skip = (getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset")
    if skip or {"image", "images"} & set(columns) or "input_ids" in columns:
        return
    if "prompt" in columns and "completion" not in columns:
        raise ValueError(
            f"{name} has a 'prompt' column but no 'completion' column (its columns are {columns}): TRL's SFTTrainer "
            "reads 'prompt' as the first part of prompt-completion data. Add a 'completion' column, or rename "
            "'prompt' and set dataset_text_field to it"
        )
    text_field = getattr(args, "dataset_text_field", None) or "text"  # None: TRL builds a default SFTConfig
    if {text_field, "messages", "conversations", "prompt"} & set(columns):
        return
    features = getattr(dataset, "features", None) or {}
    texts = [c for c in columns if getattr(features.get(c), "dtype", None) in ("string", "large_string")]
    setting = "dataset_text_field to the text's column"
    if len(texts) == 1:
        setting = f"dataset_text_field={texts[0]!r}"
    raise ValueError(
        f"{name} has no column TRL's SFTTrainer can train on: its columns are {columns}. SFTTrainer reads the text "
        f"from the column dataset_text_field names ({text_field!r}), from 'messages' (conversations), from 'prompt' "
        f"and 'completion', or tokens from 'input_ids'. Set {setting} (SFTConfig / ODCSFTConfig, or "
        "--dataset_text_field on a recipe's command line), rename the column, or pass a formatting_func"
    )


class ODCSFTTrainer(_SFTPart, ODCMixin, SFTTrainer):
    """``trl.SFTTrainer`` with ODC."""

    odc_compute_path = True


def make_odc_sft_trainer(sft_cls: type[SFTTrainer]) -> type[SFTTrainer]:
    """``ODCX = make_odc_sft_trainer(X)`` for a subclass X of ``trl.SFTTrainer``: ``class ODCX(_SFTPart, ODCMixin, X)``,
    as ``ODCSFTTrainer``."""
    return type(f"ODC{sft_cls.__name__}", (_SFTPart, ODCMixin, sft_cls),
                {"__module__": __name__, "odc_compute_path": True})  # fmt: skip


__all__ = ["ODCSFTTrainer", "check_sft_columns", "make_odc_sft_trainer"]
