"""The model zoo of the trainer tests: tiny configs of the families people fine-tune, each with the attention and
loss variants its definition uses, trained by odc_hf and by TRL on the same microbatches.

Every family is built from a config made here (no downloads): 2 layers, hidden size 32, vocabulary of the offline
tokenizer, random weights seeded the same for every run. Its **variants** are what makes it more than plain causal
attention: ``window`` (sliding-window layers, ``WINDOW`` tokens, shorter than every document), ``softcap`` (attention
logit soft-capping, small enough to bind on a tiny model's logits), ``sinks`` (GPT-OSS's learned sink logits, drawn
at unit scale so they matter) and ``router_aux`` (a Mixture-of-Experts load-balancing loss with coefficient
``ROUTER_AUX_COEF``). :func:`switched_off` builds the same model with one variant off: the negative controls.

The runs (``STEPS`` steps of ``MINIBATCH`` documents, ``MICRO`` documents per microbatch, fp32, CPU):

- :func:`trl_run`: TRL's ``SFTTrainer`` in one process, padded rows, the model's own attention (``sdpa``, or ``eager``
  for families whose soft-capping or sinks SDPA cannot compute), gradient accumulation over the step's ``MINIBATCH // MICRO``
  microbatches in dataset order;
- :func:`odc_run`: ``ODCSFTTrainer`` (packed rows, odc_hf's attention) on 1 or 2 ranks with exactly those
  microbatches, dealt to the ranks by ``SCHEDULE`` (uneven counts, a rank with none in the first step). For the
  router loss the reference is TRL's own definition on the same microbatches (its coefficient times the mean over
  the step's microbatches), which is what a different dealing must not change.

:func:`grpo_run` does the same for GRPO on fixed rollouts (TRL's padded rows vs ODC's packed layout, one process,
one microbatch per step, so the router loss sees the same tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch

WINDOW = 16
SOFTCAP = 0.01
GPU_SOFTCAP, GPU_QUERY_SCALAR = 1.0, 1
"""Gemma 2's soft-capping and ``query_pre_attn_scalar`` in the GPU zoo. Its released models use 50 and 256, which
never bind on random weights (logits ~0.1); at scale 1 the logits are ~1.6 and a cap of 1.0 binds: TRL's run without
it lands 2.1e-1 from TRL's with it (CPU, fp32, measured; 1.8e-2 at the CPU zoo's 0.01 and scale 256), far outside
the bf16 noise (2.7e-4 to 8.7e-3 on one H200)."""
ROUTER_AUX_COEF = 0.05
MINIBATCH, MICRO, STEPS = 8, 2, 3
SEED = 0
SCHEDULE = {1: [[4], [4], [4]], 2: [[4, 0], [1, 3], [3, 1]]}
"""Microbatches per rank per step: the step's ``MINIBATCH // MICRO`` microbatches in order, the first ``k0`` on rank 0."""
SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[dict], object]  # size and token ids -> the transformers config
    variants: tuple[str, ...] = ()
    grpo: bool = False  # also checked on ODCGRPOTrainer's packed layout (families with non-plain attention)
    label: str = ""  # how docs/models.md names it (default: the name)


def _moe(**kwargs) -> dict:
    return dict(kwargs, router_aux_loss_coef=ROUTER_AUX_COEF)


