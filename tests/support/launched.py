"""A script run as ``accelerate launch --config_file accelerate_configs/<config> SCRIPT ARGS`` would run it on CPU, in
ranks forked from the test process's fork server (``odc_hf.testing.run_ranks``) instead of fresh interpreters.

What the ranks get is what accelerate's launcher gives its processes: the variables accelerate computes from the YAML
(``prepare_multi_gpu_env``: mixed precision, dynamo, the HSDP mesh of ``cpu_hsdp.yaml``, ...) plus those of
:func:`odc_hf.testing.accelerate_cpu` (``ACCELERATE_USE_CPU``, offline, one thread), and torchrun's rank, world and
master variables with the rendezvous store held by the test process (``TORCHELASTIC_USE_AGENT_STORE``): the process
group is started by what the script runs (accelerate's state), when it runs, as under torchrun. Each rank then runs
the script as ``__main__`` with its arguments, as the interpreter would (tests/recipes/test_launched_harness.py
compares a script's view of both). The difference from a real launch is where torch, transformers, accelerate and TRL
were imported: once, in the fork server, instead of in every process (~10 s of CPU each on the test machine), which
is what makes the number-only parity runs cheap. The command-line paths themselves (the launcher,
``python -m odc_hf.run``, an example's own relaunch, the documented recipes) keep their real launches in the tests
that test them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from odc_hf.testing import run_process, run_ranks
from odc_hf.testing.recipes import CPU_LAUNCH_ENV

ROOT = Path(__file__).resolve().parents[2]

# accelerate_cpu's variables (CPU_LAUNCH_ENV) are the ones a launched rank of this checkout sees; a plain process gets
# them but the first
_OFFLINE_ENV = {k: v for k, v in CPU_LAUNCH_ENV.items() if k != "ACCELERATE_USE_CPU"}


def _with_checkout(env: dict) -> dict:
    """``env`` with this checkout first on ``PYTHONPATH`` (for what the runs start in turn)."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": pythonpath}


def launcher_environment(config: str = "cpu.yaml") -> tuple[int, dict[str, str]]:
    """``(processes, variables)``: what ``accelerate launch --config_file accelerate_configs/<config>`` adds to every
    process's environment, computed by accelerate's own launcher code from the YAML."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(ROOT / "accelerate_configs" / config), "--main_process_port", "0", "script.py"]
    before = {**os.environ, **CPU_LAUNCH_ENV}
    saved = dict(os.environ)
    os.environ.update(CPU_LAUNCH_ENV)  # accelerate reads ACCELERATE_USE_CPU while it validates the command
    try:
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
        env = prepare_multi_gpu_env(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    added = {k: v for k, v in env.items() if before.get(k) != v}
    return int(args.nproc_per_node), {**CPU_LAUNCH_ENV, **added}


def run_as_main(target: str, argv) -> None:
    """``python TARGET ARGV`` (a script path) or ``python -m MODULE ARGV`` (``target`` = ``"-m MODULE"``): run as
    ``__main__`` by ``runpy`` with ``sys.argv`` set; a ``SystemExit(0)`` is a normal end. Imports resolve as in the test
    process (``sys.path`` is the fork server's: the checkout's packages and tests/support), not from a script's own
    folder."""
    import runpy

    module = target[3:] if target.startswith("-m ") else None
    sys.argv = [module or target, *argv]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise


def _rank_main(rank, world_size, target, argv):
    run_as_main(target, argv)


def run_launched(script, *args, config: str = "cpu.yaml", env: dict | None = None, timeout_s: float = 900) -> None:
    """Run ``script`` (a path, or ``"-m MODULE"``) on the processes ``config`` launches, as described above.
    Raises ``odc_hf.testing.RanksFailed`` with every failing rank's traceback."""
    processes, launcher_env = launcher_environment(config)
    run_ranks(_rank_main, processes, str(script), [str(a) for a in args], timeout_s=timeout_s, init_process_group=False,
              env={**_with_checkout(launcher_env), **(env or {})})  # fmt: skip


def run_plain(target, *args, env: dict | None = None, timeout_s: float = 900) -> None:
    """``python TARGET ARGS`` (a script path, or ``"-m MODULE"``) in one plain process (no launcher, no process
    group), forked from the same server."""
    run_process(run_as_main, str(target), [str(a) for a in args], timeout_s=timeout_s,
                env={**_with_checkout(_OFFLINE_ENV), **(env or {})})  # fmt: skip
