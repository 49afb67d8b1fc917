"""The labels of a ``data_collator`` you give a trainer: read from it, checked, and trained on.

odc_hf packs every microbatch itself (:class:`~odc_hf.integrations.trainer.bundle.BundleCollator`), so the collator a
Trainer was given does not build the training batches. It may still decide what is trained: transformers'
``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` sets the label of every pad token to -100, so where the pad
token is the end-of-text token (a common setting) no end-of-text token is trained; a collator of your own may mask
prompts or other spans. Before the first step, :func:`collator_labels` runs your collator as the Trainer would run it
(its unused columns removed) on the first examples, and reads its labels at each example's tokens:

- no labels, or labels equal to the dataset's (``labels``, else ``input_ids``) at every predicted token: odc_hf packs
  the dataset's labels, as without a collator;
- other labels, the same on every call and whichever examples share its batch: each packed microbatch takes its labels
  from your collator, called once on the microbatch's examples (the Trainer calls it once per batch);
- a collator that changes the tokens, whose labels change from call to call (random masking) or depend on the batch's
  other examples, or whose batch is laid out otherwise than one row per example or one row for all: refused, by the
  collator's name and what differed.

A label is compared where the model predicts it: every token of a document but its first (whose label no packed or
single-document row trains). Padding the collator adds (rows' ``attention_mask`` zeros, or positions after the
examples' tokens) must carry no label.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["CollatorLabels", "collator_labels", "CHECKED_EXAMPLES"]

CHECKED_EXAMPLES = 8
"""Examples (the dataset's first non-empty ones) the collator is run on before training."""

IGNORE = -100


class _Mismatch(Exception):
    """The collator's batch does not hold the examples' tokens as they are (the message says where)."""


def _ids(values) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


def _rows(batch: Mapping[str, Any]) -> list[tuple[list[int], list[int] | None]]:
    """Per row of a collated batch: its tokens and labels at the positions its ``attention_mask`` keeps (all when there
    is none)."""
    ids = torch.as_tensor(batch["input_ids"])
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    labels, mask = batch.get("labels"), batch.get("attention_mask")
    labels = None if labels is None else torch.as_tensor(labels).reshape(ids.shape)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).reshape(ids.shape).bool()
    return [(ids[r][mask[r]].tolist(), None if labels is None else labels[r][mask[r]].tolist())
            for r in range(ids.shape[0])]  # fmt: skip


