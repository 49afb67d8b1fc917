"""``ODCTrainer`` on a LoRA model (a ``PeftModel``): odc_hf's fused loss goes on the transformers model inside the
adapter, as TRL's fused head requires. Installed on the ``PeftModel`` itself it took the whole model's output for the
backbone's and every step failed (``'CausalLMOutputWithPast' object has no attribute 'last_hidden_state'``, measured).
Compared with transformers' Trainer on the same LoRA model and batches, in one process, on a tied and an untied head."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


def _pad(examples):
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        ids[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[row, : len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_odc_trainer_trains_a_lora_model_as_the_trainer(tmp_path, cpu, tie):
    from datasets import Dataset
    from fsdp_helpers import tiny_qwen2
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from odc_hf import ODCTrainer

    generator = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"input_ids": [torch.randint(5, 250, (n,), generator=generator).tolist()
                                            for n in (9, 17, 12, 30, 21, 14, 25, 8)]})  # fmt: skip

    def run(cls, name, **kwargs):
        model = get_peft_model(tiny_qwen2(tie=tie), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                               lora_dropout=0.0, init_lora_weights=False))  # fmt: skip
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-2, use_cpu=True, report_to="none", disable_tqdm=True,
                                 save_strategy="no", logging_steps=1, train_sampling_strategy="sequential")  # fmt: skip
        trainer = cls(model=model, args=args, train_dataset=data, **kwargs)
        trainer.train()
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]

    class InOrder(ODCTrainer):  # the Trainer's sequential order: the same samples in each step
        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            loader.batch_sampler.minibatch_indices = lambda step: list(range(4 * step, 4 * step + 4))
            return loader

    ours, reference = run(InOrder, "odc"), run(Trainer, "trainer", data_collator=_pad)
    for (loss, norm), (their_loss, their_norm) in zip(ours, reference, strict=True):
        assert loss == pytest.approx(their_loss, rel=1e-6) and norm == pytest.approx(their_norm, rel=1e-4)
