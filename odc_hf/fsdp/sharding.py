"""Shard a transformers model the way accelerate's FSDP2 path does, for where accelerate does not.

Accelerate ignores FSDP on a CPU-only host, so on CPU odc_hf applies ``fully_shard`` itself with the same
unit grouping: one unit per transformer block (the model's ``_no_split_modules`` classes), the input
embedding alone when untied, a tail unit ``[final norm, (input embedding,) output embedding]`` with
``reshard_after_forward=False``, and the root. Tests use it to compare ODC with plain FSDP2 on the same units. With a 2-D ``(replicate, shard)`` mesh it
applies HSDP the same way.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from odc_hf.fsdp import internals


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied anywhere in ``model`` (by accelerate, by :func:`shard_model` or by hand)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _block_classes(model: torch.nn.Module) -> set[str]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules; pass block_classes explicitly"
        )
    return names


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside the wrappers the trainers hand over: PEFT's ``PeftModel`` (``get_base_model()``,
    through its ``LoraModel``) and ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``); ``model`` itself if plain.

    The final norm is a child of the transformers model, so it must be looked up there: on the wrapper, attribute
    forwarding lands one level short (``PeftModel.model`` is the causal LM, whose children are the backbone and
    ``lm_head``), and an untied ``lm_head`` would end alone in a tail unit no forward ever gathers.
    """
    for _ in range(8):  # wrappers nest (a compiled PeftModel); bounded, never a cycle
        if hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        else:
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return model
        model = inner
    return model


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The norm before the output head: the last direct child of the backbone (``base_model_prefix``) whose class
    name says norm (``model.norm`` in Llama/Qwen/Mistral, ``transformer.ln_f`` in GPT-2); ``None`` if there is none.
    Looked up through :func:`unwrap_model`, so a ``PeftModel`` finds the same norm as the plain model."""
    model = unwrap_model(model)
    prefix = getattr(model, "base_model_prefix", "")
    backbone = getattr(model, prefix, None) if prefix else None
    if not isinstance(backbone, torch.nn.Module):
        return None
    norms = [m for _, m in backbone.named_children() if "norm" in type(m).__name__.lower()]
    return norms[-1] if norms else None


def _default_mesh(model: torch.nn.Module):
    """A 1-D mesh of every rank on the device type of ``model``'s parameters.

    ``fully_shard`` without a mesh builds one on torch's current accelerator whenever CUDA is visible, and that
    mesh sets this process's CUDA device from LOCAL_RANK: a CPU rank on a machine with one GPU then asks for device
    1 ("invalid device ordinal"), and a CPU model would be sharded on a CUDA mesh. Meta parameters keep the default.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta" or not dist.is_initialized():
        return None
    return init_device_mesh(param.device.type, (dist.get_world_size(),))


def shard_model(
    model: torch.nn.Module,
    *,
    mesh=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    block_classes: set[str] | None = None,
) -> torch.nn.Module:
    """Apply ``fully_shard`` per block, to the embedding/tail units and to the root; returns the model.

    ``mesh``: ``None`` (every rank, 1-D, on the parameters' device type), a 1-D mesh, or a 2-D ``(replicate, shard)`` mesh for HSDP, e.g.
    ``init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))``.
    """
    if mesh is not None and mesh.ndim not in (1, 2):
        raise NotImplementedError(
            f"shard_model: a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; FSDP2 and ODC take a 1-D (shard) or 2-D "
            "(replicate, shard) data-parallel mesh. Tensor / context parallel dims are not supported with ODC."
        )
    kwargs = {
        "mesh": mesh if mesh is not None else _default_mesh(model),
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "reshard_after_forward": reshard_after_forward,
    }
    classes = block_classes or _block_classes(model)
    for module in list(model.modules()):
        if type(module).__name__ in classes and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
    input_embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output_embed = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = input_embed is not None and output_embed is not None and input_embed.weight is output_embed.weight
    if not tied and input_embed is not None:
        fully_shard(input_embed, **kwargs)
    tail = [final_norm(model), input_embed if tied else None, output_embed]
    tail = [m for m in tail if m is not None and not isinstance(m, FSDPModule)]
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, **root_kwargs)
    return model


def gather_head_with_final_norm(model: torch.nn.Module) -> bool:
    """Where a sharder left an untied output embedding alone in its unit, gather that unit when the final norm runs.

    Accelerate's FSDP2 path (GPUs) looks for the final norm on the model it is handed, so on a ``PeftModel`` it misses
    it and ``lm_head`` gets a unit of its own. TRL's fused head and Liger's fused loss read ``lm_head.weight`` without
    calling the module, so nothing would ever gather that unit (odc_hf's guard then stops the run at step 1). This
    pulls the gather into the final norm's forward (``FSDPModule.unshard``, FSDP2's public call; under ODC a
    one-sided gather), which is what sharing the norm's unit does. The unit keeps accelerate's
    ``reshard_after_forward=False``, so the weight stays gathered until backward. Returns whether it was needed.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    norm = final_norm(model)
    if not isinstance(head, FSDPModule) or norm is None:
        return False
    if any(norm in internals.group_modules(group) for group in internals.param_groups(head)):
        return False  # already one unit (shard_model's and accelerate's layout of a plain model)

    def gather_head(module, args):
        head.unshard()

    norm.register_forward_pre_hook(gather_head)
    return True
