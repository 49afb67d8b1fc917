"""The import rules of the layers (docs/design.md, "Layers"), checked on the sources: run it to see where a change
breaks them.

- ``odc_hf.balance`` is pure planning: importing it loads neither transformers, accelerate, TRL nor (from odc_hf code)
  torch.distributed, checked by importing it in a fresh interpreter with those blocked;
- no odc_hf module imports a higher layer (transport < fsdp < model helpers and test fixtures < prediction <
  integrations < launchers; balance and transport are independent of each other), transport / fsdp / balance import
  nothing of Hugging Face, and integrations (what training runs) imports neither prediction nor the fixtures;
- every module has a layer, and the package root holds only the modules named in ``ROOT_MODULES``;
- the library never imports benchmarks or tests; tests never import benchmarks and benchmarks never import tests
  (what both need lives in ``odc_hf.testing``); a benchmark imports another benchmark's file only when it is a shared
  module (no ``__main__`` block), never a script.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Layer of every odc_hf package / top-level module: a module may import odc_hf modules of lower layers and of its own
# package only. transport and balance share a layer so that neither may import the other; so do attention and testing.
LAYERS = {
    "odc_hf.version": 0, "odc_hf.config": 0,
    "odc_hf.transport": 1, "odc_hf.balance": 1,
    "odc_hf.fsdp": 2,
    "odc_hf.attention": 3, "odc_hf.testing": 3,
    "odc_hf.prediction": 4,
    "odc_hf.integrations": 5,  # its __init__ only: every module lives in one of the rooms below
    # the rooms of integrations, each a concept (docs/design.md, "Map"); a room imports lower rooms only
    "odc_hf.integrations.upstream": 5.0,
    "odc_hf.integrations.launch": 5.1, "odc_hf.integrations.models": 5.1,
    "odc_hf.integrations.checkpoint": 5.1, "odc_hf.integrations.vllm": 5.1,
    "odc_hf.integrations.accelerate": 5.2, "odc_hf.integrations.compute": 5.2,
    "odc_hf.integrations.trainer": 5.3,
    "odc_hf.integrations.trl": 5.4,
    "odc_hf.run": 6, "odc_hf.estimate": 6, "odc_hf.offline": 6,
    # the CPU stand-in for vLLM's engine: a fixture that installs itself into TRL and odc_hf's vLLM fence
    "odc_hf.testing.vllm_fake": 6,
    "odc_hf": 7,  # the package's __init__ (its exports are lazy)
}  # fmt: skip
# The modules at the package root: the public config and the version checks everything imports (layer 0), the
# three documented commands, and the __init__; the attention implementation a user registers by importing it is the
# one root package (odc_hf.attention, with its per-document variants).
ROOT_MODULES = {"__init__", "config", "version", "run", "estimate", "offline"}
ROOT_PACKAGES = {"attention", "balance", "fsdp", "integrations", "prediction", "testing", "transport"}
HUGGING_FACE = ("transformers", "accelerate", "trl", "peft", "datasets")
FORBIDDEN = {  # modules a package must not import
    "odc_hf.transport": HUGGING_FACE,
    "odc_hf.fsdp": HUGGING_FACE,
    "odc_hf.balance": (*HUGGING_FACE, "torch.distributed"),
    # training runs none of the prediction code and none of the fixtures (integrations sits above both)
    "odc_hf.integrations": ("odc_hf.prediction", "odc_hf.testing"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, function-level ones included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]  # from x import submodule
    return found


def _layer_of(module: str) -> tuple[str, int] | None:
    """The LAYERS entry a module belongs to (longest matching prefix)."""
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, LAYERS[prefix]
    return None


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _benchmark_scripts() -> set[str]:
    """Benchmark files with a ``__main__`` block (run as ``python -m benchmarks.<folder>.<script>``, never imported),
    by module name."""
    return {_module_name(p) for p in (ROOT / "benchmarks").rglob("*.py")
            if "results" not in p.parts and '__name__ == "__main__"' in p.read_text()}  # fmt: skip


def test_no_odc_hf_module_imports_a_higher_layer_or_a_forbidden_library():
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")}  # tests' helpers, imported by their bare names
    broken = []
    for path in sorted((ROOT / "odc_hf").rglob("*.py")):
        name = _module_name(path)
        own, layer = _layer_of(name)
        for line, module in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            top = module.split(".")[0]
            if top in ("benchmarks", "tests") or top in local:
                broken.append(f"{where}: the library never imports benchmarks or tests")
            target = _layer_of(module) if top == "odc_hf" else None
            if target is not None and target[0] != own and target[1] >= layer:
                broken.append(f"{where}: {own} (layer {layer}) may not import {target[0]} (layer {target[1]})")
            for package, forbidden in FORBIDDEN.items():
                if _within(name, [package]) and _within(module, forbidden):
                    broken.append(f"{where}: {package} may not import {module}")
    assert not broken, "\n".join(broken)


def test_every_module_has_a_layer():
    """A module that matches no LAYERS entry but the package's own would fall into the top layer, where every import
    passes: each must be named, by its own entry or by its package's."""
    unnamed = []
    for path in sorted((ROOT / "odc_hf").rglob("*.py")):
        name = _module_name(path)
        if name != "odc_hf" and _layer_of(name)[0] == "odc_hf":
            unnamed.append(f"{path.relative_to(ROOT)} ({name}) matches no entry of LAYERS")
    assert not unnamed, "\n".join(unnamed)


