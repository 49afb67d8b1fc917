"""What ``python -m odc_hf.estimate`` reads, in process: lengths files, datasets (local files, saved datasets, folders),
the column it counts, the tokenizer's counts, and the model's shape; every refusal by its words."""

import json

import numpy as np
import pytest
import torch

from odc_hf.prediction.estimate_inputs import (
    EstimateError,
    dataset_lengths,
    load_rows,
    model_shape,
    pick_column,
    read_lengths_file,
)


def test_lengths_files_in_each_form_and_their_refusals(tmp_path):
    text = tmp_path / "l.txt"
    text.write_text("# counts\n10\n\n 20  # a comment\n0\n")
    assert read_lengths_file(text).tolist() == [10, 20, 0] and read_lengths_file(str(text)).dtype == np.int64
    as_list = tmp_path / "l.data"  # no .json suffix: read as JSON because it starts with "["
    as_list.write_text(" [3, 4]")
    assert read_lengths_file(as_list).tolist() == [3, 4]
    as_object = tmp_path / "o.json"
    as_object.write_text(json.dumps({"lengths": [5, 6], "note": "x"}))
    assert read_lengths_file(as_object).tolist() == [5, 6]
    cases = {
        "missing.txt": None,
        "bad.json": "{",
        "nolist.json": json.dumps({"counts": [1]}),
        "bool.json": "[1, true]",
        "neg.json": "[1, -2]",
        "float.json": "[1, 2.5]",
        "word.txt": "1\n2k\n",
    }
    words = {
        "missing.txt": r": no such file$",
        "bad.json": r": not valid JSON \(",
        "nolist.json": r": expected a JSON list of integers or an object with 'lengths'$",
        "bool.json": r": entry 1 is True, not a token count \(int >= 0\)$",
        "neg.json": r": entry 1 is -2, not a token count \(int >= 0\)$",
        "float.json": r": entry 1 is 2.5, not a token count \(int >= 0\)$",
        "word.txt": r", line 2: '2k' is not a token count \(one integer per line\)$",
    }
    for name, content in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        with pytest.raises(EstimateError, match=rf"^--lengths {path}" + words[name]):
            read_lengths_file(path)


def test_the_counted_column_is_chosen_as_documented():
    assert pick_column(["text", "input_ids"], None) == "input_ids"
    assert pick_column(["text", "messages"], None) == "messages"
    assert pick_column(["id", "text"], None) == "text"
    assert pick_column(["prompt", "completion"], None) == "prompt+completion"
    assert pick_column(["prompt", "completion"], "prompt+completion") == "prompt+completion"
    assert pick_column(["body", "text"], "body") == "body"
    with pytest.raises(EstimateError, match=r"^--column 'prompt\+completion' is not in the dataset; its columns are "
                                            r"\['prompt'\]$"):  # fmt: skip
        pick_column(["prompt"], "prompt+completion")
    with pytest.raises(EstimateError, match=r"^--column 'x' is not in the dataset; its columns are \['text'\]$"):
        pick_column(["text"], "x")
    with pytest.raises(EstimateError, match=r"^no input_ids, messages, text or prompt\+completion column among "
                                            r"\['prompt', 'body'\]: pass --column NAME$"):  # fmt: skip
        pick_column(["prompt", "body"], None)


