"""A rank that raises mid-minibatch makes the others fail promptly with a message naming it; setups the public
hooks cannot serve raise clear errors instead of producing wrong numbers."""

from __future__ import annotations

from functools import partial

from fsdp_helpers import distributed_run, loss_sum, microbatch, tiny_qwen2

from odc_hf.testing import run_ranks


def test_rank_raising_mid_minibatch_fails_the_others():
    run = partial(distributed_run, fail_rank=1)
    outcomes = run_ranks(run, 3, (1, 1, 1), 3, "odc", raise_on_failure=False, timeout_s=240)
    assert "data loader exploded" in outcomes[1].error
    for o in (outcomes[0], outcomes[2]):
        assert o.error is not None
        assert "PeerFailedError: rank 1 failed (RuntimeError: data loader exploded)" in o.error, o.error
        assert "minibatch barrier of minibatch 1" in o.error


CASES = {
    "twice": "ODCError: ODC is already installed",
    "no_publish": "before publish()",
    "finish_twice": "finish_minibatch() twice without publish()",
    "not_sharded": "apply fully_shard first",
}


def _misuse_case(rank, case):
    from odc_hf.fsdp import install_odc, shard_model

    model = tiny_qwen2()
    if case != "not_sharded":
        shard_model(model)
    if case == "twice":
        install_odc(model, timeout_s=20)
        install_odc(model, timeout_s=20)
    elif case == "no_publish":
        odc = install_odc(model, timeout_s=20)
        loss_sum(model, microbatch(0, rank)).backward()
        odc.finish_minibatch(1)
        loss_sum(model, microbatch(1, rank)).backward()  # forward before publish()
    elif case == "finish_twice":
        odc = install_odc(model, timeout_s=20)
        odc.finish_minibatch(0)
        odc.finish_minibatch(0)
    else:
        install_odc(model, timeout_s=20)


def _misuse(rank, world_size):
    from odc_hf.transport import ODCError

    messages = {}
    for case in CASES:
        try:
            _misuse_case(rank, case)
            messages[case] = "no error"
        except (ODCError, NotImplementedError, ValueError) as err:
            messages[case] = f"{type(err).__name__}: {err}"
    return messages


def test_unsupported_setups_raise_clearly():
    for messages in run_ranks(_misuse, 2):
        for case, expected in CASES.items():
            assert expected in messages[case], (case, messages[case])


def _four_rank_misuse(rank, world_size):
    from odc_hf.fsdp import install_odc, shard_model

    try:
        install_odc(shard_model(tiny_qwen2(), reshard_after_forward=2), timeout_s=20)
    except NotImplementedError as err:
        return str(err)
    return "no error"


def test_integer_reshard_is_refused():  # HSDP and frozen parameters are supported: test_fsdp_hsdp / _frozen_params
    for message in run_ranks(_four_rank_misuse, 4):
        assert "integer reshard_after_forward" in message, message


def _single(rank, world_size):
    from odc_hf.fsdp import install_odc, shard_model

    try:
        install_odc(shard_model(tiny_qwen2()))
    except ValueError as err:
        return str(err)
    return "no error"


def test_world_size_one_is_refused():
    assert "at least 2 ranks" in run_ranks(_single, 1)[0]
