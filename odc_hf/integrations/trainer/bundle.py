"""A rank's bundle for one optimizer step: from dataset indices to packed, padding-free microbatches.

    loader = BundleLoader(BundleDataset(ds), batch_sampler=ODCBatchSampler(...),
                          collate_fn=BundleCollator(max_tokens_per_microbatch=..., pad_token_id=tok.pad_token_id))

yields, per optimizer step, this rank's microbatches (possibly none): ``ODCBatchSampler`` (``odc_hf.balance``) plans
the indices, :class:`BundleDataset` fetches the examples, :class:`BundleCollator` packs each microbatch into one row.
:class:`Bundle` is how the trainer holds them (``TrainerBundleCollator`` makes one).

Packing is TRL's ``DataCollatorForLanguageModeling(padding_free=True)``, the collator ``SFTTrainer``
itself uses: documents concatenated into one row, ``position_ids`` restarting at 0 per document, no
attention mask (transformers then derives a block-diagonal causal mask from ``position_ids``; an
all-ones mask would join the documents), the label of every document's first token set to -100 so no
token is predicted across a boundary, and ``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx`` for
varlen kernels.

Those boundaries are what the attention reads, once per forward, never per layer: transformers' flash path
(``flash_attention_4``, ``modeling_flash_attention_utils._flash_attention_forward``) hands ``cu_seq_lens_q/k`` (int32,
on the device with the batch) and ``max_length_q/k`` (Python ints) straight to the varlen kernel when all four are
there; from ``position_ids`` alone it would re-derive them in every layer (``_is_packed_sequence`` reads the positions
back to the host, ``prepare_fa_kwargs_from_position_ids`` runs a ``nonzero``: host syncs per layer). ``sdpa_varlen``
reads ``cu_seq_lens_q`` once per forward (cached across layers). ``position_ids`` stay for the rotary embedding and
transformers' mask code (one read per forward, ``find_packed_sequence_indices``). ``tests/attention/test_attention_boundaries.py``
checks what every layer receives. What it does not do, and this module adds: folding ``completion_mask`` /
``assistant_masks`` into the labels (TRL does that during dataset preparation), truncation to the
token budget, empty dummy microbatches, and ``num_label_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["MASK_KEYS", "Bundle", "BundleCollator", "BundleDataset", "BundleLoader", "TrainerBundleCollator"]

MASK_KEYS = ("completion_mask", "assistant_masks")
"""Optional per-token 0/1 columns; tokens where any of them is 0 get label -100."""


class BundleDataset(torch.utils.data.Dataset):
    """Map-style view whose items are microbatches: ``dataset_view[[i, j, ...]] -> [example_i, example_j, ...]``.

    Use it with the sampler as a *batch* sampler, ``DataLoader(BundleDataset(ds), batch_sampler=sampler,
    collate_fn=BundleCollator(...))``: each "batch" the sampler yields is one bundle (a list of microbatches),
    the DataLoader fetches ``[view[mb] for mb in bundle]`` and the collator packs it. Being a plain batch
    sampler is what lets accelerate's ``skip_first_batches`` (Trainer resume) skip whole bundles.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, microbatch: Sequence[int]) -> list[Any]:
        return [self.dataset[int(i)] for i in microbatch]


def _as_list(values) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


