"""The newest-releases lane of CI (non-gating): odc_hf's surface and trainer-parity tests against the newest releases
of its dependencies, in an environment of its own, with one table of what it found.

The gating run installs the lock (tests/constraints.txt); this one installs what a user's ``pip install odc_hf``
would get today, so it shows what the next version bump of the lock must fix. It never fails: its exit status is 0
whatever the tests do (a broken network or a failed install is reported in the table too). torch stays at 2.13.0:
PyPI's newer torch builds are CUDA builds, which CI does not install; the table lists the newest torch all the same.

    python .ci/newest_releases.py [--keep DIR]      # from the repository root; .ci/run calls it after the gating run
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "tokenizers", "huggingface-hub", "vllm")
GROUPS = {  # test group -> test files (each group runs in one pytest process)
    "surface": ["tests/project/test_transformers_surface.py", "tests/project/test_upstream_signatures.py",
                "tests/grpo/test_grpo_trl_surface.py", "tests/fsdp/test_fsdp_internals.py",
                "tests/project/test_version_policy.py", "tests/recipes/test_patch_trl.py"],
    "trainer parity": ["tests/trainers/test_trainer_sft_parity.py", "tests/grpo/test_grpo_parity.py",
                       "tests/models/test_model_zoo.py"],
}
NOT_INSTALLED = {"torch": "kept at 2.13.0 (PyPI's newer builds are CUDA)", "vllm": "not run (pins a CUDA torch)"}


def sh(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)
    except subprocess.TimeoutExpired as error:
        return subprocess.CompletedProcess(command, 124, error.stdout or "", f"timed out after {timeout:.0f} s")


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "tests" / "constraints.txt").read_text().splitlines():
        name, _, pinned = line.split("#")[0].strip().partition("==")
        if pinned:
            pins[re.sub(r"[-_.]+", "-", name).lower()] = pinned
    return pins


def newest(python: str, package: str) -> str:
    """The newest release on the package index, as pip sees it (``pip index versions``)."""
    out = sh([python, "-m", "pip", "index", "versions", package], timeout=120)
    found = re.search(rf"^{re.escape(package)} \(([^)]+)\)", out.stdout, re.I | re.M)
    return found.group(1) if found else "?"


def installed(python: str) -> dict[str, str]:
    out = sh([python, "-m", "pip", "list", "--format=freeze"], timeout=120).stdout
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, _, v in (line.partition("==") for line in out.splitlines())}


def run_group(python: str, files: list[str], timeout: float) -> str:
    start = time.monotonic()
    # this lane installs newer releases than the lock on purpose: the lock-equality check does not apply here
    deselect = ["--deselect", "tests/project/test_version_policy.py::test_the_installed_versions_are_the_lock"]
    out = sh([python, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *deselect, *files],
             timeout=timeout)
    seconds = time.monotonic() - start
    summary = next((line.strip("= ") for line in reversed(out.stdout.splitlines()) if " in " in line), out.stderr[-200:])
    verdict = "pass" if out.returncode == 0 else ("timeout" if out.returncode == 124 else "FAIL")
    if verdict == "FAIL":
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
        print(f"\n--- {files}: {len(failed)} failed ---\n" + "\n".join(out.stdout.splitlines()[-60:]), flush=True)
    return f"{verdict} ({summary}; {seconds:.0f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="make the environment in this folder and keep it (default: a temporary one)")
    parser.add_argument("--group_timeout", type=float, default=900.0, help="seconds per test group")
    options = parser.parse_args()
    start = time.monotonic()
    env_dir = Path(options.keep or tempfile.mkdtemp(prefix="odc_newest_"))
    python = str(env_dir / "bin" / "python")
    rows, problems, results = {}, [], {}
    try:
        steps = [
            [sys.executable, "-m", "venv", str(env_dir)],
            [python, "-m", "pip", "install", "-q", "torch==2.13.0"],
            # the newest release of everything odc_hf[test] needs, torch held where it is
            [python, "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-e", ".[test]",
             "torch==2.13.0"],
        ]  # fmt: skip
        for step in steps:
            out = sh(step, timeout=1200)
            if out.returncode != 0:
                problems.append(f"`{' '.join(step[-3:])}` failed: {(out.stderr or out.stdout)[-400:]}")
                break
        if not problems:
            for group, files in GROUPS.items():
                present = [f for f in files if (ROOT / f).exists()]
                results[group] = run_group(python, present, options.group_timeout)
        have = installed(python) if not problems else {}
        pins = locked()
        for package in PACKAGES:
            rows[package] = (pins.get(package, "-"), newest(python if Path(python).exists() else sys.executable, package),
                             have.get(package) or NOT_INSTALLED.get(package, "not installed"))  # fmt: skip
    finally:
        if not options.keep:
            shutil.rmtree(env_dir, ignore_errors=True)
    print("\n## Newest releases (non-gating lane)\n")
    print("| package | pinned (tests/constraints.txt) | newest on the index | installed in this lane |")
    print("|---|---|---|---|")
    for package, (pinned, latest, lane) in rows.items():
        newer = lane[:1].isdigit() and pinned != "-" and lane.split("+")[0] != pinned.split("+")[0]
        print(f"| {package} | {pinned} | {latest} | {lane}{' (not the locked version)' if newer else ''} |")
    print("| **test group** | | | **result** |")
    for group, files in GROUPS.items():
        print(f"| {group} | {len(files)} files | | {results.get(group, 'not run') if not problems else 'not run'} |")
    for problem in problems:
        print(f"\nlane problem: {problem}")
    print(f"\nnewest-releases lane: {time.monotonic() - start:.0f} s (non-gating: CI's result does not depend on it)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as error:  # non-gating: report, never fail CI
        print(f"newest-releases lane could not run: {type(error).__name__}: {error}")
        sys.exit(0)
