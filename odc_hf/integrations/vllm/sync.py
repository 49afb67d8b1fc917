"""vLLM generation beside ODC: TRL's colocated engine, its weights pushed from ODC's published shards.

TRL's ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` builds one engine per rank (``VLLMGeneration``:
``LLM(..., distributed_executor_backend="external_launcher", seed=rank)``) and, whenever the optimizer step has moved
since the engine's weights were loaded (its ``_last_loaded_step``), calls ``VLLMGeneration.sync_weights()`` before
generating. TRL's sync reads every FSDP2 parameter with ``DTensor.full_tensor()``: a collective per parameter, every
rank in lockstep. ``ODCGRPOTrainer`` keeps TRL's engine, generation, bookkeeping, importance-sampling correction and
metrics, and replaces only ``sync_weights`` (:class:`ODCWeightSync`, mixed into the engine object's class by
:func:`adopt_generation`): the whole parameters come from ODC's published shards, read one-sidedly
(``ODCHandle.full_parameters``: no collective, each rank at its own time), named and merged as vLLM loads them
(:mod:`odc_hf.integrations.vllm.weights`), and go into the engine's model through vLLM's public ``LLM.apply_model``, in
one ``load_weights`` call fed unit by unit. A parameter of vLLM's model that the sync did not write is an error: the
engine would otherwise generate from stale weights and nothing would say so.

Sleep mode (``vllm_enable_sleep_mode``) as TRL runs it: the engine sleeps at level 2 after every generation (weights
and KV cache freed), so TRL's ``generate`` asks for a sync before the next one; the sync wakes the weights first.

Ranks sharing a GPU (``odc_hf.integrations.launch.shared_gpu``): TRL tells each engine its GPU through ``LOCAL_RANK`` (the
accelerator's local process index), which vLLM's external-launcher worker takes as a device index; in that mode the
index is the rank's GPU (``shared_gpu.localize_rank``), so nothing here changes it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import torch

from odc_hf.integrations.upstream.trl import mark_weights_awake, missing_generation_attributes
from odc_hf.integrations.vllm.weights import LoraMerge, vllm_weights
from odc_hf.version import TESTED


def load_into(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Run in the engine's worker (``LLM.apply_model``): load ``weights``; returns the model's parameters not written."""
    loaded = model.load_weights(weights)
    if loaded is None:  # a model whose load_weights reports nothing: nothing to check against
        return []
    return sorted({name for name, _ in model.named_parameters()} - set(loaded))


class ODCWeightSync:
    """Mixed before TRL's ``VLLMGeneration`` (see the module docstring); set up by :func:`adopt_generation`."""

    odc_source: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    """The trainer's whole parameters, ``named_parameters()`` names (``ODCHandle.full_parameters`` under ODC)."""
    odc_lora: LoraMerge | None
    odc_sync_seconds: list[float]

    def sync_weights(self):
        if self.mode != "colocate":
            raise NotImplementedError(
                f"odc_hf pushes weights into colocated vLLM engines only, not vllm_mode={self.mode!r}"
            )
        start = time.perf_counter()
        if self.enable_sleep_mode:  # level 2 freed the weights: map them again before writing (as TRL does)
            from trl.generation.vllm_generation import empty_cache

            empty_cache()
            self.llm.wake_up(tags=["weights"])
            mark_weights_awake(self)
        weights = vllm_weights(self.odc_source(), self.odc_lora)
        missing = [
            name
            for part in self.llm.apply_model(functools.partial(load_into, weights=weights))
            for name in part
        ]
        if missing:
            raise RuntimeError(
                f"the vLLM weight sync did not write {len(missing)} of vLLM's parameters ({missing[:8]}...): the "
                "trainer's parameter names do not map onto this vLLM model's"
            )
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies are asynchronous: time them whole
        self.odc_sync_seconds.append(time.perf_counter() - start)


@functools.cache
def _with_weight_sync(cls: type) -> type:
    return type(f"ODC{cls.__name__}", (ODCWeightSync, cls), {"__module__": __name__})


def adopt_generation(generation, source: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                     lora: LoraMerge | None = None):  # fmt: skip
    """Give TRL's ``VLLMGeneration`` object (built by the trainer) ODC's ``sync_weights``: its class becomes a subclass
    with :class:`ODCWeightSync` first (everything else stays TRL's, including the generation TRL's own ``generate``
    runs and its internal re-syncs under sleep mode). Returns the object."""
    missing = missing_generation_attributes(generation)
    if missing:
        raise RuntimeError(
            f"TRL's VLLMGeneration lacks {missing}: odc_hf's vLLM weight sync was written for TRL 1.16"
        )
    llm = getattr(generation, "llm", None)
    if llm is not None and not callable(getattr(llm, "apply_model", None)):
        raise RuntimeError(f"{type(llm).__name__} lacks apply_model, through which odc_hf pushes its weights into the "
                           "vLLM engine; odc_hf was tested on vllm " + ", ".join(TESTED["vllm"]))  # fmt: skip
    if not isinstance(generation, ODCWeightSync):
        generation.__class__ = _with_weight_sync(type(generation))
    generation.odc_source, generation.odc_lora, generation.odc_sync_seconds = source, lora, []
    return generation
