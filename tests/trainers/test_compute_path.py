"""The microbatch compute path: fused loss = full-logits loss under ODC with uneven microbatch counts, the
activation-checkpointing choice as a pure function of the memory model, Liger errors, the trainer hooks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from fsdp_helpers import VOCAB, full, loss_sum, max_rel_error, microbatch, tiny_qwen2

from odc_hf.balance.cost import QuadraticCostModel
from odc_hf.balance.memory import (
    GIB,
    MemoryModel,
    checkpointed_indices,
    choose_checkpointing,
    describe_checkpointing,
    layers_to_checkpoint,
)
from odc_hf.config import ODCConfig
from odc_hf.integrations.compute import activation_checkpointing, fused_head
from odc_hf.testing import run_ranks

# microbatches per rank, per minibatch: uneven, and a rank with none
COUNTS = [(3, 1), (0, 2)]


def _memory(**overrides) -> MemoryModel:
    # 1.5B-like at bf16: ~0.18 MB per token per layer without AC, 3 KB with it (the layer input)
    values = dict(num_layers=28, layer_bytes_per_token=180e3, checkpoint_bytes_per_token=3e3,
                  recompute_bytes_per_token=180e3, other_bytes_per_token=20e3, fixed_bytes=2 * GIB,
                  static_bytes=12 * GIB)  # fmt: skip
    return MemoryModel(**{**values, **overrides})


def test_auto_checkpointing_is_the_least_recomputation_that_fits():
    model = _memory()
    tokens = 32768
    none, full_ = model.peak_bytes(tokens, 0), model.peak_bytes(tokens, 28)
    assert full_ < none
    assert choose_checkpointing(model, tokens, 200 * GIB) == (0, True)  # a large device: no checkpointing
    n, fits = choose_checkpointing(model, tokens, (none + full_) / 2)  # memory short: some layers
    assert fits and 0 < n < 28
    assert model.peak_bytes(tokens, n) <= (none + full_) / 2 < model.peak_bytes(tokens, n - 1)
    assert choose_checkpointing(model, tokens, full_) == (28, True)  # just enough for full
    assert choose_checkpointing(model, tokens, full_ - 1) == (28, False)  # nothing fits: full, flagged
    # "auto" never needs more memory than "full" wherever "full" fits, for any budget
    for budget in torch.linspace(full_, none * 1.1, 50).tolist():
        n, fits = choose_checkpointing(model, tokens, budget)
        assert fits and model.peak_bytes(tokens, n) <= budget


def test_when_nothing_fits_the_advice_is_a_budget_that_fits_or_the_resident_state():
    """Not even full checkpointing fits: the warning names the largest token budget that would (and it does fit,
    one more token does not), or, when parameters, gradients and optimizer states fill the device by themselves
    (a 7B model on one 80 GB card: 16 bytes per parameter), says no budget fits and what shrinks them."""
    from odc_hf.balance.memory import largest_fitting_tokens, shortfall

    model, tokens = _memory(), 32768
    device = model.peak_bytes(tokens, 28) - 1
    fitting = largest_fitting_tokens(model, device)
    assert 0 < fitting < tokens
    assert model.peak_bytes(fitting, 28) <= device < model.peak_bytes(fitting + 1, 28)
    assert shortfall(model, tokens, device).endswith(f"lower max_tokens_per_microbatch to {fitting} or less")
    seven_b = _memory(static_bytes=7.6e9 * 16, fixed_bytes=0.0)  # fp32 weights + grads + two AdamW states
    assert largest_fitting_tokens(seven_b, 0.9 * 80 * GIB) == 0
    words = shortfall(seven_b, 16384, 0.9 * 80 * GIB)
    assert "no token budget fits" in words and "113.2 GiB per process" in words and "LoRA" in words
    assert "lower max_tokens_per_microbatch" not in words


def test_memory_model_round_trip_and_validation():
    model = _memory()
    data = {**model.to_dict(), "device": "NVIDIA H200", "note": "ignored"}
    assert MemoryModel.from_dict(json.loads(json.dumps(data))) == model
    with pytest.raises(ValueError, match="layer_bytes_per_token"):
        _memory(layer_bytes_per_token=-1.0)
    with pytest.raises(ValueError, match="checkpointed layers"):
        model.peak_bytes(10, 29)


def test_predicted_peak_is_the_documented_sum_of_its_terms():
    """peak(T, n) = static + fixed + T x (other + n x checkpoint + (L - n) x layer + recompute if n > 0), checked
    term by term with values that no other combination of the terms reproduces (killed mutants: the checkpoint term
    subtracted, the recompute term paid at n = 0 or not at n = 1, a recompute of 1 byte at n = 0)."""
    terms = dict(num_layers=4, layer_bytes_per_token=1000.0, checkpoint_bytes_per_token=10.0,
                 recompute_bytes_per_token=300.0, other_bytes_per_token=7.0, fixed_bytes=50_000.0,
                 static_bytes=2_000_000.0)  # fmt: skip
    model = MemoryModel(**terms)
    for n in range(5):
        per_token = 7.0 + n * 10.0 + (4 - n) * 1000.0 + (300.0 if n > 0 else 0.0)
        assert model.bytes_per_token(n) == per_token
        for tokens in (0, 1, 4096):
            assert model.peak_bytes(tokens, n) == 2_000_000.0 + 50_000.0 + tokens * per_token
    # without a recompute transient, one checkpointed layer saves exactly layer - checkpoint bytes per token
    plain = MemoryModel(**{**terms, "recompute_bytes_per_token": 0.0})
    assert plain.bytes_per_token(0) - plain.bytes_per_token(1) == 990.0
    # the choice reads the same terms: with 3 of 4 layers needed at 1000 tokens, not 2 and not 4
    device = model.peak_bytes(1000, 3)
    assert choose_checkpointing(model, 1000, device) == (3, True)
    assert choose_checkpointing(model, 1000, device - 1) == (4, True)


def test_memory_errors_name_the_value_and_its_range():
    with pytest.raises(ValueError, match=r"num_layers must be >= 1, got 0"):
        _memory(num_layers=0)
    assert _memory(num_layers=1).bytes_per_token(1) == 3e3 + 180e3 + 20e3  # one layer is a valid model
    for name in ("layer_bytes_per_token", "checkpoint_bytes_per_token", "recompute_bytes_per_token",
                 "other_bytes_per_token", "fixed_bytes", "static_bytes"):  # fmt: skip
        for bad in (-1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=rf"MemoryModel\.{name} must be finite and >= 0, got {bad}"):
                _memory(**{name: bad})
    model = _memory()
    assert model.peak_bytes(0, 0) == 14 * GIB  # no tokens: the resident terms
    with pytest.raises(ValueError, match=r"tokens must be >= 0, got -1"):
        model.peak_bytes(-1, 0)
    with pytest.raises(ValueError, match=r"checkpointed layers must be in \[0, 28\], got -1"):
        model.bytes_per_token(-1)
    with pytest.raises(ValueError, match=r"checkpointed fraction must be in \[0, 1\], got 1.5"):
        layers_to_checkpoint(1.5, 28)
    with pytest.raises(ValueError, match=r"checkpointed layers must be in \[0, 28\], got 29"):
        checkpointed_indices(29, 28)


def test_the_advice_reads_whole_gib_and_the_edges_of_the_room():
    """shortfall's numbers are GiB of the predicted need and of the usable device; a budget of one token is still
    advice; a device exactly filled by the resident terms leaves room for no token; a model with no per-token
    bytes fits any budget."""
    from odc_hf.balance.memory import largest_fitting_tokens, shortfall

    model = _memory(static_bytes=10 * GIB, fixed_bytes=2 * GIB)
    words = shortfall(model, 65536, 20 * GIB)
    need = model.peak_bytes(65536, 28) / GIB
    assert words.startswith(f"even full activation checkpointing is predicted to need {need:.1f} GiB at 65536 tokens "
                            "per microbatch, and 20.0 GiB are usable")  # fmt: skip
    per_token = model.bytes_per_token(28)
    one_token = model.peak_bytes(1, 28)
    assert largest_fitting_tokens(model, one_token) == 1
    assert shortfall(model, 65536, one_token).endswith("lower max_tokens_per_microbatch to 1 or less")
    assert largest_fitting_tokens(model, 12 * GIB) == 0  # the resident terms exactly fill it
    assert largest_fitting_tokens(model, 12 * GIB + per_token - 1) == 0
    words = shortfall(model, 65536, 12 * GIB)
    assert "alone take 12.0 GiB per process: no token budget fits" in words
    assert words.endswith("train an adapter (LoRA), or use a smaller model")
    free = MemoryModel(num_layers=2, layer_bytes_per_token=0.0, checkpoint_bytes_per_token=0.0, static_bytes=GIB)
    assert largest_fitting_tokens(free, 2 * GIB) >= 2**62
    half = MemoryModel(num_layers=1, layer_bytes_per_token=1.0, checkpoint_bytes_per_token=0.5)  # below a byte
    assert largest_fitting_tokens(half, 1.0) == 2 and largest_fitting_tokens(half, 0.0) == 0
    assert choose_checkpointing(free, 2**40, 2 * GIB) == (0, True)


def test_selective_spelling_and_layer_spread():
    assert layers_to_checkpoint(0.5, 28) == 14 and layers_to_checkpoint(0.01, 28) == 1
    assert layers_to_checkpoint(1.0, 28) == 28 and layers_to_checkpoint(0.0, 28) == 0
    assert checkpointed_indices(14, 28) == list(range(1, 28, 2))  # every second layer
    assert checkpointed_indices(28, 28) == list(range(28)) and checkpointed_indices(0, 28) == []
    assert len(set(checkpointed_indices(9, 28))) == 9
    assert [describe_checkpointing(n, 28) for n in (0, 7, 28)] == ["none", "selective 7/28", "full"]
    assert ODCConfig(activation_checkpointing=0.25).activation_checkpointing == "0.25"
    assert (
        ODCConfig.from_env(
            {"ODC_ACTIVATION_CHECKPOINTING": "full", "ODC_DEVICE_MEMORY_GIB": "40"}
        ).device_memory_gib
        == 40
    )
    for bad in ("sometimes", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="activation_checkpointing must be"):
            ODCConfig(activation_checkpointing=bad)
    with pytest.raises(ValueError, match="kernels must be"):
        ODCConfig(kernels="triton")


def test_calibration_json_records_the_compute_path_and_reads_back(tmp_path, caplog):
    model = QuadraticCostModel(a=0.1, b=2e-5, c=1e-10, floor=0.15)
    path = fused_head.ComputePath(kernels="liger", loss=fused_head.TRL_FUSED_HEAD, checkpointing="none",
                                    checkpointed_layers=0, num_layers=28)  # fmt: skip
    record = {**model.to_dict(), "compute_path": path.describe(), "lengths": [1, 2]}
    file = tmp_path / "calibration.json"
    file.write_text(json.dumps(record))
    assert QuadraticCostModel.from_dict(json.loads(file.read_text())) == model  # unknown keys ignored
    other = fused_head.ComputePath(loss=fused_head.FULL_LOGITS, checkpointing="full")
    with caplog.at_level("WARNING"):
        fused_head.check_recorded(json.loads(file.read_text()), other, str(file))
    assert "re-calibrate" in caplog.text and "full_logits" in caplog.text


def test_use_liger_kernel_without_liger_or_without_gpu_is_a_clear_error(monkeypatch):
    import importlib.util

    cpu = torch.device("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"use_liger_kernel=True needs .*not installed.*odc_hf\[kernels\]"):
        fused_head.resolve_kernels("auto", True, cpu)
    with pytest.raises(ValueError, match=r"kernels='liger'"):
        fused_head.resolve_kernels("liger", False, cpu)
    assert fused_head.resolve_kernels("auto", False, cpu) == "none"  # auto: quietly without
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a)
    )
    with pytest.raises(ValueError, match="Triton GPU kernels and this run's device is cpu"):
        fused_head.resolve_kernels("auto", True, cpu)
    assert fused_head.resolve_kernels("auto", False, cpu) == "none"
    assert fused_head.resolve_kernels("auto", False, torch.device("cuda", 0)) == "liger"
    with pytest.raises(ValueError, match="contradicts"):
        fused_head.resolve_kernels("none", True, cpu)


def test_selective_checkpointing_sets_the_chosen_layers_and_keeps_gradients():
    ids = microbatch(0, 0)
    grads = {}
    for n in (0, 1, 2):
        model = tiny_qwen2()
        activation_checkpointing.enable_checkpointing(model, n)
        flags = [layer.gradient_checkpointing for layer in activation_checkpointing.decoder_layers(model)]
        assert sum(flags) == n and flags == [i in checkpointed_indices(n, 2) for i in range(2)]
        loss_sum(model, ids).backward()
        grads[n] = {k: p.grad.clone() for k, p in model.named_parameters()}
    for n in (1, 2):  # recomputation gives the same gradients (same fp32 ops, same order)
        assert max_rel_error(grads[n], grads[0]) <= 1e-6


def _odc_fused_run(rank, world_size):
    """Two ranks, ODC, TRL's fused head as ODCSFTTrainer runs it (no DTensor collective: the guard would raise),
    one of two layers checkpointed (selective AC under FSDP2 + ODC)."""
    from odc_hf.fsdp import install_odc, shard_model

    model = tiny_qwen2()
    assert fused_head.install_fused_head(model, outputs=fused_head.SFT_HEAD_OUTPUTS)  # SFTTrainer's head
    fused_head.guard_sharded_head(model)
    activation_checkpointing.enable_checkpointing(model, 1)
    shard_model(model)
    odc = install_odc(model, timeout_s=60)
    out = []
    for m, counts in enumerate(COUNTS):
        start = sum(counts[:rank])
        mine = [microbatch(m, start + i) for i in range(counts[rank])]
        total = sum(microbatch(m, i).numel() - 1 for i in range(sum(counts)))
        losses = []
        with odc.failure_guard():
            for ids in mine:
                loss = fused_head.fused_head_loss(model, {"input_ids": ids, "labels": ids}, total)
                loss.backward()
                losses.append(loss.item())
        odc.finish_minibatch(sum(ids.numel() - 1 for ids in mine))
        grads = {
            n: full(p.grad) if p.grad is not None else torch.zeros(p.shape)
            for n, p in model.named_parameters()
        }
        out.append({"grads": grads, "losses": losses})
        model.zero_grad(set_to_none=True)
        odc.publish()  # no optimizer step here: the same shards, published for the next minibatch's gathers
    odc.close()
    return out


def test_fused_loss_equals_full_logits_under_odc_with_uneven_microbatch_counts():
    ranks = run_ranks(_odc_fused_run, 2, timeout_s=240)
    reference = tiny_qwen2()  # one process, full logits, every microbatch of the minibatch
    for m, counts in enumerate(COUNTS):
        batch = [microbatch(m, i) for i in range(sum(counts))]
        total = sum(ids.numel() - 1 for ids in batch)
        losses = []
        for ids in batch:
            loss = loss_sum(reference, ids) / total
            loss.backward()
            losses.append(loss.item())
        want = {n: p.grad.clone() for n, p in reference.named_parameters()}
        reference.zero_grad(set_to_none=True)
        got = ranks[0][m]["losses"] + ranks[1][m]["losses"]
        # fp32 throughout: only the summation order differs (chunked logsumexp, per-rank accumulation)
        assert got == pytest.approx(losses, rel=1e-5)
        assert max_rel_error(ranks[0][m]["grads"], want) <= 1e-5, m
        assert max_rel_error(ranks[1][m]["grads"], want) <= 1e-5, m


def _trainer(tmp_path, args_cls=None, **kwargs):
    from datasets import Dataset
    from transformers import TrainingArguments

    from odc_hf.integrations.trainer.mixin import ODCTrainer

    cls = args_cls or TrainingArguments
    args = cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)
    data = Dataset.from_dict({"input_ids": [microbatch(0, i)[0].tolist() for i in range(4)]})
    return ODCTrainer(
        model=tiny_qwen2(), args=args, train_dataset=data, odc_config=ODCConfig(max_tokens_per_microbatch=64)
    )


def test_odc_trainer_uses_the_fused_head_and_owns_checkpointing(tmp_path):
    trainer = _trainer(tmp_path)
    path = trainer.odc_compute
    assert (path.kernels, path.loss, path.fused_by_odc, path.checkpointing) == (
        "none",
        fused_head.TRL_FUSED_HEAD,
        True,
        "auto",
    )
    ids = microbatch(0, 1)
    model = trainer.model
    model.train()
    loss = trainer.compute_loss(model, {"input_ids": ids, "labels": ids}, num_items_in_batch=torch.tensor(7))
    want = loss_sum(model, ids) / 7  # full logits
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    trainer.get_train_dataloader()
    assert (
        path.checkpointed_layers == 0 and path.describe()["activation_checkpointing"] == "none (auto)"
    )  # CPU
    # the user's own gradient_checkpointing=True wins over "auto"; the Trainer applies it
    user = _trainer(tmp_path, gradient_checkpointing=True)
    assert user.odc_compute.checkpointing == "user" and user.args.gradient_checkpointing
    with pytest.raises(ValueError, match="use_liger_kernel=True needs"):
        _trainer(tmp_path, use_liger_kernel=True)


def test_odc_sft_trainer_replaces_trl_default_checkpointing_with_auto(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from odc_hf.integrations.trl.sft_trainer import ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer

    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    assert args.gradient_checkpointing  # TRL's default
    data = Dataset.from_dict({"input_ids": [microbatch(0, i)[0].tolist() for i in range(4)]})
    trainer = ODCSFTTrainer(model=tiny_qwen2(), args=args, train_dataset=data, processing_class=default_tokenizer(),
                            odc_config=ODCConfig(activation_checkpointing="0.5", max_tokens_per_microbatch=64))  # fmt: skip
    path = trainer.odc_compute
    assert (path.loss, path.fused_by_odc, path.checkpointing) == (fused_head.TRL_FUSED_HEAD, False, "0.5")
    assert not trainer.args.gradient_checkpointing  # odc_hf's setting wins, and the Trainer leaves it alone
    trainer.get_train_dataloader()
    assert path.describe()["activation_checkpointing"] == "selective 1/2"
    flags = [layer.gradient_checkpointing for layer in activation_checkpointing.decoder_layers(trainer.model)]
    assert flags == [False, True]


def test_oom_names_the_policy_and_prediction():
    path = fused_head.ComputePath(checkpointing="auto", checkpointed_layers=0, num_layers=28, tokens=32768,
                                    predicted_peak_bytes=70 * GIB, device_bytes=80 * GIB)  # fmt: skip
    with pytest.raises(
        RuntimeError,
        match=r"'none \(auto\)'.*70.0 GiB at 32768 tokens.*80.0 GiB.*activation_checkpointing='full'",
    ):
        with fused_head.oom_guard(path):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    fake = SimpleNamespace()  # the guard leaves other errors alone
    with pytest.raises(KeyError) as caught:
        with fused_head.oom_guard(path):
            raise KeyError(fake)
    assert caught.value.args == (fake,)  # the very error, unchanged


assert VOCAB  # fsdp_helpers' tiny vocabulary: every id below is valid


def test_calibration_copies_of_a_two_layer_model_build_with_four_layers():
    """calibrate_memory builds 2- and 4-layer copies of the model's architecture; a 2-layer model's ``layer_types``
    has 2 entries, and transformers' constructor indexes it per layer (seen on one H200: IndexError in every
    one-process CUDA run of a 2-layer model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc_hf.integrations.compute.activation_checkpointing import config_with_layers

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    assert len(config.layer_types) == 2
    for layers in (1, 2, 4):
        copy = config_with_layers(config, layers)
        assert copy.num_hidden_layers == layers and len(copy.layer_types) == layers
        assert len(Qwen2ForCausalLM(copy).model.layers) == layers
    assert config.num_hidden_layers == 2 and len(config.layer_types) == 2  # the model's own config is untouched