def _families() -> dict[str, Family]:
    import transformers as t

    two = ["sliding_attention", "full_attention"]
    families = [
        Family("llama", lambda c: t.LlamaConfig(**c), label="Llama"),
        Family("mistral", lambda c: t.MistralConfig(**c, sliding_window=None), label="Mistral, no window"),
        Family("mistral_window", lambda c: t.MistralConfig(**c, sliding_window=WINDOW), ("window",), grpo=True,
               label="Mistral, window on every layer"),  # fmt: skip
        Family("qwen2", lambda c: t.Qwen2Config(**c), label="Qwen2"),
        Family("qwen3", lambda c: t.Qwen3Config(**c, head_dim=8), label="Qwen3"),
        Family("qwen3_window", lambda c: t.Qwen3Config(**c, head_dim=8, use_sliding_window=True, sliding_window=WINDOW,
                                                        max_window_layers=1), ("window",), grpo=True,
               label="Qwen3, one sliding-window layer"),  # fmt: skip
        Family("qwen3_moe", lambda c: t.Qwen3MoeConfig(**c, head_dim=8, **_moe(num_experts=4, num_experts_per_tok=2,
                                                                               moe_intermediate_size=32)),
               ("router_aux",), grpo=True, label="Qwen3-MoE"),  # fmt: skip
        Family("mixtral", lambda c: t.MixtralConfig(**c, **_moe(num_local_experts=4, num_experts_per_tok=2)),
               ("router_aux",), label="Mixtral"),  # fmt: skip
        Family("gemma2", lambda c: t.Gemma2Config(**c, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
                                                  attn_logit_softcapping=SOFTCAP,
                                                  layer_types=two), ("window", "softcap"), grpo=True,
               label="Gemma 2, sliding + full layers"),  # fmt: skip
        Family("gemma3", lambda c: t.Gemma3TextConfig(**c, head_dim=8, sliding_window=WINDOW, layer_types=two),
               ("window",), grpo=True, label="Gemma 3 text, sliding + full layers"),  # fmt: skip
        Family("phi3", lambda c: t.Phi3Config(**c, sliding_window=WINDOW), ("window",), label="Phi-3"),
        Family("olmo2", lambda c: t.Olmo2Config(**c), label="OLMo 2"),
        Family("smollm3", lambda c: t.SmolLM3Config(**c, no_rope_layers=[1, 0]),  # layer 1 without RoPE
               label="SmolLM3, a layer without RoPE"),  # fmt: skip
        Family("gpt_oss", lambda c: t.GptOssConfig(**c, head_dim=8, sliding_window=WINDOW, layer_types=two,
                                                   **_moe(num_local_experts=4, num_experts_per_tok=2)),
               ("window", "sinks", "router_aux"), grpo=True, label="GPT-OSS, sliding + full layers"),  # fmt: skip
        Family("cohere2", lambda c: t.Cohere2Config(**c, sliding_window=WINDOW, layer_types=two), ("window",),
               label="Cohere 2, sliding + full layers"),  # fmt: skip
        Family("deepseek_v3", lambda c: t.DeepseekV3Config(  # multi-head latent attention: q/k and v head dims differ
            **{**c, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1), label="DeepSeek-V3 (latent attention, MoE)"),  # fmt: skip
    ]
    return {f.name: f for f in families}


FAMILIES = _families()


def _gpu_families() -> dict[str, Family]:
    """Gemma 3, Gemma 2, GPT-OSS and Qwen3-MoE with the head dimensions of their released models (256, 256, 64, 128), a
    window of 64 tokens, 8 experts, Gemma 2's soft-capping at ``GPU_SOFTCAP``: the shapes FlashAttention-4 and
    cuDNN's attention meet in training."""
    import transformers as t

    two = ["sliding_attention", "full_attention"]
    return {
        "gemma3": Family("gemma3", lambda c: t.Gemma3TextConfig(**{**c, "num_attention_heads": 2, "num_key_value_heads": 1},
                                                                head_dim=256, sliding_window=64, layer_types=two),
                         ("window",), label="Gemma 3 text"),  # fmt: skip
        "gemma2": Family("gemma2", lambda c: t.Gemma2Config(**{**c, "num_attention_heads": 2, "num_key_value_heads": 1},
                                                            head_dim=256, query_pre_attn_scalar=GPU_QUERY_SCALAR, sliding_window=64,
                                                            attn_logit_softcapping=GPU_SOFTCAP, layer_types=two),
                         ("window", "softcap"), label="Gemma 2"),  # fmt: skip
        "gpt_oss": Family("gpt_oss", lambda c: t.GptOssConfig(**{**c, "num_attention_heads": 8, "num_key_value_heads": 2},
                                                              head_dim=64, sliding_window=64, layer_types=two,
                                                              **_moe(num_local_experts=8, num_experts_per_tok=2)),
                          ("window", "sinks", "router_aux"), label="GPT-OSS"),  # fmt: skip
        "qwen3_moe": Family("qwen3_moe", lambda c: t.Qwen3MoeConfig(**{**c, "num_attention_heads": 4, "num_key_value_heads": 2},
                                                                    head_dim=128, **_moe(num_experts=8,
                                                                    num_experts_per_tok=2, moe_intermediate_size=128)),
                            ("router_aux",), label="Qwen3-MoE"),  # fmt: skip
    }


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where and at what size the zoo runs: the families, their size, the documents' token range, the device."""

    name: str
    families: dict
    size: dict
    min_tokens: int
    max_tokens: int
    use_cpu: bool

    @property
    def budget(self) -> int:  # tokens per packed microbatch: MICRO documents
        return MICRO * self.max_tokens


CPU = Setting("cpu", FAMILIES, SIZE, min_tokens=2 * WINDOW + 8, max_tokens=96, use_cpu=True)
"""Every document longer than two windows."""
GPU = Setting("gpu", _gpu_families(), dict(SIZE, hidden_size=256, intermediate_size=512), min_tokens=160,
              max_tokens=512, use_cpu=False)  # fmt: skip
SETTINGS = {s.name: s for s in (CPU, GPU)}


def token_ids(tokenizer) -> dict:
    return {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None}  # fmt: skip


def build(name: str, tokenizer, off: str | None = None, setting: Setting = CPU):
    """The family's model with seeded random weights; ``off``: one of its variants switched off, or ``"all"``."""
    import transformers

    config = setting.families[name].config({**setting.size, **token_ids(tokenizer)})
    if off in ("window", "all"):  # wider than any document: the window never binds
        config.sliding_window = 4 * setting.max_tokens
    if off in ("softcap", "all"):
        config.attn_logit_softcapping = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        # the model's own attention: SDPA, or eager where SDPA cannot compute the definition (transformers 5.17 lets
        # Gemma 2 run SDPA and drops its soft-capping there)
        own = "eager" if getattr(config, "attn_logit_softcapping", None) is not None else None
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=own)
        sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
        with torch.no_grad():
            for s in sinks:  # unit scale (the config's init is 0.02): a sink then takes a real share of each row
                s.normal_() if off not in ("sinks", "all") else s.fill_(-1e4)
    return model.float()


