"""Your own training loop with ODC: accelerate's FSDP plugin carrying ODC's options (docs/quickstart.md).

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml examples/own_loop.py   # CPU
    accelerate launch --config_file accelerate_configs/odc.yaml examples/own_loop.py                          # GPUs

``ODCFSDPPlugin`` holds FSDP2's options (accelerate's ``FullyShardedDataParallelPlugin`` fields) and ODC's
(``odc_config``); ``ODCAccelerator(fsdp_plugin=...)`` shards the model and installs ODC in ``prepare()``. The loop runs
this rank's microbatches of each global minibatch (ranks run different numbers of them, maybe none), then the one
synchronisation per minibatch, then the optimizer step. ``tests/trainers/test_fsdp_plugin.py`` runs :func:`train` on 2 CPU
ranks and checks every step against a single process on the whole minibatch.
"""

from __future__ import annotations

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from odc_hf import ODCAccelerator, ODCConfig, ODCFSDPPlugin
from odc_hf.balance import FlopCostModel, ODCBatchSampler
from odc_hf.integrations.trainer.bundle import BundleCollator, BundleDataset
from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model


def train(*, num_samples=64, minibatch_size=16, max_tokens_per_microbatch=1024, max_steps=None, lr=1e-3):
    """Train a tiny Qwen2-shaped model on the standard library's sources. Returns the accelerator, the model, the
    per-step global losses and the sampler (its ``minibatch_indices(step)`` is each step's global minibatch)."""
    plugin = ODCFSDPPlugin(odc_config=ODCConfig(timeout_s=120), reshard_after_forward=True)
    accelerator = ODCAccelerator(fsdp_plugin=plugin)
    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer)
    dataset = default_tokenized_dataset(tokenizer, num_samples, max_length=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = accelerator.prepare(model, optimizer)  # shards the model, installs ODC

    sampler = ODCBatchSampler([len(x) for x in dataset["input_ids"]], world_size=accelerator.num_processes,
                              rank=accelerator.process_index, minibatch_size=minibatch_size, drop_last=False,
                              max_tokens_per_microbatch=max_tokens_per_microbatch,
                              cost_model=FlopCostModel.from_config(model.config))  # fmt: skip
    collator = BundleCollator(max_tokens_per_microbatch=max_tokens_per_microbatch, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    loader = DataLoader(BundleDataset(dataset), batch_sampler=sampler, collate_fn=collator)

    losses = []
    for step, bundle in enumerate(loader):  # this rank's microbatches of one global minibatch (maybe none)
        if step == max_steps:
            break
        local_tokens = sum(mb.pop("num_label_tokens") for mb in bundle)
        local = torch.tensor(float(local_tokens), device=accelerator.device)
        global_tokens = accelerator.reduce(local, "sum")
        loss_sum = torch.zeros((), device=accelerator.device)
        for mb in bundle:
            # summed token loss / GLOBAL token count of the minibatch (transformers: reduction="sum" / num_items)
            loss = model(**send_to_device(mb, accelerator.device), num_items_in_batch=global_tokens).loss
            accelerator.backward(loss)
            loss_sum += loss.detach()
        # the one synchronisation per minibatch; gradients are ready after it
        accelerator.odc.finish_minibatch(local_tokens)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # the optimizer hook publishes the new shards (and zeroes the accumulators)
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss_sum, "sum").item())  # the minibatch's per-token loss
        norm = float(grad_norm)
        accelerator.print(f"step {step}: {len(bundle)} microbatches, loss {losses[-1]:.4f}, grad norm {norm:.3f}")  # fmt: skip
    return accelerator, model, losses, sampler


if __name__ == "__main__":
    accelerator, *_ = train()
    accelerator.odc.close()
