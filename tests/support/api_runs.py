"""Runs of odc_hf's public entry points for tests/project/test_public_api.py, and their single-process references.

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml tests/support/api_runs.py loops OUT
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml tests/support/api_runs.py trainers OUT
    python tests/support/api_runs.py trainers-reference OUT

``loops``: a user's own accelerate loop (docs/quickstart.md), once with ``ODCAccelerator(...).prepare`` and once with
``odc_hf.prepare(Accelerator(), ...)``. ``trainers``: ``ODCTrainer`` on a plain transformers causal-LM task and
``make_odc_trainer`` on a user's Trainer subclass (label-smoothed loss), and ``ODCTrainer`` given transformers'
causal-LM data collator (documents ending with the end-of-text token, which is also the pad token: the collator
labels none of them), ``ODCTrainer`` with the Trainer's ``label_smoothing_factor``, and on a LoRA model; ``trainers-reference``: the same Trainer classes without ODC, in one process on each whole
minibatch, and the control ``end_of_text_trained`` (those documents, every token trained). :func:`loop_reference` is the loops' reference:
plain torch, one process, every sample of a minibatch alone through the unsharded model.

Data, model and step count are those of tests/support/sft_runs.py (stdlib text, LB-Mini, the last rank without microbatches
in the first step); each run writes ``OUT/<name>.json`` (per-step loss and gradient norm, microbatch counts) and
its final weights (``OUT/<name>.pt`` for loops, a saved model in ``OUT/<name>/`` for trainers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sft_runs
import torch
import torch.nn.functional as F

STEPS = 4  # step 1: the last rank runs no microbatch; later steps: uneven counts (see sft_runs)
LR = 1e-3
LABEL_SMOOTHING = 0.1


def _model_and_data(attn: str):
    import odc_hf.attention  # noqa: F401 - registers attn_implementation="sdpa_varlen"
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, seed=sft_runs.SEED)
    model.set_attn_implementation(attn)
    return tokenizer, model, sft_runs.dataset(tokenizer)


def _sampler_cls():
    from odc_hf.balance import ODCBatchSampler

    return sft_runs.zero_rank_on_first_step(ODCBatchSampler)


# -- a user's accelerate loop ---------------------------------------------------------------------------------------
def _loop(accelerator, model, optimizer, tokenizer, data) -> dict:
    from accelerate.utils import send_to_device
    from torch.utils.data import DataLoader

    from odc_hf.balance import FlopCostModel
    from odc_hf.integrations.trainer.bundle import BundleCollator, BundleDataset

    sampler = _sampler_cls()([len(x) for x in data["input_ids"]], world_size=accelerator.num_processes,
                             rank=accelerator.process_index, minibatch_size=8, seed=sft_runs.SEED,
                             max_tokens_per_microbatch=sft_runs.BUDGET,
                             cost_model=FlopCostModel.from_config(accelerator.unwrap_model(model).config))  # fmt: skip
    collator = BundleCollator(max_tokens_per_microbatch=sft_runs.BUDGET, pad_token_id=tokenizer.pad_token_id)
    loader = DataLoader(BundleDataset(data), batch_sampler=sampler, collate_fn=collator)
    history, counts = [], []
    for step, bundle in zip(range(STEPS), loader):
        local_tokens = sum(mb.pop("num_label_tokens") for mb in bundle)
        global_tokens = accelerator.reduce(torch.tensor(float(local_tokens), device=accelerator.device), "sum")
        loss_sum = torch.zeros((), device=accelerator.device)
        for mb in bundle:
            loss = model(**send_to_device(mb, accelerator.device), num_items_in_batch=global_tokens).loss
            accelerator.backward(loss)
            loss_sum += loss.detach()
        accelerator.odc.finish_minibatch(local_tokens)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        loss = accelerator.reduce(loss_sum, "sum")
        count = accelerator.gather(torch.tensor([len(bundle)], device=accelerator.device))
        history.append({"step": step + 1, "loss": float(loss), "grad_norm": float(grad_norm)})
        counts.append(count.tolist())
    weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # collective: every rank
    accelerator.odc.close()
    return {"history": history, "microbatches": counts, "weights": weights}


def run_loops(out: Path) -> None:
    from accelerate import Accelerator

    import odc_hf
    from odc_hf import ODCAccelerator, ODCConfig

    config = ODCConfig(timeout_s=300)
    results = {}
    for name in ("odc_accelerator", "odc_hf_prepare"):
        tokenizer, model, data = _model_and_data("sdpa_varlen")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        if name == "odc_accelerator":
            accelerator = ODCAccelerator(odc_config=config)
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            accelerator = Accelerator()
            model, optimizer = odc_hf.prepare(accelerator, model, optimizer, odc_config=config)
        assert accelerator.odc is not None and accelerator.num_processes == 2
        results[name] = _loop(accelerator, model, optimizer, tokenizer, data)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        for name, result in results.items():
            torch.save(result.pop("weights"), out / f"{name}.pt")
            (out / f"{name}.json").write_text(json.dumps(result))


def loop_reference() -> dict:
    """The loops' reference: one process, no ODC, no accelerate; each minibatch's samples one by one through the
    unsharded model, token cross-entropies summed and divided by the minibatch's token count."""
    tokenizer, model, data = _model_and_data("sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    order = sft_runs.minibatch_order(len(data))
    history = []
    for step in range(STEPS):
        samples = [torch.tensor([data[i]["input_ids"]]) for i in order[8 * step : 8 * (step + 1)]]
        total = sum(ids.numel() - 1 for ids in samples)
        loss = sum(F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum") for ids in samples)
        loss = loss / total
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        history.append({"step": step + 1, "loss": loss.item(), "grad_norm": float(grad_norm)})
    return {"history": history, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- Trainers ---------------------------------------------------------------------------------------------------------
def label_smoothing_trainer():
    """A user's Trainer subclass: label-smoothed token cross-entropy, summed, divided by the step's token count."""
    from transformers import Trainer

    class LabelSmoothingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                                   label_smoothing=LABEL_SMOOTHING, reduction="sum")  # fmt: skip
            loss = loss / (num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum())
            return (loss, outputs) if return_outputs else loss

    return LabelSmoothingTrainer


def _training_args(out: Path, **changes):
    from transformers import TrainingArguments

    fields = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=LR,
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=sft_runs.SEED,
                  logging_steps=1, save_strategy="no", report_to="none", dataloader_drop_last=True, disable_tqdm=True)  # fmt: skip
    return TrainingArguments(**{**fields, **changes})


def _pad_collator(pad_token_id: int):
    """The reference's batches: rows right-padded, padding masked out of attention and labels."""

    def collate(examples):
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), pad_token_id)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, e in enumerate(examples):
            ids[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
            mask[row, : len(e["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return collate


def with_end_of_text(data, tokenizer):
    """Every document ending with the end-of-text token, as tokenized training text usually does (here the pad
    token too)."""
    return data.map(lambda example: {"input_ids": example["input_ids"] + [tokenizer.eos_token_id]})


def run_trainers(out: Path, reference: bool) -> None:
    from transformers import DataCollatorForLanguageModeling, Trainer

    from odc_hf import ODCConfig, ODCTrainer, make_odc_trainer

    classes = {"plain_trainer": (Trainer, ODCTrainer)}
    user = label_smoothing_trainer()
    classes["user_subclass"] = (user, make_odc_trainer(user))
    # transformers' causal-LM collator, given by the user: it sets the pad token's labels to -100 (here the
    # end-of-text token's, which ends every document): ODC must train on its labels, not the dataset's
    classes["lm_collator"] = (Trainer, ODCTrainer)
    # the Trainer's own label smoothing: it shifts the labels for a causal LM by the model's class name, which
    # FSDP2's sharding changes (the sharded run compared each position's logits with its own token: loss 7.28
    # against the Trainer's 8.31 at step 1, measured)
    classes["label_smoothing"] = (Trainer, ODCTrainer)
    # a LoRA model the user made (a PeftModel): odc_hf's fused loss goes inside the adapter
    classes["lora"] = (Trainer, ODCTrainer)
    if reference:  # the control: the same documents with every end-of-text token trained
        classes["end_of_text_trained"] = (Trainer, None)
    for name, (plain, with_odc) in classes.items():
        tokenizer, model, data = _model_and_data("sdpa" if reference else "sdpa_varlen")
        collator = None
        changes = {"label_smoothing_factor": LABEL_SMOOTHING} if name == "label_smoothing" else {}
        if name in ("lm_collator", "end_of_text_trained"):
            data = with_end_of_text(data, tokenizer)
        if name == "lm_collator":
            collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        if name == "lora":
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(sft_runs.SEED)  # the adapter's random init: the same in every process
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                     init_lora_weights=False))  # fmt: skip
        if reference:
            data = data.select(sft_runs.minibatch_order(len(data)))
            args = _training_args(out / name, per_device_train_batch_size=8, train_sampling_strategy="sequential",
                                  use_cpu=True, **changes)  # fmt: skip
            trainer = plain(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                            data_collator=collator or _pad_collator(tokenizer.pad_token_id))  # fmt: skip
            assert trainer.accelerator.num_processes == 1
        else:
            cls = type(f"ZeroFirst{with_odc.__name__}", (with_odc,), {"odc_sampler_class": _sampler_cls()})
            trainer = cls(model=model, args=_training_args(out / name, **changes), train_dataset=data, processing_class=tokenizer,
                          data_collator=collator,
                          odc_config=ODCConfig(max_tokens_per_microbatch=sft_runs.BUDGET, timeout_s=300))  # fmt: skip
            assert trainer.accelerator.num_processes == 2 and isinstance(trainer, plain)
        trainer.train()
        trainer.save_model()
        result = {"history": sft_runs.trainer_history(trainer), "class": type(trainer).__name__}
        if not reference:
            assert trainer.odc is not None
            result["microbatches"] = [s.microbatches for s in trainer.odc_stats.steps]
            trainer.odc.close()
        if trainer.accelerator.is_main_process:
            (out / f"{name}.json").write_text(json.dumps(result))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["loops", "trainers", "trainers-reference"])
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "loops":
        run_loops(args.out)
    else:
        run_trainers(args.out, reference=args.what == "trainers-reference")


if __name__ == "__main__":
    main()
