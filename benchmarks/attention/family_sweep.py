"""Every causal-LM family in the installed transformers through odc_hf's definition check (CPU, seconds per family).

For each ``model_type`` with a causal-LM class: its default config, with every sliding window switched on where the
config has one (``--windows``), the static refusals (multimodal, non-attention layer types, chunked attention), then
:func:`odc_hf.integrations.models.definition_check.check_class` on a small copy: ``exact``, ``refused`` (with its reason;
also where the check is blind: its control, the row without boundaries, within 100x the threshold of the documents
alone, which the trainers refuse as unverifiable), or ``error`` (the default config itself does not build, or no small
copy could be made: in training the check then runs on the user's model itself). Also the check's cost per family. Writes JSON + markdown.

    python -m benchmarks.attention.family_sweep --out benchmarks/results                # ~5 min on one core
    python -m benchmarks.attention.family_sweep --windows --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import subprocess
import time
import warnings
from pathlib import Path

from benchmarks.common import report


def _windowed(config) -> bool:
    if not hasattr(config, "sliding_window"):
        return False
    config.sliding_window = 4096
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = True
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = 0
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types and set(types) <= {"full_attention", "sliding_attention"}:
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]
    return True


def sweep(names: list[str], windows: bool) -> dict[str, dict]:
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import odc_hf.attention
    from odc_hf.integrations.models import definition_check
    from odc_hf.integrations.models.family import needs_of, refusal

    rows = {}
    for name in names:
        start = time.perf_counter()
        try:
            cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])
            config = CONFIG_MAPPING[name]()
            if windows and not _windowed(config):
                continue
            with torch.device("meta"):
                shell = cls(definition_check.probe_config(config))
            reason = refusal(shell)
            if reason:
                rows[name] = {"result": "refused", "why": reason}
                continue
            sdpa = needs_of(shell).sdpa  # as the trainers decide it (soft-capping and sinks run eager)
            implementation = odc_hf.attention.VARLEN_ATTENTION if sdpa else odc_hf.attention.EAGER_VARLEN_ATTENTION
            verdict = definition_check.check_class(cls, config, implementation, sdpa=sdpa)
            blind = verdict.control < definition_check.SENSITIVITY * definition_check.THRESHOLD
            why = None
            if not verdict.exact:
                why = f"{verdict.what} ({verdict.layer}); works: {verdict.works}"
            elif blind:  # verify_definition refuses it: the check cannot see documents attending to each other
                why = f"the check is blind on it: its control (boundaries removed) differs by only {verdict.control:.1e}"
            rows[name] = {"result": "exact" if why is None else "refused", "difference": verdict.difference,
                          "control": verdict.control, "seconds": verdict.seconds, "why": why}  # fmt: skip
        except Exception as error:  # noqa: BLE001 - recorded per family
            rows[name] = {"result": "error", "why": f"{type(error).__name__}: {str(error)[:300]}"}
        rows[name]["wall_seconds"] = time.perf_counter() - start
        print(name, rows[name]["result"], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", action="store_true", help="switch on each config's sliding window")
    parser.add_argument("--families", nargs="*", help="model types (default: every causal-LM family)")
    parser.add_argument("--out", default=str(report.RESULTS / "attention"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.set_num_threads(1)
    names = args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = sweep(names, args.windows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    meta = {"date": date, "commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "windows": args.windows,
            "command": "python -m benchmarks.attention.family_sweep" + (" --windows" if args.windows else "")}  # fmt: skip
    windows = "_windows" if args.windows else ""
    stem = Path(args.out) / f"family_sweep{windows}_cpu_transformers{transformers.__version__}_{date}_{commit}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.parent.joinpath(stem.name + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    counts = {k: sum(r["result"] == k for r in rows.values()) for k in ("exact", "refused", "error")}
    seconds = sorted(r["seconds"] for r in rows.values() if "seconds" in r)
    lines = [f"# Definition check over transformers' causal-LM families ({'windows on' if args.windows else 'default configs'})",
             "", f"{meta}", "", f"exact {counts['exact']}, refused {counts['refused']}, error {counts['error']}; check "
             f"cost median {seconds[len(seconds) // 2]:.2f} s, max {seconds[-1]:.2f} s (one CPU thread)" if seconds else "",
             "", "| family | result | packed vs alone | control | seconds | why |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in rows.items():
        lines.append(f"| {name} | {row['result']} | {row.get('difference', float('nan')):.1e} | "
                     f"{row.get('control', float('nan')):.1e} | {row.get('seconds', float('nan')):.2f} | "
                     f"{(row.get('why') or '').replace('|', '/')[:200]} |")  # fmt: skip
    stem.parent.joinpath(stem.name + ".md").write_text("\n".join(lines) + "\n")
    print(stem.parent / (stem.name + ".md"))


if __name__ == "__main__":
    main()
