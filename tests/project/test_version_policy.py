"""odc_hf's version policy (odc_hf.version): the lock the tests install through lists tested versions only and
covers every requirement; an untested minor warns once on rank 0, naming the tested ones, and is not refused;
a missing name is refused by name."""

from __future__ import annotations

import tomllib
import warnings
from importlib.metadata import distributions, metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from odc_hf import version
from odc_hf.integrations.upstream import transformers as transformers_version
from odc_hf.integrations.upstream import trl as trl_version
from odc_hf.integrations.upstream import vllm as vllm_version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "tests" / "constraints.txt"


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            assert pinned, f"tests/constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = pinned
    return pins


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_lock_pins_a_tested_minor_of_every_policy_package():
    pins = _lock()
    for package, tested in version.TESTED.items():
        if package == "vllm":  # not in the CPU lock: vLLM pins a CUDA torch (the vllm extra, GPU tests)
            assert package not in pins
            continue
        assert version.minor(pins[package]) in tested, f"the lock installs {package} {pins[package]}; tested: {tested}"


def test_the_lock_covers_every_requirement_of_the_test_install():
    project = _project()
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    pins = _lock()
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is required but not locked: run .ci/update_lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])


def test_the_python_floor_is_no_lower_than_the_requirements_floor():
    """A Python that odc_hf admits but one of its installed requirements refuses makes pip fail with "no matching
    distribution for trl>=1.16" instead of naming the Python (seen on 3.10 with requires-python >=3.10)."""
    project = _project()
    ours = SpecifierSet(project["requires-python"])
    pythons = [f"3.{minor}" for minor in range(8, 16)]
    for requirement in map(Requirement, project["dependencies"]):
        theirs = SpecifierSet(metadata(requirement.name).get("Requires-Python") or "")
        refused = [p for p in pythons if p in ours and p not in theirs]
        assert not refused, f"odc_hf admits Python {refused}, which {requirement.name} refuses ({theirs})"


def test_the_version_lists_are_views_of_one_table():
    assert transformers_version.TESTED_TRANSFORMERS is version.TESTED["transformers"]
    assert trl_version.TESTED_TRL is version.TESTED["trl"]
    assert vllm_version.TESTED_VLLM is version.TESTED["vllm"]
    assert version.TESTED_TORCH is version.TESTED["torch"]


@pytest.fixture
def fresh_policy(monkeypatch):
    monkeypatch.setattr(version, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)


