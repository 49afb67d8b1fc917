"""Checks of the training data the ODC trainers run before training, each raising with the numbers and the fix.

They run where the data enters (``ODCMixin.get_train_dataloader``, before any step; the emptiness check also in the
trainer's ``__init__``, before TRL reads the first row): an empty dataset, a dataset with no sample longer than one
token (nothing to train on), a dataset smaller than one global minibatch that ``dataloader_drop_last`` would drop
whole (the Trainer would then run zero steps), and samples longer than the token budget of one microbatch, which is
resolved here (:func:`resolve_max_tokens`: one function for every trainer, each with its rule) and checked once.
"""

from __future__ import annotations

import logging

import torch

from odc_hf.balance import padded_microbatch_width
from odc_hf.config import ODCConfig

logger = logging.getLogger(__name__)

TRUNCATE_SETTINGS = (
    "ODCConfig(truncate=True), `--odc_truncate true` (ODCTrainingArguments / ODCSFTConfig / ODCGRPOConfig), "
    "`--truncate` (examples/sft.py), or ODC_TRUNCATE=1 in the environment (also reaches recipes run through "
    "`python -m odc_hf.run`)"
)
"""Every way to switch truncation on, for error messages."""


def train_lengths(dataset) -> list[int]:
    """Token count of every sample of a map-style training dataset with an ``input_ids`` column."""
    if dataset is None:
        raise ValueError("Trainer: training requires a train_dataset")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(
            "odc_hf plans each minibatch from sample lengths, so it needs a map-style dataset; got an iterable "
            "one (streaming, or accelerate's dispatch_batches): load it without streaming"
        )
    if "input_ids" not in getattr(dataset, "column_names", ["input_ids"]):
        raise ValueError("odc_hf needs a tokenized dataset with an 'input_ids' column")
    check_not_empty(dataset)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    check_something_to_train(lengths)
    return lengths


EMPTY_DATASET = (
    "train_dataset is empty (0 samples): check the data loading and filtering before training (TRL drops samples "
    "that are fully masked or empty after tokenisation)"
)


def check_not_empty(dataset) -> None:
    """An empty training dataset is an error saying so. Called before TRL's trainers see it too: SFTTrainer's
    ``__init__`` reads the first row, and an empty dataset ended there in a bare ``StopIteration``."""
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(EMPTY_DATASET)


def check_something_to_train(lengths: list[int]) -> None:
    """Samples that tokenized to nothing, or to a single token, hold no next-token target: if every sample is such,
    training has nothing to learn from (every step's loss would be 0.0, with no gradient). Refuse it, naming the data
    as the cause (the token budget, derived from the longest sample, would otherwise be reported as 0)."""
    if lengths and max(lengths) <= 1:
        raise ValueError(
            f"every one of the {len(lengths)} training samples tokenized to {max(lengths)} token(s) or fewer, so there "
            "is no next-token target to train on: the text column is empty (or holds only whitespace / special "
            "tokens). Check the dataset's text field (SFTConfig.dataset_text_field) and its formatting"
        )


def check_minibatch_fits(num_samples: int, *, per_device: int, accumulation: int, world: int, drop_last: bool,
                         global_batch_size: int | None = None) -> None:  # fmt: skip
    """With ``drop_last`` a dataset smaller than one global minibatch gives zero steps: refuse it, saying what to change.

    Without ``drop_last`` the last, partial minibatch is planned and trained as the Trainer's own dataloader
    trains a last partial batch, so that is the alternative the message offers. ``global_batch_size``: ODCConfig's,
    which replaces ``per_device x accumulation x world`` when set.
    """
    minibatch = global_batch_size or per_device * accumulation * world
    if drop_last and num_samples < minibatch:
        made_of = (f"ODCConfig.global_batch_size {global_batch_size}" if global_batch_size else
                   f"per_device_train_batch_size {per_device} x gradient_accumulation_steps {accumulation} x {world} "
                   "processes")  # fmt: skip
        lower = "global_batch_size" if global_batch_size else "per_device_train_batch_size or gradient_accumulation_steps"
        raise ValueError(
            f"the training dataset ({num_samples} samples) is smaller than one global minibatch ({minibatch} = "
            f"{made_of}), and dataloader_drop_last=True drops it, so no step would run. Lower {lower}, use more "
            "samples, or set dataloader_drop_last=False to train the partial minibatch"
        )


