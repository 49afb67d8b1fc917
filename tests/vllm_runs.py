"""GRPO with vLLM (colocate) on the GPU, for tests/test_grpo_vllm_gpu.py: ODCGRPOTrainer or TRL's GRPOTrainer, the
same tiny Qwen2 (head_dim 64, saved to disk: vLLM loads its engine from the path), prompts, reward and seed.

    python tests/vllm_runs.py odc OUT [--steps 3] [--sleep] [--peft]                 # one process
    python tests/vllm_runs.py trl OUT                                                # TRL's GRPOTrainer + vLLM
    accelerate launch --config_file accelerate_configs/odc.yaml --num_processes 2 tests/vllm_runs.py odc OUT
                                                       # two ranks (on a one-GPU machine they share it)

``--stand_in`` runs the same on CPU with tests/vllm_fake.py's engine (HF names, no stacking), to check this runner
without a GPU. Both trainers run with odc_hf's vLLM environment (``prefer_vllm_environment``).

After every weight sync the engine's parameters are read back (``LLM.apply_model``) and compared with the trainer's
own parameters at that moment, gathered independently of ODC (each shard through the CPU,
``odc_hf.fsdp.state_dict.full_tensor_on_cpu``), mapped as vLLM's Qwen2 stacks them (``qkv_proj`` = q, k, v;
``gate_up_proj`` = gate, up; embeddings padded to vLLM's vocabulary multiple), in the engine's dtype: equal or not,
and the largest difference. Each generation's completions are recorded (to compare rollouts between runs). Writes
``OUT/rank<r>.json``: ``history`` (logged steps), ``syncs``, ``rollouts``, ``world``, ``device``, ``versions``,
``sync_seconds`` (ODC) and the vLLM environment variables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def digit_reward(completions, **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]


def vllm_layout(weights: dict) -> dict:
    """HF Qwen2 names -> vLLM's Qwen2 parameters at tensor parallel 1 (stacked projections concatenated on dim 0)."""
    import torch

    out, stacks = {}, {}
    for name, tensor in weights.items():
        for stacked, parts in STACKED.items():
            hit = next((p for p in parts if f".{p}." in name), None)
            if hit is not None:
                stacks.setdefault(name.replace(f".{hit}.", f".{stacked}."), {})[hit] = tensor
                break
        else:
            out[name] = tensor
    for name, parts in stacks.items():
        order = STACKED[next(s for s in STACKED if f".{s}." in name)]
        out[name] = torch.cat([parts[p] for p in order], 0)
    return out


def compare(engine_model, expected: dict) -> dict:
    """Run in the engine (apply_model): every engine parameter against ``expected`` (CPU tensors)."""
    import torch

    worst, unequal, beyond_ulp, uncovered = 0.0, [], [], []
    for name, param in engine_model.named_parameters():
        want = expected.get(name)
        if want is None:
            uncovered.append(name)
            continue
        got = param.detach()[: want.shape[0]] if param.shape[0] > want.shape[0] else param.detach()
        exact = want.to(got.device)
        want = exact.to(got.dtype)
        if got.shape != want.shape:
            unequal.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
            beyond_ulp.append(name)
            continue
        worst = max(worst, float((got.float() - want.float()).abs().max()))
        if not torch.equal(got, want):
            unequal.append(name)
            # one rounding step of the engine's dtype around the trainer's value (a merge computed elsewhere)
            ulp = torch.finfo(got.dtype).eps * exact.float().abs().clamp(min=torch.finfo(got.dtype).tiny)
            if bool(((got.float() - exact.float()).abs() > ulp).any()):
                beyond_ulp.append(name)
    return {
        "max_abs": worst,
        "unequal": unequal,
        "beyond_ulp": beyond_ulp,
        "uncovered": uncovered,
        "compared": len(expected),
    }


STAND_IN = False  # --stand_in: tests/vllm_fake.py's CPU engine (a transformers model: HF names, no stacking)


def trainer_weights(trainer) -> dict:
    """The policy's whole parameters, each shard through the CPU (a collective on every rank; no ODC involved), as
    vLLM takes them (LoRA merged)."""
    from odc_hf.fsdp.state_dict import full_tensor_on_cpu
    from odc_hf.integrations.vllm_weights import LoraMerge, vllm_weights

    model = trainer.accelerator.unwrap_model(trainer.model)
    device = trainer.accelerator.device  # LoRA: merged where the sync merges (the same matmul kernel)
    named = [(n, full_tensor_on_cpu(p).to(device)) for n, p in model.named_parameters()]
    configs = getattr(model, "peft_config", None)
    lora = LoraMerge.from_config(configs[model.active_adapter], model.active_adapter) if configs else None
    weights = dict(vllm_weights(named, lora))
    return {name: t.cpu() for name, t in (weights if STAND_IN else vllm_layout(weights)).items()}


