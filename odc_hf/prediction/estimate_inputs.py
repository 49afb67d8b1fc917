"""The inputs of ``python -m odc_hf.estimate``: token counts (from a file, or a dataset's rows tokenized as
TRL's SFTTrainer does) and the model's shape; bad input raises :class:`EstimateError` saying what to change.

A dataset's rows are counted by their column:

- an ``input_ids`` column: its lengths (already tokenized);
- ``messages`` (chat): ``tokenizer.apply_chat_template(messages, tokenize=True)``;
- a text column: ``tokenizer(text + eos)`` (TRL appends the eos string when the text does not end with it);
- ``prompt`` + ``completion``: the two concatenated (strings, or message lists through the chat template).

``datasets`` and ``transformers`` are imported here, lazily, so the planning library stays light.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .workloads import QWEN2_5_SHAPES

BATCH = 1000
TIED_PRESETS = {"1.5B"}  # Qwen2.5-1.5B ties its embeddings; 7B, 14B, 32B do not
BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}


class EstimateError(ValueError):
    """Bad input to ``python -m odc_hf.estimate``, with what to change; its ``main`` prints it and exits with 2."""


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Token counts from a file: one integer per line (blank lines and ``#`` comments skipped), or JSON (a list,
    or an object with a ``lengths`` list)."""
    path = Path(path)
    if not path.is_file():
        raise EstimateError(f"--lengths {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json" or text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise EstimateError(f"--lengths {path}: not valid JSON ({err})") from None
        values = data.get("lengths") if isinstance(data, dict) else data
        if not isinstance(values, list):
            raise EstimateError(
                f"--lengths {path}: expected a JSON list of integers or an object with 'lengths'"
            )
        bad = [(i, v) for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise EstimateError(
                f"--lengths {path}: entry {bad[0][0]} is {bad[0][1]!r}, not a token count (int >= 0)"
            )
        return np.asarray(values, dtype=np.int64)
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not line.isdigit():
            raise EstimateError(
                f"--lengths {path}, line {number}: {line!r} is not a token count (one integer per line)"
            )
        values.append(int(line))
    return np.asarray(values, dtype=np.int64)


def model_shape(spec: str):
    """A Qwen2.5 size (``1.5B``, ``7B``, ...) or a config path / hub name read with ``transformers.AutoConfig``, its
    text model built on the meta device and measured (:func:`shape_of_model`)."""
    from .cluster import ModelShape
    from .workloads import qwen2_5_config

    if spec in QWEN2_5_SHAPES:
        config = qwen2_5_config(spec)
        config.tie_word_embeddings = spec in TIED_PRESETS
        return ModelShape.from_config(config, name=f"Qwen2.5-{spec}")
    if re.fullmatch(r"\d+(\.\d+)?[bB]", spec):  # a size that is not a preset: no need to ask the hub
        raise EstimateError(f"--model {spec!r}: not a preset; the presets are {', '.join(QWEN2_5_SHAPES)} (Qwen2.5 "
                            "sizes), otherwise pass a config path or hub name")  # fmt: skip
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec)
    except Exception as err:  # noqa: BLE001 - any loading failure is the user's input to fix
        raise EstimateError(
            f"--model {spec!r}: not a preset ({', '.join(QWEN2_5_SHAPES)}) and AutoConfig could not load it "
            f"({type(err).__name__}: {err})"
        ) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:  # built on the meta device (no memory): exact counts for any family, experts at their active share
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return shape_of_model(AutoModelForCausalLM.from_config(text), name=spec)
    except Exception as err:  # noqa: BLE001 - fall back to the dense-decoder formula, which may still apply
        built = f"{type(err).__name__}: {str(err).partition(chr(10))[0]}"  # its first line, not its list of configs
    try:
        return ModelShape.from_config(text, name=spec)
    except ValueError as err:
        raise EstimateError(f"--model {spec!r}: transformers could not build it as a causal LM ({built}); {err}") from None


def shape_of_model(model, name: str | None = None):
    """The :class:`~odc_hf.prediction.cluster.ModelShape` of a built causal LM (on the meta device: no memory, no
    weights), exact for any family.

    The FSDP units are the model's decoder layers (transformers' ``GradientCheckpointingLayer`` blocks, their mean size
    when layers differ) and the root (everything else). N counts every 2-D weight outside embeddings (the LM head
    included, tied or not) and stacked experts (3-D parameters) at the share of experts a token uses
    (``num_experts_per_tok``), as the trainers' FLOP model reads a model; heads x head_dim come from the config.
    """
    import torch
    from transformers import GradientCheckpointingLayer

    from .cluster import ModelShape

    text = model.config.get_text_config()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers (GradientCheckpointingLayer blocks)")
    total = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for layer in layers for p in layer.parameters()) // len(layers)
    top_k = getattr(text, "num_experts_per_tok", None)
    matmul = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):  # a lookup, no matmul
            continue
        for param in module.parameters(recurse=False):
            if param.dim() == 2:
                matmul += param.numel()
            elif param.dim() == 3:  # stacked experts (experts, out, in)
                share = min(1.0, top_k / param.shape[0]) if top_k else 1.0 / param.shape[0]
                matmul += int(param.numel() * share)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        name=name or getattr(text, "name_or_path", "") or type(model).__name__,
        num_layers=len(layers),
        layer_params=per_layer,
        root_params=total - per_layer * len(layers),
        num_matmul_params=matmul,
        attn_dim=heads * head_dim,
    )


