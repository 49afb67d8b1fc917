"""Fixtures shared by several test modules, and guards that keep tests independent of their order (the suite is
also run in random orders: tests/README.md)."""

import importlib
import os
import sys

import pytest
import torch

# One torch thread in the test processes and in what they start: the models here are tiny, so a second intra-op thread
# adds hand-off and spin-waiting, not speed, and the suite's workers and their ranks already keep every core busy.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for this test, whatever the session set (tiny models: thread hand-off dominates)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# TRL's own classes, as their defining modules hold them, and the public names a recipe imports them by.
_TRL_CLASSES = (("trl.trainer.sft_trainer", "SFTTrainer"), ("trl.trainer.grpo_trainer", "GRPOTrainer"))


def _trl_names_not_trls() -> list[tuple]:
    """``(module, name, TRL's class)`` for each of ``trl.SFTTrainer`` / ``trl.trainer.GRPOTrainer`` ... that is not
    TRL's own class (patched by any means: through odc_hf.patch_trl or by assigning the attribute). Nothing is
    looked at before the test session imported trl; from then on TRL's defining modules are imported to compare."""
    if "trl" not in sys.modules:
        return []
    wrong = []
    for defining, name in _TRL_CLASSES:
        original = getattr(importlib.import_module(defining), name)
        for package in ("trl", "trl.trainer"):
            module = sys.modules.get(package)
            if module is not None and getattr(module, name, original) is not original:
                wrong.append((module, name, original))
    return wrong


@pytest.fixture(autouse=True)
def trl_left_unpatched():
    """A test that patches TRL (odc_hf.patch_trl) must undo it: later tests, in any order, see TRL's own classes."""
    yield
    odc_trl = sys.modules.get("odc_hf.integrations.trl.patch")
    if odc_trl is not None and odc_trl._PATCHED:
        odc_trl.unpatch_trl()
        pytest.fail("this test left trl.SFTTrainer / trl.GRPOTrainer patched: use `with odc_hf.patch_trl():`")
    wrong = _trl_names_not_trls()
    for module, name, original in wrong:  # TRL's classes back, so that later tests are not affected
        setattr(module, name, original)
    if wrong:
        names = [f"{module.__name__}.{name}" for module, name, _ in wrong]
        pytest.fail(f"this test left {names} bound to something other than TRL's own class")


@pytest.fixture(autouse=True)
def environment_restored():
    """Variables a test sets in this process are not seen by later tests (nor by the processes they launch):
    in-process Accelerators set e.g. ACCELERATE_USE_FSDP / FSDP_* when built with an FSDP plugin, and nothing of
    accelerate's undoes it. The environment is put back as it was before the test."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:  # pytest's own: it keeps it up to date
        del os.environ[name]
    for name, value in before.items():
        if name != "PYTEST_CURRENT_TEST" and os.environ.get(name) != value:
            os.environ[name] = value


# The files that take longest (wall seconds in one process on 2 CPU cores), longest first. pytest-xdist's loadfile hands
# whole files to the workers in collection order (its own reorder, by number of tests, is turned off below): the longest
# started first, so that both workers run until near the end instead of one finishing a long file alone. Files not
# listed keep their order after these. Not applied when pytest-randomly orders the tests (tests/README.md).
LONGEST_FIRST = (
    "tests/models/test_model_zoo.py",
    "tests/recipes/test_trl_recipe_runpy.py",
    "tests/recipes/test_recipe_docs.py",
    "tests/fsdp/test_collective_audit.py",
    "tests/grpo/test_grpo_parity.py",
    "tests/trainers/test_trainer_logged_metrics.py",
    "tests/project/test_public_api.py",
    "tests/grpo/test_vllm_runs_stand_in.py",
    "tests/grpo/test_grpo_metrics.py",
    "tests/recipes/test_lora_recipe_reference.py",
    "tests/transport/test_ipc_files.py",
    "tests/trainers/test_trainer_hsdp.py",
    "tests/trainers/test_user_errors.py",
    "tests/recipes/test_trl_grpo_recipe_runpy.py",
    "tests/trainers/test_trainer_resume.py",
    "tests/benchmark_runs/test_sft_e2e_smoke.py",
    "tests/grpo/test_peft_grpo_parity.py",
    "tests/trainers/test_trainer_elastic_resume.py",
    "tests/fsdp/test_fsdp_hsdp.py",
    "tests/trainers/test_peft_sft.py",
    "tests/benchmark_runs/test_grpo_vllm_benchmark.py",
    "tests/benchmark_runs/test_single_gpu_benchmark_smoke.py",
    "tests/trainers/test_trainer_sft_parity.py",
    "tests/trainers/test_trainer_plan_ahead.py",
    "tests/benchmark_runs/test_grpo_benchmark_smoke.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection's order of files
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("randomly"):
        return
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: order within a file kept


def _untested_versions() -> list[str]:
    from odc_hf.version import TESTED, untested

    return [line for line in (untested(package) for package in TESTED) if line is not None]


def pytest_report_header(config):
    """The versions under test, and which of them odc_hf was not tested on (the lock installs tested ones)."""
    from odc_hf.version import TESTED, installed_version

    found = ", ".join(f"{p} {installed_version(p)}" for p in TESTED if installed_version(p) is not None)
    lines = [f"odc_hf version policy: {found}"]
    lines += [f"UNTESTED: {line.split('. odc_hf goes on')[0]}" for line in _untested_versions()]
    return lines


def pytest_terminal_summary(terminalreporter):
    untested = _untested_versions()
    if untested:
        terminalreporter.section("untested versions")
        for line in untested:
            terminalreporter.write_line(f"UNTESTED: {line.split('. odc_hf goes on')[0]} (odc_hf.version.TESTED)")
