"""``ODCGRPOTrainer(use_vllm=True, vllm_mode="colocate")`` wired to TRL's own vLLM generation, on 2 CPU ranks with a
stand-in engine (odc_hf/testing/vllm_fake.py: TRL builds it where it would build vLLM's ``LLM``; it has vLLM's stacked Qwen2
layout and ``load_weights`` contract, a forward of its own, and starts from its own random weights). What runs is
TRL's ``VLLMGeneration`` (engine arguments, generation, sleep mode, the ``_last_loaded_step`` bookkeeping) and TRL's
importance-sampling correction and metrics, with ODC's weight sync (``ODCWeightSync``: whole parameters from ODC's
published shards, vLLM's names, LoRA merged) and ODC's rollout balancing and microbatches.

Asserted: one sync per optimizer step, before that step's generation (sleep mode: after waking the weights); the
weights the engine generated with equal, bit for bit, what it must hold computed without odc_hf's sync code (the
trainer's parameters when the step starts, LoRA merged by peft's own ``merge_and_unload()`` on a CPU copy, stacked as
vLLM stacks them: tests/support/vllm_runs.py ``reference_weights``), and none of them was already there before the first sync;
the engine generated with those weights (TRL's ``sampling/sampling_logp_difference/max``, the trainer's
log-probabilities of the sampled tokens against the engine's, stays at float noise, < 1e-4, while a run whose sync is
switched off exceeds 1e-1 at its first step); each rank's engine generated its own rank's prompts; losses and gradient
norms equal TRL's GRPOTrainer's on the same rollouts; every metric TRL logs is logged; the engine got TRL's colocate
arguments and odc_hf's environment. Refused before anything is built: ``vllm_mode="server"``, tensor-parallel
engines, an untested vLLM.

What only a GPU can check (tests/gpu/test_grpo_vllm_gpu.py): vLLM's own ``load_weights`` and kernels, its sampler and
sleep mode's memory, and the two engines of two ranks sharing one GPU. The GPU test's runner and checks run on CPU in
tests/grpo/test_vllm_runs_stand_in.py.
"""

from __future__ import annotations

import pytest
from vllm_runs import compare, digit_reward, prompt_problems, reference_weights

from odc_hf.testing import run_ranks
from odc_hf.testing.data import make_eos_prone

