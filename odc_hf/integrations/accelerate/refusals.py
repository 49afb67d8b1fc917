"""What odc_hf cannot run, and why: the setup refusals of the accelerator and the trainers, each a named check whose
message says what to change. They run before anything expensive (before accelerate builds its Accelerator where
they can) so that a run that cannot work stops in seconds.

- engines and launch: :func:`check_supported` (FSDP2 only, no DDP / DeepSpeed / Megatron-LM / XLA),
  :func:`refuse_other_engines`, :func:`check_launch_before_accelerate` (an FSDP1 launch config),
  :func:`check_world_matches_launch` (processes that each think they are alone), :func:`check_cpu_ranks_have_no_gpu_to_pick`;
- options: :func:`check_fsdp_config` / :func:`check_launch_config` (``odc_*`` keys in an FSDP config, which
  accelerate and transformers ignore silently; ODC's options live in ``ODCConfig``, ``odc_*`` training arguments or
  ``ODC_*`` variables, docs/configuration.md);
- models and checkpoints: :func:`check_not_quantized` (QLoRA), :func:`check_shared_gpu_state_dict`.

Refusals that belong to another concept live with it: a model family's definition
(:mod:`odc_hf.integrations.models.family`, :mod:`odc_hf.integrations.models.definition_check`), attention kernels
(:mod:`odc_hf.integrations.compute.attention`), the HSDP mesh (:mod:`odc_hf.integrations.accelerate.parallelism`),
training data (:mod:`odc_hf.integrations.trainer.train_data`), checkpoints (:mod:`odc_hf.integrations.checkpoint.resume`),
GRPO options (:mod:`odc_hf.integrations.trl.grpo_config`) and upstream versions (:mod:`odc_hf.integrations.upstream`).

On ``odc_*`` keys in an FSDP config: with ``TrainingArguments(fsdp_config={...})`` transformers keeps unknown keys
(and strips a ``fsdp_`` prefix) and accelerate's plugin never reads them; :func:`check_fsdp_config` sees the dict.
In the accelerate YAML's ``fsdp_config``, ``accelerate launch`` copies only the keys it knows into the ranks'
environment, so a rank never sees the others: :func:`launch_config_file` finds the YAML the launcher read, from the
launcher's command line (the rank's parent process, on Linux) or accelerate's default config; where neither can be
read (another launcher, another OS) the check is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from odc_hf.integrations.launch import shared_gpu


def _field_names() -> list[str]:
    import dataclasses

    from odc_hf.config import ODCConfig

    return [f.name for f in dataclasses.fields(ODCConfig)]


def _closest_option(key: str) -> str | None:
    """The ODC option ``key`` (``odc_balanse``) names or most resembles (``balance``); ``None`` when none is close."""
    import difflib

    name = key.removeprefix("odc_")
    names = _field_names()
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


def check_fsdp_config(fsdp_config, where: str) -> None:
    """Raise on an ``odc_*`` key (also ``fsdp_odc_*``) of an FSDP config dict, naming it and where ODC options go: the
    option it names, or (a misspelt one) the closest valid option, written each way it can be set."""
    if not isinstance(fsdp_config, dict):
        return
    keys = sorted(k for k in fsdp_config if str(k).removeprefix("fsdp_").startswith("odc_"))
    if not keys:
        return
    key = keys[0].removeprefix("fsdp_")
    option = _closest_option(key)
    if option is None:
        flag, variable, unknown = "--odc_<option>", "ODC_<OPTION>", f" ({key!r} is not an ODC option)"
    else:
        flag, variable, unknown = f"e.g. --odc_{option}", f"ODC_{option.upper()}", ""
        if option != key.removeprefix("odc_"):
            unknown = f" ({key!r} is not an ODC option; the closest is 'odc_{option}')"
    valid = ", ".join(f"odc_{n}" for n in _field_names())
    raise ValueError(
        f"{where} has {', '.join(repr(k) for k in keys)}, which accelerate ignores: ODC's options do not go in an "
        f"FSDP config{unknown}. Set them as training arguments ({valid}: {flag} with ODCSFTConfig / "
        f"ODCTrainingArguments), as environment variables ({variable}=...), or in ODCConfig(...) "
        "(docs/configuration.md)"
    )


def launch_config_file(environ=None) -> Path | None:
    """The accelerate config file ``accelerate launch`` read for this rank, if it can be known; else ``None``."""
    environ = os.environ if environ is None else environ
    if "LOCAL_RANK" not in environ:
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(a.endswith("accelerate") or a.startswith("accelerate.commands") or a == "launch" for a in argv):
        return None  # torchrun, srun, ...: no accelerate config
    for i, arg in enumerate(argv):
        if arg in ("--config_file", "--config-file") and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith(("--config_file=", "--config-file=")):
            return Path(arg.split("=", 1)[1])
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file) if os.path.isfile(default_config_file) else None


def check_launch_config(environ=None) -> None:
    """:func:`check_fsdp_config` on the ``fsdp_config`` of the accelerate YAML this rank was launched with."""
    path = launch_config_file(environ)
    if path is None or not path.is_file() or path.suffix not in (".yaml", ".yml"):
        return
    import yaml

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return  # accelerate itself read it; not ours to report
    if isinstance(config, dict):
        check_fsdp_config(config.get("fsdp_config"), f"fsdp_config in the accelerate config {str(path)!r}")


def refuse_other_engines(deepspeed_plugin=None, megatron_lm_plugin=None) -> None:
    """ODC replaces FSDP2's collectives: refuse DeepSpeed / Megatron-LM (asked for in code or by ``accelerate launch``)
    before accelerate builds them, with a message saying what to use instead."""
    for name, given, variable in (("DeepSpeed", deepspeed_plugin, "ACCELERATE_USE_DEEPSPEED"),
                                  ("Megatron-LM", megatron_lm_plugin, "ACCELERATE_USE_MEGATRON_LM")):  # fmt: skip
        if given is not None or os.environ.get(variable, "false").lower() == "true":
            raise ValueError(
                f"odc_hf replaces FSDP2's collectives and does not run under {name}: launch with an FSDP2 accelerate "
                "config (accelerate_configs/odc.yaml) or none, and configure sharding with ODCFSDPPlugin"
            )


def check_supported(accelerator: Accelerator) -> None:
    """Refuse setups ODC cannot serve, with a message that says what to change."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type == DistributedType.FSDP and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "odc_hf needs FSDP2: set `fsdp_version: 2` in the accelerate config (FSDP1 is not supported)"
        )
    if accelerator.distributed_type in (
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
        DistributedType.XLA,
    ):
        raise ValueError(
            f"odc_hf does not support {accelerator.distributed_type}; use FSDP2 (accelerate_configs/odc.yaml)"
        )
    if accelerator.distributed_type == DistributedType.MULTI_GPU:
        raise ValueError(
            "this accelerate config runs DDP on GPUs; ODC replaces FSDP2's collectives, so launch with an FSDP2 "
            "config (accelerate_configs/odc.yaml), or build the accelerator as odc_hf.ODCAccelerator (its "
            "ODCFSDPPlugin switches accelerate to FSDP2)"
        )


