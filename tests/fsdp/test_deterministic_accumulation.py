"""``deterministic`` (bit-reproducible gradient accumulation on CUDA: one slot per sender, summed in rank order, instead
of atomics in arrival order), as far as a CPU can check it: the option reaches the transport from every place a user
sets it, and the test harness that forces the ranks' pushes into opposite orders gives the same bits on the CPU
transport (whose slots are always deterministic). The CUDA transport's two modes under those forced orders run in
tests/gpu/test_gpu_shared.py (``test_deterministic_accumulation_repeats_bit_for_bit``)."""

from __future__ import annotations

import functools

import pytest
import torch
from fsdp_helpers import distributed_run

from odc_hf.testing import run_ranks

ROUTES = ("default", "odc_config", "environment", "arguments")


def _transport_options(rank, world_size, out):
    """Build and start an ODCSFTTrainer (one step) per route; what make_transport was asked for each time."""
    import os

    import sft_runs

    import odc_hf.fsdp.adapter as adapter
    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    seen = []
    real = adapter.make_transport

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    adapter.make_transport = spy
    tokenizer = default_tokenizer()
    asked = {}
    for route in ROUTES:
        seen.clear()
        os.environ.pop("ODC_DETERMINISTIC", None)
        extra, config = {}, None
        if route == "odc_config":
            config = ODCConfig(deterministic=True)
        elif route == "environment":
            os.environ["ODC_DETERMINISTIC"] = "1"
        elif route == "arguments":
            extra = {"odc_deterministic": True}
        args = sft_runs.sft_config(f"{out}/{route}", config_class=ODCSFTConfig, max_steps=1, use_cpu=True,
                                   per_device_train_batch_size=2, **extra)  # fmt: skip
        trainer = ODCSFTTrainer(model=tiny_qwen2_model(tokenizer, seed=0), args=args, odc_config=config,
                                train_dataset=sft_runs.dataset(tokenizer), processing_class=tokenizer)  # fmt: skip
        trainer.train()
        asked[route] = list(seen)
        trainer.odc.close()
    os.environ.pop("ODC_DETERMINISTIC", None)
    return asked


@pytest.mark.slow
def test_the_option_reaches_the_transport_from_every_route(tmp_path):
    # reference: the value each route sets, written out; the default route must give False
    for asked in run_ranks(_transport_options, 2, str(tmp_path), env={"ACCELERATE_USE_CPU": "true"}):
        assert asked == {"default": [False], "odc_config": [True], "environment": [True], "arguments": [True]}, asked


def _bits(record):
    return [{k: step[k] for k in ("grads", "params")} for step in record]


def _identical(a, b) -> bool:
    return all(torch.equal(x[kind][name], y[kind][name]) for x, y in zip(a, b, strict=True)
               for kind in ("grads", "params") for name in x[kind])  # fmt: skip


def test_forced_push_orders_give_the_same_bits_on_the_cpu_transport():
    # rank r waits 0.3 * r seconds before its microbatches (rank 0 pushes first), then the reverse order; the CPU
    # transport sums one slot per sender in rank order, so the two runs must be bitwise equal (as CUDA's
    # deterministic mode must; its atomic mode, given such orders, need not)
    forward = functools.partial(distributed_run, delays=(0.0, 0.3))
    backward = functools.partial(distributed_run, delays=(0.3, 0.0))
    a = run_ranks(forward, 2, (3, 1), 2, "odc", "fp32")[0]
    b = run_ranks(backward, 2, (3, 1), 2, "odc", "fp32")[0]
    assert a[0]["odc"].startswith("CPU shared-memory transport, deterministic slots"), a[0]["odc"]
    # the orders really were opposite: rank 0's first push came first in every minibatch of a, last in every one of b
    assert all(step["pushed_at"][0] < step["pushed_at"][1] for step in a), [s["pushed_at"] for s in a]
    assert all(step["pushed_at"][1] < step["pushed_at"][0] for step in b), [s["pushed_at"] for s in b]
    assert _identical(_bits(a), _bits(b))
    # control: the comparison sees a one-bit difference (a gradient nudged by one ulp is not "identical")
    nudged = [{kind: dict(step[kind]) for kind in ("grads", "params")} for step in _bits(b)]
    name = next(iter(nudged[0]["grads"]))
    nudged[0]["grads"][name] = torch.nextafter(nudged[0]["grads"][name], torch.tensor(float("inf")))
    assert not _identical(_bits(a), nudged)
