"""The upstream fence: outside ``odc_hf/integrations/upstream/`` no module of the integration touches a private name of
transformers, TRL, accelerate, PEFT or vLLM -- by import, attribute access, a name in a string (``getattr``), or by
overriding a private method of an upstream class. A release that renames one then breaks one room, whose version
policy names it.

Private names are harvested from the installed sources of those libraries (``def _x``, ``._x``), so odc_hf's own
private helpers (``_odc_*``, module-level ``_helpers``) never count. Each rule also runs on a broken twin.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTEGRATIONS = ROOT / "odc_hf" / "integrations"
FENCE = INTEGRATIONS / "upstream"
UPSTREAM = ("transformers", "trl", "accelerate", "peft", "vllm")
# Private names of Python itself that upstream sources use too: a namedtuple's methods.
STDLIB = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_odc")


def upstream_private_names() -> set[str]:
    """Every ``_name`` an installed upstream library defines or reads as an attribute (vLLM's only when installed)."""
    names = set()
    for package in UPSTREAM:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for path in pathlib.Path(root).rglob("*.py"):
                if package == "transformers" and "models" in path.relative_to(root).parts[:1]:
                    continue  # per-family modeling files: their helpers are not the Trainer's surface
                names |= set(re.findall(r"(?:\.|def )(_[A-Za-z]\w*)", path.read_text(errors="ignore")))
    return {n for n in names if _private(n)} - STDLIB


def fence_breaches(source: str, where: str, private: set[str]) -> list[str]:
    """Where ``source`` touches an upstream private name: imports, attribute access, names in strings."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in UPSTREAM:
            parts = node.module.split(".")
            found += [f"{where}:{node.lineno} imports {node.module}" for p in parts if _private(p)][:1]
            found += [f"{where}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                      if _private(a.name)]  # fmt: skip
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in UPSTREAM and any(_private(p) for p in a.name.split("."))]  # fmt: skip
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{where}:{node.lineno} reads .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.append(f"{where}:{node.lineno} names {node.value!r}")
    return found


def overridden_private_methods(module) -> list[str]:
    """Private methods a class of ``module`` defines that one of its upstream base classes defines too."""
    found = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        upstream_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in UPSTREAM]
        for name in vars(cls):
            if _private(name) and any(name in vars(b) for b in upstream_bases):
                found.append(f"{module.__name__}.{cls.__name__} overrides {name}")
    return found


def _modules_outside_the_fence():
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        if FENCE in path.parents:
            continue
        yield path, ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@pytest.fixture(scope="module")
def private():
    names = upstream_private_names()
    assert {"_save_checkpoint", "_metrics", "_generate_and_score_completions", "_get_output_dir"} <= names  # harvest
    return names


def test_no_module_outside_the_fence_touches_an_upstream_private_name(private):
    breaches = []
    for path, _ in _modules_outside_the_fence():
        breaches += fence_breaches(path.read_text(), str(path.relative_to(ROOT)), private)
    assert not breaches, "\n".join(breaches)


def test_the_fence_itself_is_where_they_are(private):
    """The fence is not empty: the scan, run on it, finds what the rest of the integration may not hold."""
    inside = [b for path in sorted(FENCE.glob("*.py")) for b in fence_breaches(path.read_text(), path.name, private)]
    assert any("_save_checkpoint" in b for b in inside), inside
    assert any("_metrics" in b for b in inside), inside


# The lower layers (attention, fsdp, prediction, ...) sit below the integration and cannot import the fence: each
# upstream private name they touch is listed here with where its existence is checked. A new one fails the test
# below, and so does an entry whose read is gone.
BELOW_THE_FENCE = {
    ("odc_hf/attention/varlen.py", "_attn_implementation"):
        "no public getter; the one read (implementation_name), listed in the fence's PRIVATE_ATTRIBUTES",
    ("odc_hf/fsdp/sharding.py", "_no_split_modules"):
        "transformers' decoder-layer classes, listed in PRIVATE_ATTRIBUTES; a model without it is refused by name",
    ("odc_hf/fsdp/sharding.py", "_orig_mod"):
        "torch.compile's OptimizedModule (a torch name transformers reads too); absent means not compiled",
    ("odc_hf/prediction/batch_rebalance.py", "_assign"):
        "the batch_rebalance baseline's plan, checked by sampler_class() before use (prediction, never training)",
}  # fmt: skip


def _own_private_names() -> set[str]:
    """Private names odc_hf defines itself (``def _x``, ``self._x = ...``, ``_x: T`` in a class): reading those is
    not touching upstream's, whatever upstream also calls its own."""
    pattern = r"def (_\w+)|self\.(_\w+)\s*(?::[^=\n]*)?=(?!=)|^\s+(_\w+)\s*:"
    names = set()
    for path in (ROOT / "odc_hf").rglob("*.py"):
        names |= {n for groups in re.findall(pattern, path.read_text(), re.M) for n in groups if n}
    return names


def _below_the_fence_sources():
    for path in sorted((ROOT / "odc_hf").rglob("*.py")):
        if INTEGRATIONS not in path.parents:
            yield str(path.relative_to(ROOT)), path.read_text()


def below_the_fence(private: set[str], sources) -> set[tuple[str, str]]:
    """(file, name) of every upstream private name the ``(file, source)`` pairs touch, odc_hf's own names aside."""
    private = private - _own_private_names()
    return {(where, breach.rsplit(" ", 1)[1].strip("'.")) for where, source in sources
            for breach in fence_breaches(source, where, private)}  # fmt: skip


def test_below_the_fence_only_the_listed_private_names(private):
    found = below_the_fence(private, _below_the_fence_sources())
    new = sorted(found - set(BELOW_THE_FENCE))
    gone = sorted(set(BELOW_THE_FENCE) - found)
    assert not new, f"upstream private names outside the fence, not in BELOW_THE_FENCE: {new}"
    assert not gone, f"BELOW_THE_FENCE lists reads that are gone: {gone}"


def test_below_the_fence_sees_a_new_read(private):
    """Broken twin: a lower-layer module reading a Trainer private name is found by file and name, while odc_hf's
    own private names that upstream also uses (a transport's ``self._buffer``) are not."""
    twin = ("odc_hf/fsdp/twin.py", "def units(trainer):\n    return trainer._metrics, getattr(trainer, '_get_output_dir')\n")
    own = ("odc_hf/transport/twin.py", "class T:\n    def __init__(self):\n        self._buffer = 1\n    def f(self):\n        return self._buffer\n")
    assert "_buffer" in private  # upstream uses the name too: the own-name rule is what passes it
    assert below_the_fence(private, [twin, own]) == {("odc_hf/fsdp/twin.py", "_metrics"),
                                                     ("odc_hf/fsdp/twin.py", "_get_output_dir")}  # fmt: skip


def test_the_scan_sees_each_kind_of_breach(private):
    """Broken twins: each rule reports its own kind of breach, and odc_hf's own private names pass."""
    broken = {
        "metrics = trainer._metrics['train']": "reads ._metrics",
        "from transformers.trainer import _is_peft_model": "imports _is_peft_model from transformers.trainer",
        "from trl._compat import x": "imports trl._compat",
        "setattr(generation, '_llm_weights_sleeping', False)": "names '_llm_weights_sleeping'",
        "super()._save_checkpoint(model, trial)": "reads ._save_checkpoint",
    }
    for source, words in broken.items():
        assert [b.split(" ", 1)[1] for b in fence_breaches(source, "twin", private)] == [words], source
    clean = "self._odc_replay = None\nx = _helper(1)\nload_result._replace(missing_keys=[])\nimport trl.trainer"
    assert fence_breaches(clean, "clean", private) == []


def test_no_class_outside_the_fence_overrides_an_upstream_private_method():
    found = []
    for _, name in _modules_outside_the_fence():
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # vLLM-only modules where vLLM is not installed still import (lazy vllm)
            pytest.fail(f"{name} does not import: {error}")
        found += overridden_private_methods(module)
    assert not found, "\n".join(found)


def test_the_override_check_sees_an_override():
    from transformers import Trainer

    twin = type(sys)("twin_module")
    twin.Mine = type("Mine", (Trainer,), {"__module__": "twin_module", "_save_checkpoint": lambda self, m, t: None,
                                          "_odc_own": lambda self: None, "odc_public": lambda self: None})  # fmt: skip
    assert overridden_private_methods(twin) == ["twin_module.Mine overrides _save_checkpoint"]
