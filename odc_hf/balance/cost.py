"""Cost models: estimated forward+backward cost of documents and packed microbatches.

The planners only ever compare costs, so units do not matter (FLOPs, seconds, tokens), but the
*shape* does: attention makes the cost of one document superlinear in its length, and that is the
whole reason to balance by cost rather than by tokens. With padding-free packing (``position_ids``
restarting per document) attention is computed per document, so the cost of a packed microbatch is

    microbatch_cost = overhead + sum over its documents of doc_cost(length)

where ``overhead`` is a fixed per-microbatch price (kernel launches, Python, the per-layer FSDP
work), zero for the analytic models and fitted by :func:`calibrate`.

Three models:

- :class:`FlopCostModel`: ``6·N·s + 6·L·d_attn·s²`` from a model config (WORKLOADS.md). No
  measurements needed; ignores that short sequences are launch-bound on real GPUs.
- :class:`TokenCostModel`: cost = tokens. What "balance by tokens" planners implicitly use; shown
  for comparison, and the sampler's default only because it needs no config.
- :class:`QuadraticCostModel`: ``a + b·s + c·s²`` fitted to timings measured on the target device
  (:func:`calibrate`), the most faithful when the device is available.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

__all__ = ["CostModel", "FlopCostModel", "QuadraticCostModel", "TokenCostModel", "calibrate", "time_lengths"]


def as_lengths(lengths: Sequence[int] | np.ndarray, *, name: str = "lengths") -> np.ndarray:
    """Validate document lengths (non-negative integers) and return them as a 1-D float64 array."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token counts, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0, got min {arr.min()}")
    return arr