def dataset(tokenizer, setting: Setting = CPU):
    """``STEPS * MINIBATCH`` real-text documents of ``min_tokens``..``max_tokens`` tokens (``input_ids``)."""
    from datasets import Dataset

    from odc_hf.testing.data import default_tokenized_dataset

    pool = default_tokenized_dataset(tokenizer, 4 * STEPS * MINIBATCH, max_length=setting.max_tokens, seed=SEED)
    ids = [row for row in pool["input_ids"] if len(row) >= setting.min_tokens][: STEPS * MINIBATCH]
    assert len(ids) == STEPS * MINIBATCH, len(ids)
    return Dataset.from_dict({"input_ids": ids})


def microbatches(step: int) -> list[list[int]]:
    """Dataset indices of the step's microbatches, in TRL's order."""
    first = step * MINIBATCH
    return [list(range(first + i, first + i + MICRO)) for i in range(0, MINIBATCH, MICRO)]


def forced_sampler(world: int):
    """An ``ODCBatchSampler`` whose plans are TRL's microbatches, dealt by ``SCHEDULE[world]``."""
    from odc_hf.balance import ODCBatchSampler, Plan

    class Forced(ODCBatchSampler):
        def minibatch_indices(self, step):
            return np.arange(step * MINIBATCH, (step + 1) * MINIBATCH)

        def plan(self, step):
            mbs = microbatches(step)
            counts = SCHEDULE[world][step]
            dealt = [mbs[sum(counts[:r]) : sum(counts[: r + 1])] for r in range(world)]
            return Plan(mode=self.mode, microbatches=dealt, microbatch_costs=[[1.0] * len(d) for d in dealt],
                        lower_bound=0.0)  # fmt: skip

    return Forced


