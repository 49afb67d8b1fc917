"""Cost models: estimated forward+backward cost of documents and packed microbatches.

The planners only ever compare costs, so units do not matter (FLOPs, seconds, tokens), but the
*shape* does: attention makes the cost of one document superlinear in its length, and that is the
whole reason to balance by cost rather than by tokens. With padding-free packing (``position_ids``
restarting per document) attention is computed per document, so the cost of a packed microbatch is

    microbatch_cost = max(floor, overhead + sum over its documents of doc_cost(length))

where ``overhead`` is a fixed per-microbatch price and ``floor`` the least a microbatch costs at all
(both zero for the analytic models; fitted by ``odc_hf.prediction.calibrate.calibrate``). The floor is how a real
GPU behaves: a short row is launch-bound (the host issues kernels slower than the GPU runs them, up to a few
thousand tokens for a 1.5B model), while a long row is GPU-bound and its host work hides under the GPU's. Fitting
that with an additive ``a`` instead (``a + b·s + c·s²`` over all lengths) prices every packed row ``a`` too cheap
per extra document, where the floor model matches the measured rows (docs/balancing.md has the measurements).

Three models:

- :class:`FlopCostModel`: ``6·N·s + 6·L·d_attn·s²`` from a model config (docs/design.md). No
  measurements needed; ignores that short sequences are launch-bound on real GPUs.
- :class:`TokenCostModel`: cost = tokens. What "balance by tokens" planners implicitly use; shown
  for comparison, and the sampler's default only because it needs no config.
- :class:`QuadraticCostModel`: ``max(floor, a + b·s + c·s²)`` fitted to timings measured on the target
  device (``odc_hf.prediction.calibrate``, which runs the model), the most faithful when the device is
  available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

__all__ = ["CostModel", "FlopCostModel", "QuadraticCostModel", "TokenCostModel"]


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


def decoder_dims(config, otherwise: str) -> tuple[int, int, int, int, int]:
    """(hidden, layers, attention heads, key/value heads, head_dim) of a dense decoder config (Llama / Qwen2 /
    Mistral attribute names), or a ValueError that ends with ``otherwise`` (what to do instead)."""
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [name for name in needed if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"config {type(config).__name__} lacks {missing}: not a dense decoder config; {otherwise}")
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return hidden, config.num_hidden_layers, heads, kv_heads, head_dim


class CostModel:
    """Base: subclasses define ``overhead`` (and ``floor``) and :meth:`doc_costs`."""

    overhead: float = 0.0
    floor: float = 0.0

    def doc_costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per-document cost (without the per-microbatch overhead), one float per length."""
        raise NotImplementedError

    def price(self, doc_cost_sum: float) -> float:
        """Cost of a non-empty microbatch whose documents cost ``doc_cost_sum``: max(floor, overhead + sum)."""
        return max(self.floor, self.overhead + float(doc_cost_sum))

    def microbatch_cost(self, doc_lengths: Sequence[int] | np.ndarray) -> float:
        """Cost of one packed microbatch (:meth:`price` of its documents); 0.0 when empty.

        An empty microbatch is priced 0: under ODC it is not run at all, and under FSDP the dummy
        step it stands for overlaps a real microbatch of another rank, whose cost sets the pace.
        """
        costs = self.doc_costs(doc_lengths)
        return 0.0 if costs.size == 0 else self.price(costs.sum())

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
        hidden, layers, heads, kv_heads, head_dim = decoder_dims(config, "build FlopCostModel(...) directly")
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
    """``max(floor, a + Σ (b·s + c·s²))`` per microbatch of documents s, usually in seconds
    (``odc_hf.prediction.calibrate``).

    ``a`` is a fixed price per microbatch, ``floor`` the least any microbatch costs (launch-bound rows,
    see the module docstring); ``floor=0`` gives the plain additive model.
    """

    a: float
    b: float
    c: float
    floor: float = 0.0

    def __post_init__(self):
        for name in ("a", "b", "c", "floor"):
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

    def to_dict(self) -> dict:
        """``{"a", "b", "c", "floor"}``: the JSON form :meth:`from_dict` reads (and ``cost_model=`` files hold)."""
        return {"a": self.a, "b": self.b, "c": self.c, "floor": self.floor}

    @classmethod
    def from_dict(cls, data: dict) -> QuadraticCostModel:
        """Read :meth:`to_dict`'s form; ``floor`` may be missing (files written before it existed). Other keys (the
        compute path a file records, raw timings) are ignored."""
        missing = [k for k in ("a", "b", "c") if k not in data]
        if missing:
            raise ValueError(f"a cost model needs keys a, b, c (and optionally floor); missing {missing}")
        return cls(a=float(data["a"]), b=float(data["b"]), c=float(data["c"]), floor=float(data.get("floor", 0.0)))

    @classmethod
    def fit(cls, lengths: Sequence[int], seconds: Sequence[float]) -> QuadraticCostModel:
        """Fit ``max(floor, a + b·s + c·s²)`` to single-document timings (see :meth:`_fit`)."""
        s = as_lengths(lengths)
        t = np.asarray(seconds, dtype=np.float64)
        if t.shape != s.shape:
            raise ValueError(f"lengths and seconds must have the same length, got {s.shape} and {t.shape}")
        if np.unique(s).size < 3:
            raise ValueError("fitting a + b·s + c·s² needs timings at >= 3 distinct lengths")
        if not np.all(np.isfinite(t)) or t.min() < 0:
            raise ValueError("seconds must be finite and >= 0")
        return cls._fit(np.stack([np.ones_like(s), s, s * s], axis=1), t)

    @classmethod
    def fit_microbatches(
        cls, microbatches: Sequence[Sequence[int]], seconds: Sequence[float]
    ) -> QuadraticCostModel:
        """Fit ``max(floor, a + b·Σs + c·Σs²)`` to measured microbatch times (in-situ calibration).

        ``microbatches[i]`` holds the document lengths of a packed microbatch that took ``seconds[i]``
        (forward + backward, as timed in training, so sharding, gathers and packing are included). The
        single-GPU timings of ``odc_hf.prediction.calibrate.calibrate`` can misjudge packed rows in a sharded run;
        this fits the cost the planner will actually see. Same fit as :meth:`fit`, with the floor split on Σs.
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
        return cls._fit(design, t)

    @classmethod
    def _fit(cls, design: np.ndarray, t: np.ndarray) -> QuadraticCostModel:
        """Least squares of ``max(floor, design @ (a, b, c))`` with every coefficient >= 0.

        Rows are taken in order of token count (``design[:, 1]``). Candidate ``k`` says the ``k``
        shortest rows sit on the floor: ``floor`` = their median and ``(a, b, c)`` = the NNLS fit of the
        rest (at least 3 distinct token counts); a candidate whose fit prices its own floor rows above the
        floor, or that splits one token count, is skipped; ``k = 0`` is the plain additive fit. The candidate with
        the least squared error of ``max(floor, a + b·s + c·s²)`` over all rows wins (ties: fewer floor
        rows). Timings that do not grow with length (a launch-bound device) give ``b = c = 0``: then only the
        per-microbatch overhead matters and the planners balance tokens through each document's share of it.
        """
        order = np.argsort(design[:, 1], kind="stable")
        design, t = design[order], t[order]
        best, best_error = None, np.inf
        for k in range(design.shape[0]):
            rest = design[k:]
            if np.unique(rest[:, 1]).size < 3:
                break
            if k and design[k - 1, 1] == design[k, 1]:  # split between distinct token counts only
                continue
            coef = cls._nnls(rest, t[k:])
            if coef is None or (k and coef[1] == 0 and coef[2] == 0):  # a floor needs something above it
                continue
            floor = float(np.median(t[:k])) if k else 0.0
            if k and float(design[k - 1] @ coef) > floor:  # a "floor" row the fit prices above the floor
                continue
            error = float(np.sum((np.maximum(floor, design @ coef) - t) ** 2))
            if error < best_error * (1 - 1e-9):
                best, best_error = (coef, floor), error
        if best is None:
            raise ValueError("all timings are zero; cannot fit a cost model")
        (a, b, c), floor = best
        return cls(a=float(a), b=float(b), c=float(c), floor=floor if floor > a else 0.0)

    @staticmethod
    def _nnls(columns: np.ndarray, t: np.ndarray) -> np.ndarray | None:
        """Exact NNLS over the 7 subsets of (a, b, c): solve each, keep the best with no negative coefficient."""
        scale = np.maximum(columns.max(axis=0), 1e-300)  # conditioning: s² reaches 1e9 and more
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
        return None if best is None or not best.any() else best / scale

    def describe(self) -> str:
        floor = f"max({self.floor:.4g}, " if self.floor else ""
        return (
            f"calibrated model {floor}{self.a:.4g} + {self.b:.4g}·s + {self.c:.4g}·s²{')' if floor else ''} "
            "per microbatch (seconds)"
        )