@pytest.mark.parametrize("tied", [False, True], ids=["untied_head", "tied_head"])
@pytest.mark.parametrize("peft", [False, True])
def test_calibration_copies_of_a_peft_model_keep_its_adapter(peft, tied):
    """calibrate_memory's copies of a LoRA model: its base architecture with the same adapter config (so the same
    parameters are trainable). Calling the PeftModel's class with a config raised TypeError in every LoRA run on a
    GPU (seen on one H200: tests/gpu/test_gpu_one_device.py::test_odc_lora_sft_on_cuda_matches_trl_lora)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc_hf.integrations.compute.activation_checkpointing import small_copy
    from odc_hf.integrations.compute.fused_head import TRL_FUSED_HEAD

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    if peft:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    small = small_copy(model, 4, device="cpu", dtype=torch.float32, kernels="none", loss=TRL_FUSED_HEAD)
    trainable = sorted(n.split("layers.")[-1] for n, p in small.named_parameters() if p.requires_grad)
    assert len(trainable) == (4 * 4 if peft else len(list(small.parameters())))  # LoRA A, B on q and v per layer
    assert type(small).__name__ == ("PeftModelForCausalLM" if peft else "Qwen2ForCausalLM")
    ids = torch.randint(0, 64, (1, 16))
    small(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()  # the forward calibrate_memory times
    assert all(p.grad is not None for p in small.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "mixed_precision, param_dtype, sharded, expected",
    [("bf16", torch.float32, False, torch.bfloat16), ("fp16", torch.float32, False, torch.float16),
     ("bf16", torch.float32, True, None), ("bf16", torch.bfloat16, False, None), ("no", torch.float32, False, None),
     (None, torch.float32, False, None)],
)  # fmt: skip
def test_the_calibration_runs_autocast_where_training_does(mixed_precision, param_dtype, sharded, expected):
    """One process with mixed precision over float32 parameters is accelerate's plain autocast; FSDP2 (several
    processes) gathers the parameters in the compute dtype, and half-precision parameters need no autocast."""
    assert activation_checkpointing.autocast_over_full_precision(mixed_precision, param_dtype, sharded) == expected


def _saved_bytes_per_token(model, autocast) -> float:
    """Bytes autograd saves for backward per token (distinct storages, rows of 64 and 128 tokens)."""
    sizes = []
    for tokens in (64, 128):
        seen = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            activation_checkpointing.calibration_step(model, tokens, fused_head.FULL_LOGITS, torch.device("cpu"), autocast)
        sizes.append(sum(seen.values()))
    return (sizes[1] - sizes[0]) / 64


def test_calibration_under_autocast_sees_the_float32_residual_stream_and_the_weight_copies():
    """The calibration step runs as one-process mixed-precision training does (float32 parameters under autocast):
    the layers' matmuls in bf16, the gradients float32, and more saved per token than the same model in bf16 (the
    residual stream stays float32). Broken twin: the step without autocast on the float32 copy computes float32.
    resident_bytes adds the weight copies autocast keeps (2 bytes per parameter at bf16) on one process only."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    full_precision = Qwen2ForCausalLM(config).train()
    half = Qwen2ForCausalLM(config).to(torch.bfloat16).train()
    seen = []
    hook = full_precision.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    activation_checkpointing.calibration_step(full_precision, 16, fused_head.FULL_LOGITS, torch.device("cpu"), torch.bfloat16)
    activation_checkpointing.calibration_step(full_precision, 16, fused_head.FULL_LOGITS, torch.device("cpu"), None)  # twin
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]
    assert all(p.dtype == torch.float32 for p in full_precision.parameters())
    under_autocast = _saved_bytes_per_token(full_precision, torch.bfloat16)
    in_bf16 = _saved_bytes_per_token(half, None)
    print(f"saved per token: {under_autocast:.0f} B under autocast over float32, {in_bf16:.0f} B in bf16")
    assert under_autocast > 1.1 * in_bf16, (under_autocast, in_bf16)

    params = sum(p.numel() for p in full_precision.parameters())
    plan = dict(compute_dtype=torch.bfloat16, odc=False)
    one, one_autocast = (activation_checkpointing.resident_bytes(full_precision, world_size=1, autocast=a, **plan)
                         for a in (None, torch.bfloat16))  # fmt: skip
    assert one[0] == one_autocast[0] and one[1] == 0.0 and one_autocast[1] == 2 * params
    two = activation_checkpointing.resident_bytes(full_precision, world_size=2, autocast=None, **plan)
    assert two == activation_checkpointing.resident_bytes(full_precision, world_size=2, autocast=torch.bfloat16, **plan)