def sft_args(out, world: int = 1, setting: Setting = CPU, **changes):
    from trl import SFTConfig

    fields = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=MICRO,
                  gradient_accumulation_steps=MINIBATCH // MICRO // world, learning_rate=3e-3,
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1e3, seed=SEED,
                  logging_steps=1, save_strategy="no", report_to="none", bf16=False, use_cpu=setting.use_cpu,
                  max_length=setting.budget,
                  packing=False, dataloader_drop_last=True, disable_tqdm=True, gradient_checkpointing=False,
                  train_sampling_strategy="sequential")  # fmt: skip
    return SFTConfig(**{**fields, **changes})


def history(trainer) -> list[dict]:
    keys = ("step", "loss", "grad_norm", "aux_loss", "entropy", "mean_token_accuracy")
    return [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]


class Fp64GradNorm:
    """A ``TrainerCallback`` recording, before each optimizer step, the gradient norm computed in float64 (the zoo
    never clips: ``max_grad_norm=1e3``): the exact norm of the gradients TRL computed. torch's fp32 norm (TRL's
    logged ``grad_norm``) is off from it by up to ~1e-5 relative on these models (a fp32 sum of ~10^5 squares), and
    odc_hf on several ranks sums its shards' squares in float64, so at world 2 the exact norm is the reference."""

    def __init__(self, model):
        self.model, self.norms = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        squares = sum(float(p.grad.double().pow(2).sum()) for p in self.model.parameters() if p.grad is not None)
        self.norms.append(math.sqrt(squares))

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def trl_run(name: str, out, off: str | None = None, setting: Setting = CPU, **changes) -> list[dict]:
    """TRL's SFTTrainer, one process, the model's own attention on padded rows (see the module docstring); each step
    also carries ``grad_norm_fp64`` (:class:`Fp64GradNorm`)."""
    from trl import SFTTrainer

    from odc_hf.testing.data import default_tokenizer

    tokenizer = default_tokenizer()
    model = build(name, tokenizer, off, setting)
    if off in ("router_aux", "all") and "router_aux" in setting.families[name].variants:
        changes["router_aux_loss_coef"] = 0.0
    norms = Fp64GradNorm(model)
    trainer = SFTTrainer(model=model, args=sft_args(out, setting=setting, **changes),
                         train_dataset=dataset(tokenizer, setting), processing_class=tokenizer, callbacks=[norms])  # fmt: skip
    trainer.train()
    save_final_weights(trainer, out)
    steps = history(trainer)
    assert len(norms.norms) == len(steps)
    return [dict(h, grad_norm_fp64=n) for h, n in zip(steps, norms.norms)]


def odc_run(names: list[str], out: str, world: int, setting: str = "cpu", bf16: bool = False,
            attention: str = "auto", kernels: str = "auto") -> dict[str, dict]:  # fmt: skip
    """``ODCSFTTrainer`` on every family of ``names`` in turn, on this rank (``world`` ranks): each family's history,
    microbatch counts, attention and compute path (with the Liger kernel config it applied). ``setting``: a name of
    :data:`SETTINGS` (ranks get it by name)."""
    from odc_hf import ODCConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer

    tokenizer, setting = default_tokenizer(), SETTINGS[setting]
    trainer_cls = type("ZooODCSFTTrainer", (ODCSFTTrainer,), {"odc_sampler_class": forced_sampler(world)})
    results = {}
    for name in names:
        config = ODCConfig(max_tokens_per_microbatch=setting.budget, timeout_s=120, attention=attention,
                           kernels=kernels)  # fmt: skip
        trainer = trainer_cls(model=build(name, tokenizer, setting=setting),
                              args=sft_args(f"{out}/{name}", world, setting, bf16=bf16),
                              train_dataset=dataset(tokenizer, setting), processing_class=tokenizer,
                              odc_config=config)  # fmt: skip
        trainer.train()
        save_final_weights(trainer, f"{out}/{name}")
        results[name] = {"history": history(trainer), "attention": trainer.odc_attention,
                         "microbatches": [list(s.microbatches) for s in trainer.odc_stats.steps],
                         "compute": compute_of(trainer)}  # fmt: skip
        if trainer.odc is not None:
            trainer.odc.close()
    return results