def test_dataset_lengths_count_what_training_tokenizes(tmp_path):
    """Text rows count the tokenizer's ids with one end-of-sequence token (not doubled when the text has it);
    prompt + completion rows their concatenation; input_ids rows their length; conversations through the chat
    template; ``max_samples`` the first rows; a saved dataset and a folder of files load too."""
    import datasets

    from odc_hf.testing.data import default_tokenizer

    tok = default_tokenizer()
    eos = tok.eos_token
    texts = ["hello world", "a longer line of text" + eos, "x"]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": t, "prompt": t[:3], "completion": t[3:], "input_ids": [1] * (i + 2)})
                            + "\n" for i, t in enumerate(texts)))  # fmt: skip
    want = [len(tok(t if t.endswith(eos) else t + eos)["input_ids"]) for t in texts]
    assert dataset_lengths(str(path), tokenizer="default", column="text").tolist() == want
    assert dataset_lengths(str(path), tokenizer="default", column="prompt+completion").tolist() == want
    assert dataset_lengths(str(path), tokenizer="default", column=None).tolist() == [2, 3, 4]  # input_ids first
    for column in (None, "text"):  # token counts, as integers, whichever way they are counted
        assert dataset_lengths(str(path), tokenizer="default", column=column).dtype == np.int64
    assert dataset_lengths(str(path), tokenizer="default", column="text", max_samples=2).tolist() == want[:2]
    chats = [[{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}] for t in texts]
    conv = tmp_path / "chat.jsonl"
    conv.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    want_chat = [len(ids) for ids in tok.apply_chat_template(chats, tokenize=True, return_dict=True)["input_ids"]]
    assert dataset_lengths(str(conv), tokenizer="default", column=None).tolist() == want_chat
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    assert dataset_lengths(str(saved), tokenizer="default", column=None).tolist() == want
    table = tmp_path / "rows.parquet"  # a binary data file: read, never taken for an empty text file
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(table))
    assert dataset_lengths(str(table), tokenizer="default", column=None).tolist() == want
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text(path.read_text())
    assert len(load_rows(str(folder), split="train", config_name=None)) == 3


def test_dataset_refusals_by_their_words(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("  \n\n")
    with pytest.raises(EstimateError, match=rf"^--dataset {empty}: the file is empty \(no rows\); give a file with one "
                                            "sample per row$"):  # fmt: skip
        load_rows(str(empty), split="train", config_name=None)
    odd = tmp_path / "rows.xyz"
    odd.write_text("1\n")
    with pytest.raises(EstimateError, match=rf"^--dataset {odd}: unknown file type '\.xyz'; use one of \["):
        load_rows(str(odd), split="train", config_name=None)
    with pytest.raises(EstimateError, match=rf"^--dataset {tmp_path / 'gone.jsonl'}: no such file$"):
        load_rows(str(tmp_path / "gone.jsonl"), split="train", config_name=None)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": 5}\n{"text": 6}\n')
    with pytest.raises(EstimateError, match=r"^row 0\+ of column 'text' holds int, not text or chat messages$"):
        dataset_lengths(str(numbers), tokenizer="default", column="text")
    with pytest.raises(EstimateError, match=r"^--tokenizer '/nonexistent/tok' could not be loaded \(OSError: .*\); pass a "
                                            r"path, a hub name, or 'default' for odc_hf's offline tokenizer$"):  # fmt: skip
        dataset_lengths(str(numbers), tokenizer="/nonexistent/tok", column="text")


def test_a_dataset_without_rows_and_chats_the_tokenizer_cannot_template_are_refused(tmp_path):
    """A saved dataset with no rows (the empty-file check does not see it), conversations with a tokenizer that has
    no chat template, and a chat template that raises: each refused by its words, none counted as zero tokens."""
    import datasets

    from odc_hf.testing.data import default_tokenizer

    none = tmp_path / "none"  # saved after a filter: a data file with no rows, which datasets loads
    datasets.Dataset.from_dict({"text": ["a"]}).filter(lambda row: False).save_to_disk(str(none))
    with pytest.raises(EstimateError, match=rf"^--dataset '{none}' \(split 'train'\) has no rows$"):
        dataset_lengths(str(none), tokenizer="default", column=None)
    unsaved = tmp_path / "unsaved"  # saved with no data file at all: datasets cannot load it
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(unsaved))
    listed = tmp_path / "listed.json"  # an empty JSON list: not blank, but no rows either
    listed.write_text("[]")
    for local in (unsaved, listed):
        with pytest.raises(EstimateError, match=rf"^--dataset '{local}' \(split 'train'\) could not be read: \w+Error: "
                                                r".*\. A local file or folder: if it holds no rows \(an empty "
                                                r"JSON list, a dataset saved empty\), give it at least one; otherwise "
                                                r"mend what datasets names$") as caught:  # fmt: skip
            dataset_lengths(str(local), tokenizer="default", column=None)
        assert "hub" not in str(caught.value)  # a local path: no advice about network access
    chats = tmp_path / "chat.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tok = default_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path / "plain"))
    with pytest.raises(EstimateError, match=r"^row 0\+ of column 'messages' holds chat messages but the tokenizer has "
                                            r"no chat template$"):  # fmt: skip
        dataset_lengths(str(chats), tokenizer=str(tmp_path / "plain"), column=None)
    rows = tmp_path / "rows.jsonl"  # a tokenizer without an end-of-sequence token: nothing appended to the text
    rows.write_text(json.dumps({"text": "hello world"}) + "\n")
    eos = tok.eos_token
    tok.eos_token = None
    tok.save_pretrained(str(tmp_path / "no_eos"))
    assert dataset_lengths(str(rows), tokenizer=str(tmp_path / "no_eos"), column=None).tolist() == [
        len(tok("hello world")["input_ids"])]  # fmt: skip
    assert len(tok("hello world")["input_ids"]) < len(tok("hello world" + eos)["input_ids"])
    tok.chat_template = "{{ raise_exception('no roles here') }}"
    tok.save_pretrained(str(tmp_path / "raising"))
    with pytest.raises(EstimateError, match=r"^row 0\+ of column 'messages': the chat template failed "
                                            r"\(TemplateError: no roles here\)$"):  # fmt: skip
        dataset_lengths(str(chats), tokenizer=str(tmp_path / "raising"), column=None)