class CostModel:
    """Base: subclasses define ``overhead`` and :meth:`doc_costs`."""

    overhead: float = 0.0

    def doc_costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per-document cost (without the per-microbatch overhead), one float per length."""
        raise NotImplementedError

    def microbatch_cost(self, doc_lengths: Sequence[int] | np.ndarray) -> float:
        """Cost of one packed microbatch: overhead + sum of per-document costs; 0.0 when empty.

        An empty microbatch is priced 0: under ODC it is not run at all, and under FSDP the dummy
        step it stands for overlaps a real microbatch of another rank, whose cost sets the pace.
        """
        costs = self.doc_costs(doc_lengths)
        return 0.0 if costs.size == 0 else float(self.overhead + costs.sum())

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class FlopCostModel(CostModel):
    """Forward+backward FLOPs ``6·N·s + 6·L·d_attn·s²`` (the s² term is causal attention).

    ``num_matmul_params`` (N) counts every matmul weight: Q, K, V, O, the MLP and the lm_head, but
    not the embedding lookup (a gather, no FLOPs). ``attn_dim`` is heads · head_dim.
    """

    num_matmul_params: int
    num_layers: int
    attn_dim: int

    def __post_init__(self):
        for name in ("num_matmul_params", "num_layers", "attn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FlopCostModel.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config) -> FlopCostModel:
        """Build from a dense decoder config (Llama/Qwen2/Mistral-style attribute names)."""
        needed = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        missing = [name for name in needed if getattr(config, name, None) is None]
        if missing:
            raise ValueError(
                f"config {type(config).__name__} lacks {missing}; build FlopCostModel(...) directly"
            )
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q_and_o = 2 * hidden * heads * head_dim
        k_and_v = 2 * hidden * kv_heads * head_dim
        mlp = 3 * hidden * config.intermediate_size  # gate, up, down
        lm_head = hidden * config.vocab_size
        n = layers * (q_and_o + k_and_v + mlp) + lm_head
        return cls(num_matmul_params=n, num_layers=layers, attn_dim=heads * head_dim)

    @property
    def crossover_length(self) -> float:
        """s* where attention FLOPs equal the linear FLOPs: N / (L · d_attn)."""
        return self.num_matmul_params / (self.num_layers * self.attn_dim)

    def doc_costs(self, lengths):
        s = as_lengths(lengths)
        return 6.0 * self.num_matmul_params * s + 6.0 * self.num_layers * self.attn_dim * s * s

    def describe(self) -> str:
        return (
            f"FLOP model 6·N·s + 6·L·d_attn·s² (N={self.num_matmul_params / 1e9:.3f}B, L={self.num_layers}, "
            f"d_attn={self.attn_dim}, s*={self.crossover_length / 1e3:.1f}k)"
        )


@dataclass(frozen=True, kw_only=True)
class TokenCostModel(CostModel):
    """Cost = number of tokens. Blind to attention; use a FLOP or calibrated model for long context."""

    def doc_costs(self, lengths):
        return as_lengths(lengths)

    def describe(self) -> str:
        return "token-linear model (cost = tokens)"


@dataclass(frozen=True, kw_only=True)
class QuadraticCostModel(CostModel):
    """``a`` per microbatch plus ``b·s + c·s²`` per document, usually in seconds (see :func:`calibrate`)."""

    a: float
    b: float
    c: float

    def __post_init__(self):
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"QuadraticCostModel.{name} must be finite and >= 0, got {value}")
        if self.a == 0 and self.b == 0 and self.c == 0:
            raise ValueError("QuadraticCostModel needs a, b or c > 0, otherwise everything costs nothing")

    @property
    def overhead(self) -> float:  # type: ignore[override]
        return self.a

    def doc_costs(self, lengths):
        s = as_lengths(lengths)
        return self.b * s + self.c * s * s

    @classmethod
    def fit(cls, lengths: Sequence[int], seconds: Sequence[float]) -> QuadraticCostModel:
        """Non-negative least squares fit of ``seconds ≈ a + b·s + c·s²`` on single-document timings.

        Coefficients are constrained to be >= 0 (a negative overhead or slope would make the planner
        prefer more microbatches or longer documents): with three unknowns, every subset of active
        coefficients is solved and the best feasible one kept, which is exact NNLS. Timings that do not
        grow with length (a launch-bound device) give b = c = 0: then only the overhead matters and
        the planners balance tokens, through the overhead share of each document.
        """
        s = as_lengths(lengths)
        t = np.asarray(seconds, dtype=np.float64)
        if t.shape != s.shape:
            raise ValueError(f"lengths and seconds must have the same length, got {s.shape} and {t.shape}")
        if np.unique(s).size < 3:
            raise ValueError("fitting a + b·s + c·s² needs timings at >= 3 distinct lengths")
        if not np.all(np.isfinite(t)) or t.min() < 0:
            raise ValueError("seconds must be finite and >= 0")
        return cls._nnls(np.stack([np.ones_like(s), s, s * s], axis=1), t)

    @classmethod
    def fit_microbatches(
        cls, microbatches: Sequence[Sequence[int]], seconds: Sequence[float]
    ) -> QuadraticCostModel:
        """Fit ``a + b·Σs + c·Σs²`` to measured microbatch times (in-situ calibration).

        ``microbatches[i]`` holds the document lengths of a packed microbatch that took ``seconds[i]``
        (forward + backward, as timed in training, so sharding, gathers and packing are included). The
        single-GPU timings of :func:`calibrate` can misjudge packed rows in a sharded run; this fits the
        cost the planner will actually see. Same non-negative least squares as :meth:`fit`.
        """
        t = np.asarray(seconds, dtype=np.float64)
        if len(microbatches) != t.size:
            raise ValueError(f"got {len(microbatches)} microbatches but {t.size} timings")
        rows = []
        for docs in microbatches:
            d = as_lengths(list(docs), name="microbatch document lengths")
            if d.size == 0:
                raise ValueError("an empty microbatch has no cost to fit; drop dummy microbatches")
            rows.append((1.0, d.sum(), float(np.sum(d * d))))
        design = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
        if np.unique(design[:, 1]).size < 3:
            raise ValueError("fitting needs microbatches of >= 3 distinct token counts")
        if not np.all(np.isfinite(t)) or (t.size and t.min() < 0):
            raise ValueError("seconds must be finite and >= 0")
        return cls._nnls(design, t)

    @classmethod
    def _nnls(cls, columns: np.ndarray, t: np.ndarray) -> QuadraticCostModel:
        """Exact NNLS over the 7 subsets of (a, b, c): solve each, keep the best with no negative coefficient."""
        scale = columns.max(axis=0)  # conditioning: s² reaches 1e9 and more
        design = columns / scale
        best, best_residual = None, np.inf
        for size in (3, 2, 1):
            for active in combinations(range(3), size):
                coef, *_ = np.linalg.lstsq(design[:, active], t, rcond=None)
                if np.any(coef < 0):
                    continue
                residual = float(np.sum((design[:, active] @ coef - t) ** 2))
                if residual < best_residual - 1e-18:
                    full = np.zeros(3)
                    full[list(active)] = coef
                    best, best_residual = full, residual
        if best is None or not best.any():
            raise ValueError("all timings are zero; cannot fit a cost model")
        a, b, c = best / scale
        return cls(a=float(a), b=float(b), c=float(c))

    def describe(self) -> str:
        return f"calibrated model {self.a:.4g} + {self.b:.4g}·s + {self.c:.4g}·s² per microbatch (seconds)"


def time_lengths(model, lengths: Sequence[int], *, repeats: int = 3, device=None) -> list[float]:
    """Median seconds of forward+backward of ``model`` on one random sequence per length.

    Each length is run once to warm up, then ``repeats`` times; the median is kept (robust to the
    occasional allocator or clock hiccup). Gradients are cleared after each run. ``device`` defaults to
    the model's own device. The model must accept ``input_ids`` and ``labels`` (any HF causal LM).
    """
    import torch

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    lengths = [int(s) for s in lengths]
    if any(s < 2 for s in lengths):
        raise ValueError("calibration lengths must be >= 2 tokens")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_once(ids):
        sync()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        sync()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    was_training = model.training
    model.train()
    medians = []
    try:
        for s in lengths:
            ids = torch.randint(0, vocab, (1, s), generator=generator).to(device)
            run_once(ids)  # warm-up: kernels, allocator, autotuning
            medians.append(statistics.median(run_once(ids) for _ in range(repeats)))
    finally:
        model.train(was_training)
    return medians


def calibrate(model, lengths: Sequence[int], *, repeats: int = 3, device=None) -> QuadraticCostModel:
    """Time forward+backward of ``model`` at each length (:func:`time_lengths`); fit ``a + b·s + c·s²``."""
    seconds = time_lengths(model, lengths, repeats=repeats, device=device)
    return QuadraticCostModel.fit([int(s) for s in lengths], seconds)