FINAL_WEIGHTS = "final_weights.pt"


def save_final_weights(trainer, out) -> None:
    """The trained model's whole state (gathered from every rank: a collective, all ranks call it) as float32 CPU
    tensors in ``out/final_weights.pt``, written by the main process."""
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    state = trainer.accelerator.get_state_dict(trainer.model)
    # a sharded tensor is gathered by every rank, in the same (sorted) order
    state = {k: (state[k].full_tensor() if isinstance(state[k], DTensor) else state[k]) for k in sorted(state)}
    if trainer.accelerator.is_main_process:
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().float().cpu() for k, v in state.items()}, Path(out) / FINAL_WEIGHTS)


def update_difference(name: str, ours, reference) -> tuple[float, str]:
    """The largest, over the model's parameters, of ``|update_ours - update_ref| / |update_ref|`` (updates: final
    weights minus the family's seeded initial weights), and the parameter where it is; inf when the runs' parameters
    differ or nothing was updated."""
    from pathlib import Path

    from odc_hf.testing.data import default_tokenizer

    initial = {k: v.detach().float() for k, v in build(name, default_tokenizer()).state_dict().items()}
    a, b = (torch.load(Path(p) / FINAL_WEIGHTS) for p in (ours, reference))
    if set(a) != set(b) or not set(b) <= set(initial):
        return math.inf, f"parameters differ: {sorted(set(a) ^ set(b))[:4]}"
    worst, where, moved = 0.0, "", 0
    for key, final in b.items():
        theirs, mine = final - initial[key], a[key] - initial[key]
        norm = float(theirs.norm())
        if norm == 0.0:  # not trained (a frozen or unused parameter): ours must not move either
            if float(mine.norm()) != 0.0:
                return math.inf, key
            continue
        moved += 1
        difference = float((mine - theirs).norm()) / norm
        if difference > worst:
            worst, where = difference, key
    return (worst, where) if moved else (math.inf, "no parameter was updated")


def compute_of(trainer) -> dict | None:
    path = trainer.odc_compute
    return None if path is None else dict(path.describe(), kernel_config=path.kernel_config)


def odc_rank(rank: int, world: int, names: list[str], out: str, plain: tuple[str, ...] = ()) -> dict[str, dict]:
    results = odc_run(names, out, world)
    results.update({f"plain:{name}": plain_run(name, f"{out}/plain", world) for name in plain})
    return results


# -- transformers' Trainer: the model's own loss, router loss included ------------------------------------------------
def plain_args(out, world: int = 1):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=MINIBATCH // MICRO // world, learning_rate=3e-3,
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1e3, seed=SEED,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             dataloader_drop_last=True, disable_tqdm=True, train_sampling_strategy="sequential")  # fmt: skip


def plain_model(name: str, tokenizer):
    """The family's model with its router loss on (``output_router_logits``: the model adds
    ``router_aux_loss_coef * aux_loss`` to its own loss, as transformers' ``Trainer`` trains it)."""
    model = build(name, tokenizer)
    model.config.output_router_logits = True
    return model