def add_checks(trainer, record: dict) -> None:
    """Read the engine back after every sync and record every generation's completions (a subclass of the engine
    object's class, TRL's or ODC's)."""
    generation = trainer.vllm_generation
    base = type(generation)

    class Checked(base):
        def sync_weights(self):
            super().sync_weights()
            expected = trainer_weights(trainer)
            result = self.llm.apply_model(lambda model: compare(model, expected))[0]
            record["syncs"].append({"global_step": trainer.state.global_step, **result})

        def generate(self, prompts, images, num_generations, profiler=None):
            out = super().generate(prompts, images, num_generations, profiler)
            record["rollouts"].append([list(ids) for ids in out[1]])
            return out

    generation.__class__ = Checked


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_model(out: Path, rank: int) -> str:
    """The tiny model (head_dim 64) and the offline tokenizer, saved for vLLM; returns the path."""
    from odc_hf.testing.data import TINY_HEAD_DIM_64, default_tokenizer, tiny_qwen2_model

    path = out / f"model_rank{rank}"  # one copy per rank: no barrier needed before the trainer starts
    tokenizer = default_tokenizer()
    tiny_qwen2_model(tokenizer, seed=0, max_position_embeddings=1024, **TINY_HEAD_DIM_64).save_pretrained(
        path
    )
    tokenizer.save_pretrained(path)
    return str(path)


def run(
    trainer_name: str, out: Path, *, steps: int, sleep: bool, peft: bool, memory: float, length: int
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOConfig, ODCGRPOTrainer
    from odc_hf.integrations.vllm_version import prefer_vllm_environment

    prefer_vllm_environment()  # TRL's run too: the same engine environment for both trainers
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    path = build_model(out, rank)
    if STAND_IN:
        import vllm_fake
        from transformers import AutoConfig

        vllm_fake.install(AutoConfig.from_pretrained(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    config_class = ODCGRPOConfig if trainer_name == "odc" else GRPOConfig
    args = config_class(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=length, learning_rate=1e-3, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", seed=0, logging_steps=1,
        save_strategy="no", report_to="none", bf16=False, use_cpu=STAND_IN, disable_tqdm=True, temperature=1.0,
        gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32}, use_vllm=True,
        vllm_mode="colocate", vllm_gpu_memory_utilization=memory, vllm_enable_sleep_mode=sleep,
        vllm_max_model_length=1024,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": f"Compute {a} + {3 * a % 17} = "} for a in range(64)])
    kwargs = dict(
        model=path, reward_funcs=digit_reward, args=args, train_dataset=data, processing_class=tokenizer
    )
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
    torch.manual_seed(0)  # TRL draws LoRA weights in __init__
    if trainer_name == "odc":
        trainer = ODCGRPOTrainer(**kwargs, odc_config=ODCConfig(timeout_s=300, log_timeline=False))
    else:
        trainer = GRPOTrainer(**kwargs)
    record = {"syncs": [], "rollouts": []}
    add_checks(trainer, record)
    trainer.train()
    result = {
        **record,
        "history": [h for h in trainer.state.log_history if "loss" in h],
        "world": trainer.accelerator.num_processes,
        "device": str(trainer.accelerator.device),
        "versions": {n: _version(n) for n in ("vllm", "torch", "trl", "transformers")},
        "env": {
            k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER")
        },
        "sync_seconds": getattr(trainer.vllm_generation, "odc_sync_seconds", None),
        "odc": trainer.odc.describe() if getattr(trainer, "odc", None) is not None else None,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trainer", choices=["odc", "trl"])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sleep", action="store_true", help="vllm_enable_sleep_mode=True")
    p.add_argument(
        "--peft", action="store_true", help="LoRA r=8 on q_proj, v_proj (merged into vLLM's weights)"
    )
    p.add_argument(
        "--gpu_memory_utilization", type=float, default=0.2, help="vLLM's share of the GPU, per engine"
    )
    p.add_argument("--max_completion_length", type=int, default=64)
    p.add_argument("--stand_in", action="store_true", help="CPU: tests/vllm_fake.py's engine instead of vLLM")
    a = p.parse_args(argv)
    global STAND_IN
    STAND_IN = a.stand_in
    run(
        a.trainer,
        a.out,
        steps=a.steps,
        sleep=a.sleep,
        peft=a.peft,
        memory=a.gpu_memory_utilization,
        length=a.max_completion_length,
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    main()
