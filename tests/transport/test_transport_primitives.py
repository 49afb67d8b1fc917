"""Gather is bit-exact and scatter-accumulate is exact under random sizes, delays and uneven push counts.

Each check runs on spawned ranks (gloo on CPU; on CUDA: nccl + symmetric memory with a GPU per rank, gloo + CUDA
IPC when ranks share a GPU: `python -m pytest -m gpu tests/`, see tests/README.md for the last GPU runs). Every rank
can recompute what every other rank published or pushed from the shared seed, so the expected values are exact, not
approximations.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from odc_hf.testing import rank_device, run_ranks
from odc_hf.transport import UnitSpec, make_transport

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # GPU runs: tests/README.md


def _skip_unless(backend: str, world_size: int) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (ranks share it when there are fewer GPUs than ranks)")


def _device(backend: str, rank: int) -> torch.device:
    return rank_device()


def _published(seed: int, rank: int, rnd: int, unit: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + rnd * 7919 + unit * 131 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _gather_ranks(rank, world_size, backend, seed, rounds):
    device = _device(backend, rank)
    sizes = [1, 7, 1000, 65537, 3 * 2**17 + 5]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    with make_transport(device=device, timeout_s=60) as transport:
        units = [
            transport.register(UnitSpec(name=f"u{i}", shard_numel=n, param_dtype=d))
            for i, (n, d) in enumerate(zip(sizes, dtypes))
        ]
        checked = 0
        for rnd in range(rounds):
            for u, n, d in zip(units, sizes, dtypes):
                transport.staging(u).copy_(_published(seed, rank, rnd, u, n, d))
            transport.barrier(what="publish barrier")
            for u, n, d in zip(units, sizes, dtypes):
                out = torch.full((world_size * n,), float("nan"), dtype=d, device=device)
                own = torch.full((n,), 42.0, dtype=d, device=device)
                out.view(world_size, n)[rank].copy_(own)
                transport.gather(u, out)
                rows = out.view(world_size, n).cpu()
                for peer in range(world_size):
                    want = own.cpu() if peer == rank else _published(seed, peer, rnd, u, n, d)
                    assert torch.equal(rows[peer], want), (rnd, u, peer)
                    checked += 1
            transport.barrier(what="minibatch barrier")
    return checked


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_is_bit_exact(backend, world_size):
    _skip_unless(backend, world_size)
    checked = run_ranks(_gather_ranks, world_size, backend, 1234, 3, cuda=backend == "cuda")
    assert checked == [3 * 5 * world_size] * world_size


def _pushes(seed: int, rnd: int, sender: int, world_size: int, numel: int, dtype: torch.dtype):
    """The integer-valued rows ``sender`` pushes in round ``rnd`` (0-3 pushes, sometimes none)."""
    rng = random.Random(f"{seed}-{rnd}-{sender}")
    count = rng.choice([0, 0, 1, 2, 3])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return [torch.randint(-8, 9, (world_size * numel,), generator=g).to(dtype) for _ in range(count)]


def _scatter_ranks(rank, world_size, backend, seed, rounds):
    device = _device(backend, rank)
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 5000) for _ in range(3)] + [70001]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    delay = random.Random(f"delay-{seed}-{rank}")
    totals = []
    with make_transport(device=device, timeout_s=60) as transport:
        units = [
            transport.register(UnitSpec(name=f"g{i}", shard_numel=n, param_dtype=torch.bfloat16))
            for i, n in enumerate(sizes)
        ]
        for rnd in range(rounds):
            transport.minibatch = rnd
            mine = {
                u: _pushes(seed, rnd * 100 + u, rank, world_size, n, d)
                for u, n, d in zip(units, sizes, dtypes)
            }
            for u in units:
                for row in mine[u]:
                    if delay.random() < 0.2:
                        time.sleep(delay.random() * 2e-3)
                    transport.scatter_accumulate(u, row.to(device), include_self=(u == 0))
            total = transport.barrier(count=rank + rnd, what="minibatch barrier")
            totals.append(total)
            for u, n, d in zip(units, sizes, dtypes):
                got = transport.take_accumulated(u).cpu()
                want = torch.zeros(n, dtype=torch.float64)
                for sender in range(world_size):
                    if sender != rank or u == 0:  # unit 0's pushes include the sender's own row
                        for row in _pushes(seed, rnd * 100 + u, sender, world_size, n, d):
                            want += row.view(world_size, n)[rank].double()
                assert got.dtype == torch.float32
                assert torch.equal(got.double(), want), (rnd, u, (got.double() - want).abs().max())
            transport.barrier(what="publish barrier")
    expected = [sum(r + rnd for r in range(world_size)) for rnd in range(rounds)]
    assert totals == expected
    return rounds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_scatter_accumulate_is_exact_with_uneven_pushes(backend, world_size):
    _skip_unless(backend, world_size)
    rounds = 200 if world_size == 2 else 100
    done = run_ranks(_scatter_ranks, world_size, backend, 99, rounds, cuda=backend == "cuda")
    assert done == [rounds] * world_size
