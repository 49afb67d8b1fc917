"""A failing rank's own message is the last thing a user sees (odc_hf/integrations/launch/rank_errors.py): each launched rank
prints one line and writes its traceback to a file; the examples' launcher keeps the rest of the launcher's output
(torch's elastic agent reports every rank in a ``ChildFailedError``) in the error folder and ends with the rank that
failed first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent(
    """
    import os, sys, time
    from odc_hf.integrations.launch import rank_errors
    from odc_hf.transport.base import PeerFailedError
    rank_errors.install()
    if os.environ["RANK"] == "0":
        time.sleep(0.3)
        raise PeerFailedError("rank 1 failed (ValueError: the cause); rank 0 stopped at its barrier")
    print("step 1", flush=True)
    raise ValueError("the cause, in odc_hf's words")
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys
    sys.stderr.write("progress 10%\\rprogress 100%\\n"); sys.stderr.flush()
    children = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "RANK": str(r)})
                for r in range(2)]
    codes = [c.wait() for c in children]
    sys.stderr.write("Traceback (most recent call last):\\n  File launcher\\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\\n" + "=" * 60 + "\\n")
    sys.exit(1)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_the_launcher_ends_with_the_rank_that_failed_first_and_keeps_the_report_in_a_file(tmp_path):
    driver = (
        "import sys; from odc_hf.integrations.launch.rank_errors import run_launcher; "
        "sys.exit(run_launcher([sys.executable, '-c', sys.argv[1], sys.argv[2]], dict(__import__('os').environ)))"
    )
    proc = subprocess.run([sys.executable, "-c", driver, LAUNCHER, RANK], env=_env(), capture_output=True,
                          timeout=120)  # fmt: skip
    stderr = proc.stderr.decode()  # bytes: text mode would turn the progress bar's \r into \n
    assert proc.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    # what came before the failure is shown as it came (a progress bar's \r included); the launcher's report is not
    assert stderr.startswith("progress 10%\rprogress 100%\n"), stderr
    assert "ChildFailedError" not in stderr and "Traceback" not in stderr, stderr
    # rank 1 raised first; rank 0 stopped because of it (a PeerFailedError, later): rank 1's message is the cause
    assert lines[-2] == "odc_hf: rank 1 failed: ValueError: the cause, in odc_hf's words", lines
    assert lines[-1].startswith("odc_hf: details (every rank's traceback, the launcher's report) in "), lines
    folder = Path(lines[-1].rsplit(" in ", 1)[1])
    assert "ChildFailedError" in (folder / "launcher.log").read_text()  # the report: kept, not lost
    assert "Traceback" in (folder / "rank1.log").read_text() and "ValueError" in (folder / "rank1.log").read_text()
    assert json.loads((folder / "rank0.json").read_text())["peer"] is True
    assert proc.stdout == b"step 1\n"  # stdout is not touched


def test_control_without_the_hook_the_rank_prints_its_traceback(tmp_path):
    """Control: the rank without ``install()`` (a plain process, or before) prints Python's own traceback."""
    code = RANK.replace("rank_errors.install()", "pass")
    proc = subprocess.run([sys.executable, "-c", code], env={**_env(), "RANK": "1"}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert "Traceback (most recent call last)" in proc.stderr and "odc_hf: rank" not in proc.stderr


def test_outside_a_launched_rank_python_reports_as_usual():
    from odc_hf.integrations.launch import rank_errors

    before = sys.excepthook
    environ = dict(os.environ)
    os.environ.pop("RANK", None)
    try:
        rank_errors.install()
        assert sys.excepthook is before
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_runs_without_a_rendezvous_id_do_not_share_an_error_folder():
    """torchrun's run id is "none" unless --rdzv-id is given (accelerate launch on one machine): two such runs, each
    a launcher with its own process id, get their own folders (the control: a real run id names the folder)."""
    from odc_hf.integrations.launch.rank_errors import error_dir

    folder = error_dir({"TORCHELASTIC_RUN_ID": "none"})
    assert folder.name == f"odc_hf-errors-pid{os.getppid()}"
    assert error_dir({}) == folder
    assert error_dir({"TORCHELASTIC_RUN_ID": "job/7"}).name == "odc_hf-errors-job_7"
    assert error_dir({"TORCHELASTIC_RUN_ID": "none", "ODC_ERROR_DIR": "/x/y"}) == Path("/x/y")


@pytest.mark.slow
def test_resuming_without_a_checkpoint_ends_with_odc_hfs_message_not_the_launchers_report(tmp_path):
    """The user's case: ``python examples/sft.py --resume_from_checkpoint last`` with no checkpoint. Before, the
    message was inside torch's ``ChildFailedError`` report of every rank, after each rank's traceback."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sft.py"), "--resume_from_checkpoint", "last", "--output_dir",
         str(tmp_path / "fresh"), "--max_steps", "1"],
        env={**_env(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
        timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("odc_hf: rank ") and "failed: ValueError: resume_from_checkpoint='last' resumes " \
        "from the newest complete checkpoint" in lines[-2], proc.stderr[-3000:]  # fmt: skip
    assert "ChildFailedError" not in proc.stderr and "Traceback (most recent call last)" not in proc.stderr
    folder = Path(lines[-1].rsplit(" in ", 1)[1])
    assert "ChildFailedError" in (folder / "launcher.log").read_text()