def test_model_shapes_from_presets_and_config_paths(tmp_path):
    import transformers

    from odc_hf.prediction.cluster import ModelShape

    tied, untied = model_shape("1.5B"), model_shape("7B")
    assert tied.name == "Qwen2.5-1.5B" and tied.num_params == 1_543_714_304
    assert untied.name == "Qwen2.5-7B" and untied.num_params == 7_615_616_512
    for size in ("3B", "3b", "0.5B"):  # a size, not a preset: refused without asking the hub
        with pytest.raises(EstimateError, match=rf"^--model '{size}': not a preset; the presets are 1\.5B, 7B, 14B, 32B "
                                                r"\(Qwen2\.5 sizes\), otherwise pass a config path or hub name$"):  # fmt: skip
            model_shape(size)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=101)  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    assert model_shape(str(tmp_path / "llama")) == ModelShape.from_config(config, name=str(tmp_path / "llama"))
    with pytest.raises(EstimateError, match=rf"^--model '{tmp_path / 'nothing'}': not a preset \(1\.5B, 7B, 14B, 32B\) "
                                            r"and AutoConfig could not load it \(OSError: "):  # fmt: skip
        model_shape(str(tmp_path / "nothing"))


def test_lengths_file_edges_zero_tokens_comments_and_json_by_suffix_or_content(tmp_path):
    zeros = tmp_path / "z.json"
    zeros.write_text("[0, 1]")
    assert read_lengths_file(zeros).tolist() == [0, 1]  # an empty sample is a count
    commented = tmp_path / "c.txt"
    commented.write_text("5 # a # b\n")
    assert read_lengths_file(commented).tolist() == [5]
    scalar = tmp_path / "s.json"  # a .json file is JSON whatever it starts with
    scalar.write_text("5")
    with pytest.raises(EstimateError, match=r"expected a JSON list of integers or an object with 'lengths'$"):
        read_lengths_file(scalar)
    braced = tmp_path / "b.data"  # and a file starting with "{" is JSON whatever its suffix
    braced.write_text(json.dumps({"lengths": [7]}))
    assert read_lengths_file(braced).tolist() == [7]


def test_many_rows_are_counted_in_batches_with_a_progress_bar(tmp_path, capsys):
    """More rows than two tokenizer batches (2 x 1,000): every row counted (the last, partial batch too), and a
    progress bar on stderr; a dataset saved with several splits gives the split asked for."""
    import datasets

    from odc_hf.testing.data import default_tokenizer

    texts = [f"sample {i} " + "word " * (i % 7) for i in range(2001)]
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = default_tokenizer()
    want = [len(ids) for ids in tok([t + tok.eos_token for t in texts])["input_ids"]]
    assert dataset_lengths(str(path), tokenizer="default", column="text").tolist() == want
    err = capsys.readouterr().err
    assert "tokenizing" in err and "2001/2001" in err and "samples" in err
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"] * 3}),
                          "test": datasets.Dataset.from_dict({"text": ["b"] * 2})}).save_to_disk(str(splits))  # fmt: skip
    assert len(load_rows(str(splits), split="test", config_name=None)) == 2
    assert len(dataset_lengths(str(splits), tokenizer="default", column=None, split="test")) == 2
    for suffix in (".json", ".csv", ".txt"):
        empty = tmp_path / f"empty{suffix}"
        empty.write_text("")
        with pytest.raises(EstimateError, match=r": the file is empty \(no rows\)"):
            load_rows(str(empty), split="train", config_name=None)


