"""The model zoo (tests/support/zoo_runs.py): every family trains exactly as TRL trains it, or is refused by name.

For each family, ``ODCSFTTrainer`` (packed rows, odc_hf's attention: ``sdpa_varlen``, or ``eager_varlen`` where
transformers runs no SDPA) on 1 and on 2 CPU ranks (uneven microbatch counts, a rank with none in the first step)
against TRL's own ``SFTTrainer`` in one process (padded rows, the model's own attention and masks, its router loss),
on the same microbatches: per-step loss, gradient norm and, for Mixture-of-Experts families, the logged ``aux_loss``.
The families with more than plain attention also run ``ODCGRPOTrainer``'s packed layout against ``GRPOTrainer``.

Tolerance (fp32): the runs add the same per-token terms in other orders (packed vs padded rows, per-document vs
masked attention, two ranks' partial sums): measured <= 3.5e-7 relative for SFT and GRPO, <= 1.4e-6 for the GRPO
losses of MoE families (a loss of ~0.02 that is the difference of a ~0.1 router term and the policy term); the bound
is 1e-5. Negative controls: each variant switched off (window wider than every document, no soft-capping, sinks at
-1e4, router coefficient 0) moves TRL's own run by more than 100x that bound, so an ODC run that dropped the variant
would fail here; the measured movements are printed with ``-rP``.

``python tests/models/test_model_zoo.py`` rewrites the table in docs/models.md from a run of these checks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import zoo_runs
from zoo_runs import FAMILIES, largest_difference

from odc_hf.testing import run_ranks

RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
NAMES = list(FAMILIES)
CONTROLS = [(name, variant) for name, family in FAMILIES.items() for variant in family.variants]
GRPO_NAMES = [name for name, family in FAMILIES.items() if family.grpo]
PLAIN = ("qwen3_moe",)  # ODCTrainer (transformers' Trainer) with the model's own router loss


@pytest.fixture(scope="module")
def cpu_env():
    """ACCELERATE_USE_CPU for this module's in-process trainers, and the whole environment put back after them:
    their Accelerators set ACCELERATE_USE_FSDP and others, which later modules' launches would inherit (conftest's
    per-test guard snapshots the environment after module fixtures ran)."""
    before = dict(os.environ)
    os.environ["ACCELERATE_USE_CPU"] = "true"
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="module")
def zoo_dirs(tmp_path_factory) -> dict:
    return {"trl": tmp_path_factory.mktemp("zoo_trl"), "odc": tmp_path_factory.mktemp("zoo_odc")}


@pytest.fixture(scope="module")
def trl(zoo_dirs, cpu_env) -> dict[str, list[dict]]:
    out = zoo_dirs["trl"]
    return {name: zoo_runs.trl_run(name, out / name) for name in NAMES}


@pytest.fixture(scope="module")
def odc(zoo_dirs, cpu_env) -> dict[int, dict[str, dict]]:
    out = zoo_dirs["odc"]
    one = zoo_runs.odc_rank(0, 1, NAMES, str(out / "w1"), PLAIN)
    two = run_ranks(zoo_runs.odc_rank, 2, NAMES, str(out / "w2"), PLAIN, env={"ACCELERATE_USE_CPU": "true"},
                    timeout_s=900)  # fmt: skip
    assert two[0] == two[1] or all(two[0][n]["history"] == two[1][n]["history"] for n in NAMES)
    return {1: one, 2: two[0]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_odc_sft_trains_each_family_as_trl_does(name, world, trl, odc):
    run = odc[world][name]
    assert run["microbatches"] == zoo_runs.SCHEDULE[world], run["microbatches"]
    if "router_aux" in FAMILIES[name].variants:
        assert all("aux_loss" in h for h in run["history"] + trl[name])
    implementation = run["attention"]["implementation"]
    assert implementation in ("sdpa_varlen", "eager_varlen"), run["attention"]
    # one process reports torch's fp32 gradient norm, as TRL does; two ranks odc_hf's float64 one (zoo_runs.Fp64GradNorm)
    difference = largest_difference(run["history"], trl[name], renamed={"grad_norm": "grad_norm_fp64"} if world > 1 else None)
    print(f"{name} world {world} ({implementation}): {difference:.1e}")
    assert difference <= RTOL, (run["history"], trl[name])


UPDATE_RTOL = 1e-4
"""Per-parameter updates after 3 AdamW steps: |ours - TRL's| / |TRL's| per parameter tensor. AdamW divides by the root
of the second moment, so an element whose gradient is ~0 moves by rounding-sized noise on both sides (measured 0 to 7.9e-6
on 1 and 2 ranks, the largest on Qwen3's k_norm weights, printed with -rP); a variant switched off moves the updates by
0.77 or more (the controls below assert > 100x the bound)."""


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_odc_sft_updates_every_parameter_as_trl_does(name, world, trl, odc, zoo_dirs):
    difference, where = zoo_runs.update_difference(name, zoo_dirs["odc"] / f"w{world}" / name, zoo_dirs["trl"] / name)
    print(f"{name} world {world}: per-parameter update {difference:.1e} ({where})")
    assert difference <= UPDATE_RTOL, (difference, where)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", PLAIN)
def test_odc_trainer_keeps_the_models_own_router_loss_as_transformers_trainer_does(name, world, odc, tmp_path, cpu_env):
    # transformers' Trainer adds the model's whole router loss to each microbatch's loss (coef * aux, not divided by
    # the accumulation steps): ODCTrainer computes what that Trainer computes in one process on the same microbatches
    reference = zoo_runs.plain_run(name, tmp_path)["history"]
    ours = odc[world][f"plain:{name}"]["history"]
    difference = largest_difference(ours, reference, keys=("loss", "grad_norm"),
                                    renamed={"grad_norm": "grad_norm_fp64"} if world > 1 else None)  # fmt: skip
    print(f"{name} ODCTrainer world {world}: {difference:.1e}")
    assert difference <= RTOL, (ours, reference)


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", CONTROLS)
def test_each_variant_switched_off_changes_what_trl_trains(name, variant, trl, tmp_path, cpu_env, zoo_dirs):
    off = zoo_runs.trl_run(name, tmp_path / "off", off=variant)
    moved = largest_difference(off, trl[name], keys=("loss", "grad_norm"))
    updates, where = zoo_runs.update_difference(name, tmp_path / "off", zoo_dirs["trl"] / name)
    print(f"{name} without {variant}: {moved:.1e}; per-parameter update {updates:.1e} ({where})")
    assert moved > 100 * RTOL, (off, trl[name])
    assert updates > 100 * UPDATE_RTOL, (updates, where)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory, cpu_env) -> dict[str, tuple[dict, dict]]:
    out = tmp_path_factory.mktemp("zoo_grpo")
    return {name: (zoo_runs.grpo_run(name, out / name / "odc", "odc"), zoo_runs.grpo_run(name, out / name / "trl", "trl"))
            for name in GRPO_NAMES}  # fmt: skip


def grpo_difference(ours: dict, reference: dict) -> float:
    return largest_difference(ours["history"], reference["history"], ("loss", "grad_norm", "aux_loss", "entropy"))


@pytest.mark.slow
@pytest.mark.parametrize("name", GRPO_NAMES)
def test_odc_grpo_packed_layout_trains_each_family_as_trl_does(name, grpo):
    ours, reference = grpo[name]
    assert ours["packed"] and ours["microbatches"] == [[1]] * zoo_runs.GRPO_STEPS
    difference = grpo_difference(ours, reference)
    print(f"{name} GRPO ({ours['attention']['implementation']}): {difference:.1e}")
    assert difference <= RTOL, (ours["history"], reference["history"])


@pytest.mark.slow
def test_a_router_loss_beside_sapo_and_an_entropy_bonus_is_trls(tmp_path, cpu_env):
    """Qwen3-MoE, loss_type sapo with TRL's entropy bonus: TRL adds the router loss to its loss branch's result and
    leaves it out of its logged policy_loss; ODC scales sapo's branch and rebuilds policy_loss from the samples'
    weighted losses, so both must keep the router loss where TRL has it. Measured before the fix: policy_loss off by
    exactly the router term (-0.0230 against TRL's -0.1230 with dapo)."""
    name, extra = "qwen3_moe", {"loss_type": "sapo", "entropy_coef": 0.01}
    ours = zoo_runs.grpo_run(name, tmp_path / "odc", "odc", **extra)
    reference = zoo_runs.grpo_run(name, tmp_path / "trl", "trl", **extra)
    assert all("policy_loss" in h and h["aux_loss"] > 1.0 for h in reference["history"]), reference["history"]
    difference = largest_difference(ours["history"], reference["history"], ("loss", "grad_norm", "aux_loss", "policy_loss"))
    assert difference <= RTOL, (ours["history"], reference["history"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "gemma2", "mistral_window"])
def test_the_highest_entropy_tokens_with_an_entropy_bonus_train_as_trls(tmp_path, cpu_env, name):
    """TRL's top_entropy_quantile with its entropy bonus on families with a router loss (Qwen3-MoE, GPT-OSS: sinks
    too), soft-capping (Gemma 2) and a sliding window (Mistral): the pass before the step runs the family's own
    attention and router as the training forward does; loss, gradient norm, router loss, policy_loss as TRL's. The LM
    head is scaled by 20: token entropies then span 0.5-6.5 nats, neighbours >= 7e-5 apart (measured on 60 tokens of
    each family), where at 1 they span 8.3110-8.3118 with ties, and float noise picks the quantile's side."""
    extra = {"top_entropy_quantile": 0.5, "entropy_coef": 0.01, "logit_scale": 20.0}
    ours = zoo_runs.grpo_run(name, tmp_path / "odc", "odc", **extra)
    reference = zoo_runs.grpo_run(name, tmp_path / "trl", "trl", **extra)
    difference = largest_difference(ours["history"], reference["history"], ("loss", "grad_norm", "aux_loss", "policy_loss"))
    assert difference <= RTOL, (ours["history"], reference["history"])


GRPO_SPLIT_NAMES = [name for name in GRPO_NAMES if "router_aux" not in FAMILIES[name].variants]
"""Families whose GRPO loss does not depend on which rows share a microbatch (a router loss does: its per-expert token
shares are per microbatch, so odc_hf's own packing of the rows gives another one; those rows run one microbatch)."""


@pytest.fixture(scope="module")
def grpo_split(tmp_path_factory, cpu_env) -> dict[str, tuple[dict, dict]]:
    out = tmp_path_factory.mktemp("zoo_grpo_split")
    return {name: (zoo_runs.grpo_run(name, out / name / "odc", "odc", split=True),
                   zoo_runs.grpo_run(name, out / name / "trl", "trl", split=True)) for name in GRPO_SPLIT_NAMES}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", GRPO_SPLIT_NAMES)
def test_odc_grpo_packed_layout_with_several_microbatches_trains_each_family_as_trl_does(name, grpo_split):
    ours, reference = grpo_split[name]
    assert ours["packed"] and all(counts[0] > 2 for counts in ours["microbatches"]), ours["microbatches"]
    difference = grpo_difference(ours, reference)
    print(f"{name} GRPO, {ours['microbatches']} microbatches vs TRL's 2 per step: {difference:.1e}")
    assert difference <= RTOL, (ours["history"], reference["history"])


@pytest.mark.parametrize("name", list(zoo_runs.REFUSED))
def test_families_packed_rows_cannot_train_exactly_are_refused_by_name(name):
    from odc_hf.integrations.models.family import check_packable

    build, words = zoo_runs.REFUSED[name]
    model = build()
    with pytest.raises(ValueError, match=words) as refused:
        check_packable(model)
    assert model.config.get_text_config().model_type in str(refused.value) or model.config.model_type in str(refused.value)


def test_a_refused_family_stops_the_trainer_before_training(tmp_path, cpu_env):
    from datasets import Dataset

    from odc_hf import ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer

    model = zoo_runs.REFUSED["Qwen3-Next (qwen3_next), linear-attention layers"][0]()
    tokenizer = default_tokenizer()
    with pytest.raises(ValueError, match=r"qwen3_next has layers of type \['linear_attention'\]"):
        ODCSFTTrainer(model=model, args=zoo_runs.sft_args(tmp_path), processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8}))  # fmt: skip