def test_resident_bytes_follow_the_documented_fsdp2_layout_term_by_term():
    """resident_bytes' docstring, counted from the model's named parameters (not from decoder_layers): the sharded
    master weights, gradients of trainable ones only, optimizer states; under ODC the bf16 staging shard and the fp32
    accumulator; unsharded, the embedding/head unit and its gradient plus two decoder layers in flight with their
    gradient and fp32 reduce copy. Frozen parameters, float32 vs bf16 masters and 2 vs 4 ranks give different sums."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    for name, p in model.named_parameters():  # a frozen base with trainable attention: trainable < total
        p.requires_grad_("self_attn" in name)
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    trainable = sum(p.numel() for p in named.values() if p.requires_grad)
    layer = sum(p.numel() for n, p in named.items() if n.startswith("model.layers.0."))
    tail = sum(p.numel() for n, p in named.items() if not n.startswith("model.layers."))
    assert 0 < trainable < total and tail == 2 * 96 * 32 + 32 and 3 * layer + tail == total
    for master, world, odc, states in ((4, 2, True, 2), (4, 4, False, 2), (2, 2, True, 0)):
        model.to(torch.float32 if master == 4 else torch.bfloat16)
        static, fixed = activation_checkpointing.resident_bytes(model, world_size=world, compute_dtype=torch.bfloat16,
                                                                odc=odc, optimizer_states=states)  # fmt: skip
        want = (total * master + trainable * master + trainable * 4 * states) / world
        if odc:
            want += (total * 2 + trainable * 4) / world
        assert static == pytest.approx(want, rel=1e-12), (master, world, odc, states)
        assert fixed == 2 * tail * 2 + 2 * layer * (2 + 2 + 4)
    static, fixed = activation_checkpointing.resident_bytes(model, world_size=1, compute_dtype=torch.bfloat16,
                                                            odc=True, optimizer_states=2)  # fmt: skip
    assert static == total * 2 + trainable * (2 + 8) and fixed == 0.0  # one process: no staging, nothing in flight


def _tiny_moe(dtype=torch.float32):
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, num_experts=4, num_experts_per_tok=2)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def test_float32_experts_stay_off_ligers_tf32_moe_kernel_unless_asked(caplog):
    """Liger's fused MoE kernel multiplies float32 on TF32: ``kernels="auto"`` keeps float32 experts on the model's
    own implementation (``swiglu: False``, the rest of Liger kept); asked for by name it applies, with a warning;
    bf16 experts, mixed precision and dense models are left as they are."""
    moe, dense = _tiny_moe(), tiny_qwen2()
    assert fused_head.fp32_experts(moe, "no") and fused_head.fp32_experts(moe, None)
    assert not fused_head.fp32_experts(moe, "bf16") and not fused_head.fp32_experts(_tiny_moe(torch.bfloat16), "no")
    assert not fused_head.fp32_experts(dense, "no")

    def config(model, requested=None, explicit=False, mixed_precision="no"):
        return fused_head.liger_kernel_config(model, requested, explicit=explicit, mixed_precision=mixed_precision)

    with caplog.at_level("INFO", logger=fused_head.logger.name):
        assert config(moe) == {"swiglu": False}
        assert config(moe, {"rms_norm": False}) == {"rms_norm": False, "swiglu": False}  # the user's keys kept
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        assert config(moe, explicit=True) == {}  # use_liger_kernel=True / kernels="liger": as asked, warned
        assert config(moe, {"swiglu": True}) == {"swiglu": True}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("TF32" in w and "'swiglu': False" in w for w in warnings), warnings
    assert config(moe, {"swiglu": False}, explicit=True) == {"swiglu": False}
    assert config(moe, mixed_precision="bf16") == {} and config(dense) == {} and config(dense, {"rope": False}) == {"rope": False}


def test_the_trainer_applies_liger_with_the_float32_experts_config(tmp_path, monkeypatch):
    """The wiring (Liger itself needs CUDA): where Liger applies, the trainer applies it with that config and keeps it
    on the compute path (the memory calibration's small copy takes the same)."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from odc_hf.integrations.trainer.mixin import ODCTrainer

    applied = []
    monkeypatch.setattr(fused_head, "resolve_kernels", lambda *args: "liger")
    monkeypatch.setattr(fused_head, "liger_supports", lambda model: True)
    monkeypatch.setattr(fused_head, "apply_liger_kernels", lambda model, **kw: applied.append(kw))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    data = Dataset.from_dict({"input_ids": [microbatch(0, i)[0].tolist() for i in range(4)]})
    trainer = ODCTrainer(model=_tiny_moe(), args=args, train_dataset=data, odc_config=ODCConfig(max_tokens_per_microbatch=64))
    assert applied == [{"fused_linear_cross_entropy": True, "kernel_config": {"swiglu": False}}]
    assert trainer.odc_compute.kernel_config == {"swiglu": False}
