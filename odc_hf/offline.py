"""A local model and data set for trying a recipe without the hub: ``python -m odc_hf.offline DIR``.

Writes ``DIR/model``: a tiny Qwen2 causal LM (random weights, 2 layers) with odc_hf's offline byte-level BPE tokenizer
(ChatML template), loadable with ``AutoModelForCausalLM.from_pretrained`` / ``--model_name_or_path``; and
``DIR/data/train.jsonl``: conversations of real text (``{"messages": [user, assistant]}``, from the Python standard
library's docstrings), loadable with ``datasets.load_dataset`` / ``--dataset_name``; with ``--prompts``, their user
turns alone as conversational prompts for GRPO (``{"prompt": [user]}``). Nothing is downloaded: run it on a machine
without network, then e.g. ``trl.scripts.sft`` or ``trl.scripts.grpo`` through ``python -m odc_hf.run``
(docs/trl_recipes.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from odc_hf.testing.recipes import write_model_and_data

CONVERSATION_CHARS = 600

__all__ = ["main"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m odc_hf.offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", type=Path, help="where to write model/ and data/ (created if missing)")
    parser.add_argument(
        "--num-rows", type=int, default=64, help="conversations in data/train.jsonl (default: 64)"
    )
    parser.add_argument(
        "--prompts", action="store_true",
        help='write prompts for GRPO ({"prompt": [user turn]}, conversational) instead of whole conversations',
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.num_rows < 1:
        parser.error(f"--num-rows must be at least 1, got {args.num_rows}")
    rows = None
    if args.prompts:
        from odc_hf.testing.data import default_conversations

        rows = [{"prompt": c["messages"][:1]} for c in default_conversations(args.num_rows, max_chars=CONVERSATION_CHARS)]
    model_dir, data_dir = write_model_and_data(args.directory, rows, num_rows=args.num_rows)
    what = "prompts" if args.prompts else "conversations"
    print(f"wrote a tiny Qwen2 model and its tokenizer to {model_dir}, {args.num_rows} {what} to {data_dir}")
    print(f"MODEL_DIR={model_dir}")
    print(f"DATA_DIR={data_dir}")


if __name__ == "__main__":
    main()