def packed_worst_case(lengths: list[int]) -> int:
    """The budget rule of the packed layout (SFT, Trainer): a microbatch is one packed row, so the smallest budget
    that holds every possible microbatch is the longest sample's."""
    return max(lengths)


def padded_worst_case(lengths: list[int], prompts: list[int], *, rows: int, multiple: int) -> int:
    """The budget rule of GRPO's layout: TRL's own widest microbatch, ``rows`` (``per_device_train_batch_size``) rows
    of the widest padded row these samples (prompt + completion ``lengths``, of which ``prompts``) could form, its
    columns rounded to ``multiple``."""
    return rows * padded_microbatch_width(prompts, [n - p for n, p in zip(lengths, prompts)], multiple)


def resolve_max_tokens(config: ODCConfig, lengths: list[int], worst_case: int, *, truncatable: bool = True,
                       is_main_process: bool = True) -> int:  # fmt: skip
    """The token budget of one microbatch, ``max_tokens_per_microbatch``, for training samples of ``lengths``:
    ``ODCConfig.max_tokens_per_microbatch`` (validated where it entered, in ODCConfig), else ``worst_case``, the
    trainer's rule (:func:`packed_worst_case`, :func:`padded_worst_case`; docs/configuration.md). Samples longer
    than it are checked here, once: an error naming every way to raise it, and, where the trainer truncates
    (``truncatable``, SFT / Trainer), to truncate, or with ``ODCConfig.truncate`` one log line. From here on the
    value is passed on trusted (attention warm-up, checkpointing, the sampler and the collator)."""
    max_tokens = config.max_tokens_per_microbatch or worst_case
    too_long = [n for n in lengths if n > max_tokens]
    if not too_long:
        return max_tokens
    if not truncatable:
        raise ValueError(
            f"a prompt + completion has {max(lengths)} tokens, more than max_tokens_per_microbatch={max_tokens}; raise "
            "it (ODCConfig.max_tokens_per_microbatch, --odc_max_tokens_per_microbatch, ODC_MAX_TOKENS_PER_MICROBATCH) "
            "or unset it (then TRL's own widest microbatch); GRPO samples are never truncated"
        )  # fmt: skip
    if not config.truncate:
        raise ValueError(
            f"{len(too_long)} of {len(lengths)} training samples are longer than max_tokens_per_microbatch={max_tokens} "
            f"(the longest has {max(too_long)} tokens). Raise the budget (ODCConfig.max_tokens_per_microbatch, "
            "--odc_max_tokens_per_microbatch, ODC_MAX_TOKENS_PER_MICROBATCH), filter the data, or cut them to the "
            f"budget with {TRUNCATE_SETTINGS}"
        )
    if is_main_process:
        logger.warning(
            "odc_hf: truncating %d of %d training samples to max_tokens_per_microbatch=%d tokens (the longest has "
            "%d); their tokens beyond the budget are not trained on", len(too_long), len(lengths), max_tokens,
            max(too_long),
        )  # fmt: skip
    return max_tokens


def warn_no_label_tokens(step: int, mask_keys: tuple[str, ...]) -> None:
    """A step whose minibatch holds no label token trains nothing (loss 0.0, zero gradient): a warning naming the
    step and the likely causes. Not an error: a TRL user's run with an occasional fully masked minibatch (completion-
    or assistant-only loss on short answers) goes on, as TRL's own would; every step warning means the data is wrong."""
    logger.warning(
        "odc_hf: step %d has no label tokens in its whole minibatch (every rank): its loss is 0.0 and it trains "
        "nothing. Check the data: empty texts, or every target masked%s", step,
        f" by {' or '.join(mask_keys)}" if mask_keys
        else " (labels of -100, as TRL's completion_only_loss / assistant_only_loss set them)",
    )  # fmt: skip
