"""Memory model of one microbatch and the activation-checkpointing choice it implies (pure: numbers in, choice out).

Peak device memory of a rank while it runs forward + backward of a microbatch of ``T`` tokens with ``n`` of its
``L`` decoder layers checkpointed::

    peak(T, n) = static + fixed + T * (other + n*checkpoint + (L - n)*layer + (recompute if n > 0 else 0))

- ``static``: resident between microbatches (sharded parameters, gradients, optimizer state, ODC buffers);
- ``fixed``: token-independent transients (unsharded units in flight, their gradients, library workspaces);
- ``layer``: bytes per token a decoder layer keeps for its backward when it is not checkpointed;
- ``checkpoint``: bytes per token a checkpointed layer keeps (its inputs);
- ``recompute``: the transient of recomputing one checkpointed layer during backward (only paid when n > 0);
- ``other``: the rest (embeddings, final norm, the loss path: full logits or a fused head).

The per-token terms are linear in ``T`` for memory-linear attention (SDPA's flash/cuDNN kernels, per-document on
packed rows) and chunked losses; ``odc_hf.integrations.compute.activation_checkpointing.calibrate_memory`` measures them
on the GPU with the run's kernels and loss path. :func:`choose_checkpointing` is the ``activation_checkpointing="auto"``
rule: the fewest checkpointed layers whose predicted peak fits; ``full`` when nothing is predicted to fit (it
needs the least memory, so "auto" never fails where "full" would have fitted).
"""

from __future__ import annotations

import dataclasses
import math

GIB = 2**30

__all__ = ["MemoryModel", "checkpointed_indices", "choose_checkpointing", "describe_checkpointing",
           "layers_to_checkpoint", "largest_fitting_tokens", "shortfall"]  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Predicted peak bytes of one microbatch's forward + backward (see the module docstring)."""

    num_layers: int
    layer_bytes_per_token: float
    checkpoint_bytes_per_token: float
    recompute_bytes_per_token: float = 0.0
    other_bytes_per_token: float = 0.0
    fixed_bytes: float = 0.0
    static_bytes: float = 0.0

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"MemoryModel.num_layers must be >= 1, got {self.num_layers}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "num_layers" and (not math.isfinite(value) or value < 0):
                raise ValueError(f"MemoryModel.{field.name} must be finite and >= 0, got {value}")

    def bytes_per_token(self, checkpointed: int) -> float:
        """Token-proportional bytes with ``checkpointed`` of the decoder layers checkpointed."""
        n = self._check(checkpointed)
        recompute = self.recompute_bytes_per_token if n > 0 else 0.0
        return (self.other_bytes_per_token + n * self.checkpoint_bytes_per_token
                + (self.num_layers - n) * self.layer_bytes_per_token + recompute)  # fmt: skip

    def peak_bytes(self, tokens: int, checkpointed: int) -> float:
        """Predicted peak device bytes of a microbatch of ``tokens`` tokens."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return self.static_bytes + self.fixed_bytes + tokens * self.bytes_per_token(checkpointed)

    def _check(self, checkpointed: int) -> int:
        if not 0 <= checkpointed <= self.num_layers:
            raise ValueError(f"checkpointed layers must be in [0, {self.num_layers}], got {checkpointed}")
        return int(checkpointed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MemoryModel:
        """Read :meth:`to_dict`'s form; unknown keys (notes a caller stored beside it) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def choose_checkpointing(model: MemoryModel, tokens: int, device_bytes: float) -> tuple[int, bool]:
    """``(checkpointed layers, fits)``: the fewest checkpointed layers whose predicted peak is <= ``device_bytes``.

    When not even full checkpointing is predicted to fit, returns ``(num_layers, False)``: full checkpointing
    needs the least memory (``checkpoint <= layer`` per token), so nothing else can do better; the caller says so.
    """
    for n in range(model.num_layers + 1):
        if model.peak_bytes(tokens, n) <= device_bytes:
            return n, True
    return model.num_layers, False


def largest_fitting_tokens(model: MemoryModel, device_bytes: float) -> int:
    """The most tokens per microbatch whose predicted peak with full checkpointing is <= ``device_bytes`` (0 when
    the resident terms alone do not fit)."""
    room = device_bytes - model.static_bytes - model.fixed_bytes
    per_token = model.bytes_per_token(model.num_layers)
    if room <= 0:
        return 0
    return int(room // per_token) if per_token > 0 else 2**62


def shortfall(model: MemoryModel, tokens: int, device_bytes: float) -> str:
    """What to change when not even full checkpointing fits ``tokens`` tokens in ``device_bytes``: a smaller token
    budget when one fits, else the resident state that fills the device by itself and what shrinks it."""
    need = model.peak_bytes(tokens, model.num_layers)
    head = (f"even full activation checkpointing is predicted to need {need / GIB:.1f} GiB at {tokens} tokens per "
            f"microbatch, and {device_bytes / GIB:.1f} GiB are usable")  # fmt: skip
    fitting = largest_fitting_tokens(model, device_bytes)
    if fitting > 0:
        return f"{head}: lower max_tokens_per_microbatch to {fitting} or less"
    resident = (model.static_bytes + model.fixed_bytes) / GIB
    return (f"{head}, while parameters, gradients, optimizer states and the unsharded units alone take "
            f"{resident:.1f} GiB per process: no token budget fits. Shard over more processes (more GPUs), train an "
            "adapter (LoRA), or use a smaller model")  # fmt: skip


def layers_to_checkpoint(fraction: float, num_layers: int) -> int:
    """How many of ``num_layers`` layers a fraction checkpoints (rounded up: a fraction > 0 checkpoints one at least)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the checkpointed fraction must be in [0, 1], got {fraction}")
    return min(num_layers, math.ceil(fraction * num_layers - 1e-9))


def checkpointed_indices(checkpointed: int, num_layers: int) -> list[int]:
    """Which layer indices to checkpoint: ``checkpointed`` of ``num_layers``, spread evenly (every k-th for L/k)."""
    if not 0 <= checkpointed <= num_layers:
        raise ValueError(f"checkpointed layers must be in [0, {num_layers}], got {checkpointed}")
    return [(2 * i + 1) * num_layers // (2 * checkpointed) for i in range(checkpointed)]


def describe_checkpointing(checkpointed: int, num_layers: int) -> str:
    """``none``, ``full`` or ``selective n/L``."""
    if checkpointed == 0:
        return "none"
    if checkpointed == num_layers:
        return "full"
    return f"selective {checkpointed}/{num_layers}"