MULTIMODAL = [name for name, (_, words) in zoo_runs.REFUSED.items() if words == "multimodal"]


def _counting_maps(monkeypatch) -> list:
    """Every ``datasets.Dataset.map`` call from here on, by its description (TRL prepares the data with them)."""
    import datasets

    calls, original = [], datasets.Dataset.map

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("desc"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "map", counted)
    return calls


@pytest.mark.parametrize("given", ["model", "folder"])
@pytest.mark.parametrize("name", MULTIMODAL)
def test_a_multimodal_model_is_refused_before_any_data_work(name, given, tmp_path, cpu_env, monkeypatch):
    """Refused before TRL tokenizes the dataset (minutes on a real one): no ``map`` call ran. The model as an object
    or as a folder TRL would load (its config is read, nothing else)."""
    from datasets import Dataset

    from odc_hf import ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer

    model = zoo_runs.REFUSED[name][0]()
    if given == "folder":
        model.config.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    calls = _counting_maps(monkeypatch)
    with pytest.raises(ValueError, match=r"is a multimodal model \(vision_config\)"):
        ODCSFTTrainer(model=model, args=zoo_runs.sft_args(tmp_path), processing_class=default_tokenizer(),
                      train_dataset=Dataset.from_dict({"text": ["one document", "another one"] * 4}))  # fmt: skip
    assert calls == [], calls


