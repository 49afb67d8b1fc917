"""The signatures (parameter names and kinds) of every upstream callable odc_hf overrides or calls by a private name —
the Trainer hooks and submodule functions of odc_hf/integrations/upstream/transformers.py, TRL GRPOTrainer's methods of
odc_hf/integrations/upstream/trl.py, and every method of transformers, TRL or accelerate that an odc_hf class overrides
(public ones too: ``compute_loss``, ``training_step``, ``get_train_dataloader``, ``log``, ``prepare``, ...) — equal the
ones recorded at the lock (tests/upstream_signatures.json). A release
that renames or reorders a parameter fails here by name (the newest-releases lane runs this file too), not at run time.

Regenerate the record after moving the lock: ``python tests/project/test_upstream_signatures.py --write``. Another
release odc_hf supports (the GPU image's transformers 5.17) may differ where odc_hf's use does not depend on it:
``--write-release`` on that release records its differences (tests/project/upstream_signatures_releases.json, under the
installed versions), after reading each one against odc_hf's calls; the test accepts them on that release only."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "upstream_signatures.json"
RELEASES = Path(__file__).resolve().parent / "upstream_signatures_releases.json"


def installed_release() -> str:
    """The key of the installed upstream versions in :data:`RELEASES`."""
    import accelerate
    import transformers
    import trl

    return f"transformers=={transformers.__version__} trl=={trl.__version__} accelerate=={accelerate.__version__}"


def expected() -> dict:
    """The lock's record, with the differences recorded for the installed release (when it is another one)."""
    recorded = json.loads(RECORD.read_text())
    releases = json.loads(RELEASES.read_text()) if RELEASES.exists() else {}
    recorded.update(releases.get(installed_release(), {}).get("signatures", {}))
    return recorded


def _callables() -> dict:
    from transformers import Trainer
    from trl import GRPOTrainer

    from odc_hf.integrations.upstream import transformers as tv
    from odc_hf.integrations.upstream import trl as trl_version

    found = {f"transformers.Trainer.{name}": getattr(Trainer, name) for name in tv.TRAINER_HOOKS}
    for module, names in tv.SUBMODULE_NAMES.items():
        imported = importlib.import_module(module)
        for name in names:
            value = getattr(imported, name)
            if inspect.isfunction(value):
                found[f"{module}.{name}"] = value
    found.update({f"trl.GRPOTrainer.{name}": getattr(GRPOTrainer, name) for name in trl_version.GRPO_PRIVATE_METHODS})
    listed = {id(f) for f in found.values()}
    found.update({name: f for name, f in _overridden().items() if id(f) not in listed})
    return found


def _overridden() -> dict:
    """Every upstream method an odc_hf class overrides, public ones included (``compute_loss``, ``training_step``,
    ``get_train_dataloader``, ``log``, ...), found by reading the classes: a method defined in an odc_hf class (or one
    of its parts) whose upstream base class defines the same name."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainerCallback
    from trl import GRPOTrainer, SFTTrainer

    from odc_hf.integrations.accelerate.accelerator import ODCAccelerator
    from odc_hf.integrations.accelerate.plugin import ODCFSDPPlugin
    from odc_hf.integrations.trainer.mixin import ODCTrainer, _ODCCallback
    from odc_hf.integrations.trl.grpo_trainer import ODCGRPOTrainer
    from odc_hf.integrations.trl.sft_trainer import ODCSFTTrainer

    pairs = {ODCTrainer: Trainer, ODCSFTTrainer: SFTTrainer, ODCGRPOTrainer: GRPOTrainer, _ODCCallback: TrainerCallback,
             ODCAccelerator: Accelerator, ODCFSDPPlugin: FullyShardedDataParallelPlugin}  # fmt: skip
    found = {}
    for ours, upstream in pairs.items():
        own = {k for cls in ours.__mro__ if cls.__module__.startswith("odc_hf.") for k in vars(cls)}
        for name in sorted(own):
            value = inspect.getattr_static(upstream, name, None)
            if name.startswith("__") and name != "__init__" or not inspect.isfunction(value):
                continue
            found[f"{value.__module__}.{value.__qualname__}"] = value  # where it is defined: inherited ones once
    return found


def signature(function) -> list[list[str]]:
    """``[[name, kind], ...]`` of a callable's parameters (defaults and annotations are not part of the contract)."""
    return [[p.name, p.kind.name] for p in inspect.signature(function).parameters.values()]


def differences(recorded: dict, installed: dict) -> list[str]:
    out = []
    for name in sorted(set(recorded) | set(installed)):
        if name not in installed:
            out.append(f"{name}: recorded, not listed any more (regenerate the record)")
        elif name not in recorded:
            out.append(f"{name}: listed, not recorded (regenerate the record)")
        elif recorded[name] != installed[name]:
            out.append(f"{name}: recorded {recorded[name]}, installed {installed[name]}")
    return out


def test_every_listed_upstream_callable_keeps_its_recorded_signature():
    installed = {name: signature(f) for name, f in _callables().items()}
    problems = differences(expected(), installed)
    assert not problems, "upstream signatures changed:\n" + "\n".join(problems)


def test_a_renamed_or_reordered_parameter_is_reported_by_name():
    """Control: the comparison is not blind to a rename, a kind change or a missing name."""

    def before(self, model, trial=None): ...

    def renamed(self, model, trial_params=None): ...

    def keyword_only(self, model, *, trial=None): ...

    recorded = {"Trainer._save_checkpoint": signature(before)}
    assert differences(recorded, {"Trainer._save_checkpoint": signature(before)}) == []
    assert differences(recorded, {"Trainer._save_checkpoint": signature(renamed)}) == [
        "Trainer._save_checkpoint: recorded [['self', 'POSITIONAL_OR_KEYWORD'], ['model', 'POSITIONAL_OR_KEYWORD'], "
        "['trial', 'POSITIONAL_OR_KEYWORD']], installed [['self', 'POSITIONAL_OR_KEYWORD'], ['model', "
        "'POSITIONAL_OR_KEYWORD'], ['trial_params', 'POSITIONAL_OR_KEYWORD']]"
    ]
    assert len(differences(recorded, {"Trainer._save_checkpoint": signature(keyword_only)})) == 1
    assert differences(recorded, {}) == ["Trainer._save_checkpoint: recorded, not listed any more (regenerate the record)"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    RECORD.write_text(json.dumps({name: signature(f) for name, f in _callables().items()}, indent=1) + "\n")
    print(f"wrote {RECORD}")
elif __name__ == "__main__" and sys.argv[1:2] == ["--write-release"]:
    lock = json.loads(RECORD.read_text())
    changed = {name: signature(f) for name, f in _callables().items() if lock.get(name) != signature(f)}
    releases = json.loads(RELEASES.read_text()) if RELEASES.exists() else {}
    releases[installed_release()] = {"why accepted": " ".join(sys.argv[2:]) or "(say why)", "signatures": changed}
    RELEASES.write_text(json.dumps(releases, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(changed)} differences to {RELEASES}: {sorted(changed)}")
