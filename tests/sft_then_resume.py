"""Run examples/sft.py twice in one ``accelerate launch``: a run that saves a checkpoint, then a fresh trainer (new
model, optimizer and ODC install) resumed from that checkpoint. For tests that need both without paying for a second
launch (4 processes starting torch, transformers and TRL cost ~40 s on 2 cores).

    accelerate launch ... tests/sft_then_resume.py --checkpoint_step 5 <examples/sft.py arguments>

The first run writes ``<output_dir>/losses.json`` (``--losses_json`` is set here), the resumed run
``<output_dir>/resumed/losses.json``; pass ``--save_steps`` and no ``--output_dir`` / ``--losses_json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import sft  # noqa: E402 - examples/sft.py, found through the path above


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_step", type=int, required=True)
    parser.add_argument("--run_dir", required=True)
    ours, rest = parser.parse_known_args()
    run = Path(ours.run_dir)
    first = sft.main([*rest, "--output_dir", str(run), "--losses_json", str(run / "losses.json")])
    if first.odc is not None:
        first.odc.close()  # the resumed trainer installs its own
    checkpoint = run / f"checkpoint-{ours.checkpoint_step}"
    (run / "resumed").mkdir(parents=True, exist_ok=True)
    sft.main([*rest, "--save_steps", "0", "--output_dir", str(run / "resumed"),
              "--losses_json", str(run / "resumed" / "losses.json"), "--resume_from_checkpoint", str(checkpoint)])  # fmt: skip


if __name__ == "__main__":
    main()