def test_an_untested_minor_warns_once_naming_the_tested_ones(fresh_policy):
    with pytest.warns(version.UntestedVersionWarning) as caught:
        assert version.warn_if_untested("transformers", versions={"transformers": "5.99.1"}) == ["transformers"]
    (message,) = [str(w.message) for w in caught]
    assert "transformers 5.99.1 is not a version odc_hf was tested on" in message
    assert all(minor in message for minor in version.TESTED["transformers"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second call is silent
        assert version.warn_if_untested("transformers", versions={"transformers": "5.99.1"}) == []


def test_a_tested_minor_and_other_ranks_stay_silent(fresh_policy, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tested = {p: f"{v[-1]}.3" for p, v in version.TESTED.items()}
        assert version.warn_if_untested(*tested, versions=tested) == []
        monkeypatch.setenv("RANK", "1")
        assert version.warn_if_untested("accelerate", versions={"accelerate": "9.0.0"}) == []


@pytest.mark.parametrize(
    "package,raw,expected",
    [("torch", "2.11.0+cu130", None), ("torch", "2.15.0", "2.15"), ("vllm", "0.26.0+cu130", None),
     ("trl", "1.17.0.dev0", "1.17")],
)  # fmt: skip
def test_minor_of_local_and_development_versions(package, raw, expected):
    assert (version.untested(package, raw) is None) == (expected is None)
    if expected is not None:
        assert f"{package} {raw} is not a version" in version.untested(package, raw)


def test_another_trl_minor_warns_and_a_missing_name_is_refused(fresh_policy, monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.17.0")

    HasAll = type("HasAll", (), dict.fromkeys(trl_version.SFT_PRIVATE_ATTRIBUTES))

    with pytest.warns(version.UntestedVersionWarning, match="trl 1.17.0"):
        trl_version.check_trl_sft(HasAll())  # warns, goes on
    with pytest.raises(RuntimeError, match=r"lacks \['_total_train_tokens', 'aux_loss_enabled'"):
        trl_version.check_trl_sft(type("Renamed", (), {"_metrics": {}})())


def test_another_vllm_minor_warns_and_a_missing_vllm_is_refused(fresh_policy):
    with pytest.warns(version.UntestedVersionWarning, match="vllm 0.34.0"):
        assert vllm_version.check_vllm("0.34.0") == "0.34.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert vllm_version.check_vllm("0.26.0+cu130") == "0.26.0+cu130"


def test_a_vllm_engine_without_apply_model_is_refused():
    from odc_hf.integrations.vllm.sync import adopt_generation

    generation = type("Generation", (), {"mode": "colocate", "llm": object(), "enable_sleep_mode": False})()
    with pytest.raises(RuntimeError, match="object lacks apply_model"):
        adopt_generation(generation, source=lambda: [])


def test_ci_runs_exactly_the_readme_test_command_through_the_lock():
    readme = (ROOT / "README.md").read_text()
    (command,) = [line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line]
    assert "-c tests/constraints.txt" in command
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    (main_job,) = [line for line in readme.splitlines() if line.startswith("pip install") and "examples/sft.py" in line]
    assert "-c tests/constraints.txt" in main_job


@pytest.mark.parametrize("failing", ["pip", "python", None])
def test_ci_fails_when_any_step_of_the_readme_command_fails(tmp_path, failing):
    """.ci/run with stand-ins for pip and python: a failed install stops CI with its status (bash's set -e alone
    would go on to the lane, whose exit is 0), as a failed pytest does; the lane runs only after both passed."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("pip", "python"):
        status = 3 if tool == failing else 0
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\nexit {status}\n')
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines()
    if failing is None:
        assert proc.returncode == 0 and calls[-1] == "python .ci/newest_releases.py", (proc.stderr, calls)
    else:
        assert proc.returncode == 3, (proc.returncode, proc.stderr, calls)
        assert not any("newest_releases" in c for c in calls), calls


def _lock_differences(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """Every locked package whose installed version is not the pinned one (local labels such as +cpu ignored)."""
    out = []
    for name, pinned in sorted(pins.items()):
        have = installed.get(name)
        if have is None:
            out.append(f"{name}: locked {pinned}, not installed")
        elif have.split("+")[0] != pinned:
            out.append(f"{name}: locked {pinned}, installed {have}")
    return out


def _installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}


def test_lock_differences_name_each_package_that_differs():
    """Control for the check below: a drifted or missing package is reported by name with both versions."""
    pins = {"torch": "2.13.0", "trl": "1.16.0", "six": "1.16.0"}
    assert _lock_differences(pins, {"torch": "2.13.0+cpu", "trl": "1.16.0", "six": "1.16.0"}) == []
    assert _lock_differences(pins, {"torch": "2.13.0", "trl": "1.17.0"}) == [
        "six: locked 1.16.0, not installed",
        "trl: locked 1.16.0, installed 1.17.0",
    ]


def test_the_installed_versions_are_the_lock():
    """CI installs through the lock (README command 2); this fails, naming each package, when what is installed is
    not what the lock says (a release that slipped past ``-c``, a package installed by hand). Machines whose torch is
    not the lock's (the GPU image's own torch build) are not lock installs and are skipped with that reason."""
    pins, installed = _lock(), _installed()
    if installed.get("torch", "").split("+")[0] != pins["torch"]:
        pytest.skip(f"torch {installed.get('torch')} is not the lock's {pins['torch']}: not a lock install")
    differences = _lock_differences(pins, installed)
    assert not differences, "installed versions differ from tests/constraints.txt:\n" + "\n".join(differences)
