"""Install ODC on a ``fully_shard``-ed model and run its minibatch lifecycle.

    model = ...  # fully_shard applied (accelerate, odc_hf.fsdp.shard_model), 1-D or (replicate, shard) mesh
    odc = install_odc(model)                    # collective: registers every unit, publishes the shards
    odc.attach_optimizer(optimizer)             # publish() after every optimizer.step()
    for minibatch in loader:                    # each rank: its own number of microbatches, maybe zero
        for micro in minibatch:
            (loss_sum(model, micro) / global_token_count).backward()
        odc.finish_minibatch(local_token_count) # the one synchronisation; returns the global count
        clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()

Gradients: every row of every reduce-scatter (this rank's own too) is added into its owner's fp32
accumulator; ``finish_minibatch`` makes each trainable ``param.grad`` a view of this rank's accumulator (no copy;
ranks that ran no microbatch get theirs the same way). So gradients are valid from ``finish_minibatch`` until
``publish()``, which zeroes the accumulators for the next minibatch; during the minibatch ``param.grad``
reads as zeros. FSDP's own gradient division is switched off: the comm sees a plain SUM, so normalise the
loss by the global token count. Frozen parameters get no gradient and no accumulator; their shards are
published once.

HSDP (a 2-D ``(replicate, shard)`` mesh): ODC runs within each shard group (one node), FSDP2's per-microbatch
cross-replica all-reduce is switched off, and ``finish_minibatch`` sums each accumulator over the replicate
group once (:mod:`odc_hf.transport.replicas`), before the gradients are exposed. On an R x 1 mesh (pure
replication) there is nothing to gather or scatter: FSDP2 accumulates locally and that one all-reduce is all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from odc_hf.fsdp import internals
from odc_hf.fsdp.full_parameters import full_parameters
from odc_hf.fsdp.hooks import ODCAllGather, ODCReduceScatter, ReplicaOnlyReduceScatter
from odc_hf.fsdp.units import ODCUnit, Topology, find_units
from odc_hf.transport import DEFAULT_TIMEOUT_S, ODCError, Transport, make_transport
from odc_hf.transport.base import PeerFailedError, PeerTimeoutError
from odc_hf.transport.control import group_ranks
from odc_hf.transport.failures import report_failure
from odc_hf.transport.replicas import ReplicaSync


class ODCHandle:
    """The ODC state of one model: its units, the transport(s), and the minibatch lifecycle."""

    def __init__(self, model: torch.nn.Module, units: list[ODCUnit], topology: Topology,
                 transport: Transport | None, replicas: ReplicaSync | None):  # fmt: skip
        self.model = model
        self.units = units
        for unit in units:
            unit.owner = self
        self.topology = topology
        self.transport = transport
        """The one-sided transport over the shard group; ``None`` on a shard group of one rank (R x 1 mesh)."""
        self.replicas = replicas
        """The once-per-minibatch all-reduce over the replicate group; ``None`` without replicas."""
        self.rank = dist.get_rank(topology.shard_group)
        self.world_size = topology.shard_size
        self.global_rank = dist.get_rank()
        self.minibatch = 0
        self.published = False
        self.reduces_unused_params = False
        self._zero_outputs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._publish_hooks: dict[int, RemovableHandle] = {}  # per attached optimizer (by id): its step hook
        self._closed = False

    def describe(self) -> str:
        """One line: the transport, the mesh and the device, e.g. for a run's summary."""
        transport = self.transport.describe() if self.transport is not None else "no shard-group transport (R x 1)"
        return f"{transport}; mesh {self.topology.describe()}; {self._device()}"

    @property
    def replicated(self) -> bool:
        """Whether the mesh is 2-D (HSDP): FSDP2's cross-replica all-reduce is off and ODC's runs instead."""
        return self.topology.replicate_group is not None

    # -- setup -------------------------------------------------------------------------------------
    def _install(self) -> None:
        for unit in self.units:
            module = unit.module
            if self.transport is not None:
                unit.id = self.transport.register(unit.spec)
                module.set_custom_all_gather(ODCAllGather(unit))
                module.set_custom_reduce_scatter(ODCReduceScatter(unit))
            else:  # shard group of one: FSDP2 runs no all-gather / reduce-scatter comm
                module.set_custom_reduce_scatter(ReplicaOnlyReduceScatter(unit))
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            if self.replicated:  # HSDP: ODC sums over the replicas once per minibatch instead
                module.set_requires_all_reduce(False, recurse=False)
            if hasattr(module, "set_reduce_scatter_unused_params"):  # torch >= 2.12: keeps the layout fixed
                module.set_reduce_scatter_unused_params(True, recurse=False)
                self.reduces_unused_params = True
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module._odc_installed = True
        if self.transport is not None and self.replicas is not None:
            self.transport.control.remote_check = (
                self.replicas.check
            )  # a failure on another node ends our waits

    # -- hooks call these --------------------------------------------------------------------------
    def check_can_gather(self, unit: ODCUnit) -> None:
        if not self.published:
            raise ODCError(
                f"rank {self.global_rank}: forward of unit {unit.name!r} in minibatch {self.minibatch} before "
                "publish(): call odc.publish() after optimizer.step() (or odc.attach_optimizer(optimizer))"
            )

    def zero_output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of one all-zero buffer (per dtype and device) shared by every unit's reduce-scatter output."""
        key = (dtype, torch.device(device))
        buffer = self._zero_outputs.get(key)
        if buffer is None or buffer.numel() < numel:
            largest = max(u.spec.accum_numel for u in self.units)
            buffer = torch.zeros(max(numel, largest), dtype=dtype, device=device)
            self._zero_outputs[key] = buffer
        return buffer[:numel]

    # -- the minibatch lifecycle -------------------------------------------------------------------
    def _accumulator(self, unit: ODCUnit) -> torch.Tensor:
        """This rank's complete (within the shard group) fp32 gradient shard of ``unit``'s trainable params."""
        if self.transport is not None:
            return self.transport.accumulated(unit.id)
        kept = internals.partial_reduce_output(unit.param_group)  # R x 1: FSDP2 accumulated it locally
        if kept is not None:
            unit.fallback = None
            return kept
        if unit.fallback is None:  # this rank has run no microbatch yet: its gradient is zero
            unit.fallback = torch.zeros(unit.spec.accum_numel, dtype=torch.float32, device=self._device())
        return unit.fallback

    def _device(self) -> torch.device:
        return self.units[0].slots[0].param.device

    def reshard(self) -> None:
        """Shard every unit again (FSDP2's public ``reshard()``; a no-op for a unit already sharded).

        A forward without backward (an evaluation, a generation, a frozen model's scoring) leaves the units that do
        not reshard after forward (FSDP2's root) gathered: their modules show whole parameters, not the sharded ones
        that the optimizer, the clip and in-place updates of the shards must see, and hold the whole tensors in
        memory until a backward reshards them (a frozen model has none)."""
        for unit in self.units:
            unit.module.reshard()

    @torch.no_grad()
    def finish_minibatch(self, local_tokens: float = 0.0) -> float:
        """End the minibatch: wait for every rank, fold the accumulators into the trainable ``param.grad``.

        ``local_tokens`` is summed over all ranks (every shard group) and returned: use it as the loss
        normaliser, or pass 0.
        """
        if not self.published:
            raise ODCError(f"rank {self.global_rank}: finish_minibatch() twice without publish() in between")
        total = float(local_tokens)
        if self.transport is not None:
            self.transport.minibatch = self.minibatch
            try:
                total = self.transport.barrier(total, what="minibatch barrier")
            except (PeerFailedError, PeerTimeoutError) as err:
                if self.replicas is not None:  # the other nodes cannot see this node's control block
                    self.replicas.announce(str(err))
                raise
        # The gradients below go to the sharded parameters, which the clip and the optimizer must see through the
        # modules; on a rank that trained no microbatch since an evaluation or a generation, the root is gathered.
        self.reshard()
        trainable = [u for u in self.units if not u.spec.gather_only]
        accumulators = [self._accumulator(u) for u in trainable]
        if self.replicas is not None:
            count = torch.tensor([total], dtype=torch.float64, device=self._device())
            self.replicas.all_reduce(
                [count, *accumulators], what="cross-replica all-reduce", minibatch=self.minibatch
            )
            total = float(count.item())
        for unit, accumulated in zip(trainable, accumulators):
            for slot in unit.trainable:
                param = slot.param
                # Shard(0): the shard is contiguous at its offset (relative to the accumulator, which may itself
                # be a view with a storage offset: so no as_strided here).
                local = accumulated.narrow(0, slot.accum_offset, slot.fsdp_param.sharded_size.numel())
                local = local.view(slot.fsdp_param.sharded_size)
                if local.dtype != param.dtype:  # parameters kept in bf16: the gradient must match
                    local = local.to(param.dtype)
                param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                shape=param.size(), stride=param.stride())  # fmt: skip
        self.minibatch += 1
        self.published = False
        return total

    @torch.no_grad()
    def publish(self, *, frozen: bool = True) -> None:
        """Write every unit's current shard (cast to the all-gather dtype) for peers to read, zero the
        accumulators (ending the gradients' life), then synchronise once.

        ``frozen=False`` (what :meth:`attach_optimizer` does after each step) skips the frozen parameters:
        their shards were published once and never change. Call ``publish()`` (all of them) after loading a
        checkpoint.
        """
        for unit in self.units:
            if self.transport is None:  # R x 1: nothing to publish (no gathers), only the gradient to reset
                kept = internals.partial_reduce_output(unit.param_group)
                for accumulated in (kept, unit.fallback):
                    if accumulated is not None:
                        accumulated.zero_()
                continue
            self.transport.reset_accumulator(unit.id)
            staging = self.transport.staging(unit.id)
            as_bytes = unit.spec.param_dtype == torch.uint8
            for slot in unit.slots:
                if not (frozen or slot.trainable):
                    continue
                local = slot.param.to_local().reshape(-1)
                if as_bytes:  # the unit gathers mixed dtypes as raw bytes
                    local = local.view(torch.uint8)
                staging[slot.gather_offset : slot.gather_offset + local.numel()].copy_(local)
        if self.transport is not None:
            self.transport.minibatch = self.minibatch
            try:
                self.transport.barrier(what="publish barrier")
            except (PeerFailedError, PeerTimeoutError) as err:
                if self.replicas is not None:
                    self.replicas.announce(str(err))
                raise
        self.published = True

    # -- reductions of one number, and clipping ----------------------------------------------------
    def reduce_sum(self, value: float, *, what: str = "reduction barrier") -> float:
        """The sum of ``value`` over the shard group (the host barrier, rank order: equal on every rank). On an
        R x 1 mesh each rank holds whole replicas: its own value is the sum."""
        if self.transport is None:
            return float(value)
        self.transport.minibatch = self.minibatch
        return self.transport.barrier(float(value), what=what)

    def reduce_max(self, value: float) -> float:
        """The maximum of ``value`` over the shard group (one all-reduce on the process group)."""
        if self.transport is None:
            return float(value)
        group = self.topology.shard_group
        on_cpu = "gloo" in str(dist.get_backend(group)).lower()
        tensor = torch.tensor([float(value)], dtype=torch.float64, device="cpu" if on_cpu else self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return float(tensor.item())

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the model's gradients to ``max_norm`` without a functional collective
        (:func:`odc_hf.fsdp.gradients.clip_grad_norm_`); returns the norm before clipping."""
        from odc_hf.fsdp.gradients import clip_grad_norm_

        return clip_grad_norm_(self, parameters, max_norm, norm_type)

    @torch.no_grad()
    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole parameter)`` for every parameter of the model, from the published shards: no
        collective, no peer takes part (:mod:`odc_hf.fsdp.full_parameters`). Names as
        ``model.named_parameters()`` gives them (a tied output embedding once, under the input embedding's name);
        values in each unit's all-gather dtype.

        Valid from :meth:`publish` until the next :meth:`finish_minibatch`, where the forward's gathers are valid
        too (e.g. to push the weights into an inference engine before generating). One unit's rows are in memory
        at a time; each tensor yielded is new (keep it or drop it).
        """
        if self.transport is not None and not self.published:
            raise ODCError(
                f"rank {self.global_rank}: full_parameters() in minibatch {self.minibatch} between "
                "finish_minibatch() and publish(): peers may be writing their new shards; call it after the "
                "optimizer step's publish()"
            )
        yield from full_parameters(self.model, self.units, self.transport, self.rank)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Publish (the trainable shards) after every ``optimizer.step()``; returns the hook handle. Once per
        optimizer: attaching it again returns the first handle."""
        if id(optimizer) not in self._publish_hooks:
            self._publish_hooks[id(optimizer)] = optimizer.register_step_post_hook(lambda *_: self.publish(frozen=False))
        return self._publish_hooks[id(optimizer)]

    # -- failures ----------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Tell every peer (this node's through the control block, other nodes' through the store) at once."""
        if self.transport is not None:
            self.transport.abort(reason)
        if self.replicas is not None:
            self.replicas.announce(f"rank {self.global_rank} failed ({reason})")

    @contextlib.contextmanager
    def failure_guard(self):
        """Tell every peer at once, with the exception's type and message, when this rank raises inside; where a
        peer failed first, raise :class:`~odc_hf.transport.PeerFailedError` naming it instead
        (:func:`odc_hf.transport.failures.report_failure`, which also releases peers blocked in collectives)."""
        try:
            yield self
        except BaseException as err:
            report_failure(self.transport, err, announce=self.abort)
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.transport is not None:
                self.transport.close()
            if self.replicas is not None:
                self.replicas.close()

    def __enter__(self) -> ODCHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.abort(f"{exc_type.__name__}: {exc}"[:400])
        self.close()


def install_odc(
    model: torch.nn.Module,
    *,
    transport: Transport | None = None,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    shm_dir: str | None = None,
    peer_memory: str = "auto",
    deterministic: bool = False,
) -> ODCHandle:
    """Collective: put ODC comms on every FSDP unit of ``model`` and publish the current parameters.

    ODC runs over FSDP's shard group, read from the units' mesh (the whole world on a 1-D mesh, one node's
    ranks on a ``(replicate, shard)`` mesh). ``group`` / ``transport``, if given, must span exactly that group.
    ``peer_memory`` / ``deterministic``: the CUDA transport's options (:func:`odc_hf.transport.make_transport`).
    """
    if not dist.is_initialized():
        raise ValueError("install_odc needs torch.distributed initialised (init_process_group) first")
    units, topology = find_units(model)
    if topology.shard_size * topology.replicate_size < 2:
        raise ValueError("install_odc needs at least 2 ranks; with one there is nothing to communicate")
    shard_ranks = group_ranks(topology.shard_group)
    if group is not None and group_ranks(group) != shard_ranks:
        raise ValueError(
            f"install_odc(group=...) spans ranks {group_ranks(group)}, but the model is sharded over ranks "
            f"{shard_ranks} (mesh {topology.describe()}); leave group=None to use FSDP's shard group"
        )
    if transport is not None and transport.world_size != topology.shard_size:
        raise ValueError(
            f"install_odc(transport=...) spans {transport.world_size} ranks, but the model is sharded over "
            f"{topology.shard_size} (mesh {topology.describe()})"
        )
    if transport is None and topology.shard_size > 1:
        device = next(model.parameters()).device
        transport = make_transport(topology.shard_group, device=device, timeout_s=timeout_s, shm_dir=shm_dir,
                                   peer_memory=peer_memory, deterministic=deterministic)  # fmt: skip
    replicas = None
    if topology.replicate_size > 1:
        replicas = ReplicaSync(topology.shard_group, topology.replicate_group, timeout_s=timeout_s)
    handle = ODCHandle(model, units, topology, transport, replicas)
    handle._install()
    handle.publish()
    return handle