def test_control_the_map_counter_sees_trls_data_preparation(tmp_path, cpu_env, monkeypatch):
    """Control of the test above: with a text model the same construction runs TRL's maps (the count is not blind)."""
    from datasets import Dataset

    from odc_hf import ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    calls = _counting_maps(monkeypatch)
    ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=zoo_runs.sft_args(tmp_path), processing_class=tokenizer,
                  train_dataset=Dataset.from_dict({"text": ["one document", "another one"] * 4}))  # fmt: skip
    assert "Tokenizing train dataset" in calls, calls


def rendered(trl, odc, grpo) -> list[str]:
    sft = {name: {w: largest_difference(odc[w][name]["history"], trl[name],
                                       renamed={"grad_norm": "grad_norm_fp64"} if w > 1 else None) for w in (1, 2)}
           for name in NAMES}  # fmt: skip
    attention = {name: odc[1][name]["attention"]["implementation"] for name in NAMES}
    refusals = {}
    for name, (build, _) in zoo_runs.REFUSED.items():
        from odc_hf.integrations.models.family import refusal

        refusals[name] = refusal(build())
    return zoo_runs.table(sft, attention, {n: grpo_difference(*grpo[n]) for n in GRPO_NAMES}, refusals, RTOL)


DOCS = ROOT / "docs" / "models.md"


