"""odc_hf asks torch's CUDA caching allocator for expandable segments before CUDA starts, where it can, and keeps a
user's own setting (odc_hf/integrations/launch/cuda_allocator.py). On one H200, ODCSFTTrainer without activation
checkpointing and torch's default allocator reserved all 139 GiB for 98 GiB allocated and retried; with expandable
segments it reserved 99 GiB (the same speed; docs/performance.md)."""

from __future__ import annotations

import logging

import pytest
import torch

from odc_hf.integrations.launch import cuda_allocator
from odc_hf.integrations.launch.relaunch import launch_env, plan_launch

VALUE = "expandable_segments:True"


def _clear(monkeypatch):
    """No allocator variables during the test; the process's own restored after it (set first, so that
    monkeypatch records the variable's state even where it was absent)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "ODC_EXPANDABLE_SEGMENTS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize(("setting", "on"), [
    (None, False), ("", False), (VALUE, True), ("expandable_segments:true", True),
    ("max_split_size_mb:128,expandable_segments:True", True), ("expandable_segments:False", False),
    ("garbage_collection_threshold:0.6", False),
])  # fmt: skip
def test_expandable_reads_torch_setting_strings(setting, on):
    assert cuda_allocator.expandable(setting) is on


def test_prefer_sets_the_variable_when_nobody_chose():
    env: dict[str, str] = {}
    assert cuda_allocator.prefer_expandable_segments(env, cuda_started=False) == "set"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": VALUE}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_prefer_keeps_the_users_setting(name):
    env = {name: "max_split_size_mb:256"}
    assert cuda_allocator.prefer_expandable_segments(env, cuda_started=False) == "user"
    assert env == {name: "max_split_size_mb:256"}


def test_prefer_opt_out_late_and_bad_values():
    env = {"ODC_EXPANDABLE_SEGMENTS": "0"}
    assert cuda_allocator.prefer_expandable_segments(env, cuda_started=False) == "off"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    env = {}
    assert cuda_allocator.prefer_expandable_segments(env, cuda_started=True) == "late" and env == {}
    with pytest.raises(ValueError, match="ODC_EXPANDABLE_SEGMENTS must be 1/true or 0/false, got 'maybe'"):
        cuda_allocator.prefer_expandable_segments({"ODC_EXPANDABLE_SEGMENTS": "maybe"}, cuda_started=False)


def test_launch_env_asks_for_it_on_gpu_plans_only():
    gpu = launch_env(plan_launch(2, 2), {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert gpu["PYTORCH_CUDA_ALLOC_CONF"] == VALUE
    kept = launch_env(plan_launch(2, 2), {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert kept["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert launch_env(plan_launch(2, 1), {})["PYTORCH_CUDA_ALLOC_CONF"] == VALUE  # 2 ranks sharing one GPU
    assert "PYTORCH_CUDA_ALLOC_CONF" not in launch_env(plan_launch(2, 0), {})  # CPU ranks: no CUDA allocator


def test_odc_configs_ask_before_the_arguments_start_cuda(monkeypatch, tmp_path):
    from odc_hf import ODCSFTConfig

    _clear(monkeypatch)
    assert not torch.cuda.is_initialized()
    ODCSFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert cuda_allocator.user_setting() == VALUE
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    ODCSFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert cuda_allocator.user_setting() == "max_split_size_mb:64"


def test_check_says_once_on_cuda_without_it_and_counts_nothing_off_cuda(monkeypatch, caplog):
    _clear(monkeypatch)
    with caplog.at_level(logging.INFO, logger="odc_hf"):
        state = cuda_allocator.check(torch.device("cuda"), main_process=True)
        assert cuda_allocator.check(torch.device("cuda"), main_process=False) == state  # other ranks: silent
        assert cuda_allocator.check(torch.device("cpu"), main_process=True) == state
    assert state == {"expandable_segments": False, "setting": None}
    assert [r.getMessage().count("expandable segments") for r in caplog.records] == [1]
    caplog.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", VALUE)
    with caplog.at_level(logging.INFO, logger="odc_hf"):
        assert cuda_allocator.check(torch.device("cuda"), main_process=True)["expandable_segments"] is True
    assert not caplog.records
    assert cuda_allocator.RetryCounter(torch.device("cpu")).delta() is None


# Liger's RoPE: the Triton kernel, unless the user chose (odc_hf/integrations/compute/fused_head.py: pin_liger_rope). On
# one H200 liger-kernel 0.8.5's auto-selected CuTe DSL RoPE cost ~0.67 s of host time per 32k step of new lengths.
def test_liger_rope_pinned_to_triton_where_liger_offers_both():
    from odc_hf.integrations.compute.fused_head import pin_liger_rope

    both = ["nvidia-cutedsl", "nvidia-triton"]
    env: dict[str, str] = {}
    assert pin_liger_rope(env, impls=both) == "pinned" and env == {"LIGER_KERNEL_IMPL_ROPE": "nvidia-triton"}
    for name in ("LIGER_KERNEL_IMPL_ROPE", "LIGER_KERNEL_BACKEND_ROPE", "LIGER_KERNEL_IMPL", "LIGER_KERNEL_BACKEND"):
        env = {name: "nvidia-cutedsl"}
        assert pin_liger_rope(env, impls=both) == "user" and env == {name: "nvidia-cutedsl"}
    for impls in (["nvidia-triton"], ["nvidia-cutedsl"], []):  # one RoPE (or a future renaming): nothing to choose
        env = {}
        assert pin_liger_rope(env, impls=impls) == "no choice" and env == {}


def test_liger_rope_pin_against_the_installed_liger():
    pytest.importorskip("liger_kernel.backends", reason="liger-kernel >= 0.8 (per-op implementations) not installed")
    from liger_kernel.backends import all_impls

    from odc_hf.integrations.compute.fused_head import pin_liger_rope

    env: dict[str, str] = {}
    state = pin_liger_rope(env)
    assert state == ("pinned" if {"nvidia-cutedsl", "nvidia-triton"} <= set(all_impls("rope")) else "no choice")
    if state == "pinned":  # Liger accepts the name it registered
        from liger_kernel.backends import resolve_impl

        assert resolve_impl("rope", env["LIGER_KERNEL_IMPL_ROPE"]).impl_name == "nvidia-triton"