def check_launch_before_accelerate(environ=None) -> None:
    """Refuse, before accelerate builds its Accelerator, what accelerate would reject with a message that does not
    mention ODC: an FSDP1 accelerate config (on a CPU-only host accelerate's FSDP1 plugin raises "There are currently
    no available devices found" before odc_hf's own FSDP2 check could run)."""
    environ = os.environ if environ is None else environ
    check_launch_config(environ)  # odc_* keys in the launch YAML's fsdp_config, which accelerate drops silently
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes") and environ.get("FSDP_VERSION") == "1":
        raise ValueError(
            "odc_hf needs FSDP2: set `fsdp_version: 2` in the accelerate config's fsdp_config (found fsdp_version: 1; "
            "FSDP1 is not supported). accelerate_configs/odc.yaml is a working GPU config; on a CPU-only host use "
            "accelerate_configs/cpu.yaml with ACCELERATE_USE_CPU=true"
        )


def check_cpu_ranks_have_no_gpu_to_pick(use_cpu: bool = False, environ=None) -> None:
    """Refuse CPU ranks that would pick a CUDA device that does not exist, before anything synchronises.

    accelerate's ``wait_for_everyone`` calls ``torch.distributed.barrier(device_ids=[local_rank])`` on CPU ranks too,
    and torch then places the barrier's tensor on ``cuda:<local_rank>`` whenever CUDA is visible: on a machine with
    one GPU, rank 1 of a 2-process CPU run fails there with "CUDA error: invalid device ordinal" (inside TRL's dataset
    preparation). ``python examples/sft.py`` hides CUDA from CPU ranks
    (``odc_hf.integrations.launch.relaunch.plan_launch``); a launch of ``accelerate_configs/cpu.yaml`` by hand must do the
    same."""
    environ = os.environ if environ is None else environ
    cpu = use_cpu or environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    local_rank = environ.get("LOCAL_RANK", "")
    if not cpu or not local_rank.isdigit() or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if int(local_rank) >= gpus:
        raise RuntimeError(
            f"CPU rank {local_rank} sees {gpus} CUDA device(s): accelerate's barrier would place a tensor on "
            f"cuda:{local_rank}, which does not exist ('invalid device ordinal'). Hide the GPUs from CPU ranks: "
            "`CUDA_VISIBLE_DEVICES= ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml "
            "...` (python examples/sft.py does this itself), or train on your GPU with one process "
            "(python examples/sft.py --num_processes 1; docs/quickstart.md, \"One GPU\")"
        )