STEPS = 3
ENV = {
    "ACCELERATE_USE_CPU": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
IS_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max")  # fmt: skip
NOT_COMPARED = ("step", "epoch", "learning_rate", "step_time")


def _train(rank: int, world: int, out: str, trainer_name: str, *, sleep: bool = False, peft: bool = False,
           is_mode: str = "token_truncate", sync: bool = True, steps: int = STEPS) -> dict:  # fmt: skip
    import os

    import torch
    from datasets import Dataset
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOTrainer
    from odc_hf.testing import vllm_fake
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    torch.set_num_threads(1)
    tokenizer = default_tokenizer()
    tokenizer.padding_side = "left"
    model = tiny_qwen2_model(tokenizer, seed=0)
    make_eos_prone(model)  # completions of varied lengths: a loss that is not zero up to rounding
    fake = vllm_fake.install(model.config)
    args = GRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=12, learning_rate=1e-2, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", seed=0, logging_steps=1,
        save_strategy="no", report_to="none", bf16=False, use_cpu=True, disable_tqdm=True, temperature=1.0,
        gradient_checkpointing=False, use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=sleep,
        vllm_importance_sampling_mode=is_mode,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": f"Compute {a} + {3 * a % 17} = "} for a in range(64)])
    kwargs = dict(
        model=model, reward_funcs=digit_reward, args=args, train_dataset=data, processing_class=tokenizer
    )
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
    snapshots = []

    class Snapshot(
        TrainerCallback
    ):  # the trainer's parameters when each step starts: what its sync must load
        def on_step_begin(self, args, state, control, **kw):
            snapshots.append({n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                              for n, p in trainer.model.named_parameters()})  # fmt: skip

    torch.manual_seed(0)
    if trainer_name == "odc":
        trainer = ODCGRPOTrainer(**kwargs, odc_config=ODCConfig(timeout_s=60, log_timeline=False))
    else:
        trainer = GRPOTrainer(**kwargs)
    trainer.add_callback(Snapshot())
    engine = fake.instances[-1]
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    if not sync:  # negative control: the engine keeps its own weights
        trainer.vllm_generation.sync_weights = lambda: None
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = unwrapped.peft_config[unwrapped.active_adapter] if peft else None
    expected = [reference_weights(s, peft_config=peft_config, model_config=model.config) for s in snapshots]
    result = {
        "events": engine.events,
        "llm": {
            k: engine.kwargs.get(k)
            for k in (
                "distributed_executor_backend",
                "seed",
                "logprobs_mode",
                "enable_sleep_mode",
                "tensor_parallel_size",
            )
        },  # fmt: skip
        "history": [h for h in trainer.state.log_history if "loss" in h],
        "env": {
            k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER")
        },
        # the engine's own starting weights against the first step's expected ones: names already equal
        "initially_equal": [n for n, t in expected[0].items() if n in initial and torch.equal(initial[n], t)],
        # what the engine generated with, against what it must hold at each step
        "generated_with": [compare(w.items(), e) for w, e in zip(engine.weights_at_generate, expected)],
        "generations": len(engine.weights_at_generate),
        "prompts": [g["prompts"] for g in engine.generated],
        "rollouts": [g["completions"] for g in engine.generated],
    }
    if trainer_name == "odc":
        result["sync_seconds"] = len(trainer.vllm_generation.odc_sync_seconds)
        result["odc_steps"] = [list(s.microbatches) for s in trainer.odc_stats.steps]
        for handle in (trainer.odc, trainer.odc_ref):
            if handle is not None:
                handle.close()
    torch.distributed.barrier()
    return result


def _entry(rank, world, out):
    return {name: _train(rank, world, f"{out}/{name}", trainer, **options)
            for name, (trainer, options) in RUNS.items()}  # fmt: skip


# the LoRA + sleep run also takes TRL's sequence-level importance-sampling ratio ((B, 1) per generation batch); the
# last run is the negative control: ODC's trainer with its sync switched off, one step
RUNS = {"odc": ("odc", {}), "odc_lora_sleep": ("odc", {"sleep": True, "peft": True, "is_mode": "sequence_mask"}),
        "trl": ("trl", {}), "odc_no_sync": ("odc", {"sync": False, "steps": 1})}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_vllm")
    return run_ranks(_entry, 2, str(out), env=ENV, timeout_s=300)


def _per_step(result) -> list:
    return [(h["step"], h.get("sampling/sampling_logp_difference/max")) for h in result["history"]]


def _weight_problems(result) -> list:
    return [(k, {key: c[key][:4] for key in ("unequal", "uncovered", "unfilled", "shapes") if c[key]}, c["max_abs"])
            for k, c in enumerate(result["generated_with"])
            if c["unequal"] or c["uncovered"] or c["unfilled"] or c["shapes"]]  # fmt: skip


def test_one_sync_per_step_loads_the_trainers_parameters_exactly(runs):
    for rank, per_rank in enumerate(runs):
        for name in ("odc", "odc_lora_sleep", "trl"):
            result = per_rank[name]
            if name != "trl":
                assert result["sync_seconds"] == STEPS, (name, result["events"])
            assert result["generations"] == STEPS, (name, result["events"])
            # every parameter the engine generated with, in vLLM's stacked layout, against peft's merge of the trainer's
            # parameters at the step's start, hand-stacked: bit for bit (TRL's own sync is held to the same check)
            assert _weight_problems(result) == [], (name, _weight_problems(result))
            assert result["initially_equal"] == [], (name, "the engine started with these of the trainer's weights: "
                                                     "the comparison cannot see a sync that skips them")  # fmt: skip
            assert result["llm"] == {"distributed_executor_backend": "external_launcher", "seed": rank,
                                     "logprobs_mode": "processed_logprobs", "enable_sleep_mode": name == "odc_lora_sleep",
                                     "tensor_parallel_size": 1}  # fmt: skip
            assert result["env"] == {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_USE_FLASHINFER_SAMPLER": "0",
            }
        assert runs[rank]["odc"]["events"] == ["apply_model", "reset_prefix_cache", "generate"] * STEPS
        # sleep mode as TRL runs it: level 2 after building and after every generation; the sync wakes the weights
        assert runs[rank]["odc_lora_sleep"]["events"] == ["sleep:2"] + [
            "wake_up:weights", "apply_model", "reset_prefix_cache", "wake_up:kv_cache", "generate", "sleep:2"
        ] * STEPS  # fmt: skip
    assert len(runs[0]["odc"]["odc_steps"]) == STEPS


def test_without_the_sync_the_engine_keeps_its_own_weights_and_the_checks_fail(runs):
    # the negative control of the two tests around it: the same comparison finds every parameter unequal
    for per_rank in runs:
        result = per_rank["odc_no_sync"]
        assert result["events"] == ["generate"], result["events"]
        (problems,) = result["generated_with"]
        assert len(problems["unequal"]) == problems["compared"] == 16, problems  # every parameter of the engine


def test_the_engine_generates_with_the_synced_weights(runs):
    # TRL's sampling_logp_difference/max: |trainer log-prob - engine log-prob| of the sampled tokens, max over the
    # step's tokens of every rank. Same weights, fp32, the engine's own unpadded forward vs the trainer's packed or
    # padded rows: measured <= 1.9e-6; bound 1e-4. Without the sync (the engine's own initial weights) it is measured
    # at 1.44 in the first step; bound 1e-1 there.
    for name in ("odc", "odc_lora_sleep", "trl"):
        steps = _per_step(runs[0][name])
        assert [s for s, _ in steps] == list(range(1, STEPS + 1)), (name, steps)
        assert all(d is not None and d < 1e-4 for _, d in steps), (name, steps)
    ((step, unsynced),) = _per_step(runs[0]["odc_no_sync"])
    assert step == 1 and unsynced > 1e-1, unsynced


def test_each_ranks_engine_generates_its_own_ranks_prompts(runs):
    # both ranks' engines are built alike; had one generated the other's prompts (or both the whole batch), a
    # prompt would appear on both ranks in a generation
    for name in ("odc", "odc_lora_sleep"):
        assert prompt_problems([per_rank[name] for per_rank in runs]) == [], name
    assert prompt_problems([runs[0]["odc"], runs[0]["odc"]]), "the check cannot fail"


def test_same_rollouts_as_trls_grpo_trainer_give_the_same_step(runs):
    # Both trainers start from the same weights and their engines from the same seeds (TRL's seed=rank), so the first
    # step's completions are the same; later steps sample from weights that agree to float rounding, so they usually
    # coincide too (measured: all 3 steps). Where a step's completions are the same on both ranks, the step must be
    # TRL's (fp32, other microbatches and kernels: ODC's packed rows vs TRL's padded ones):
    # - gradient norms: measured <= 2.9e-5 relative, bound 1e-4 (as tests/grpo/test_grpo_parity.py);
    # - losses (-0.02 to -0.06 here: the completions' lengths vary, so the group-centred advantages do not cancel;
    #   with the equal lengths of a model that never stops they were ~1e-7, rounding noise): measured <= 5.5e-7
    #   relative (2.2e-8 absolute), bound 1e-5 relative. A lost microbatch or another normaliser moves a loss by 10%.
    odc, trl = [r["odc"] for r in runs], [r["trl"] for r in runs]
    same = [i for i in range(STEPS) if all(o["rollouts"][i] == t["rollouts"][i] for o, t in zip(odc, trl))]
    assert 0 in same, "step 1's completions differ: the engines did not start from the same weights and seed"
    lengths = {len(c) for rank in odc for c in rank["rollouts"][0]}
    assert len(lengths) > 2, lengths  # the model ends completions early: the loss is not ~0
    for i in same:
        a, b = odc[0]["history"][i], trl[0]["history"][i]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (i, a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0.0), (i, a, b)


def test_every_metric_trl_logs_with_vllm_is_logged(runs):
    trl_keys = set(runs[0]["trl"]["history"][0]) - set(NOT_COMPARED)
    assert set(IS_KEYS) <= trl_keys
    for name in ("odc", "odc_lora_sleep"):
        for h in runs[0][name]["history"]:
            assert trl_keys <= set(h), (name, sorted(trl_keys - set(h)))
            assert h["odc/vllm_sync_s"] >= 0.0


def _refusal(tmp_path, **changes):
    from trl import GRPOConfig

    from odc_hf import ODCGRPOTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none",
                      bf16=False, use_cpu=True, max_completion_length=8, use_vllm=True, **changes)  # fmt: skip
    import datasets

    ODCGRPOTrainer(model=tiny_qwen2_model(tokenizer), reward_funcs=digit_reward, args=args,
                   train_dataset=datasets.Dataset.from_list([{"prompt": "1+1="}] * 8), processing_class=tokenizer)  # fmt: skip