class BundleCollator:
    """Collate ``list[list[example]]`` (microbatches of examples) into ``list[dict]`` of packed rows.

    Each dict has ``input_ids``, ``position_ids``, ``labels`` of shape (1, T) plus TRL's varlen keys,
    and ``num_label_tokens``: the number of tokens that contribute to the causal-LM loss (labels !=
    -100 after the model's one-position shift), so the trainer can normalise by the GLOBAL count.
    ``num_label_tokens`` is not a model input: pop it before ``model(**microbatch)``.

    An empty microbatch (a dummy step of an FSDP plan) becomes one ``pad_token_id`` token with label
    -100 and ``num_label_tokens == 0``: the rank still runs forward/backward, contributing no loss.

    Args:
        max_tokens_per_microbatch: if set, a packed microbatch longer than this raises ValueError
            (the planner should have prevented it), unless ``truncate`` applies. Taken as given: the budget is
            validated where it enters (``ODCConfig``, ``ODCBatchSampler``) and reaches the collator from there.
        truncate: cut every document to ``max_tokens_per_microbatch`` tokens (pairs with the sampler's
            ``truncate=True``).
        pad_token_id: token of dummy microbatches (never trained on).
        mask_keys: which 0/1 columns mask labels (default both of ``MASK_KEYS``; TRL's SFT trainer passes none: it
            folds the masks its settings enable into ``labels`` while preparing the dataset).
        labels_from: where a microbatch's labels come from instead of its examples' ``labels`` (else ``input_ids``):
            a callable taking the microbatch's examples and returning each one's labels (the trainers pass a
            :class:`~odc_hf.integrations.trainer.collator_labels.CollatorLabels` for a data collator that builds
            labels of its own). Masks and truncation apply on top.
    """

    def __init__(
        self,
        *,
        max_tokens_per_microbatch: int | None = None,
        truncate: bool = False,
        pad_token_id: int = 0,
        mask_keys: Sequence[str] = MASK_KEYS,
        labels_from: Callable[[Sequence[Mapping[str, Any]]], list[list[int]]] | None = None,
    ):
        if truncate and max_tokens_per_microbatch is None:
            raise ValueError("truncate=True needs max_tokens_per_microbatch")
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.truncate = truncate
        self.pad_token_id = int(pad_token_id)
        self.mask_keys = tuple(mask_keys)
        self.labels_from = labels_from
        self._packer = DataCollatorForLanguageModeling(pad_token_id=self.pad_token_id, padding_free=True)

    def _document(self, example: Mapping[str, Any], labels=None) -> dict[str, list[int]]:
        """input_ids and labels of one example (``labels`` given: those), masks folded in, truncated if configured."""
        input_ids = _as_list(example["input_ids"])
        labels = example.get("labels") if labels is None else labels
        labels = list(input_ids) if labels is None else _as_list(labels)
        if len(labels) != len(input_ids):
            raise ValueError(f"example has {len(input_ids)} input_ids but {len(labels)} labels")
        for key in self.mask_keys:
            if example.get(key) is not None:
                mask = _as_list(example[key])
                if len(mask) != len(input_ids):
                    raise ValueError(f"example has {len(input_ids)} input_ids but {len(mask)} {key}")
                labels = [label if keep else -100 for label, keep in zip(labels, mask)]
        if self.truncate and len(input_ids) > self.max_tokens_per_microbatch:
            input_ids = input_ids[: self.max_tokens_per_microbatch]
            labels = labels[: self.max_tokens_per_microbatch]
        return {"input_ids": input_ids, "labels": labels}

    def collate_microbatch(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Pack one microbatch's examples into a single padding-free row."""
        examples = [example for example in examples if len(example["input_ids"])]
        labels = self.labels_from(examples) if self.labels_from is not None and examples else [None] * len(examples)
        documents = [self._document(example, own) for example, own in zip(examples, labels)]
        total = sum(len(doc["input_ids"]) for doc in documents)
        if self.max_tokens_per_microbatch is not None and total > self.max_tokens_per_microbatch:
            raise ValueError(
                f"microbatch has {total} tokens, more than max_tokens_per_microbatch="
                f"{self.max_tokens_per_microbatch}; plan with the same budget (and truncate setting)"
            )
        if not documents:
            documents = [{"input_ids": [self.pad_token_id], "labels": [-100]}]
        batch = self._packer(documents)
        batch["num_label_tokens"] = int((batch["labels"][:, 1:] != -100).sum())
        return batch

    def __call__(self, bundle: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
        return [self.collate_microbatch(examples) for examples in bundle]


class Bundle(Mapping):
    """This rank's microbatches for one optimizer step.

    As a Mapping it shows each key concatenated over the microbatches, which is what the Trainer's once-per-step
    helpers read (token counting, FLOP estimate); ``training_step`` iterates ``microbatches``. Its
    ``"attention_mask"`` (the packed rows have none) is 1 on every token of a document and 0 on the pad token of an
    empty microbatch, so the Trainer's ``include_num_input_tokens_seen="non_padding"`` counts the documents' tokens,
    an eos that is also the pad token included.
    """

    def __init__(self, microbatches: list[dict], empty: Sequence[bool] = ()):
        self.microbatches = microbatches
        self.empty = tuple(empty) or (False,) * len(microbatches)
        """Per microbatch, whether it held no document (its row is one pad token)."""

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "attention_mask" and not any(key in mb for mb in self.microbatches):
            return torch.cat([torch.zeros((1, 0), dtype=torch.long)]
                             + [torch.full_like(mb["input_ids"], 0 if empty else 1)
                                for mb, empty in zip(self.microbatches, self.empty)], dim=-1)  # fmt: skip
        parts = [mb[key] for mb in self.microbatches if isinstance(mb.get(key), torch.Tensor)]
        if not parts:
            if key == "input_ids":
                return torch.zeros((1, 0), dtype=torch.long)
            raise KeyError(key)
        return torch.cat(parts, dim=-1)

    def __iter__(self):
        keys = self.microbatches[0].keys() if self.microbatches else ("input_ids",)
        return iter(
            [k for k in keys if k == "input_ids" or isinstance(self.microbatches[0].get(k), torch.Tensor)]
        )

    def __len__(self) -> int:
        return len(list(iter(self)))

    @property
    def label_tokens(self) -> int:
        return sum(int(mb["num_label_tokens"]) for mb in self.microbatches)

    @property
    def input_tokens(self) -> int:
        return sum(int(mb["input_ids"].numel()) for mb in self.microbatches)


class TrainerBundleCollator(BundleCollator):
    """:class:`BundleCollator` whose bundles come out as :class:`Bundle` (what ``ODCMixin.training_step`` takes)."""

    def __call__(self, bundle):
        empty = [not any(len(example["input_ids"]) for example in examples) for examples in bundle]
        return Bundle(super().__call__(bundle), empty)


class BundleLoader(DataLoader):
    """DataLoader over bundles; ``set_epoch`` reaches the sampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