def check_world_matches_launch(accelerator: Accelerator, environ=None) -> None:
    """Refuse a launch that started several processes which each see a single-process run (e.g. ``accelerate launch
    --config_file accelerate_configs/cpu.yaml`` on a CPU host without ``ACCELERATE_USE_CPU=true``): they would train
    independent copies of the model into the same output directory."""
    environ = os.environ if environ is None else environ
    launched = environ.get("WORLD_SIZE", "")
    if launched.isdigit() and int(launched) > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate set up each one as a single "
            "process, so they would train independently. On a CPU-only host set ACCELERATE_USE_CPU=true, e.g. "
            "`ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml ...` (that config "
            "takes torchrun's launcher and the variable makes every process a CPU rank); on GPUs launch with an "
            "FSDP2 config (accelerate_configs/odc.yaml)"
        )


def check_not_quantized(model: torch.nn.Module) -> None:
    """Refuse a quantized base model (QLoRA: bitsandbytes 4/8-bit, or any transformers quantizer) under ODC.

    ODC publishes each unit's shards and gathers them by bytes; quantized weights carry their scales and layout in
    tensor subclasses and quantizer state that the FSDP2 adapter does not know, and no test covers them. LoRA on an
    unquantized (bf16) base is supported.
    """
    quantizer = getattr(model, "hf_quantizer", None)  # a PeftModel forwards the lookup to its base model
    integer = sorted({str(p.dtype) for p in model.parameters() if not p.dtype.is_floating_point})
    if quantizer is not None or integer:
        found = type(quantizer).__name__ if quantizer is not None else f"{', '.join(integer)} parameters"
        raise NotImplementedError(
            f"odc_hf does not support quantized base models under ODC (QLoRA; found {found}): load the base model "
            "unquantized (e.g. dtype=torch.bfloat16) and train LoRA on it, or set ODCConfig(enabled=False) to run "
            "plain FSDP2 collectives"
        )


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, under ODC, an optimizer that changes the parameters outside ``step()``: one with ``train()`` / ``eval()``
    modes (a schedule-free optimizer moves the parameters between two sequences when switched), or one that updates
    them inside backward (LOMO's ``fused_backward``). ODC's peers gather the shards published after each step. Also one
    whose update of a parameter is not the updates of its shards (:func:`shard_update_problem`)."""
    if callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None)):
        how = "its train()/eval() modes change the parameters outside optimizer.step() (a schedule-free optimizer)"
    elif callable(getattr(optimizer, "fused_backward", None)):
        how = "it updates the parameters inside backward (LOMO), before ODC has summed the gradients"
    elif (problem := shard_update_problem(optimizer)) is not None:
        raise NotImplementedError(
            f"odc_hf does not support {type(optimizer).__name__}: its update of a parameter is not the updates of the "
            f"parameter's shards ({problem}). odc_hf shards every parameter along its first dimension and each rank "
            "updates its shard alone, as FSDP2 does, so the model would be trained by other numbers than the "
            "optimizer's definition gives. Use an optimizer whose update is elementwise (optim='adamw_torch', "
            "'adamw_torch_fused', 'sgd', 'adagrad', 'rmsprop', ...)"
        )
    else:
        return
    raise NotImplementedError(
        f"odc_hf does not support {type(optimizer).__name__} under ODC: {how}, while the peers read the shards "
        "published after each optimizer step. Use an optimizer that changes the parameters in step() only "
        "(optim='adamw_torch', ...), or set ODCConfig(enabled=False) to run plain FSDP2 collectives"
    )


def shard_update_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """How ``optimizer``'s update of a whole parameter differs from its updates of the parameter's two halves along
    the first dimension (two shards), or ``None`` when they agree or it cannot be told.

    A new optimizer of the same class, with each of ``optimizer``'s parameter groups' options in turn, takes two steps
    on a 4 x 6 tensor and on its two 2 x 6 halves (as two parameters), on CPU with the same gradients. An elementwise
    update (Adam, SGD with momentum, Adagrad, Lion) agrees to float noise; one that reads whole-tensor statistics
    (Adafactor's factored moments and parameter scale, a trust ratio or norm per tensor as in LAMB, Muon's
    orthogonalisation, GaLore's projections) does not. An optimizer that cannot run on CPU tensors (a GPU-only kernel)
    cannot be told and is not refused."""
    cls = type(optimizer)
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(4, 6, generator=generator)
    grads = [torch.randn(4, 6, generator=generator) for _ in range(2)]

    def on_cpu(options: dict) -> dict:  # the same arithmetic on CPU tensors: no fused, capturable or foreach kernels
        return {k: False if k in ("fused", "capturable", "foreach") and v else v for k, v in options.items()
                if k != "params"}  # fmt: skip

    defaults = on_cpu(optimizer.defaults)
    groups = []
    for group in optimizer.param_groups:
        options = on_cpu(group)
        if options not in groups:
            groups.append(options)
    for options in groups:
        try:
            one = torch.nn.Parameter(whole.clone())
            halves = [torch.nn.Parameter(whole[:2].clone()), torch.nn.Parameter(whole[2:].clone())]
            first = cls([{"params": [one], **options}], **defaults)
            second = cls([{"params": halves, **options}], **defaults)
            for grad in grads:
                one.grad = grad.clone()
                halves[0].grad, halves[1].grad = grad[:2].clone(), grad[2:].clone()
                first.step()
                second.step()
        except Exception:  # noqa: BLE001 - an optimizer this test cannot run is not judged by it
            return None
        got = torch.cat([h.detach() for h in halves])
        if not torch.allclose(one.detach(), got, rtol=1e-5, atol=1e-7):
            moved = float((one.detach() - whole).abs().max())
            apart = float((one.detach() - got).abs().max())
            return (f"two steps on a 4 x 6 tensor moved it by up to {moved:.3g}; the same steps on its two halves "
                    f"end up to {apart:.3g} away from that")  # fmt: skip
    return None


def fsdp_state_dict_type(accelerator: Accelerator) -> str:
    """How accelerate's FSDP plugin saves state dicts (``"StateDictType.SHARDED_STATE_DICT"``, ...), "" without one."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return str(getattr(plugin, "state_dict_type", "") or "")


def check_shared_gpu_state_dict(accelerator: Accelerator) -> None:
    """Ranks sharing a GPU cannot write FULL_STATE_DICT checkpoints (accelerate gathers them with
    ``full_tensor()``, a functional collective that crashes on gloo with CUDA tensors): refuse before training."""
    if shared_gpu.active() and "FULL_STATE_DICT" in fsdp_state_dict_type(accelerator):
        raise ValueError(
            f"odc_hf: {shared_gpu.describe()}; FULL_STATE_DICT checkpoints are not supported there (accelerate "
            "gathers them with DTensor.full_tensor(), which crashes on gloo with CUDA tensors): set "
            "fsdp_state_dict_type: SHARDED_STATE_DICT (accelerate_configs/odc.yaml does)"
        )
