"""Synthetic length generators follow docs/design.md ("Workloads")."""

import numpy as np
import pytest

from odc_hf.prediction.workloads import GRPO_SIGMA, WORKLOADS, generate_lengths, qwen2_5_config

N = 20_000


@pytest.mark.parametrize("name", WORKLOADS)
def test_generators_are_seeded_integer_and_within_the_cap(name):
    a = generate_lengths(name, 1000, seed=7)
    assert a.dtype == np.int64 and a.shape == (1000,)
    assert np.array_equal(a, generate_lengths(name, 1000, seed=7))
    assert not np.array_equal(a, generate_lengths(name, 1000, seed=8))
    assert a.min() >= 1
    clipped = generate_lengths(name, 1000, seed=7, max_length=2048)
    assert clipped.max() <= 2048
    assert generate_lengths(name, 0, seed=0).shape == (0,)


def test_longalign_is_a_truncated_lognormal_around_17k():
    lengths = generate_lengths("longalign", N, seed=0, max_length=1 << 20)  # a cap above its own bound
    # truncated at [8k, 64k] by redrawing, not by the cap: ~4% of the samples fall within 1k of the lower bound and
    # ~0.35% would exceed the upper one
    assert 8192 <= lengths.min() < 8300 and 60_000 < lengths.max() <= 65536
    # truncating the lower tail at 8k lifts the median a little above 17k
    assert 17_000 <= np.median(lengths) <= 18_500
    assert 17_000 <= lengths.mean() <= 21_000


def test_swe_smith_is_heavy_tailed_around_20k():
    lengths = generate_lengths("swe_smith", N, seed=0)
    assert np.median(lengths) == pytest.approx(20_000, rel=0.05)
    # lognormal(20k, 1.0) has mean 33k; clipping at 128k trims it (the published mean is ~34.7k)
    assert 28_000 <= lengths.mean() <= 35_000
    assert lengths.max() == 128 * 1024  # clipped at the default cap


def test_grpo_has_a_point_mass_at_the_cap_and_short_right_answers():
    lengths = generate_lengths("grpo_aime", N, seed=0, max_length=8192)
    at_cap = np.mean(lengths == 8192)
    assert 0.35 <= at_cap <= 0.55  # most wrong (9k-median) answers hit an 8k cap
    assert 0.18 <= np.mean(lengths < 4000) <= 0.28  # mostly right answers (30%, 3k median)
    assert lengths.min() >= 100


def test_tulu_is_short_chat():
    lengths = generate_lengths("tulu", N, seed=0)
    assert np.median(lengths) == pytest.approx(500, rel=0.05)
    assert 650 <= lengths.mean() <= 850
    assert lengths.max() <= 4096


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"^unknown workload 'c4'; choose one of \('longalign', 'swe_smith', "):
        generate_lengths("c4", 10, 0)
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=rf"^num_samples must be a non-negative integer, got {bad}$"):
            generate_lengths("tulu", bad, 0)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=rf"^max_length must be a positive integer, got {bad}$"):
            generate_lengths("tulu", 10, 0, max_length=bad)
    with pytest.raises(ValueError, match=r"^unknown Qwen2.5 size '3B'; choose one of \['1.5B', '14B', '32B', '7B'\]$"):
        qwen2_5_config("3B")


def test_caps_below_the_workloads_own_bounds():
    """LongAlign clipped after its [8k, 64k] truncation (every sample at a cap below 8k); GRPO's response shortened so
    prompt + response fit the cap, down to one response token when the prompt alone reaches it; an integral float
    count and cap accepted."""
    assert (generate_lengths("longalign", 50, seed=1, max_length=4096) == 4096).all()
    assert (generate_lengths("tulu", 50, seed=1, max_length=1) == 1).all()  # the smallest cap: one token each
    short = generate_lengths("grpo_aime", 2000, seed=1, max_length=200)
    assert short.max() == 200 and short.min() >= 101  # prompts of 100-300 tokens plus at least one response token
    assert np.array_equal(generate_lengths("tulu", 5.0, seed=3, max_length=100.0), generate_lengths("tulu", 5, 3,
                                                                                                     max_length=100))
    wide = generate_lengths("grpo_aime", 200_000, seed=1, max_length=1 << 22)  # no cap in reach: two lognormal modes
    assert 3_000 < np.median(wide[wide < 6_000]) < 4_000 and 8_500 < np.median(wide[wide >= 6_000]) < 10_500
    # the mean: prompts U[100, 300] (200) + 30% x 3k + 70% x 9k lognormal medians x exp(sigma^2 / 2); standard error
    # 12.5 tokens, prompts drawn from [0, 100) instead would move it by 150
    assert wide.mean() == pytest.approx(200 + np.exp(GRPO_SIGMA**2 / 2) * (0.3 * 3000 + 0.7 * 9000), abs=60)


def test_qwen2_5_shapes_are_the_published_ones():
    config = qwen2_5_config("7B")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (28, 3584, 28, 4, 18944, 152_064)  # fmt: skip
    assert config.hidden_size // config.num_attention_heads == 128
