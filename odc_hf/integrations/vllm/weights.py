"""The trainer's parameters as vLLM loads them: its names, LoRA adapters merged into their base weights.

A pure function over ``(name, tensor)`` pairs (:func:`vllm_weights`), so that it is tested without vLLM. Names follow
TRL's own weight sync (``VLLMGeneration._iter_fsdp2_params`` / ``_fix_param_name_to_vllm``, TRL 1.16): activation
checkpointing's ``_checkpoint_wrapped_module.`` and PEFT's ``base_model.model.`` prefix go, a LoRA-wrapped layer's
``.base_layer`` goes, ``modules_to_save.<adapter>.`` goes (its ``original_module`` copy is skipped). TRL merges the
adapters into the base weights in place before reading them (``merge_adapter()``, then ``unmerge_adapter()``: in
floating point the base weights drift by the rounding of add-then-subtract at every sync); here each merged weight is
a new tensor, ``W + scaling * B @ A`` as peft's ``LoraLayer.get_delta_weight`` and ``merge`` compute it, and the base
weights are never touched. The sum runs in fp32 and is cast back to ``W``'s dtype (exact against peft in fp32; under
a bf16 all-gather dtype one rounding of the fp32 sum of the bf16 values the forward computes with).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator

import torch

PEFT_PREFIX = "base_model.model."
WRAPPER_PARTS = ("_checkpoint_wrapped_module.",)  # activation checkpointing's wrapper (torch.distributed)


@dataclasses.dataclass(frozen=True)
class LoraMerge:
    """How to merge one LoRA adapter: peft's ``LoraConfig`` fields that its merge reads. ``r`` is read from each
    ``lora_A`` weight's shape (so ``rank_pattern`` needs nothing more)."""

    adapter: str = "default"
    lora_alpha: float = 8.0
    use_rslora: bool = False
    fan_in_fan_out: bool = False

    @classmethod
    def from_config(cls, config, adapter: str = "default") -> LoraMerge:
        """From a peft ``LoraConfig``; refuses what the merge here does not compute (DoRA, LoRA biases, per-module
        alphas) and adapters other than LoRA, with a message saying so."""
        kind = str(getattr(config, "peft_type", ""))
        if not kind.endswith("LORA") or kind.endswith("ADALORA"):
            raise NotImplementedError(
                f"odc_hf's vLLM weight sync merges LoRA adapters only, got peft_type {kind!r}"
            )
        refused = [field for field, on in (("use_dora", getattr(config, "use_dora", False)),
                                           ("lora_bias", getattr(config, "lora_bias", False)),
                                           ("alpha_pattern", bool(getattr(config, "alpha_pattern", None))))
                   if on]  # fmt: skip
        if refused:
            raise NotImplementedError(
                f"odc_hf's vLLM weight sync merges plain LoRA (W + lora_alpha / r * B @ A); this adapter sets "
                f"{', '.join(refused)}. Train without it, or generate with use_vllm=False"
            )
        return cls(adapter=adapter, lora_alpha=float(config.lora_alpha), use_rslora=bool(config.use_rslora),
                   fan_in_fan_out=bool(config.fan_in_fan_out))  # fmt: skip

    def scaling(self, rank: int) -> float:
        """peft's ``LoraLayer.update_layer``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / math.sqrt(rank) if self.use_rslora else self.lora_alpha / rank

    def merge(self, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        delta = lora_b.float() @ lora_a.float()
        if self.fan_in_fan_out:
            delta = delta.T
        return (weight.float() + delta * self.scaling(lora_a.size(0))).to(weight.dtype)


def vllm_name(name: str, adapter: str = "default") -> str | None:
    """The name vLLM's ``load_weights`` knows ``name`` by, or ``None`` for a parameter vLLM has no copy of (peft's
    ``original_module`` beside ``modules_to_save``). LoRA's own parameters are handled by :func:`vllm_weights`."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    name = name.removeprefix(PEFT_PREFIX)
    if "original_module" in name:
        return None
    return name.replace(".base_layer", "").replace(f"modules_to_save.{adapter}.", "")


def _lora_part(name: str, adapter: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` for ``<module>.lora_A.<adapter>.weight`` / ``lora_B``; ``None`` for other names."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.{adapter}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    return None


def vllm_weights(named: Iterable[tuple[str, torch.Tensor]], lora: LoraMerge | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """``named`` (the trainer's ``(name, whole parameter)`` pairs, ``named_parameters()`` names) as vLLM loads them.

    With ``lora``, each adapted layer's ``base_layer.weight``, ``lora_A`` and ``lora_B`` become one merged ``weight``
    (yielded once all three have arrived: a unit holds a layer's parameters together); parameters of other adapters
    are dropped. LoRA parameters without ``lora``, and peft parameters this merge does not know (embedding LoRA,
    DoRA magnitudes), are errors, never silently skipped.
    """
    adapter = lora.adapter if lora is not None else "default"
    pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"W", "A", "B"} seen so far
    for name, tensor in named:
        clean = vllm_name(name, adapter)
        if clean is None:
            continue
        base = name.endswith(".base_layer.weight")
        if not base and "lora_" not in clean:
            yield clean, tensor
            continue
        if lora is None:
            raise ValueError(
                f"{name}: a LoRA layer's parameter, but no LoraMerge was given to merge the layer"
            )
        if base:
            module, part = clean.removesuffix(".weight"), "W"
        else:
            found = _lora_part(clean, adapter)
            if found is None:
                if ".lora_A." in clean or ".lora_B." in clean:
                    continue  # another adapter's weights: not the one merged
                raise NotImplementedError(f"{name}: a peft parameter odc_hf's LoRA merge does not know")
            module, part = found
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[module]
            yield f"{module}.weight", lora.merge(parts["W"], parts["A"], parts["B"])
    for module, parts in pending.items():  # layers this adapter does not adapt (wrapped for another adapter)
        if set(parts) != {"W"}:
            raise ValueError(f"{module}: LoRA weights {sorted(parts)} arrived without the rest of the layer")
        yield f"{module}.weight", parts["W"]
