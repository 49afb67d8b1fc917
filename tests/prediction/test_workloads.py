"""Synthetic length generators follow docs/design.md ("Workloads")."""

import numpy as np
import pytest

from odc_hf.prediction.workloads import WORKLOADS, generate_lengths

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
    lengths = generate_lengths("longalign", N, seed=0)
    assert lengths.min() >= 8192 and lengths.max() <= 65536
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
    with pytest.raises(ValueError, match="unknown workload"):
        generate_lengths("c4", 10, 0)
    with pytest.raises(ValueError, match="num_samples"):
        generate_lengths("tulu", -1, 0)
    with pytest.raises(ValueError, match="max_length"):
        generate_lengths("tulu", 10, 0, max_length=0)
