"""The first microbatch checks that the trainer's loss divides by ``num_items_in_batch``
(odc_hf/integrations/trainer/loss_scale.py): a per-microbatch mean loss, the common ``model(**inputs).loss`` in a
Trainer subclass, is refused by name; a loss that divides by it trains. Each refused trainer differs from an accepted
one by that division alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


def _data(rows: int = 4):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 250, (int(n),), generator=generator).tolist() for n in (9, 17, 12, 30, 21, 14)[:rows]]
    return Dataset.from_dict({"input_ids": ids})


def _args(tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", disable_tqdm=True, save_strategy="no")  # fmt: skip


def _loss_trainers():
    from transformers import Trainer

    class MeanLossTrainer(Trainer):  # the usual subclass: the model's loss, a mean over this microbatch's tokens
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    class SummedLossTrainer(Trainer):  # the same, with the count passed on: the model divides its sum by it
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    return MeanLossTrainer, SummedLossTrainer


def test_a_per_microbatch_mean_loss_is_refused_by_name(tmp_path, cpu):
    from fsdp_helpers import tiny_qwen2

    from odc_hf import make_odc_trainer

    mean, summed = map(make_odc_trainer, _loss_trainers())
    with pytest.raises(ValueError, match=r"^odc_hf: ODCMeanLossTrainer\.compute_loss gives a loss that does not "
                                         r"divide by num_items_in_batch: \S+ with num_items_in_batch=\d+ and \S+ with "
                                         r"\d+, on the same microbatch\. .*model\(\*\*inputs, num_items_in_batch="):  # fmt: skip
        mean(model=tiny_qwen2(), args=_args(tmp_path / "mean"), train_dataset=_data()).train()
    summed(model=tiny_qwen2(), args=_args(tmp_path / "summed"), train_dataset=_data()).train()  # the control trains


def _token_loss(outputs, labels, num_items_in_batch=None, *, divide: bool):
    logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")  # fmt: skip
    return loss / (num_items_in_batch if divide else (targets != -100).sum())


def test_a_compute_loss_func_that_ignores_the_count_is_refused(tmp_path, cpu):
    from fsdp_helpers import tiny_qwen2

    from odc_hf import ODCTrainer

    def mean(outputs, labels, num_items_in_batch=None):
        return _token_loss(outputs, labels, divide=False)

    def divided(outputs, labels, num_items_in_batch=None):
        return _token_loss(outputs, labels, num_items_in_batch, divide=True)

    with pytest.raises(ValueError, match=r"^odc_hf: ODCTrainer\.compute_loss gives a loss that does not divide"):
        ODCTrainer(model=tiny_qwen2(), args=_args(tmp_path / "mean"), train_dataset=_data(),
                   compute_loss_func=mean).train()  # fmt: skip
    ODCTrainer(model=tiny_qwen2(), args=_args(tmp_path / "divided"), train_dataset=_data(),
               compute_loss_func=divided).train()  # fmt: skip


def test_the_probe_draws_the_training_forwards_dropout_masks(tmp_path, cpu, monkeypatch):
    """With attention dropout at 0.5 the probe's loss is exactly half the training loss: it ran under the random
    state the training forward then drew from. Control: without the state put back the ratio is another number."""
    from fsdp_helpers import tiny_qwen2

    from odc_hf import make_odc_trainer
    from odc_hf.integrations.trainer import loss_scale

    ratios = []
    check = loss_scale.check
    monkeypatch.setattr(loss_scale, "check", lambda trainer, doubled, loss, n: (
        ratios.append(doubled / float(loss.detach())), check(trainer, doubled, loss, n)))  # fmt: skip
    summed = make_odc_trainer(_loss_trainers()[1])

    def dropout_model():
        model = tiny_qwen2()
        model.config.attention_dropout = 0.5
        for layer in model.model.layers:  # read from the config when the layer was built
            layer.self_attn.attention_dropout = 0.5
        return model

    summed(model=dropout_model(), args=_args(tmp_path / "same"), train_dataset=_data()).train()
    assert ratios == [pytest.approx(0.5, abs=1e-7)]
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=(): torch.no_grad())  # the state not put back
    summed(model=dropout_model(), args=_args(tmp_path / "other"), train_dataset=_data()).train()
    assert abs(ratios[1] - 0.5) > 1e-4, ratios


@pytest.mark.parametrize(("doubled", "loss", "refused"), [
    (1.5, 3.0, False),  # divides by the count
    (1.5 + 0.004, 3.0 + 0.004, False),  # and a term that does not (an MoE router loss: 0.001 x 4)
    (3.0, 3.0, True),  # a mean: the count ignored
    (6.0, 3.0, True),  # a loss multiplied by the count
    (-1.5, -3.0, False),  # a negative loss divided by the count
])  # fmt: skip
def test_the_ratio_bounds(doubled, loss, refused):
    from odc_hf.integrations.trainer import loss_scale

    trainer = type("T", (), {})()
    if refused:
        with pytest.raises(ValueError, match=r"^odc_hf: T\.compute_loss gives a loss that does not divide"):
            loss_scale.check(trainer, doubled, torch.tensor(loss), torch.tensor(40))
    else:
        loss_scale.check(trainer, doubled, torch.tensor(loss), torch.tensor(40))