def documented_table(text: str) -> tuple[int, int]:
    lines = text.splitlines()
    start = lines.index(zoo_runs.TABLE_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


@pytest.mark.slow
def test_docs_models_table_is_this_runs(trl, odc, grpo):
    """docs/models.md's table is what this run measured (rewrite it with ``python tests/models/test_model_zoo.py``)."""
    lines = DOCS.read_text().splitlines()
    start, end = documented_table(DOCS.read_text())
    table = rendered(trl, odc, grpo)
    if os.environ.get("ODC_ZOO_WRITE_TABLE"):
        lines[start:end] = table
        DOCS.write_text("\n".join(lines) + "\n")
        return
    assert lines[start:end] == table


if __name__ == "__main__":  # run the zoo and rewrite docs/models.md's table from it
    os.environ["ODC_ZOO_WRITE_TABLE"] = "1"
    sys.exit(pytest.main([__file__, "-q", "-p", "no:randomly", "-k", "docs_models_table"]))


def test_the_gpu_zoo_builds_here_and_gemma2s_soft_capping_binds():
    """The GPU zoo's families (tests/gpu/test_model_zoo_gpu.py) build from their configs on the CPU, with the head
    dimensions the GPU test claims; Gemma 2's soft-capping at the GPU zoo's cap and scale changes the logits of a
    real-text row (a cap that never binds would make the soft-capping control vacuous)."""
    import torch

    from odc_hf.testing.data import default_tokenizer

    tokenizer, gpu = default_tokenizer(), zoo_runs.GPU
    heads = {"gemma3": 256, "gemma2": 256, "gpt_oss": 64, "qwen3_moe": 128}
    assert set(gpu.families) == set(heads)
    ids = torch.tensor([zoo_runs.dataset(tokenizer, gpu)["input_ids"][0]])
    assert ids.shape[1] >= gpu.min_tokens
    for name, head_dim in heads.items():
        config = gpu.families[name].config({**gpu.size, **zoo_runs.token_ids(tokenizer)})
        assert config.head_dim == head_dim, name
    logits = {}
    for off in (None, "softcap"):
        model = zoo_runs.build("gemma2", tokenizer, off, gpu)
        model.config.final_logit_softcapping = None  # the attention's cap alone
        with torch.no_grad():
            logits[off] = model(input_ids=ids).logits
    moved = ((logits[None] - logits["softcap"]).norm() / logits["softcap"].norm()).item()
    print(f"gemma2 at cap {zoo_runs.GPU_SOFTCAP}: logits move {moved:.1e} without it")
    assert moved > 1e-2, moved