def test_a_multimodal_config_is_read_through_its_text_model(tmp_path):
    import transformers

    from odc_hf.prediction.cluster import ModelShape

    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=101)  # fmt: skip
    config = transformers.LlavaConfig(text_config=text.to_dict())
    config.save_pretrained(tmp_path / "llava")
    shape = model_shape(str(tmp_path / "llava"))
    assert shape == ModelShape.from_config(config.get_text_config(), name=str(tmp_path / "llava"))


def test_a_hub_name_is_loaded_with_its_config_and_split_and_refused_with_hub_advice_when_out_of_reach(monkeypatch):
    """A dataset name that is no local path goes to ``datasets.load_dataset`` with its config name and split; when the
    hub cannot be reached (here a stand-in for ``load_dataset`` that fails as it does offline) the refusal gives the
    advice for hub names, not the local-file one."""
    import datasets

    calls = []

    def unreachable(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("Couldn't reach 'owner/name' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(EstimateError) as caught:
        dataset_lengths("owner/name", tokenizer="default", column=None, split="test", config_name="small")
    assert calls == [(("owner/name", "small"), {"split": "test"})]
    assert str(caught.value) == (
        "--dataset 'owner/name' (split 'test') could not be loaded: ConnectionError: Couldn't reach 'owner/name' on "
        "the Hub (LocalEntryNotFoundError). A hub name needs network access (or the hub cache); otherwise pass a "
        "local file or --lengths"
    )


SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # qwen3_moe: 2 of 8 experts


@pytest.mark.parametrize("family", ["starcoder2", "phi", "qwen3", "gemma2", "qwen3_moe"])
def test_a_config_path_is_measured_on_the_built_model_of_any_family(family, tmp_path):
    """``--model <config path>`` counts what the family's model holds: two-matrix MLPs (starcoder2, phi), q/k norms
    (qwen3), four norms per layer and a tied head (gemma2), and experts (qwen3_moe: every expert in the FSDP units, the
    FLOP model's N with the active share ``num_experts_per_tok / num_experts`` of them). The references are the real
    model's parameters on the CPU; the dense-decoder formula the estimate used before (a Llama-style MLP, no extra
    norms, experts ignored) is off on each of these families."""
    import transformers

    from odc_hf.prediction.cluster import ModelShape

    extra = EXPERTS if family == "qwen3_moe" else {}
    config = transformers.AutoConfig.for_model(family, **SMALL, **extra)
    config.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = model_shape(str(tmp_path))
    named = dict(model.named_parameters())
    assert shape.num_params == sum(p.numel() for p in named.values())
    assert shape.num_layers == 2
    assert shape.layer_params == sum(p.numel() for n, p in named.items() if n.startswith("model.layers.0."))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # qwen3_moe: per layer the router (8 experts x 64) and the 2 experts a token uses, 3 matrices of 32 x 64 each
    active = 2 * (8 * 64 + 2 * 3 * 32 * 64) if family == "qwen3_moe" else 0
    assert shape.num_matmul_params == linear + active
    assert shape.attn_dim == 4 * (getattr(config, "head_dim", None) or 16)
    formula = ModelShape.from_config(config)
    assert (formula.num_params, formula.num_matmul_params) != (shape.num_params, shape.num_matmul_params)


def test_a_config_no_causal_lm_is_built_from_falls_back_to_the_formula_or_is_refused(tmp_path):
    """A config transformers builds no causal LM from: the dense-decoder formula when its attributes are there,
    otherwise a refusal naming both reasons."""
    import transformers

    from odc_hf.prediction.cluster import ModelShape

    t5 = transformers.T5Config(vocab_size=128, d_model=64, num_layers=2, num_heads=4)
    t5.save_pretrained(tmp_path / "t5")
    with pytest.raises(EstimateError, match=rf"^--model '{tmp_path / 't5'}': transformers could not build it as a "
                                            r"causal LM \(ValueError: Unrecognized configuration class [^\n]*\); config T5Config lacks "
                                            r"\['intermediate_size'\]: not a dense decoder config"):  # fmt: skip
        model_shape(str(tmp_path / "t5"))
    for name, value in SMALL.items():  # the dense attributes on a config of no causal LM: the formula applies
        setattr(t5, name, value)
    t5.save_pretrained(tmp_path / "dense")
    assert model_shape(str(tmp_path / "dense")) == ModelShape.from_config(t5, name=str(tmp_path / "dense"))


def test_the_estimate_reads_a_model_as_the_trainers_flop_model_does():
    """The estimate's FLOP terms and the cost model the trainers plan with (``ODCConfig.cost_model="flop"``) read a
    model by the same rule: the same N, depth and attention width on dense, two-matrix-MLP, Conv1D and expert models
    (stacked experts with and without a router of their own), so the two cannot drift apart."""
    import transformers

    from odc_hf.integrations.compute.cost_model import flop_cost_model
    from odc_hf.prediction.estimate_inputs import shape_of_model

    configs = [transformers.AutoConfig.for_model(family, **SMALL, **extra) for family, extra in (
        ("llama", {}), ("starcoder2", {}), ("qwen3", {}), ("gemma2", {}),
        ("qwen3_moe", EXPERTS),
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=1)),
    )] + [transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=3, n_head=4)]  # fmt: skip
    for config in configs:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        trainers, estimate = flop_cost_model(model), shape_of_model(model)
        assert (trainers.num_matmul_params, trainers.num_layers, trainers.attn_dim) == (
            estimate.num_matmul_params, estimate.num_layers, estimate.attn_dim), config.model_type  # fmt: skip