def test_server_mode_and_tensor_parallel_engines_are_refused_before_anything_is_built(tmp_path, monkeypatch):
    # vllm is not installed here: had the check come after TRL's constructor, TRL's own ImportError (or, in server
    # mode, its wait for a server) would come first
    with pytest.raises(ValueError, match="vllm_mode='server'.*Use vllm_mode='colocate'"):
        _refusal(tmp_path, vllm_mode="server")
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2"):
        _refusal(tmp_path, vllm_mode="colocate", vllm_tensor_parallel_size=2)
    with pytest.raises(ImportError, match=r"odc_hf\[vllm\]"):
        _refusal(tmp_path, vllm_mode="colocate")
    # vespo sums the log of TRL's importance ratio over every column, padding included, where TRL's ratio is that of
    # no difference: bounds that exclude 1 make it depend on TRL's padded width. Refused; bounds around 1 pass on
    # (to the missing vLLM).
    with pytest.raises(ValueError, match=r"loss_type='vespo' with a token-level vLLM importance ratio whose bounds "
                                         r"exclude 1 \(vllm_importance_sampling_clip_min=1.5"):  # fmt: skip
        _refusal(tmp_path, vllm_mode="colocate", loss_type="vespo", vllm_importance_sampling_mode="token_truncate",
                 vllm_importance_sampling_clip_min=1.5)  # fmt: skip
    with pytest.raises(ImportError, match=r"odc_hf\[vllm\]"):
        _refusal(tmp_path, vllm_mode="colocate", loss_type="vespo", vllm_importance_sampling_mode="token_mask",
                 vllm_importance_sampling_clip_min=0.5)  # fmt: skip


