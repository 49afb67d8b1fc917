"""GRPO with vLLM (colocate), for tests/gpu/test_grpo_vllm_gpu.py (vLLM on the GPU) and tests/grpo/test_vllm_runs_stand_in.py
(the same runs on CPU with odc_hf/testing/vllm_fake.py's engine): ODCGRPOTrainer or TRL's GRPOTrainer, the same tiny Qwen2
(head_dim 64), prompts, reward and seed.

    python tests/support/vllm_runs.py odc OUT [--steps 3] [--sleep] [--peft] [--no_sync]     # one process
    python tests/support/vllm_runs.py trl OUT                                                # TRL's GRPOTrainer + vLLM
    accelerate launch --config_file accelerate_configs/odc.yaml --num_processes 2 tests/support/vllm_runs.py odc OUT
                                                       # two ranks (on a one-GPU machine they share it)

``--stand_in``: on CPU, odc_hf/testing/vllm_fake.py's engine in place of vLLM's (vLLM's stacked Qwen2 layout, its
``load_weights`` contract, a forward of its own). Both trainers run with odc_hf's vLLM environment
(``prefer_vllm_environment``).

The engine starts from OTHER weights than the trainer: the checkpoint saved for vLLM (``model_rank<r>``: the engine
loads it from that path, as TRL asks it to) is the trainer's initial model with every parameter perturbed (and the
final norm scaled by 5, so that generating from it gives log-probabilities far from the trainer's), while the trainer
gets the unperturbed model as an object. So a sync that leaves any parameter unwritten shows, at every step, frozen
LoRA base weights included. ``start`` records which engine parameters already equalled the trainer's first synced
weights before the first sync (read back from the engine; under sleep mode, whose level 2 discards the weights, from
the checkpoint it loaded): none, or the check below could not see a sync that writes nothing.

After every weight sync the engine's parameters are read back (``LLM.apply_model``) and compared with the weights it
must hold, computed here without odc_hf's sync code: the trainer's own parameters at that moment, each gathered
through the CPU (``odc_hf.fsdp.state_dict.full_tensor_on_cpu``: torch's DTensor gather over a CPU mesh, no ODC), LoRA
merged by peft itself (``merge_and_unload()`` on a CPU copy of the model holding them), stacked here as vLLM's Qwen2
stacks them (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up): equal or not in the engine's dtype, one rounding
step of it or more, and the largest difference. An engine parameter of another shape than expected is a mismatch
(the one allowance: embedding / head rows padded to vLLM's multiple of 64, the padding zero), never cut to fit.

``--no_sync``: the trainer's sync is skipped (the checks still run): the negative control of the checks and of
TRL's ``sampling/sampling_logp_difference``. ``--eos_prone``: the model ends completions early (every token embedding
gets an offset in one coordinate, EOS's a larger one), so completion lengths vary and the GRPO loss is not zero up to
rounding (with equal lengths the group-centred advantages cancel).

Writes ``OUT/rank<r>.json``: ``history`` (logged steps), ``syncs``, ``start``, ``rollouts`` and ``prompts`` (per
generation), ``world``, ``device``, ``versions``, ``sync_seconds`` (ODC), ``no_sync`` and the vLLM environment
variables. The checks of these records (``sync_problems``, ...) are here too, for the GPU test and its CPU twin.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64  # vLLM pads embedding and head rows to a multiple of 64 (zero rows) at tensor parallel 1
GENERATIONS = 4  # num_generations of run(): completions per prompt
TOKEN_IS = "token_truncate"  # TRL's token-level truncated importance sampling (--importance_sampling_mode)
# What TRL 1.16's GRPOTrainer logs with vLLM and this reward (measured with TRL's own trainer on the CPU stand-in
# engine, tests/grpo/test_grpo_vllm.py): the world-2 runs, which have no TRL run beside them, are checked against these.
TRL_VLLM_KEYS = (
    "loss", "grad_norm", "num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
    "completions/max_terminated_length", "rewards/digit_reward/mean", "rewards/digit_reward/std", "reward",
    "reward_std", "frac_reward_zero_std", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max",
)  # fmt: skip


def digit_reward(completions, **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]


# -- the weights vLLM must hold, computed without odc_hf's sync code ------------------------------------------------
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
        missing = [p for p in order if p not in parts]
        if missing:
            raise ValueError(f"{name}: the trainer has no {missing} to stack")
        out[name] = torch.cat([parts[p] for p in order], 0)
    return out


def reference_weights(named: dict, *, peft_config=None, model_config=None) -> dict:
    """vLLM's weights for the trainer's whole parameters ``named`` (``named_parameters()`` names): without LoRA the
    parameters themselves; with LoRA (``peft_config``), peft's own ``merge_and_unload()`` of a CPU copy of the model
    (``model_config``) holding them; then :func:`vllm_layout`."""
    import torch

    named = {n.replace("_checkpoint_wrapped_module.", ""): t.detach().cpu() for n, t in named.items()}
    if peft_config is not None:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        dtype = next(iter(named.values())).dtype
        with torch.device("cpu"):
            skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(model_config)).to(dtype)
        peft_model = get_peft_model(skeleton, copy.deepcopy(peft_config))
        missing, unexpected = peft_model.load_state_dict(named, strict=False)
        tied = {n for n in missing if n.endswith("lm_head.weight") and model_config.tie_word_embeddings}
        if unexpected or set(missing) - tied:
            raise ValueError(f"the peft copy does not take the trainer's names: missing {sorted(set(missing) - tied)}"
                             f", unexpected {unexpected}")  # fmt: skip
        named = {n: p.detach() for n, p in peft_model.merge_and_unload().named_parameters()}
    return vllm_layout(named)


def _padding_ok(name: str, got, want) -> bool:
    """vLLM's vocabulary padding: embedding / head rows rounded up to a multiple of 64, the extra rows zero."""
    rows = -(-want.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    return (name.endswith(VOCAB_ROWS) and got.shape[1:] == want.shape[1:] and got.shape[0] == rows
            and not bool(got[want.shape[0]:].any()))  # fmt: skip


def compare(engine_params, expected: dict) -> dict:
    """Every engine parameter (``(name, tensor)`` pairs) against ``expected`` (CPU tensors, fp32): ``unequal`` (not
    bitwise equal in the engine's dtype), ``beyond_ulp`` (more than one rounding step of that dtype off, or another
    shape), ``uncovered`` (engine parameters nothing is expected for), ``unfilled`` (expected names the engine lacks),
    ``shapes`` (shape mismatches other than vLLM's zero vocabulary padding), ``max_abs``."""
    import torch

    worst, unequal, beyond_ulp, uncovered, shapes, seen = 0.0, [], [], [], [], set()
    for name, param in engine_params:
        seen.add(name)
        want = expected.get(name)
        if want is None:
            uncovered.append(name)
            continue
        got = param.detach()
        if got.shape != want.shape:
            if not _padding_ok(name, got, want):
                shapes.append(f"{name}: engine {tuple(got.shape)} vs expected {tuple(want.shape)}")
                unequal.append(name)
                beyond_ulp.append(name)
                continue
            got = got[: want.shape[0]]
        exact = want.to(got.device).float()
        cast = exact.to(got.dtype)
        worst = max(worst, float((got.float() - exact).abs().max()))
        if not torch.equal(got, cast):
            unequal.append(name)
            # one rounding step of the engine's dtype around the expected value (a merge computed elsewhere)
            ulp = torch.finfo(got.dtype).eps * exact.abs().clamp(min=torch.finfo(got.dtype).tiny)
            if bool(((got.float() - exact).abs() > ulp).any()):
                beyond_ulp.append(name)
    return {"max_abs": worst, "unequal": unequal, "beyond_ulp": beyond_ulp, "uncovered": uncovered,
            "unfilled": sorted(set(expected) - seen), "shapes": shapes, "compared": len(expected)}  # fmt: skip


def compare_engine(engine_model, expected: dict) -> dict:
    """:func:`compare` run in the engine (``LLM.apply_model``)."""
    return compare(engine_model.named_parameters(), expected)


def already_equal(start: dict, expected: dict) -> list[str]:
    """The names whose starting engine tensor (``start``, padded rows allowed) already equals ``expected``."""
    import torch

    equal = []
    for name, want in expected.items():
        got = start.get(name)
        if got is not None and got.shape[1:] == want.shape[1:] and got.shape[0] >= want.shape[0]:
            got = got[: want.shape[0]]
            if torch.equal(got.cpu(), want.to(got.dtype)):
                equal.append(name)
    return equal


# -- the runs -------------------------------------------------------------------------------------------------------
STAND_IN = False  # --stand_in: odc_hf/testing/vllm_fake.py's CPU engine
NO_SYNC = False  # --no_sync: the trainer's weight sync is skipped (negative control)


def trainer_weights(trainer) -> dict:
    """:func:`reference_weights` of the policy's whole parameters, each shard through the CPU (a collective on every
    rank; no ODC involved)."""
    from odc_hf.fsdp.state_dict import full_tensor_on_cpu

    model = trainer.accelerator.unwrap_model(trainer.model)
    named = {n: full_tensor_on_cpu(p) for n, p in model.named_parameters()}
    configs = getattr(model, "peft_config", None)
    if not configs:
        return reference_weights(named)
    return reference_weights(named, peft_config=configs[model.active_adapter],
                             model_config=model.get_base_model().config)  # fmt: skip


def _engine_weights(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def add_checks(trainer, record: dict, checkpoint: Path, out: Path | None = None) -> None:
    """Read the engine back after every sync, record every generation's prompts and completions and the engine's
    starting weights (a subclass of the engine object's class, TRL's or ODC's). With ``out``, each sync's engine
    weights and the trainer's (in the engine's layout, before the engine's cast) go to ``out/sync<k>.pt``: two runs'
    files tell how far their trainers and engines are apart."""
    generation = trainer.vllm_generation
    base = type(generation)
    if generation.enable_sleep_mode:  # level 2 discarded the engine's weights: what it loaded is the checkpoint
        from safetensors.torch import load_file

        start = vllm_layout({n: t for f in sorted(checkpoint.glob("*.safetensors")) for n, t in load_file(f).items()})
        record["start"] = {"source": "checkpoint"}
    else:
        start = generation.llm.apply_model(_engine_weights)[0]
        record["start"] = {"source": "engine"}

    class Checked(base):
        def sync_weights(self):
            if not NO_SYNC:
                super().sync_weights()
            expected = trainer_weights(trainer)
            if "equal" not in record["start"]:
                record["start"].update(equal=already_equal(start, expected), compared=len(expected))
            result = self.llm.apply_model(functools.partial(compare_engine, expected=expected))[0]
            record["syncs"].append({"global_step": trainer.state.global_step, **result})
            if out is not None:
                import torch

                engine = self.llm.apply_model(_engine_weights)[0]
                torch.save({"engine": engine, "trainer": expected}, out / f"sync{len(record['syncs'])}.pt")

        def generate(self, prompts, images, num_generations, profiler=None):
            out = super().generate(prompts, images, num_generations, profiler)
            record["prompts"].append([list(ids) for ids in out[0]])
            record["rollouts"].append([list(ids) for ids in out[1]])
            return out

    generation.__class__ = Checked


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_model(out: Path, rank: int, *, eos_prone: bool = False):
    """The tiny model (head_dim 64) and the offline tokenizer: the checkpoint the engine loads (the model perturbed,
    see the module docstring), saved under ``out``; returns its path and the trainer's model (unperturbed, from that
    path: TRL builds the engine from the trainer model's ``name_or_path``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from odc_hf.testing.data import TINY_HEAD_DIM_64, default_tokenizer, make_eos_prone, tiny_qwen2_model

    path = out / f"model_rank{rank}"  # one copy per rank: no barrier needed before the trainer starts
    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, seed=0, max_position_embeddings=1024, **TINY_HEAD_DIM_64)
    if eos_prone:
        make_eos_prone(model)
    engine_start = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in engine_start.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
        engine_start.model.norm.weight.mul_(5.0)
    engine_start.save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer_model.load_state_dict(model.state_dict())
    return path, trainer_model


def run(trainer_name: str, out: Path, *, steps: int, sleep: bool, peft: bool, memory: float, length: int,
        eos_prone: bool = False, importance_sampling: bool = True, importance_sampling_mode: str | None = None,
        loss_type: str = "dapo") -> dict:  # fmt: skip
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOConfig, ODCGRPOTrainer
    from odc_hf.integrations.upstream.vllm import prefer_vllm_environment

    prefer_vllm_environment()  # TRL's run too: the same engine environment for both trainers
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    path, model = build_model(out, rank, eos_prone=eos_prone)
    if STAND_IN:
        from odc_hf.testing import vllm_fake

        vllm_fake.install(model.config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    config_class = ODCGRPOConfig if trainer_name == "odc" else GRPOConfig
    args = config_class(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=GENERATIONS, max_completion_length=length, learning_rate=1e-3, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type=loss_type, seed=0, logging_steps=1,
        save_strategy="no", report_to="none", bf16=False, use_cpu=STAND_IN, disable_tqdm=True, temperature=1.0,
        gradient_checkpointing=False, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=memory,
        vllm_enable_sleep_mode=sleep, vllm_max_model_length=1024,
        vllm_importance_sampling_correction=importance_sampling,
        **({"vllm_importance_sampling_mode": importance_sampling_mode} if importance_sampling_mode else {}),
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": f"Compute {a} + {3 * a % 17} = "} for a in range(64)])
    kwargs = dict(
        model=model, reward_funcs=digit_reward, args=args, train_dataset=data, processing_class=tokenizer
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
    record = {"syncs": [], "rollouts": [], "prompts": []}
    add_checks(trainer, record, path, out if trainer.accelerator.num_processes == 1 else None)
    trainer.train()
    from odc_hf.integrations.launch.exit_cleanup import destroy_gloo_group_at_exit

    destroy_gloo_group_at_exit()  # TRL's trainer too: a gloo worker must not outlive the interpreter (see its docstring)
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
        "no_sync": NO_SYNC,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    return result


# -- checks of the records (the GPU test and its CPU twin) ----------------------------------------------------------
def sync_problems(run: dict, steps: int, *, merged: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with ``run``'s syncs: not one per optimizer step, an engine parameter left unexpected, unwritten
    or of another shape, or unequal to the expected weights (``merged``: LoRA-merged projections, computed by peft
    on the CPU: one rounding step of the engine's dtype allowed there)."""
    problems = []
    syncs = run["syncs"]
    if [s["global_step"] for s in syncs] != list(range(steps)):
        problems.append(f"syncs at steps {[s['global_step'] for s in syncs]}, expected one per step 0..{steps - 1}")
    for s in syncs:
        for key in ("uncovered", "unfilled", "shapes", "beyond_ulp"):
            if s[key]:
                problems.append(f"step {s['global_step']}: {key} {s[key][:6]}")
        off = [n for n in s["unequal"] if not any(f".{m}." in n for m in merged)]
        if off:
            problems.append(f"step {s['global_step']}: unequal {off[:6]} (max |diff| {s['max_abs']:.3g})")
    return problems


def start_problems(run: dict) -> list[str]:
    """The engine's starting weights must differ from the trainer's first synced ones in every parameter."""
    start = run["start"]
    if start.get("compared", 0) == 0:
        return [f"no starting weights compared: {start}"]
    return [f"the engine started with the trainer's {n}" for n in start["equal"]]


def key_problems(run: dict, keys, steps: int) -> list[str]:
    problems = []
    if [h["step"] for h in run["history"]] != list(range(1, steps + 1)):
        problems.append(f"logged steps {[h['step'] for h in run['history']]}")
    for h in run["history"]:
        missing = sorted(set(keys) - set(h))
        if missing:
            problems.append(f"step {h['step']}: missing {missing}")
    return problems


def prompt_problems(ranks: list[dict]) -> list[str]:
    """Each rank's engine generated its own rank's prompts: per generation, no prompt on two ranks."""
    problems = []
    for step, per_rank in enumerate(zip(*(r["prompts"] for r in ranks))):
        sets = [{tuple(p) for p in prompts} for prompts in per_rank]
        shared = set.intersection(*sets)
        if shared or not all(sets):
            problems.append(f"generation {step}: {len(shared)} prompts on every rank, sizes {[len(s) for s in sets]}")
    return problems


def sync_distance(a: Path, b: Path, syncs: int) -> list[dict]:
    """Per sync of two world-1 runs (their ``sync<k>.pt``): how far their trainers' weights are apart (largest
    element difference relative to the tensor's largest element, and the difference's norm relative to the weights'
    norm, over all parameters) and how many elements of their engines' weights differ."""
    import torch

    out = []
    for k in range(1, syncs + 1):
        x, y = torch.load(a / f"sync{k}.pt"), torch.load(b / f"sync{k}.pt")
        diffs = {n: x["trainer"][n].double() - y["trainer"][n].double() for n in y["trainer"]}
        largest = max(float(d.abs().max() / y["trainer"][n].double().abs().max().clamp(min=1e-30))
                      for n, d in diffs.items())  # fmt: skip
        norm = (sum(float(d.pow(2).sum()) for d in diffs.values())
                / max(sum(float(t.double().pow(2).sum()) for t in y["trainer"].values()), 1e-300)) ** 0.5  # fmt: skip
        engine = sum(int((x["engine"][n] != y["engine"][n]).sum()) for n in y["engine"])
        out.append({"sync": k, "trainer_largest": largest, "trainer_norm": norm, "engine_elements_differing": engine,
                    "engine_elements": sum(t.numel() for t in y["engine"].values())})  # fmt: skip
    return out


def engine_noise_bound(a: dict, b: dict) -> float:
    """The largest |loss difference| of two runs' steps (logged metrics ``a``, ``b``) on the same completions whose
    engines hold different weights, under TRL's token-level truncated importance sampling (``TOKEN_IS``), dapo loss,
    one iteration per generation.

    The step's loss is a mean over its completion tokens of advantage x importance weight (the policy ratio is 1 in
    value), with the same advantages and tokens in both runs. A weight is exp(trainer log-prob - engine log-prob),
    truncated above; two runs' weights at a token differ by at most the larger ratio times the difference of their
    exponents, which is at most the sum of each run's |trainer - engine| log-prob difference there. Averaged over the
    tokens: |loss difference| <= max |advantage| x ratio max x (logged sampling_logp_difference/mean of both runs), with
    |advantage| <= sqrt(G - 1) for G completions standardised per prompt, plus 1e-6 for the two trainers' forward
    passes (the policy ratio's rounding)."""
    ratio = max(a["sampling/importance_sampling_ratio/max"], b["sampling/importance_sampling_ratio/max"])
    noise = a["sampling/sampling_logp_difference/mean"] + b["sampling/sampling_logp_difference/mean"]
    return (GENERATIONS - 1) ** 0.5 * ratio * noise + 1e-6


def loss_comparison(odc: dict, trl: dict, distances: list[dict], steps: list[int], *, rtol: float) -> dict:
    """ODC's and TRL's losses at ``steps`` (0-based, the same completions in both): equal within ``rtol`` where the
    engines held the same weights, within :func:`engine_noise_bound` where they did not. Returns the problems, the
    steps whose check can fail (bound or tolerance below the loss itself), and per such step the stale-loss control:
    whether the check fails on ODC's loss of another step (a trainer that logged a stale loss)."""
    problems, meaningful, controls = [], [], []
    for i in steps:
        a, b = odc["history"][i], trl["history"][i]
        exact = distances[i]["engine_elements_differing"] == 0
        allowed = rtol * abs(b["loss"]) if exact else engine_noise_bound(a, b)
        difference = abs(a["loss"] - b["loss"])
        if difference > allowed:
            problems.append(f"step {i + 1}: loss {a['loss']:.7g} vs TRL {b['loss']:.7g}, |difference| "
                            f"{difference:.3g} > {allowed:.3g} ({'same engines' if exact else 'engine noise bound'})")  # fmt: skip
        if allowed < abs(b["loss"]):
            meaningful.append(i)
            others = [odc["history"][j]["loss"] for j in range(len(odc["history"])) if j != i]
            controls.append(any(abs(o - b["loss"]) > allowed for o in others))
    return {"problems": problems, "meaningful": meaningful, "stale_loss_fails": controls}


def same_rollout_steps(a: dict, b: dict) -> list[int]:
    """The (0-based) steps whose completions were the same in both runs."""
    return [i for i, (x, y) in enumerate(zip(a["rollouts"], b["rollouts"])) if x == y]


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
    p.add_argument("--stand_in", action="store_true", help="CPU: odc_hf/testing/vllm_fake.py's engine instead of vLLM")
    p.add_argument("--no_sync", action="store_true", help="skip the trainer's weight sync (negative control)")
    p.add_argument("--eos_prone", action="store_true", help="a model that ends completions early")
    p.add_argument("--no_importance_sampling", action="store_true",
                   help="vllm_importance_sampling_correction=False (TRL's correction for the engine's sampling)")
    p.add_argument("--loss_type", default="dapo", help="GRPOConfig.loss_type")
    p.add_argument("--importance_sampling_mode", default=None,
                   help=f"vllm_importance_sampling_mode (default: TRL's; {TOKEN_IS} for engine_noise_bound)")
    a = p.parse_args(argv)
    global STAND_IN, NO_SYNC
    STAND_IN, NO_SYNC = a.stand_in, a.no_sync
    run(a.trainer, a.out, steps=a.steps, sleep=a.sleep, peft=a.peft, memory=a.gpu_memory_utilization,
        length=a.max_completion_length, eos_prone=a.eos_prone, importance_sampling=not a.no_importance_sampling,
        importance_sampling_mode=a.importance_sampling_mode, loss_type=a.loss_type)  # fmt: skip


if __name__ == "__main__":
    main()