def test_shape_of_model_by_its_rule_on_a_model_built_by_hand():
    """Decoder layers of different sizes (the mean per layer, floored, the rest in the root, so the total is exact),
    embeddings left out of N and the head in, stacked experts at ``num_experts_per_tok`` of them (capped at all of
    them) or at one expert when the config names no count, head_dim from the config or hidden / heads, the name
    given, else the config's path, else the class; a model without decoder layers is refused."""
    from transformers import GradientCheckpointingLayer

    from odc_hf.prediction.estimate_inputs import shape_of_model

    class Block(GradientCheckpointingLayer):
        def __init__(self, width, extra):
            super().__init__()
            self.proj = torch.nn.Linear(8, width, bias=False)
            self.norm = torch.nn.Parameter(torch.ones(8 + extra))
            self.experts = torch.nn.Parameter(torch.zeros(4, 6, 8))  # 4 experts of 6 x 8

    class Config:
        num_attention_heads, hidden_size = 2, 8  # no name_or_path: a config built in code may have none

        def get_text_config(self):
            return self

    class Hand(torch.nn.Module):
        def __init__(self, config, blocks):
            super().__init__()
            self.config, self.embed = config, torch.nn.Embedding(10, 8)
            self.layers = torch.nn.ModuleList(blocks)
            self.head = torch.nn.Linear(8, 10, bias=False)

    config = Config()
    model = Hand(config, [Block(3, 0), Block(4, 1)])
    layers = [8 * 3 + 8 + 192, 8 * 4 + 9 + 192]  # 224 and 233: 457 in all, 228 per layer floored
    shape = shape_of_model(model)
    assert (shape.name, shape.num_layers, shape.layer_params, shape.root_params) == ("Hand", 2, 228, 80 + 80 + 1)
    assert shape.num_params == sum(layers) + 160 and type(shape.layer_params) is int
    assert shape.num_matmul_params == 8 * 3 + 8 * 4 + 80 + 2 * 192 // 4  # no expert count: one expert of four
    assert shape.attn_dim == 8 and type(shape.attn_dim) is int  # hidden 8 / 2 heads = head_dim 4
    config.name_or_path = ""
    assert shape_of_model(model).name == "Hand"
    for top_k, active in ((2, 96), (8, 192)):  # 2 of 4 experts; more than there are: all of them
        config.num_experts_per_tok = top_k
        assert shape_of_model(model).num_matmul_params == 8 * 3 + 8 * 4 + 80 + 2 * active
    config.head_dim, config.name_or_path = 3, "org/hand"
    assert shape_of_model(model).attn_dim == 6 and shape_of_model(model).name == "org/hand"
    assert shape_of_model(model, name="mine").name == "mine"
    with pytest.raises(ValueError, match=r"^Hand has no decoder layers \(GradientCheckpointingLayer blocks\)$"):
        shape_of_model(Hand(config, []))
