"""Optimizers that change the parameters outside ``step()`` are refused under ODC, by behaviour, not by name: ODC's
peers gather the shards published after each optimizer step, so they would read other values (a schedule-free
optimizer's ``train()`` / ``eval()`` switch moves the parameters; LOMO updates them inside backward). And the Trainer's
``torch_empty_cache_steps`` empties the device cache on the steps it names, as the Trainer's own training step does."""

from __future__ import annotations

import pytest
import torch

from odc_hf.integrations.accelerate.refusals import check_optimizer


class WithModes(torch.optim.SGD):
    """What a schedule-free optimizer shows: train() and eval() (schedulefree is not a dependency)."""

    def train(self):
        pass

    def eval(self):
        pass


class UpdatesInBackward(torch.optim.SGD):
    """What LOMO / AdaLomo show (lomo-optim is not a dependency)."""

    def fused_backward(self, loss, lr):
        pass


def _params():
    return [torch.nn.Parameter(torch.zeros(2))]


def test_an_optimizer_with_modes_or_a_fused_backward_is_refused_with_what_to_use():
    with pytest.raises(NotImplementedError, match=r"^odc_hf does not support WithModes under ODC: its train\(\)/eval\(\) "
                                                  r"modes change the parameters outside optimizer\.step\(\) \(a "
                                                  r"schedule-free optimizer\), .* \(optim='adamw_torch', \.\.\.\), or "
                                                  r"set ODCConfig\(enabled=False\)"):  # fmt: skip
        check_optimizer(WithModes(_params(), lr=0.1))
    with pytest.raises(NotImplementedError, match=r"UpdatesInBackward under ODC: it updates the parameters inside "
                                                  r"backward \(LOMO\), before ODC has summed the gradients"):  # fmt: skip
        check_optimizer(UpdatesInBackward(_params(), lr=0.1))
    for fine in (torch.optim.AdamW(_params()), torch.optim.SGD(_params(), lr=0.1)):
        check_optimizer(fine)


class Wrapper(torch.optim.Optimizer):
    """What accelerate's AcceleratedOptimizer (an Optimizer itself; building one needs a whole accelerator) is to the
    optimizer it wraps."""

    def __init__(self, optimizer):  # super().__init__ not called: only the wrapping is under test
        self.optimizer = optimizer

    def train(self):  # AcceleratedOptimizer has modes of its own, forwarded to the optimizer inside
        pass

    def eval(self):
        pass


def test_the_accelerator_checks_the_optimizer_inside_accelerates_wrapper():
    from odc_hf.integrations.accelerate.accelerator import _optimizers

    inner = WithModes(_params(), lr=0.1)
    wrapped = Wrapper(inner)
    plain = torch.optim.AdamW(_params())
    assert _optimizers([torch.nn.Linear(1, 1), wrapped, Wrapper(wrapped), Wrapper(plain)]) == [inner, inner, plain]
    check_optimizer(_optimizers([Wrapper(plain)])[0])  # the wrapper's own modes are not the optimizer's
    with pytest.raises(NotImplementedError, match="WithModes"):
        check_optimizer(_optimizers([wrapped])[0])


def _empty_cache_calls(rank, world, output_dir, every):
    """Train 2 steps of ODCSFTTrainer (2 ranks) with torch_empty_cache_steps=every; rank 0's calls per step."""
    import os

    import odc_hf.integrations.trainer.mixin as mixin
    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    os.environ["ACCELERATE_USE_CPU"] = "true"
    calls = []
    mixin.clear_device_cache = lambda *a, **k: calls.append(trainer.state.global_step)  # counts, empties nothing
    tokenizer = default_tokenizer()
    args = ODCSFTConfig(output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, max_length=128,
                        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                        torch_empty_cache_steps=every)  # fmt: skip
    trainer = ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=args, processing_class=tokenizer,
                            train_dataset=default_tokenized_dataset(tokenizer, 12, max_length=128),
                            odc_config=ODCConfig(timeout_s=60))  # fmt: skip
    trainer.train()
    microbatches = [s.microbatches[rank] for s in trainer.odc_stats.steps]
    trainer.odc.close()
    return calls, microbatches


