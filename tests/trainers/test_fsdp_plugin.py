"""ODCFSDPPlugin: accelerate's FSDP plugin carrying ODC's options, the one way every odc_hf accelerator gets them.

The own-loop example (examples/own_loop.py, ``ODCAccelerator(fsdp_plugin=ODCFSDPPlugin(...))``) trains on 2 CPU ranks
with uneven microbatch counts (a rank with none on the last step) and matches a single process on each whole
minibatch; FSDP1 / DeepSpeed / a plain Accelerator are refused with messages saying what to change; the Trainer builds
its accelerator with the same plugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin

from odc_hf import ODCConfig
from odc_hf.integrations.accelerate.plugin import ODCFSDPPlugin, as_odc_plugin
from odc_hf.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
# 4 steps of 6, 6, 6 and 1 samples: the last leaves a rank without microbatches
LOOP = dict(num_samples=19, minibatch_size=6, max_tokens_per_microbatch=640, lr=1e-3)


@pytest.fixture(autouse=True)
def _restore_accelerate_environment(monkeypatch):
    # accelerate sets ACCELERATE_USE_FSDP=true in os.environ whenever it is given an fsdp_plugin; keep it in this test.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    monkeypatch.delenv("FSDP_AUTO_WRAP_POLICY", raising=False)


def test_plugin_enforces_fsdp2_and_carries_the_config(monkeypatch):
    plugin = ODCFSDPPlugin(odc_config=ODCConfig(timeout_s=7))
    assert plugin.fsdp_version == 2 and plugin.odc_config.timeout_s == 7
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"  # one unit per block by default
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        ODCFSDPPlugin(fsdp_version=1)
    monkeypatch.setenv("FSDP_VERSION", "1")  # what `accelerate launch` sets from an FSDP1 config
    with pytest.raises(ValueError, match="FSDP1 is not supported"):
        ODCFSDPPlugin()
    monkeypatch.delenv("FSDP_VERSION")
    monkeypatch.setenv("ODC_BALANCE", "lb_micro")
    assert ODCFSDPPlugin().odc_config.balance == "lb_micro"  # no config given: ODC_* variables, as everywhere
    with pytest.raises(TypeError, match="ODCConfig"):
        ODCFSDPPlugin(odc_config={"balance": "none"})


def test_accelerate_plugins_are_converted_and_configs_given_once():
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
    plugin = as_odc_plugin(fsdp, ODCConfig(balance="none"))
    assert isinstance(plugin, ODCFSDPPlugin) and plugin is not fsdp
    assert plugin.reshard_after_forward is False and plugin.odc_config.balance == "none"
    assert as_odc_plugin(plugin) is plugin and as_odc_plugin(plugin, ODCConfig(balance="none")) is plugin
    with pytest.raises(ValueError, match="once"):
        as_odc_plugin(plugin, ODCConfig(timeout_s=1))
    with pytest.raises(ValueError, match="FSDP1"):
        as_odc_plugin(FullyShardedDataParallelPlugin(fsdp_version=1))


def test_bf16_reduction_becomes_fp32_under_odc():
    plugin = ODCFSDPPlugin(mixed_precision_policy="bf16")
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16
    plugin.reduce_in_fp32()  # what ODCAccelerator.prepare does with ODC on
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_a_plain_accelerator_cannot_shard_with_the_plugin():
    # accelerate calls set_auto_wrap_policy in prepare() right before fully_shard (GPU FSDP2 path)
    plugin = ODCFSDPPlugin()
    with pytest.raises(RuntimeError, match="plain accelerate.Accelerator.*ODCAccelerator"):
        plugin.set_auto_wrap_policy(torch.nn.Linear(2, 2))


def test_deepspeed_and_megatron_are_refused(monkeypatch):
    from odc_hf import ODCAccelerator

    with pytest.raises(ValueError, match="does not run under DeepSpeed"):
        ODCAccelerator(deepspeed_plugin=object())
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # `accelerate launch` with a DeepSpeed config
    with pytest.raises(ValueError, match="does not run under DeepSpeed"):
        ODCAccelerator()
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    with pytest.raises(ValueError, match="Megatron-LM"):
        ODCAccelerator(fsdp_plugin=ODCFSDPPlugin())


def test_the_trainer_builds_its_accelerator_with_the_plugin(tmp_path):
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    config = ODCConfig(balance="lb_micro", timeout_s=9)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    model = tiny_qwen2_model(tokenizer)
    trainer = ODCTrainer(model=model, args=args, processing_class=tokenizer, odc_config=config)
    plugin = trainer.accelerator.odc_plugin
    assert isinstance(plugin, ODCFSDPPlugin) and plugin is trainer.odc_plugin and plugin.installs_odc
    assert plugin.odc_config is config and trainer.accelerator.odc_config is config
    # TrainingArguments(fsdp=..., fsdp_config=...) (distributed runs only) gives the Trainer accelerate's plugin, which
    # as_odc_plugin converts (test_accelerate_plugins_are_converted_and_configs_given_once); DeepSpeed is refused:
    with pytest.raises(ValueError, match="does not run under DeepSpeed"):
        trainer._build_accelerator_args(deepspeed_plugin=object())


def _own_loop_rank(rank, world):
    from example_scripts import load_example

    train = load_example("own_loop").train

    accelerator, model, losses, sampler = train(**LOOP)
    # ODC is on, with the plugin's options (timeout 120 s, not the default), although accelerate drops the plugin here
    assert accelerator.odc is not None and accelerator.odc_config.timeout_s == 120
    params = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    accelerator.odc.close()
    return losses, params, sampler


def _single_process_reference(sampler, steps: int):
    """The same model trained by one process on each whole minibatch, one sample per forward."""
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer)
    dataset = default_tokenized_dataset(tokenizer, LOOP["num_samples"], max_length=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LOOP["lr"])
    losses = []
    for step in range(steps):
        samples = [torch.tensor(dataset[int(i)]["input_ids"])[None] for i in sampler.minibatch_indices(step)]
        tokens = torch.tensor(float(sum(s.numel() - 1 for s in samples)))
        loss = sum(model(input_ids=s, labels=s, num_items_in_batch=tokens).loss for s in samples)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


@pytest.mark.slow
def test_own_loop_with_the_plugin_matches_a_single_process(one_torch_thread):
    ranks = run_ranks(_own_loop_rank, 2, env={"ACCELERATE_USE_CPU": "true"})
    (losses, params, sampler), (losses_1, _, _) = ranks
    assert losses == losses_1  # every rank logs the same global loss
    steps = len(losses)
    counts = [[len(sampler.plan(s).for_rank(r)) for r in range(2)] for s in range(steps)]
    assert steps == 4 and any(a != b for a, b in counts) and 0 in counts[-1], counts  # a rank with none
    ref_losses, ref_params = _single_process_reference(sampler, steps)
    # fp32 sums of the same terms in another order (packed rows vs single samples, two ranks): ~1e-7 relative
    assert losses == pytest.approx(ref_losses, rel=2e-6)  # measured 1.2e-7
    for name, ref in ref_params.items():
        # 4 AdamW steps of at most lr=1e-3 each, from gradients equal to ~1e-6 relative (measured 1.5e-6)
        torch.testing.assert_close(params[name], ref.detach(), rtol=0, atol=1e-5, msg=name)
