"""``load_best_model_at_end`` under ODC: what odc_hf refuses, and the checkpoints its loader refuses, by name.
(The best model loaded into the sharded model and published: tests/trainers/test_trainer_sft_parity.py.)"""

from __future__ import annotations

import pytest


def _build_adapter_trainer(rank, world, output_dir):
    """ODCSFTTrainer of a LoRA adapter with load_best_model_at_end, on every rank; the error each rank raised."""
    import os

    from datasets import Dataset
    from peft import LoraConfig

    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    os.environ["ACCELERATE_USE_CPU"] = "true"
    tokenizer = default_tokenizer()
    args = ODCSFTConfig(output_dir=output_dir, max_steps=1, per_device_train_batch_size=2, max_length=64, bf16=False,
                        use_cpu=True, report_to="none", eval_strategy="steps", save_strategy="steps", eval_steps=1,
                        save_steps=1, load_best_model_at_end=True)  # fmt: skip
    data = Dataset.from_dict({"text": ["def f(x):\n    return x\n"] * 8})
    try:
        ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=args, train_dataset=data, eval_dataset=data,
                      processing_class=tokenizer, peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
                      odc_config=ODCConfig(timeout_s=30))  # fmt: skip
    except ValueError as err:
        return str(err)
    return None


def test_an_adapters_best_model_on_cpu_processes_is_refused_before_training(tmp_path):
    from odc_hf.testing import run_ranks

    errors = run_ranks(_build_adapter_trainer, 2, str(tmp_path), timeout_s=120)
    assert errors[0] == errors[1] and errors[0].startswith(
        "load_best_model_at_end=True with a PEFT adapter on CPU processes: odc_hf cannot load an adapter checkpoint "
        "into the sharded model there. Set load_best_model_at_end=False"), errors  # fmt: skip


class _Trainer:
    """What load_full_model reads of a trainer: its accelerator's unwrap_model."""

    def __init__(self, model):
        self.model = model
        self.accelerator = self

    def unwrap_model(self, model):
        return model


def _model(tied: bool = True):
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    return tiny_qwen2_model(default_tokenizer(), tie_word_embeddings=tied)


def test_a_checkpoint_without_whole_weights_is_refused_naming_what_it_holds(tmp_path):
    from odc_hf.integrations.checkpoint.sharded import CheckpointPartMissing, load_full_model

    with pytest.raises(CheckpointPartMissing, match=r"model\.safetensors \(the model's whole weights\) is missing "
                                                    r"\(no weights\)\. load_best_model_at_end needs"):  # fmt: skip
        load_full_model(_Trainer(None), str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointPartMissing, match=r"is missing \(the adapter's weights only\)\. .* load it from "
                                                    r"trainer\.state\.best_model_checkpoint after training"):  # fmt: skip
        load_full_model(_Trainer(None), str(tmp_path))


def test_whole_weights_load_and_a_missing_weight_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from odc_hf.integrations.checkpoint.sharded import CheckpointPartMissing, load_full_model

    saved = _model()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1.0)
    saved.save_pretrained(tmp_path / "whole")  # the tied lm_head is not written: not missing
    target = _model()
    load_full_model(_Trainer(target), str(tmp_path / "whole"))
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), target.state_dict().values()))
    saved.save_pretrained(tmp_path / "files", max_shard_size="100KB")  # a large model's several files and index
    assert len(list((tmp_path / "files").glob("model-*.safetensors"))) > 1
    target = _model()
    load_full_model(_Trainer(target), str(tmp_path / "files"))
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), target.state_dict().values()))
    state = {k: v.contiguous() for k, v in saved.state_dict().items() if k not in ("model.norm.weight", "lm_head.weight")}
    (tmp_path / "part").mkdir()
    save_file(state, str(tmp_path / "part" / "model.safetensors"))
    with pytest.raises(CheckpointPartMissing, match=r"lacks 1 of them \(model\.norm\.weight, \.\.\.\)"):
        load_full_model(_Trainer(_model()), str(tmp_path / "part"))


def test_an_untied_heads_weight_is_loaded_and_its_absence_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from odc_hf.integrations.checkpoint.sharded import CheckpointPartMissing, load_full_model

    saved = _model(tied=False)
    with torch.no_grad():
        saved.lm_head.weight.add_(1.0)
    saved.save_pretrained(tmp_path / "whole")
    target = _model(tied=False)
    load_full_model(_Trainer(target), str(tmp_path / "whole"))
    assert torch.equal(target.lm_head.weight, saved.lm_head.weight)
    assert not torch.equal(target.lm_head.weight, target.model.embed_tokens.weight)
    state = {k: v.contiguous() for k, v in saved.state_dict().items() if k != "lm_head.weight"}
    (tmp_path / "headless").mkdir()
    save_file(state, str(tmp_path / "headless" / "model.safetensors"))
    with pytest.raises(CheckpointPartMissing, match=r"lacks 1 of them \(lm_head\.weight, \.\.\.\)"):
        load_full_model(_Trainer(_model(tied=False)), str(tmp_path / "headless"))
