"""Seeded synthetic sequence-length generators and reference model shapes (docs/design.md, "Workloads").

No data set is downloaded: the benchmarks draw lengths from distributions fitted to published
statistics of the workloads the ODC paper evaluates. All lengths are total tokens of one training
sequence (prompt + response for GRPO). Constants are written out below with their sources.

| name        | generator                                                                          | default cap |
|-------------|------------------------------------------------------------------------------------|-------------|
| longalign   | lognormal(median 17k, σ 0.5), resampled until inside [8k, 64k]                     | 64k         |
| swe_smith   | lognormal(median 20k, σ 1.0), clipped at the cap                                    | 128k        |
| grpo_aime   | prompt U[100, 300] + response 30% lognormal(median 3k) + 70% lognormal(median 9k), | 8k          |
|             | response clipped so the sequence fits the cap (point mass at the cap)              |             |
| tulu        | lognormal(median 500, σ 1.0), clipped at the cap                                    | 4k          |

"k" is 1024 for the context-window bounds (8k, 64k, ...) and 1000 for the fitted medians. docs/design.md
gives no σ for the GRPO components: 0.5 is used for both. ``max_length`` clips every workload (the
trainer's maximum sequence length); for LongAlign it clips after the [8k, 64k] truncation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["WORKLOADS", "QWEN2_5_SHAPES", "generate_lengths", "qwen2_5_config"]

KIB = 1024
WORKLOADS = ("longalign", "swe_smith", "grpo_aime", "tulu")
DEFAULT_MAX_LENGTH = {"longalign": 64 * KIB, "swe_smith": 128 * KIB, "grpo_aime": 8 * KIB, "tulu": 4 * KIB}
GRPO_SIGMA = 0.5


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int) -> np.ndarray:
    return rng.lognormal(mean=np.log(median), sigma=sigma, size=size)


def _longalign(rng, n):
    low, high = 8 * KIB, 64 * KIB
    out = np.empty(0)
    while out.size < n:  # truncated distribution: redraw what falls outside [low, high]
        draw = _lognormal(rng, 17_000, 0.5, 2 * (n - out.size) + 16)
        out = np.concatenate([out, draw[(draw >= low) & (draw <= high)]])
    return out[:n]


def _grpo_aime(rng, n, max_length):
    prompts = rng.integers(100, 301, size=n)
    correct = rng.random(n) < 0.3  # right answers are ~3x shorter than wrong ones
    responses = np.where(
        correct, _lognormal(rng, 3_000, GRPO_SIGMA, n), _lognormal(rng, 9_000, GRPO_SIGMA, n)
    )
    return prompts + np.minimum(np.rint(responses), np.maximum(max_length - prompts, 1))


def generate_lengths(name: str, num_samples: int, seed: int, *, max_length: int | None = None) -> np.ndarray:
    """``num_samples`` integer sequence lengths (>= 1, <= max_length) of workload ``name``, seeded."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")
    if int(num_samples) != num_samples or num_samples < 0:
        raise ValueError(f"num_samples must be a non-negative integer, got {num_samples}")
    cap = DEFAULT_MAX_LENGTH[name] if max_length is None else max_length
    if int(cap) != cap or cap < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length}")
    rng = np.random.default_rng(seed)
    n = int(num_samples)
    if name == "longalign":
        raw = _longalign(rng, n)
    elif name == "swe_smith":
        raw = _lognormal(rng, 20_000, 1.0, n)
    elif name == "grpo_aime":
        raw = _grpo_aime(rng, n, int(cap))
    else:
        raw = _lognormal(rng, 500, 1.0, n)
    return np.clip(np.rint(raw), 1, int(cap)).astype(np.int64)


# Qwen2.5 dense shapes (head_dim 128), the docs/design.md table: used for FLOP cost models.
QWEN2_5_SHAPES = {
    "1.5B": dict(
        num_hidden_layers=28,
        hidden_size=1536,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151_936,
    ),
    "7B": dict(
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152_064,
    ),
    "14B": dict(
        num_hidden_layers=48,
        hidden_size=5120,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=13824,
        vocab_size=152_064,
    ),
    "32B": dict(
        num_hidden_layers=64,
        hidden_size=5120,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=27648,
        vocab_size=152_064,
    ),
}


def qwen2_5_config(size: str):
    """A ``transformers.Qwen2Config`` with the Qwen2.5-``size`` shape (no weights needed)."""
    if size not in QWEN2_5_SHAPES:
        raise ValueError(f"unknown Qwen2.5 size {size!r}; choose one of {sorted(QWEN2_5_SHAPES)}")
    from transformers import Qwen2Config

    return Qwen2Config(**QWEN2_5_SHAPES[size])