def load_rows(name: str, *, split: str, config_name: str | None):
    """A ``datasets.Dataset`` from a local file, a saved dataset folder, a folder of data files, or the hub."""
    path = Path(name)
    if path.is_file() and path.suffix in BUILDERS and _is_empty_text_file(path):  # datasets: a bare StopIteration
        raise EstimateError(f"--dataset {name}: the file is empty (no rows); give a file with one sample per row")
    import datasets

    try:
        if path.is_file():
            builder = BUILDERS.get(path.suffix)
            if builder is None:
                raise EstimateError(
                    f"--dataset {name}: unknown file type {path.suffix!r}; use one of {sorted(BUILDERS)}"
                )
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if path.is_dir():
            if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
                ds = datasets.load_from_disk(str(path))
                return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            return datasets.load_dataset(str(path), split=split)
        if path.suffix in BUILDERS:
            raise EstimateError(f"--dataset {name}: no such file")
        return datasets.load_dataset(name, config_name, split=split)
    except EstimateError:
        raise
    except Exception as err:  # noqa: BLE001 - loading failures are the user's input to fix
        if path.exists():  # a local file or folder: hub advice would mislead
            raise EstimateError(
                f"--dataset {name!r} (split {split!r}) could not be read: {type(err).__name__}: {err}. "
                "A local file or folder: if it holds no rows (an empty JSON list, a dataset saved empty), give it "
                "at least one; otherwise mend what datasets names"
            ) from None
        raise EstimateError(
            f"--dataset {name!r} (split {split!r}) could not be loaded: {type(err).__name__}: {err}. "
            "A hub name needs network access (or the hub cache); otherwise pass a local file or --lengths"
        ) from None


def _is_empty_text_file(path: Path) -> bool:
    """A text-format data file (.jsonl/.json/.csv/.txt) holding nothing but whitespace."""
    if path.suffix not in (".jsonl", ".json", ".csv", ".txt"):
        return False
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def load_tokenizer(name: str):
    if name == "default":
        from ..testing.data import default_tokenizer

        return default_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as err:  # noqa: BLE001
        raise EstimateError(
            f"--tokenizer {name!r} could not be loaded ({type(err).__name__}: {err}); pass a path, a hub name, or "
            "'default' for odc_hf's offline tokenizer"
        ) from None


def pick_column(columns: list[str], column: str | None) -> str:
    if column is not None:
        if column == "prompt+completion" and {"prompt", "completion"} <= set(columns):
            return column
        if column not in columns:
            raise EstimateError(f"--column {column!r} is not in the dataset; its columns are {columns}")
        return column
    for candidate in ("input_ids", "messages", "text"):
        if candidate in columns:
            return candidate
    if "prompt" in columns and "completion" in columns:
        return "prompt+completion"
    raise EstimateError(
        f"no input_ids, messages, text or prompt+completion column among {columns}: pass --column NAME"
    )


def dataset_lengths(
    name: str, *, tokenizer: str, column: str | None, split: str = "train", config_name: str | None = None,
    max_samples: int | None = None,
) -> np.ndarray:  # fmt: skip
    """Token count of every row (the first ``max_samples``), with a progress bar while tokenizing."""
    rows = load_rows(name, split=split, config_name=config_name)
    if len(rows) == 0:
        raise EstimateError(f"--dataset {name!r} (split {split!r}) has no rows")
    if max_samples is not None:
        rows = rows.select(range(min(max_samples, len(rows))))
    column = pick_column(list(rows.column_names), column)
    if column == "input_ids":
        return np.fromiter((len(ids) for ids in rows["input_ids"]), dtype=np.int64, count=len(rows))
    tok = load_tokenizer(tokenizer)
    from tqdm.auto import tqdm

    lengths = np.empty(len(rows), dtype=np.int64)
    bar = tqdm(total=len(rows), desc="tokenizing", unit="samples", disable=len(rows) < 2 * BATCH)
    for start in range(0, len(rows), BATCH):
        batch = rows[start : start + BATCH]
        if column == "prompt+completion":
            texts = [p + c for p, c in zip(batch["prompt"], batch["completion"])]
        else:
            texts = batch[column]
        lengths[start : start + len(texts)] = _count(tok, texts, where=f"row {start}+ of column {column!r}")
        bar.update(len(texts))
    bar.close()
    return lengths


def _count(tok, texts: list, *, where: str) -> list[int]:
    if not texts:
        return []
    if isinstance(texts[0], list):  # conversations
        if getattr(tok, "chat_template", None) is None:
            raise EstimateError(f"{where} holds chat messages but the tokenizer has no chat template")
        try:
            ids = tok.apply_chat_template(texts, tokenize=True, return_dict=True)["input_ids"]
        except Exception as err:  # noqa: BLE001
            raise EstimateError(f"{where}: the chat template failed ({type(err).__name__}: {err})") from None
        return [len(x) for x in ids]
    if not all(isinstance(t, str) for t in texts):
        raise EstimateError(f"{where} holds {type(texts[0]).__name__}, not text or chat messages")
    eos = tok.eos_token or ""
    texts = [t if not eos or t.endswith(eos) else t + eos for t in texts]
    return [len(x) for x in tok(texts)["input_ids"]]
