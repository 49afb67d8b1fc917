"""What works with several ranks on ONE GPU (gloo process group, every rank on cuda:0): a probe, one check per fresh set
of ranks so that a crash (SIGSEGV) of one check does not hide the others.

    python -m benchmarks.transport.shared_gpu_probe --out benchmarks/results/transport/shared_gpu_probe_h200x1_<date>.json

Checks: CUDA IPC peer buffers with and without expandable segments (read, atomic add), gloo collectives on CUDA
tensors (barrier with device_ids, all_reduce MAX, scatter, all_gather_into_tensor), functional collectives
(``DTensor.full_tensor`` on 1-D and 2-D meshes, ``funcol.all_reduce``), torch's DTensor ``clip_grad_norm_``, a full
state dict through ``get_model_state_dict`` and through odc_hf's CPU gather, and a DCP save + load of a sharded model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _ipc(rank, world):
    import torch.distributed as dist

    from odc_hf.transport import make_transport
    from odc_hf.transport.base import UnitSpec
    from odc_hf.transport.cuda import atomic_accumulate

    torch.cuda.set_device(0)
    with make_transport(device=torch.device("cuda", 0), timeout_s=60, peer_memory="ipc") as t:
        n = 1 << 20
        unit = t.register(UnitSpec(name="probe", shard_numel=n, param_dtype=torch.bfloat16))
        t.staging(unit).fill_(rank + 1)
        t.barrier()
        out = torch.zeros(world * n, dtype=torch.bfloat16, device="cuda")
        t.gather(unit, out)
        rows = out.view(world, n)
        read_ok = all(bool((rows[p] == p + 1).all()) for p in range(world) if p != rank)
        t.scatter_accumulate(unit, torch.full((world * n,), float(rank + 1), device="cuda"), include_self=True)
        t.barrier()
        acc = t.accumulated(unit)
        want = sum(range(1, world + 1))
        add_ok = bool((acc == want).all())
        backend = t.peer_memory.backend
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    del atomic_accumulate, dist
    return {"read": read_ok, "atomic_add": add_ok, "backend": backend, "alloc_conf": conf}


def _gloo_collectives(rank, world):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    out = {}
    dist.barrier(device_ids=[rank])
    out["barrier_device_ids"] = True
    t = torch.tensor([float(rank)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = float(t.item()) == world - 1
    g = torch.empty(world, device="cuda")
    dist.all_gather_into_tensor(g, torch.tensor([float(rank)], device="cuda"))
    out["all_gather_into_tensor"] = g.tolist() == [float(r) for r in range(world)]
    recv = torch.empty(2, device="cuda")
    try:
        dist.scatter(recv, [torch.full((2,), float(r), device="cuda") for r in range(world)] if rank == 0 else None,
                     src=0)  # fmt: skip
        out["scatter"] = recv.tolist() == [float(rank)] * 2
    except Exception as err:  # noqa: BLE001 - recorded
        out["scatter"] = f"{type(err).__name__}: {err}"[:200]
    objs = [None] * world
    dist.all_gather_object(objs, rank)
    out["all_gather_object"] = objs == list(range(world))
    return out


def _full_tensor(rank, world, dims):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.cuda.set_device(0)
    shape = (1, world) if dims == 2 else (world,)
    names = ("replicate", "shard") if dims == 2 else ("shard",)
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=names)
    x = torch.arange(world * 3 + 1, dtype=torch.float32, device="cuda")
    placements = [Shard(0)] if dims == 1 else [Replicate(), Shard(0)]
    d = distribute_tensor(x, mesh, placements)
    return bool(torch.equal(d.full_tensor(), x))


def _funcol(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    torch.cuda.set_device(0)
    t = funcol.all_reduce(torch.ones(4, device="cuda"), "sum", dist.group.WORLD)
    return float(t.sum().item()) == 4 * world


def _fsdp_model(rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5)).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _clip_dtensor(rank, world):
    torch.cuda.set_device(0)
    model = _fsdp_model(rank)
    for p in model.parameters():
        p.grad = p.detach().clone()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _full_state_dict_torch(rank, world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.cuda.set_device(0)
    model = _fsdp_model(rank)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: list(v.shape) for k, v in sd.items()}


def _full_state_dict_odc(rank, world):
    from odc_hf.fsdp.state_dict import full_state_dict

    torch.cuda.set_device(0)
    model = _fsdp_model(rank)
    sd = full_state_dict(model, rank0_only=False)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    return all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def _dcp(rank, world, directory):
    import torch.distributed.checkpoint as dcp

    torch.cuda.set_device(0)
    model = _fsdp_model(rank)
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory)
    other = _fsdp_model(rank)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    other.load_state_dict(state["model"])
    return all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), other.parameters()))


def run(name, fn, world, *args, env=None):
    from odc_hf.testing import run_ranks

    start = time.perf_counter()
    outcomes = run_ranks(fn, world, *args, backend="gloo", timeout_s=180, env=env, raise_on_failure=False,
                         start_method="spawn")  # fmt: skip
    result = {
        "name": name, "world": world, "seconds": round(time.perf_counter() - start, 1),
        "ok": all(o.ok for o in outcomes),
        "values": [o.value for o in outcomes],
        "errors": [(o.error or "")[-600:] for o in outcomes if not o.ok],
        "exitcodes": [o.exitcode for o in outcomes],
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--commit", default="")
    args = p.parse_args(argv)
    w = args.world
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"odc_probe_dcp_{os.getpid()}"
    results = [
        run("ipc, expandable segments on", _ipc, w, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        run("ipc, expandable segments off", _ipc, w, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
        run("gloo collectives on CUDA tensors", _gloo_collectives, w),
        run("DTensor.full_tensor, 1-D mesh", _full_tensor, w, 1),
        run("DTensor.full_tensor, 1 x N mesh", _full_tensor, w, 2),
        run("funcol.all_reduce", _funcol, w),
        run("torch clip_grad_norm_ over DTensors", _clip_dtensor, w),
        run("get_model_state_dict(full_state_dict=True)", _full_state_dict_torch, w),
        run("odc_hf full_state_dict (CPU gather)", _full_state_dict_odc, w),
        run("DCP save + load, sharded", _dcp, w, str(tmp)),
    ]
    payload = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
               "commit": args.commit, "command": " ".join(sys.argv), "results": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
