"""The odc_* trainer-argument fields stay in step with ODCConfig: one per field, same type, None meaning "not set"."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from odc_hf.config import ODCConfig
from odc_hf.integrations.trainer.arguments import ODCArguments, odc_config_from_args


def test_one_documented_odc_field_per_odcconfig_field():
    config_fields = [f.name for f in dataclasses.fields(ODCConfig)]
    argument_fields = {f.name: f for f in dataclasses.fields(ODCArguments)}
    # resolved annotations (HfArgumentParser replaces a field's string annotation by the type it resolves)
    config_types, argument_types = typing.get_type_hints(ODCConfig), typing.get_type_hints(ODCArguments)
    assert set(argument_fields) == {f"odc_{name}" for name in config_fields}, "add the odc_<field> to ODCArguments"
    for name in config_fields:
        argument = argument_fields[f"odc_{name}"]
        assert argument.default is None, f"odc_{name}: None means 'not set' (environment, then ODCConfig's default)"
        assert argument_types[argument.name] == config_types[name] | None, (argument.name, config_types[name])
        assert argument.metadata["help"].startswith("ODC: "), argument.name


@pytest.mark.parametrize("name", ["ODCTrainingArguments", "ODCSFTConfig", "ODCGRPOConfig"])
def test_every_arguments_class_has_the_odc_fields_unset_by_default(name):
    import odc_hf

    cls = getattr(odc_hf, name)
    args = cls(output_dir="out_unused", report_to="none", bf16=False)
    assert all(getattr(args, f.name) is None for f in dataclasses.fields(ODCArguments))
    assert odc_config_from_args(args, environ={}) == ODCConfig()


def test_grpo_config_options_reach_odcconfig():
    from odc_hf import ODCGRPOConfig

    args = ODCGRPOConfig(output_dir="out_unused", report_to="none", bf16=False, odc_balance="lb_micro",
                         odc_attention_shape_bucket=0)  # fmt: skip
    config = odc_config_from_args(args, environ={"ODC_TIMEOUT_S": "7"})
    assert (config.balance, config.attention_shape_bucket, config.timeout_s) == ("lb_micro", 0, 7.0)


def test_attention_default_matches_the_attention_module():
    from odc_hf.attention import DEFAULT_SHAPE_BUCKET, VarlenAttention

    assert ODCConfig().attention_shape_bucket == DEFAULT_SHAPE_BUCKET == VarlenAttention().shape_bucket
    assert ODCConfig().attention_varlen_kernel is VarlenAttention().varlen_kernel


def test_plan_ahead_reaches_odcconfig_and_is_checked():
    from odc_hf import ODCSFTConfig

    args = ODCSFTConfig(output_dir="out_unused", report_to="none", bf16=False, odc_plan_ahead=1)
    assert odc_config_from_args(args, environ={}).plan_ahead == 1
    assert ODCConfig.from_env({"ODC_PLAN_AHEAD": "2"}).plan_ahead == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="plan_ahead must be an integer >= 0"):
            ODCConfig(plan_ahead=bad)


@pytest.mark.parametrize(("seed", "data_seed", "sampler_seed"), [(3, None, 3), (3, 11, 11)])
def test_data_seed_seeds_the_sampler_as_in_the_trainer(tmp_path, monkeypatch, seed, data_seed, sampler_seed):
    """The Trainer seeds its sampler with data_seed when set (else seed): so does the ODC sampler. The data order
    then stays when only seed changes (control: another data_seed, another order)."""
    from datasets import Dataset
    from fsdp_helpers import tiny_qwen2
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    data = Dataset.from_dict({"input_ids": [[5 + i] * (4 + i) for i in range(16)]})

    def order(seed, data_seed):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True,
                                 report_to="none", seed=seed, data_seed=data_seed)  # fmt: skip
        sampler = ODCTrainer(model=tiny_qwen2(), args=args, train_dataset=data).get_train_dataloader().batch_sampler
        return sampler.seed, [list(sampler.minibatch_indices(step)) for step in range(4)]

    used, indices = order(seed, data_seed)
    assert used == sampler_seed
    if data_seed is not None:
        assert order(seed + 1, data_seed)[1] == indices  # the model's seed does not move the data
        assert order(seed, data_seed + 1)[1] != indices