def plain_run(name: str, out, world: int = 0) -> dict:
    """transformers' ``Trainer`` in one process (``world=0``: the reference) or ``ODCTrainer`` on ``world`` ranks, on
    the same microbatches (see the module docstring)."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    from odc_hf import ODCConfig, ODCTrainer
    from odc_hf.testing.data import default_tokenizer

    tokenizer = default_tokenizer()
    if world == 0:
        model = plain_model(name, tokenizer)
        norms = Fp64GradNorm(model)
        trainer = Trainer(model=model, args=plain_args(f"{out}/reference"), train_dataset=dataset(tokenizer),
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=[norms])  # fmt: skip
        trainer.train()
        return {"history": [dict(h, grad_norm_fp64=n) for h, n in zip(history(trainer), norms.norms)]}
    trainer_cls = type("ZooODCTrainer", (ODCTrainer,), {"odc_sampler_class": forced_sampler(world)})
    trainer = trainer_cls(model=plain_model(name, tokenizer), args=plain_args(f"{out}/odc", world),
                          train_dataset=dataset(tokenizer), processing_class=tokenizer,
                          odc_config=ODCConfig(max_tokens_per_microbatch=CPU.budget, timeout_s=120))  # fmt: skip
    trainer.train()
    if trainer.odc is not None:
        trainer.odc.close()
    return {"history": history(trainer)}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def largest_difference(ours: list[dict], reference: list[dict], keys=("loss", "grad_norm", "aux_loss"),
                       renamed: dict | None = None) -> float:  # fmt: skip
    """The largest relative difference of the logged values both runs have, step by step (inf when the steps or the
    keys differ, and when there is nothing to compare: an empty history, or a step without any of the keys);
    ``renamed``: the reference's key to compare each of ours with (default: the same)."""
    if not ours or [h["step"] for h in ours] != [h["step"] for h in reference]:
        return math.inf
    worst = 0.0
    for a, b in zip(ours, reference):
        compared = 0
        for key in keys:
            theirs = (renamed or {}).get(key, key)
            if (key in a) != (theirs in b):
                return math.inf
            if key in a:
                worst = max(worst, relative(a[key], b[theirs]))
                compared += 1
        if not compared:
            return math.inf
    return worst


# -- GRPO on fixed rollouts -------------------------------------------------------------------------------------------
GRPO_STEPS, GENERATIONS, PROMPTS = 2, 4, 2  # per step: 2 prompts x 4 completions, one microbatch of 8 rows
GRPO_SPLIT_TOKENS = 256
"""Token budget of ODC's packed GRPO microbatches in the split runs (8 rows of ~60-110 tokens: 3 or more microbatches)."""


