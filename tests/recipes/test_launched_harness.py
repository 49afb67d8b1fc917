"""The harness that runs the number-only parity runs (tests/support/launched.py) gives a script what a real
``accelerate launch`` gives it: the same launcher variables, the same accelerate state (distributed type, processes,
rank) and process group, the script run as ``__main__`` with its arguments. Checked against a real launch of the same
script; and ``odc_hf.testing.run_process``, its one-process form, runs without rank variables or a process group."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from launched import launcher_environment, run_launched, run_plain

from odc_hf.testing import RanksFailed, accelerate_cpu, run_process

PROBE = textwrap.dedent(
    """
    import json, os, sys

    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState()
    launcher = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
    ranks = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "HF_HUB_OFFLINE",
             "TOKENIZERS_PARALLELISM")
    seen = {
        "env": {k: v for k, v in os.environ.items() if k.startswith(launcher) or k in ranks},
        "distributed_type": str(state.distributed_type), "processes": state.num_processes,
        "index": state.process_index, "group": [dist.get_backend(), dist.get_world_size(), dist.get_rank()],
        "argv": sys.argv[2:], "name": __name__,
    }
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f, sort_keys=True)
    """
)


def _seen(directory, ranks: int) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
def test_a_forked_launch_gives_the_script_what_accelerate_launch_gives(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    real, forked = tmp_path / "real", tmp_path / "forked"
    real.mkdir()
    forked.mkdir()
    proc = accelerate_cpu(script, real, "--flag", "value", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_launched(script, forked, "--flag", "value", timeout_s=300)
    expected = _seen(real, 2)
    assert expected[1]["group"][1:] == [2, 1] and expected[1]["env"]["ACCELERATE_USE_CPU"] == "true", expected
    assert expected[0]["argv"] == ["--flag", "value"] and expected[0]["name"] == "__main__"
    assert _seen(forked, 2) == expected  # every field of both ranks, launcher variables included


def test_the_hsdp_config_gives_four_processes_and_accelerates_mesh_variables():
    processes, env = launcher_environment("cpu_hsdp.yaml")
    assert processes == 4 and env["ACCELERATE_USE_CPU"] == "true"
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")
    assert "PARALLELISM_CONFIG_DP_SHARD_SIZE" not in launcher_environment("cpu.yaml")[1]


def _plain(tag):
    import torch.distributed as dist

    return tag, dist.is_initialized(), {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def _fails():
    raise KeyError("the message")


def test_run_process_is_a_plain_process_and_reports_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")  # a launcher's variable in the caller's environment: not passed on
    assert run_process(_plain, "x") == ("x", False, {"RANK": None, "WORLD_SIZE": None, "MASTER_PORT": None})
    with pytest.raises(RanksFailed, match="KeyError: 'the message'"):
        run_process(_fails)
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(3 if sys.argv[1:] == ['bad'] else 0)\n")
    run_plain(script, "good")  # exit 0 is a normal end
    with pytest.raises(RanksFailed, match="SystemExit: 3"):
        run_plain(script, "bad")


def _crashes_natively(rank, world_size):
    import ctypes

    if rank == 1:
        ctypes.string_at(0)  # SIGSEGV: no Python exception, no traceback sent to the parent
    return rank


def _waits_forever_in_a_named_function(rank, world_size):
    import time

    if rank == 1:
        while True:
            time.sleep(0.05)
    return rank


def test_a_rank_that_dies_in_native_code_or_hangs_is_reported_with_its_python_stack():
    """A rank that segfaults (or that the harness kills at its deadline) says where it was: faulthandler's stack,
    written to a file the parent reads, not to a stderr the test runner may have swallowed."""
    from odc_hf.testing import run_ranks

    crashed = run_ranks(_crashes_natively, 2, raise_on_failure=False, timeout_s=60)
    assert crashed[0].ok and crashed[0].value == 0
    assert crashed[1].exitcode == -11, crashed[1]
    assert "died with exit code -11" in crashed[1].error and "where it crashed" in crashed[1].error
    assert "_crashes_natively" in crashed[1].error, crashed[1].error  # the Python frame that crashed
    hung = run_ranks(_waits_forever_in_a_named_function, 2, raise_on_failure=False, timeout_s=20)  # ample to start
    assert hung[0].ok and "killed by the harness after 20 s; where it was waiting" in hung[1].error, hung[1].error
    assert "_waits_forever_in_a_named_function" in hung[1].error