def test_the_package_root_holds_only_the_named_modules():
    """New modules go into the package of what they are (transport, fsdp, balance, prediction, integrations,
    testing); a module at the root is a decision, named in ROOT_MODULES with its reason."""
    assert {p.stem for p in (ROOT / "odc_hf").glob("*.py")} == ROOT_MODULES
    assert {p.parent.name for p in (ROOT / "odc_hf").glob("*/__init__.py")} == ROOT_PACKAGES


INTEGRATION_ROOMS = {name.rpartition(".")[2] for name in LAYERS if name.startswith("odc_hf.integrations.")}
MAX_ROOM_ARROWS = 20


def test_integrations_is_rooms_with_few_arrows_between_them():
    """``odc_hf/integrations`` holds its rooms and nothing else at its top, and the rooms stay few with few import
    arrows between them: a new module goes into the room of its concept, a new room is a decision named in LAYERS."""
    folder = ROOT / "odc_hf" / "integrations"
    assert {p.name for p in folder.glob("*.py")} == {"__init__.py"}
    assert {p.parent.name for p in folder.glob("*/__init__.py")} == INTEGRATION_ROOMS
    assert len(INTEGRATION_ROOMS) <= 10
    room = lambda module: module.split(".")[2]  # noqa: E731
    arrows = {(room(a), room(b)) for a, targets in _module_graph().items() if a.startswith("odc_hf.integrations.")
              for b in targets if b.startswith("odc_hf.integrations.") and room(a) != room(b)}  # fmt: skip
    assert len(arrows) <= MAX_ROOM_ARROWS, sorted(arrows)


def test_benchmarks_and_tests_do_not_import_each_other():
    scripts = _benchmark_scripts()
    assert {"benchmarks.sft.e2e", "benchmarks.sft.trainer_checks"} <= scripts  # the check sees the scripts it guards
    tests = {_module_name(p).rpartition(".")[2] for p in (ROOT / "tests").rglob("*.py")}
    broken = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for line, module in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if module in scripts and module != _module_name(path):
                broken.append(f"{where}: a benchmark script (share it through benchmarks/common)")
            if module.split(".")[0] == "tests" or module.split(".")[0] in tests:
                broken.append(f"{where}: benchmarks never import tests (shared code goes to odc_hf.testing)")
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for line, module in _imports(path):
            if module.split(".")[0] == "benchmarks":
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {module}: tests run benchmarks, never import them")
    assert not broken, "\n".join(broken)


def test_no_sys_path_edits_in_benchmarks_or_tests():
    """Benchmarks run as modules from the checkout (``python -m benchmarks.sft.e2e``) and tests import through pytest's
    rootdir: neither edits ``sys.path``."""
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("benchmarks", "tests") for p in sorted((ROOT / d).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.path.insert" in line or "sys.path.append" in line
             if p.name != "test_layering.py"]  # fmt: skip
    assert not found, found


BLOCKED_IMPORT = textwrap.dedent(
    """
    import builtins, importlib, importlib.abc, pkgutil, sys

    BLOCKED = ("transformers", "accelerate", "trl", "peft", "datasets")

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for this test: {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    # torch imports torch.distributed itself, so a finder cannot block it; refuse it to odc_hf code instead.
    real_import = builtins.__import__

    def guarded(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        asked = [name] + [f"{name}.{item}" for item in fromlist or ()]
        if level == 0 and importer.startswith("odc_hf") and any(
            a == "torch.distributed" or a.startswith("torch.distributed.") for a in asked
        ):
            raise ImportError(f"{importer} imports torch.distributed")
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded
    import odc_hf.balance

    for info in pkgutil.iter_modules(odc_hf.balance.__path__):
        importlib.import_module("odc_hf.balance." + info.name)
    print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
    """
)


def test_balance_imports_with_hugging_face_and_torch_distributed_blocked():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "loaded []"


def _module_graph() -> dict[str, set[str]]:
    """odc_hf module -> the odc_hf modules it imports (anywhere in the file: top level, in functions, under
    ``TYPE_CHECKING``). ``from package import name`` points at ``package.name`` when that is a module, else at the
    package (its ``__init__``)."""
    paths = {_module_name(p): p for p in (ROOT / "odc_hf").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in paths}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    if target in paths:
                        edges.add(target)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_module_import_graph_has_no_cycles():
    """A cycle (even through a function-level or TYPE_CHECKING import) means two modules each need the other: one of
    them holds something that belongs to a third, or to the other. Lists every cycle found."""
    assert _cycles(_module_graph()) == []