def labels_per_document(batch, documents: Sequence[Sequence[int]]) -> list[list[int]] | None:
    """The collator's labels of each document (``None``: its batch has no labels), from a batch of one row per document
    or one row holding them all in order. Raises :class:`_Mismatch` where the tokens are not the documents'."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        found = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise _Mismatch(f"its batch has no input_ids (it returned {found})")
    rows = _rows(batch)
    if len(rows) == len(documents):
        layout = [(row, [d]) for row, d in zip(rows, documents)]
    elif len(rows) == 1:
        layout = [(rows[0], list(documents))]
    else:
        raise _Mismatch(f"it returned {len(rows)} rows for {len(documents)} examples")
    out: list[list[int]] = []
    has_labels = rows[0][1] is not None
    number = 0
    for (tokens, labels), docs in layout:
        start = 0
        for doc in docs:
            got = tokens[start : start + len(doc)]
            if got != list(doc):
                at = next((i for i, (a, b) in enumerate(zip(got, doc)) if a != b), min(len(got), len(doc)))
                seen = got[at] if at < len(got) else "nothing"
                raise _Mismatch(f"example {number}, token {at}: {seen} where the dataset has {doc[at]}")
            if has_labels:
                out.append(labels[start : start + len(doc)])
            start += len(doc)
            number += 1
        if has_labels and any(label != IGNORE for label in labels[start:]):
            raise _Mismatch(f"it labels {len(tokens) - start} positions after the examples' tokens")
    return out if has_labels else None


def _predicted(labels: Sequence[int]) -> list[int]:
    """The labels a causal LM predicts: all but the first of a document."""
    return list(labels[1:])


def _first_difference(mine: list[list[int]], theirs: list[list[int]]) -> tuple[int, int, int, int] | None:
    """``(example, position, dataset's label, collator's label)`` of the first predicted label that differs."""
    for number, (a, b) in enumerate(zip(mine, theirs)):
        for position, (x, y) in enumerate(zip(_predicted(a), _predicted(b)), start=1):
            if x != y:
                return number, position, x, y
    return None


class CollatorLabels:
    """Labels from a data collator, per document of a microbatch: ``CollatorLabels(collate)(examples)`` runs
    ``collate`` (the collator as the Trainer calls it) once on the examples and returns each example's labels.

    A microbatch whose tokens the collator changed raises: :func:`collator_labels` checked the first examples, not
    every one."""

    def __init__(self, collate: Callable, name: str):
        self.collate = collate
        self.name = name

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        documents = [_ids(e["input_ids"]) for e in examples]
        try:
            labels = labels_per_document(self.collate(list(examples)), documents)
        except _Mismatch as error:
            raise ValueError(f"odc_hf: the data_collator ({self.name}) changed the tokens of a microbatch ({error}); "
                             "odc_hf trains on the dataset's input_ids as they are") from None  # fmt: skip
        if labels is None:
            raise ValueError(f"odc_hf: the data_collator ({self.name}) returned no labels for a microbatch, where it "
                             "did for the first examples")  # fmt: skip
        return labels


def collator_labels(collate: Callable, name: str, dataset, *, is_main_process: bool = True) -> CollatorLabels | None:
    """What a user's data collator means for training (see the module's text): ``None`` when the dataset's labels are
    its labels, a :class:`CollatorLabels` when the labels come from it; raises ``ValueError``, naming the collator,
    where its labels cannot be trained on packed rows.

    ``collate`` is the collator as the Trainer calls it (unused columns removed), ``name`` the user's collator's
    class. Runs it ``CHECKED_EXAMPLES + 2`` times on the dataset's first non-empty examples; no collective."""
    examples = []
    for index in range(min(len(dataset), 16 * CHECKED_EXAMPLES)):
        example = dataset[index]
        if len(example["input_ids"]):
            examples.append(example)
        if len(examples) == CHECKED_EXAMPLES:
            break
    if not examples:
        return None
    documents = [_ids(e["input_ids"]) for e in examples]
    own = [_ids(e["labels"]) if e.get("labels") is not None else list(d) for e, d in zip(examples, documents)]
    advice = ("put the tokens and labels you want trained in the dataset (input_ids, labels: dataset.map) and pass "
              "no data_collator")  # fmt: skip
    try:
        together = labels_per_document(collate(list(examples)), documents)
        if together is None:
            return None  # no labels: the dataset's, as odc_hf trains without a collator
        again = labels_per_document(collate(list(examples)), documents)
        alone = [labels_per_document(collate([e]), [d])[0] for e, d in zip(examples, documents)]
    except _Mismatch as error:
        raise ValueError(
            f"odc_hf: the data_collator ({name}) does not keep the dataset's tokens as they are ({error}); odc_hf "
            f"packs the dataset's input_ids itself and can take only labels from a collator: {advice}"
        ) from None
    if [_predicted(x) for x in again] != [_predicted(x) for x in together]:
        raise ValueError(
            f"odc_hf: the data_collator ({name}) returns other labels each time it is called on the same examples "
            f"(random masking?); odc_hf cannot reproduce them on its packed rows: {advice}"
        )
    differs = _first_difference(together, alone)
    if differs is not None:
        number, position, batched, single = differs
        raise ValueError(
            f"odc_hf: the data_collator ({name}) labels example {number} differently with other examples beside it "
            f"(token {position}: {batched} in a batch, {single} alone); odc_hf packs other examples together than "
            f"the Trainer batches: {advice}"
        )
    differs = _first_difference(own, together)
    if differs is None:
        return None
    number, position, dataset_label, label = differs
    if is_main_process:
        changed = sum(a != b for x, y in zip(own, together) for a, b in zip(_predicted(x), _predicted(y)))
        total = sum(len(x) - 1 for x in own)
        logger.info(
            "odc_hf: training on the labels of the data_collator (%s): they differ from the dataset's at %d of %d "
            "predicted tokens of the first %d examples (example %d, token %d: %d, dataset %d)", name, changed, total,
            len(examples), number, position, label, dataset_label,
        )  # fmt: skip
    return CollatorLabels(collate, name)