def rollouts(tokenizer):
    """A TRL ``rollout_func``: completions of ``2 * WINDOW``..64 tokens that depend only on the prompt
    and its repeat index (no generation)."""
    import random
    import zlib

    def rollout(prompts, trainer):
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            rng = random.Random(zlib.crc32(f"{prompt}|{k}".encode()))
            prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append([rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(2 * WINDOW, 64))])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def grpo_run(name: str, out, trainer: str, split: bool = False, logit_scale: float = 1.0, **grpo_args) -> dict:
    """TRL's GRPOTrainer (padded rows, the model's own attention) or ODCGRPOTrainer (packed rows, odc_hf's attention)
    in one process, ``GRPO_STEPS`` steps on the same rollouts: one microbatch each, or with ``split`` several (TRL:
    2 microbatches of 4 rows; odc_hf: packed rows of at most ``GRPO_SPLIT_TOKENS`` tokens, so their dealing differs
    from TRL's, which a loss normalised over the whole generation batch does not see; a router loss would).
    ``logit_scale`` multiplies the LM head's weights (the embeddings, where tied): a tiny model's token entropies
    otherwise lie within 1e-5 of each other, where a quantile over them (``top_entropy_quantile``) is decided by
    float noise."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOTrainer
    from odc_hf.testing.data import default_documents, default_tokenizer

    tokenizer = default_tokenizer()  # grpo_args: more GRPOConfig fields (a loss type, an entropy bonus)
    prompts = [doc[:120] for doc in default_documents(seed=SEED)[: GRPO_STEPS * PROMPTS]]
    rows = GENERATIONS * PROMPTS
    args = GRPOConfig(output_dir=str(out), max_steps=GRPO_STEPS, per_device_train_batch_size=rows // 2 if split else rows,
                      gradient_accumulation_steps=2 if split else 1, num_generations=GENERATIONS, max_completion_length=64,
                      learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      max_grad_norm=1.0, beta=0.0, seed=SEED, logging_steps=1, save_strategy="no", report_to="none",
                      bf16=False, use_cpu=True, disable_tqdm=True, shuffle_dataset=False, **grpo_args)  # fmt: skip
    model = build(name, tokenizer)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    kwargs = dict(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                  args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                  rollout_func=rollouts(tokenizer))  # fmt: skip
    if trainer == "odc":
        budget = GRPO_SPLIT_TOKENS if split else 4096
        run = ODCGRPOTrainer(**kwargs, odc_config=ODCConfig(grpo_layout="packed", max_tokens_per_microbatch=budget))
    else:
        run = GRPOTrainer(**kwargs)
    run.train()
    keys = ("step", "loss", "grad_norm", "aux_loss", "entropy", "policy_loss")  # policy_loss: with an entropy bonus
    result = {"history": [{k: h[k] for k in keys if k in h} for h in run.state.log_history if "loss" in h]}
    if trainer == "odc":
        result.update(attention=run.odc_attention, packed=run.odc_grpo_packed,
                      microbatches=[list(s.microbatches) for s in run.odc_stats.steps])  # fmt: skip
    return result


# -- families odc_hf refuses, by name -------------------------------------------------------------------------------
def _refused() -> dict[str, tuple[Callable[[], object], str]]:
    """Tiny models of families packed rows cannot train as defined: a builder, and the words the refusal must say."""
    import transformers as t

    text = dict(SIZE, vocab_size=128, pad_token_id=0)
    return {
        "Qwen2.5-VL (qwen2_5_vl)": (lambda: t.Qwen2_5_VLForConditionalGeneration(t.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                 out_hidden_size=32))), "multimodal"),  # fmt: skip
        "Gemma 3 with vision (gemma3)": (lambda: t.Gemma3ForConditionalGeneration(t.Gemma3Config(
            text_config=dict(text, head_dim=8), vision_config=dict(hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))), "multimodal"),  # fmt: skip
        "Llama 4 text (llama4_text), chunked attention": (lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(
            **text, intermediate_size_mlp=64, head_dim=8, num_local_experts=2, attention_chunk_size=WINDOW)),
            "chunked attention"),  # fmt: skip
        "Qwen3-Next (qwen3_next), linear-attention layers": (lambda: t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
            **text, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])),
            "not attention layers"),  # fmt: skip
        "Jamba (jamba), Mamba layers": (lambda: t.JambaForCausalLM(t.JambaConfig(
            **text, num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, mamba_d_state=4,
            mamba_expand=1)), "not attention layers"),  # fmt: skip
    }


REFUSED = _refused()

# -- the table of docs/models.md ---------------------------------------------------------------------------------------
TABLE_HEADER = ("| family (tiny config) | what its definition uses | odc_hf's attention on packed rows (CPU) "
                "| ODCSFTTrainer vs TRL, 1 rank / 2 ranks | ODCGRPOTrainer (packed) vs TRL | result |")  # fmt: skip
VARIANT_WORDS = {"window": f"sliding window ({WINDOW} tokens)", "softcap": "attention soft-capping",
                 "sinks": "attention sinks", "router_aux": "MoE router loss"}  # fmt: skip


def table(sft: dict[str, dict[int, float]], attention: dict[str, str], grpo: dict[str, float], refusals: dict,
          bound: float) -> list[str]:  # fmt: skip
    """The table's lines: a row per family with what this run measured against ``bound`` (exact or not), then a row
    per refused family with the start of its refusal."""
    def verdict(value: float) -> str:
        return "exact" if value <= bound else "DIFFERS"

    lines = [TABLE_HEADER, "|---|---|---|---|---|---|"]
    for name, family in FAMILIES.items():
        uses = ", ".join(VARIANT_WORDS[v] for v in family.variants) or "plain causal attention"
        results = [verdict(sft[name][1]), verdict(sft[name][2])] + ([verdict(grpo[name])] if name in grpo else [])
        lines.append(f"| {family.label or name} (`{name}`) | {uses} | `{attention[name]}` "
                     f"| {verdict(sft[name][1])} / {verdict(sft[name][2])} "
                     f"| {verdict(grpo[name]) if name in grpo else '-'} "
                     f"| {'exact' if all(r == 'exact' for r in results) else 'DIFFERS'} |")  # fmt: skip
    for name, reason in refusals.items():
        lines.append(f"| {name} | - | - | - | - | refused: {reason.split('. ')[0]} |")
    return lines
