"""A local model and data set for trying a recipe without the hub: ``python -m odc_hf.offline DIR``.

Writes ``DIR/model``: a tiny Qwen2 causal LM (random weights, 2 layers) with odc_hf's offline byte-level BPE tokenizer
(ChatML template), loadable with ``AutoModelForCausalLM.from_pretrained`` / ``--model_name_or_path``; and
``DIR/data/train.jsonl``: conversations of real text (``{"messages": [user, assistant]}``, from the Python standard
library's docstrings), loadable with ``datasets.load_dataset`` / ``--dataset_name``; with ``--prompts``, their user
turns alone as conversational prompts for GRPO (``{"prompt": [user]}``), and a model that ends its completions early
(1 to ~12 tokens) so that they differ in length. Nothing is downloaded: run it on a machine
without network, then e.g. ``trl.scripts.sft`` or ``trl.scripts.grpo`` through ``python -m odc_hf.run``
(docs/trl_recipes.md). For the GRPO recipe, ``--reward_funcs odc_hf.offline.length_reward`` names a reward that
varies within each group of completions even for the random model, so the demo run visibly trains.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from odc_hf.testing.recipes import write_model_and_data

CONVERSATION_CHARS = 600

__all__ = ["length_reward", "main"]


def length_reward(completions, **kwargs) -> list[float]:
    """The demo's GRPO reward: each completion's length in characters, divided by 100.

    GRPO learns from the spread of rewards within a group of completions of one prompt (the advantages). The random
    model of ``DIR/model`` never writes what a task reward looks for (TRL's ``think_format_reward`` wants
    ``<think>...</think>``, ``accuracy_reward`` a right answer), so those rewards are equal within every group, every
    advantage is zero and nothing trains. Lengths differ within a group, so this reward moves the weights. Takes
    TRL's completions as they come: strings (standard prompts) or lists of messages (conversational prompts).
    """
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 100.0 for t in texts]


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
        help='for GRPO: write prompts ({"prompt": [user turn]}, conversational) instead of whole conversations, and a '
        "model that ends its completions early (1 to ~12 tokens), so that their lengths and rewards differ",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.num_rows < 1:
        parser.error(f"--num-rows must be at least 1, got {args.num_rows}")
    rows = None
    if args.prompts:
        from odc_hf.testing.data import default_conversations

        rows = [{"prompt": c["messages"][:1]} for c in default_conversations(args.num_rows, max_chars=CONVERSATION_CHARS)]
    model_dir, data_dir = write_model_and_data(args.directory, rows, num_rows=args.num_rows, eos_prone=args.prompts)
    what = "prompts" if args.prompts else "conversations"
    print(f"wrote a tiny Qwen2 model and its tokenizer to {model_dir}, {args.num_rows} {what} to {data_dir}")
    print(f"MODEL_DIR={model_dir}")
    print(f"DATA_DIR={data_dir}")


if __name__ == "__main__":
    main()