def test_torch_empty_cache_steps_empties_after_each_forward_of_the_named_steps(tmp_path):
    from odc_hf.testing import run_ranks

    calls, microbatches = run_ranks(_empty_cache_calls, 2, str(tmp_path), 2, timeout_s=300)[0]
    # global_step counts finished steps: steps 1 and 3 run at global_step 0 and 2, multiples of 2
    assert calls == [0] * microbatches[0] + [2] * microbatches[2], (calls, microbatches)
    assert microbatches[0] > 0 and microbatches[2] > 0


def _train_with(rank, world, output_dir):
    """ODCSFTTrainer given a schedule-free-like optimizer, on every rank; the error each rank raised."""
    import os

    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    os.environ["ACCELERATE_USE_CPU"] = "true"
    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer)
    args = ODCSFTConfig(output_dir=output_dir, max_steps=1, per_device_train_batch_size=2, max_length=64, bf16=False,
                        use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = ODCSFTTrainer(model=model, args=args, processing_class=tokenizer,
                            train_dataset=default_tokenized_dataset(tokenizer, 8, max_length=64),
                            optimizers=(WithModes(model.parameters(), lr=0.1), None),
                            odc_config=ODCConfig(timeout_s=30))  # fmt: skip
    try:
        trainer.train()
    except NotImplementedError as err:
        return str(err), trainer.odc is None
    return None


def test_a_trainer_given_such_an_optimizer_stops_before_odc_is_installed(tmp_path):
    from odc_hf.testing import run_ranks

    results = run_ranks(_train_with, 2, str(tmp_path), timeout_s=120)
    assert results[0] == results[1] and results[0][1], results  # every rank, nothing installed to clean up
    assert results[0][0].startswith("odc_hf does not support WithModes under ODC"), results


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adagrad(p),
    lambda p: torch.optim.RMSprop(p, momentum=0.5),
    lambda p: torch.optim.Adam([{"params": p[:1], "lr": 1e-2}, {"params": p[1:], "amsgrad": True}]),
], ids=["adamw", "adamw_fused", "sgd_nesterov", "adagrad", "rmsprop", "adam_two_groups"])  # fmt: skip
def test_elementwise_optimizers_update_shards_as_the_whole(make):
    check_optimizer(make([torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))]))


def test_an_optimizer_reading_whole_tensor_statistics_is_refused_by_its_shards_behaviour():
    """Adafactor (factored second moments, parameter scale) and Muon (orthogonalised updates) update a 4 x 6 tensor
    otherwise than its two halves: refused by that measurement, with what to use. The same Adafactor with a group
    option that makes it elementwise would pass: the test runs each parameter group's own options."""
    from transformers.optimization import Adafactor

    adafactor = Adafactor(_params(), lr=None, relative_step=True, scale_parameter=True, warmup_init=False)
    with pytest.raises(NotImplementedError, match=r"^odc_hf does not support Adafactor: its update of a parameter is "
                                                  r"not the updates of the parameter's shards \(two steps on a 4 x 6 "
                                                  r"tensor moved it by up to \S+; the same steps on its two halves end "
                                                  r"up to \S+ away from that\)\. .*optim='adamw_torch'"):  # fmt: skip
        check_optimizer(adafactor)
    with pytest.raises(NotImplementedError, match=r"^odc_hf does not support Muon: its update"):
        check_optimizer(torch.optim.Muon([torch.nn.Parameter(torch.zeros(3, 2))]))


def test_an_optimizer_that_cannot_run_on_cpu_tensors_is_not_judged():
    class GpuOnly(torch.optim.SGD):
        def step(self, closure=None):
            if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
                raise RuntimeError("needs CUDA tensors")
            return super().step(closure)

    check_optimizer(GpuOnly(_params(), lr=0.1))
