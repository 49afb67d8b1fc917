"""Install ODC on a ``fully_shard``-ed model and run its minibatch lifecycle.

    model = ...  # fully_shard applied (by accelerate, or by odc_hf.fsdp.shard_model)
    odc = install_odc(model)                    # collective: registers every unit, publishes the shards
    odc.attach_optimizer(optimizer)             # publish() after every optimizer.step()
    for minibatch in loader:                    # each rank: its own number of microbatches, maybe zero
        for micro in minibatch:
            (loss_sum(model, micro) / global_token_count).backward()
        odc.finish_minibatch(local_token_count) # the one synchronisation; returns the global count
        clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()

Gradients: every row of every reduce-scatter (this rank's own too) is added into its owner's fp32
accumulator; ``finish_minibatch`` makes each ``param.grad`` a view of this rank's accumulator (no copy; ranks
that ran no microbatch get theirs the same way). So gradients are valid from ``finish_minibatch`` until
``publish()``, which zeroes the accumulators for the next minibatch; during the minibatch ``param.grad``
reads as zeros. FSDP's own gradient division is switched off: the comm sees a plain SUM, so normalise the
loss by the global token count.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from odc_hf.fsdp import internals
from odc_hf.fsdp.hooks import ODCAllGather, ODCReduceScatter
from odc_hf.transport import DEFAULT_TIMEOUT_S, ODCError, Transport, UnitSpec, make_transport
from odc_hf.transport.failures import report_failure


@dataclasses.dataclass
class ODCUnit:
    """One FSDP unit under ODC: its params in FSDP's order, each with its offset in the unit's flat shard."""

    name: str
    module: FSDPModule
    fsdp_params: list
    offsets: list[int]
    spec: UnitSpec
    id: int
    transport: Transport
    owner: ODCHandle
    rank: int
    world_size: int


def _validate_unit(name: str, module: FSDPModule, groups: list, world_size: int) -> list:
    if len(groups) > 1:
        raise NotImplementedError(
            f"unit {name!r} has {len(groups)} FSDP param groups; ODC supports one per module"
        )
    group = groups[0]
    mesh, post_forward = internals.mesh_info(group)
    if mesh.mesh.ndim != 1:
        raise NotImplementedError(
            f"unit {name!r} is sharded on a {mesh.mesh.ndim}-D mesh (HSDP?); ODC needs a 1-D mesh"
        )
    if post_forward is not None and post_forward.shard_mesh_size != mesh.shard_mesh_size:
        raise NotImplementedError(
            f"unit {name!r} uses an integer reshard_after_forward; ODC supports True/False only"
        )
    if mesh.mesh.size() != world_size:
        raise NotImplementedError(
            f"unit {name!r} is sharded over {mesh.mesh.size()} ranks, the ODC group has {world_size}"
        )
    params = internals.fsdp_params(group)
    for fp in params:
        p = fp.sharded_param
        if len(p.placements) != 1:
            raise NotImplementedError(
                f"unit {name!r}: parameter with placements {p.placements} (tensor parallel?)"
            )
        if fp.fsdp_placement.dim != 0:
            raise NotImplementedError(
                f"unit {name!r}: ODC supports Shard(0) parameters only, got {fp.fsdp_placement}"
            )
        if fp.offload_to_cpu:
            raise NotImplementedError(f"unit {name!r}: CPU offload is not supported with ODC")
        if not p.requires_grad:
            raise NotImplementedError(
                f"unit {name!r} holds a frozen parameter; put frozen parameters in their own unit or outside FSDP"
            )
    dtypes = internals.all_gather_dtype(group, params)
    if len(dtypes) != 1:
        raise NotImplementedError(f"unit {name!r} mixes parameter dtypes {dtypes}")
    return params, dtypes.pop()


class ODCHandle:
    """The ODC state of one model: its units, the transport, and the minibatch lifecycle."""

    def __init__(self, model: torch.nn.Module, transport: Transport):
        self.model = model
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.units: list[ODCUnit] = []
        self.minibatch = 0
        self.published = False
        self.reduces_unused_params = False
        self._zero_outputs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._closed = False

    # -- setup -------------------------------------------------------------------------------------
    def _install(self) -> None:
        seen: set[int] = set()  # fully_shard([a, b, c]) makes three FSDPModules that share one param group
        for name, module in self.model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            if getattr(module, "_odc_installed", False):
                raise ODCError(f"ODC is already installed on {name or 'the root module'!r}")
            groups = internals.param_groups(module)
            module._odc_installed = True
            if not groups or id(groups[0]) in seen:
                continue  # owns no parameters (FSDP never calls its comms), or its group is already done
            seen.add(id(groups[0]))
            label = name or "<root>"
            params, dtype = _validate_unit(label, module, groups, self.world_size)
            offsets, total = [], 0
            for fp in params:
                offsets.append(total)
                total += fp.padded_sharded_param_size.numel()
            spec = UnitSpec(name=label, shard_numel=total, param_dtype=dtype)
            unit = ODCUnit(label, module, params, offsets, spec, self.transport.register(spec), self.transport,
                           self, self.rank, self.world_size)  # fmt: skip
            module.set_custom_all_gather(ODCAllGather(unit))
            module.set_custom_reduce_scatter(ODCReduceScatter(unit))
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_reduce_scatter_unused_params"):  # torch >= 2.12: keeps the layout fixed
                module.set_reduce_scatter_unused_params(True, recurse=False)
                self.reduces_unused_params = True
            self.units.append(unit)
        if not self.units:
            raise ValueError(
                "install_odc: the model has no FSDPModule with parameters; apply fully_shard first"
            )

    # -- hooks call these --------------------------------------------------------------------------
    def check_can_gather(self, unit: ODCUnit) -> None:
        if not self.published:
            raise ODCError(
                f"rank {self.rank}: forward of unit {unit.name!r} in minibatch {self.minibatch} before publish(): "
                "call odc.publish() after optimizer.step() (or odc.attach_optimizer(optimizer))"
            )

    def zero_output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of one all-zero buffer (per dtype and device) shared by every unit's reduce-scatter output."""
        key = (dtype, torch.device(device))
        buffer = self._zero_outputs.get(key)
        if buffer is None or buffer.numel() < numel:
            largest = max(u.spec.shard_numel for u in self.units)
            buffer = torch.zeros(max(numel, largest), dtype=dtype, device=device)
            self._zero_outputs[key] = buffer
        return buffer[:numel]

    # -- the minibatch lifecycle -------------------------------------------------------------------
    @torch.no_grad()
    def finish_minibatch(self, local_tokens: float = 0.0) -> float:
        """End the minibatch: wait for every rank, fold the accumulators into ``param.grad``.

        ``local_tokens`` is summed over ranks and returned (use it as the loss normaliser, or pass 0).
        """
        if not self.published:
            raise ODCError(f"rank {self.rank}: finish_minibatch() twice without publish() in between")
        self.transport.minibatch = self.minibatch
        total = self.transport.barrier(local_tokens, what="minibatch barrier")
        for unit in self.units:
            accumulated = self.transport.accumulated(unit.id)
            for fp, offset in zip(unit.fsdp_params, unit.offsets):
                param = fp.sharded_param
                # Shard(0): the shard is contiguous at `offset` (relative to the accumulator, which may itself
                # be a view with a storage offset: so no as_strided here).
                local = accumulated.narrow(0, offset, fp.sharded_size.numel()).view(fp.sharded_size)
                if local.dtype != param.dtype:  # parameters kept in bf16: the gradient must match
                    local = local.to(param.dtype)
                param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                shape=param.size(), stride=param.stride())  # fmt: skip
        self.minibatch += 1
        self.published = False
        return total

    @torch.no_grad()
    def publish(self) -> None:
        """Write every unit's current shard (cast to the all-gather dtype) for peers to read, zero the
        accumulators (ending the gradients' life), then synchronise once."""
        for unit in self.units:
            self.transport.reset_accumulator(unit.id)
            staging = self.transport.staging(unit.id)
            for fp, offset in zip(unit.fsdp_params, unit.offsets):
                local = fp.sharded_param.to_local().reshape(-1)
                staging[offset : offset + local.numel()].copy_(local)
        self.transport.minibatch = self.minibatch
        self.transport.barrier(what="publish barrier")
        self.published = True

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Publish after every ``optimizer.step()``; returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self.publish())

    @contextlib.contextmanager
    def failure_guard(self):
        """Tell every peer at once, with the exception's type and message, when this rank raises inside; where a
        peer failed first, raise :class:`~odc_hf.transport.PeerFailedError` naming it instead
        (:func:`odc_hf.transport.failures.report_failure`, which also releases peers blocked in collectives)."""
        try:
            yield self
        except BaseException as err:
            report_failure(self.transport, err, announce=self.transport.abort)
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.close()

    def __enter__(self) -> ODCHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.transport.abort(f"{exc_type.__name__}: {exc}"[:400])
        self.close()


def install_odc(
    model: torch.nn.Module,
    *,
    transport: Transport | None = None,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    shm_dir: str | None = None,
) -> ODCHandle:
    """Collective: put ODC comms on every FSDP unit of ``model`` and publish the current parameters."""
    world_size = dist.get_world_size(group)
    if world_size < 2:
        raise ValueError("install_odc needs at least 2 ranks; with one there is nothing to communicate")
    if transport is None:
        device = next(model.parameters()).device
        transport = make_transport(group, device=device, timeout_s=timeout_s, shm_dir=shm_dir)
    handle = ODCHandle(model, transport)
    handle._install()
    handle.publish()
    return handle