def test_vllm_version_policy_and_environment():
    from odc_hf.integrations.upstream import vllm as vllm_version

    assert vllm_version.check_vllm("0.26.0+cu130") == "0.26.0+cu130"  # the version policy: test_version_policy.py
    environ = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert vllm_version.prefer_vllm_environment(environ, flashinfer=False) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"
    }
    assert environ == {
        "VLLM_USE_FLASHINFER_SAMPLER": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }  # theirs kept
    environ = {}
    vllm_version.prefer_vllm_environment(environ, flashinfer=True)
    assert environ == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # FlashInfer importable: its sampler stays on
    vllm_version.prefer_vllm_environment(environ, flashinfer=False)
    assert environ == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def test_trl_vllm_surfaces_the_sync_relies_on():
    # TRL 1.16: the engine is built by VLLMGeneration._init_vllm from the accelerator's local rank; generate() re-syncs
    # through self.sync_weights() while the weights sleep; GRPOTrainer syncs once per optimizer step (_last_loaded_step)
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.grpo_trainer import GRPOTrainer

    init = inspect.getsource(VLLMGeneration._init_vllm)
    assert 'os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)' in init
    assert "self.llm = LLM(" in init and 'distributed_executor_backend="external_launcher"' in init
    generate = inspect.getsource(VLLMGeneration.generate)
    assert "self._llm_weights_sleeping" in generate and "self.sync_weights()" in generate
    turn = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "if self.state.global_step != self._last_loaded_step:" in turn
    assert "self.vllm_generation.sync_weights()" in turn


def test_in_the_shared_gpu_mode_the_engine_gets_the_ranks_gpu_as_its_local_rank(monkeypatch):
    """TRL sets LOCAL_RANK to accelerate's local process index before building vLLM's LLM, and vLLM takes it as its
    GPU: in the shared-GPU mode that index is the rank's GPU (localize_rank), e.g. 0 for both ranks of one GPU."""
    import inspect

    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    from odc_hf.integrations.launch import shared_gpu

    assert 'os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)' in inspect.getsource(
        VLLMGeneration._init_vllm)  # TRL 1.16's rule this relies on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    environ = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    shared_gpu.localize_rank(environ)
    assert environ["LOCAL_RANK"] == "0"
    environ = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a GPU per rank: unchanged
    shared_gpu.localize_rank(environ)
    assert environ["LOCAL_RANK"] == "1"


def test_odc_grpo_config_with_vllm_sets_the_environment(tmp_path, monkeypatch):
    import os

    from odc_hf import ODCGRPOConfig

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    ODCGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # only with use_vllm
    ODCGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"  # FlashInfer is not installed here

