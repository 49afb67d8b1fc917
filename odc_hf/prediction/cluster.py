"""Communication and step-time model of ODC and FSDP2 on a cluster of nodes (pure: numbers in, seconds out).

The planners price compute (:mod:`odc_hf.balance.plan`); this module adds what crosses the network between
nodes, for the three ways to train on ``R`` nodes of ``S`` GPUs:

- **ODC-HSDP**: parameters, gradients and optimizer state sharded over the ``S`` GPUs of a node and
  replicated across nodes. Within a node ODC gathers and scatter-accumulates over NVLink; across nodes,
  ONE ring all-reduce of each GPU's fp32 accumulator shard over its replicate group after the minibatch
  barrier, not overlapped with compute (that is what ``finish_minibatch`` does).
- **FSDP2-HSDP**: the same layout with FSDP2's collectives within the node, plus FSDP2's cross-replica
  all-reduce of each unit's reduce-scatter output in every microbatch. It starts when the unit's backward
  ends and overlaps the backward of the units after it, so what is exposed is the tail: the last units'
  all-reduces, and any backlog when an all-reduce outlasts a unit's backward.
- **FSDP2 full sharding** over all ``R·S`` GPUs: every unit all-gathers (forward, and again in backward:
  blocks reshard after forward) and reduce-scatters across nodes in every microbatch. The next unit's
  all-gather is issued when a unit's compute starts (one unit of prefetch), a unit's reduce-scatter when its
  backward ends; exposed is whatever the network has not finished when compute would have.

Assumptions (stated in every report that uses this model):

- Communication within a node is free (hidden under compute): the single-GPU calibration predicted the
  measured 2-GPU steps within 5 % without it, and NVLink moves a block's shard in well under a millisecond.
- Each GPU has its own NIC of ``network_gb_per_s`` (GB/s, one direction); a rank's collectives use it one at
  a time, in issue order (a single FIFO queue: conservative when two could share it). No latency term: the
  messages are tens of MB and more.
- A ring all-reduce of ``B`` bytes over ``R`` GPUs (one per node) takes ``2 (R-1)/R · B / bandwidth``.
- A collective over GPUs of several nodes runs NCCL's rings over the rails: each of a node's ``S`` NICs carries
  ``1/S`` of the data, so an all-gather or reduce-scatter of ``D`` bytes in total over ``N`` GPUs takes
  ``(N-1)/N · D / (S · bandwidth)``. That is the best case for a rail-optimised fabric; with fewer NICs
  than GPUs per node, pass the bandwidth each GPU really gets.
- Units: one per transformer block, plus the root unit (embeddings, untied lm_head, final norm), whose
  all-gather opens the forward and whose reduction closes the backward. Compute is split evenly over the
  blocks (the lm_head's share is lumped into them); the forward is ``forward_fraction`` of a microbatch
  (1/4 with activation checkpointing: the backward recomputes the forward), all-gathers move bf16, gradient
  reductions fp32 (``reduce_dtype=float32``, which ODC needs too).
- The optimizer step and what surrounds it cost ``seconds per parameter`` x parameters per GPU, measured on
  2 x H200 (ODC: accumulate into grads, AdamW, publish, two barriers; FSDP2: AdamW).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..balance.cost import decoder_dims

__all__ = [
    "Cluster",
    "ModelShape",
    "StepOverheads",
    "fsdp_full_exposed",
    "fsdp_hsdp_exposed",
    "odc_all_reduce_seconds",
    "rail_collective_seconds",
    "ring_all_reduce_seconds",
    "sharded_state_bytes",
]

PARAM_BYTES = 2  # bf16 all-gathers
GRAD_BYTES = 4  # fp32 gradient reduction and ODC accumulators
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``num_nodes`` nodes of ``gpus_per_node`` GPUs; ``network_gb_per_s`` is each GPU's inter-node bandwidth."""

    gpus_per_node: int = 8
    num_nodes: int = 1
    network_gb_per_s: float = 50.0  # 400 Gb/s per GPU

    def __post_init__(self):
        for name in ("gpus_per_node", "num_nodes"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"Cluster.{name} must be a positive integer, got {value}")
        if not self.network_gb_per_s > 0:
            raise ValueError(
                f"Cluster.network_gb_per_s must be > 0 (GB/s per GPU), got {self.network_gb_per_s}"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def describe(self) -> str:
        if self.num_nodes == 1:
            return f"1 node x {self.gpus_per_node} GPUs"
        return (
            f"{self.num_nodes} nodes x {self.gpus_per_node} GPUs = {self.world_size} GPUs, "
            f"{self.network_gb_per_s:g} GB/s network per GPU"
        )


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the step-time model needs of a dense decoder: FSDP unit sizes and the FLOP-model terms.

    ``layer_params`` is one transformer block (one FSDP unit); ``root_params`` the root unit (embeddings,
    the lm_head when untied, the final norm). ``num_matmul_params`` and ``attn_dim`` are the FLOP model's
    N and heads x head_dim (:class:`~odc_hf.balance.cost.FlopCostModel`).
    """

    name: str
    num_layers: int
    layer_params: int
    root_params: int
    num_matmul_params: int
    attn_dim: int

    def __post_init__(self):
        for field in ("num_layers", "layer_params", "num_matmul_params", "attn_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelShape.{field} must be > 0, got {getattr(self, field)}")
        if self.root_params < 0:
            raise ValueError(f"ModelShape.root_params must be >= 0, got {self.root_params}")

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    def shard_params(self, shards: int) -> int:
        """Parameters one GPU holds when every unit is sharded over ``shards`` GPUs (padded, as FSDP2 does)."""
        return self.num_layers * math.ceil(self.layer_params / shards) + math.ceil(self.root_params / shards)

    @classmethod
    def from_config(cls, config, name: str | None = None) -> ModelShape:
        """From a dense decoder config (Llama / Qwen2 / Mistral attribute names), biases where the config puts them."""
        hidden, layers, heads, kv_heads, head_dim = decoder_dims(
            config, "the estimate needs one; build a ModelShape(...) directly for other shapes"
        )
        q_o = 2 * hidden * heads * head_dim
        k_v = 2 * hidden * kv_heads * head_dim
        mlp = 3 * hidden * config.intermediate_size
        # Llama-style configs say attention_bias for q, k, v and the output projection; Qwen2's have no attribute and
        # biases on q, k, v only; mlp_bias adds the three MLP projections' biases
        attention_bias = getattr(config, "attention_bias", None)
        qkv_bias = attention_bias if attention_bias is not None else getattr(config, "model_type", "") == "qwen2"
        biases = (heads + 2 * kv_heads) * head_dim if qkv_bias else 0
        biases += hidden if attention_bias else 0
        biases += 2 * config.intermediate_size + hidden if getattr(config, "mlp_bias", False) else 0
        layer = q_o + k_v + mlp + biases + 2 * hidden  # two RMSNorm weights
        embed = config.vocab_size * hidden
        tied = bool(getattr(config, "tie_word_embeddings", False))
        return cls(
            name=name or getattr(config, "name_or_path", "") or type(config).__name__,
            num_layers=layers,
            layer_params=layer,
            root_params=embed + (0 if tied else embed) + hidden,
            num_matmul_params=layers * (q_o + k_v + mlp) + embed,  # the lm_head is a matmul, tied or not
            attn_dim=heads * head_dim,
        )

    def describe(self) -> str:
        return f"{self.name} ({self.num_params / 1e9:.2f}B parameters, {self.num_layers} layers)"


@dataclass(frozen=True, kw_only=True)
class StepOverheads:
    """Seconds per parameter held by a GPU for what runs once per step besides forward and backward."""

    odc_s_per_param: float
    fsdp_s_per_param: float
    source: str = ""

    def odc(self, shape: ModelShape, shards: int) -> float:
        return self.odc_s_per_param * shape.shard_params(shards)

    def fsdp(self, shape: ModelShape, shards: int) -> float:
        return self.fsdp_s_per_param * shape.shard_params(shards)


def ring_all_reduce_seconds(num_bytes: float, ranks: int, gb_per_s: float) -> float:
    """Ring all-reduce of ``num_bytes`` per rank over ``ranks`` ranks: ``2 (R-1)/R · bytes / bandwidth``."""
    return 2.0 * (ranks - 1) / ranks * num_bytes / (gb_per_s * GB)


def rail_collective_seconds(total_bytes: float, cluster: Cluster) -> float:
    """All-gather (output) or reduce-scatter (input) of ``total_bytes`` over all GPUs of several nodes.

    NCCL's rings over the rails: each of a node's S NICs carries 1/S of the ring traffic,
    ``(N-1)/N · total / (S · bandwidth)``. Zero on one node (NVLink, hidden under compute by assumption).
    """
    if cluster.num_nodes == 1:
        return 0.0
    n = cluster.world_size
    return (n - 1) / n * total_bytes / (cluster.gpus_per_node * cluster.network_gb_per_s * GB)


def odc_all_reduce_seconds(shape: ModelShape, cluster: Cluster) -> float:
    """ODC-HSDP's one all-reduce per minibatch: every GPU's fp32 accumulator shard over its replicate group."""
    shard_bytes = GRAD_BYTES * shape.shard_params(cluster.gpus_per_node)
    return ring_all_reduce_seconds(shard_bytes, cluster.num_nodes, cluster.network_gb_per_s)


def _split(compute: np.ndarray, shape: ModelShape, forward_fraction: float):
    """Per-block forward and backward seconds of microbatches that take ``compute`` seconds."""
    compute = np.asarray(compute, dtype=np.float64)
    return forward_fraction * compute / shape.num_layers, (1 - forward_fraction) * compute / shape.num_layers


def fsdp_hsdp_exposed(
    compute, shape: ModelShape, cluster: Cluster, *, forward_fraction: float = 0.25
) -> np.ndarray:
    """Seconds FSDP2-HSDP's cross-replica all-reduces add to microbatches of ``compute`` seconds each.

    Backward runs blocks last to first, then the root unit; each unit's all-reduce (its fp32 reduce-scatter
    output, ``layer_params / S`` elements) is queued when its backward ends. Exposed = when the queue drains
    minus when compute ends: at least the last block's and the root unit's all-reduces.
    """
    compute = np.asarray(compute, dtype=np.float64)
    if cluster.num_nodes == 1:
        return np.zeros_like(compute)
    S, R, bw = cluster.gpus_per_node, cluster.num_nodes, cluster.network_gb_per_s
    block = ring_all_reduce_seconds(GRAD_BYTES * math.ceil(shape.layer_params / S), R, bw)
    root = ring_all_reduce_seconds(GRAD_BYTES * math.ceil(shape.root_params / S), R, bw)
    forward, backward = _split(compute, shape, forward_fraction)
    done = forward * shape.num_layers
    network = np.zeros_like(compute)
    for _ in range(shape.num_layers):
        done = done + backward
        network = np.maximum(network, done) + block
    network = np.maximum(network, done) + root
    return network - done


def fsdp_full_exposed(
    compute, shape: ModelShape, cluster: Cluster, *, forward_fraction: float = 0.25
) -> np.ndarray:
    """Seconds FSDP2's all-gathers / reduce-scatters across nodes add to microbatches of ``compute`` seconds.

    Forward: the root unit's all-gather, then block i's all-gather issued when block i-1's compute starts
    (one unit of prefetch); a block computes once its parameters are in. Backward, blocks last to first:
    the block is gathered again (resharded after forward), the next one's gather issued as it starts, its
    reduce-scatter queued as it ends; the root unit's reduce-scatter closes the microbatch. One FIFO queue.
    """
    compute = np.asarray(compute, dtype=np.float64)
    if cluster.num_nodes == 1:
        return np.zeros_like(compute)
    gather = rail_collective_seconds(PARAM_BYTES * shape.layer_params, cluster)
    scatter = rail_collective_seconds(GRAD_BYTES * shape.layer_params, cluster)
    forward, backward = _split(compute, shape, forward_fraction)
    layers = shape.num_layers
    network = np.full_like(compute, rail_collective_seconds(PARAM_BYTES * shape.root_params, cluster))
    busy = network.copy()  # compute free from: the embedding needs the root unit
    gathered = network + gather  # block 0's parameters
    network = gathered
    for i in range(layers):
        start = np.maximum(busy, gathered)
        if i + 1 < layers:
            gathered = np.maximum(network, start) + gather
            network = gathered
        busy = start + forward
    gathered = np.maximum(network, busy) + gather  # backward re-gathers the last block
    network = gathered
    for i in reversed(range(layers)):
        start = np.maximum(busy, gathered)
        if i > 0:
            gathered = np.maximum(network, start) + gather
            network = gathered
        busy = start + backward
        network = np.maximum(network, busy) + scatter
    network = np.maximum(network, busy) + rail_collective_seconds(GRAD_BYTES * shape.root_params, cluster)
    return np.maximum(network, busy) - compute


def sharded_state_bytes(shape: ModelShape, shards: int, *, odc: bool) -> float:
    """Persistent training state per GPU: fp32 parameters, fp32 gradients (ODC: its accumulator), AdamW's two
    fp32 moments = 16 bytes per parameter held; ODC adds its bf16 staging shard (2 bytes)."""
    return (16 + (2 if odc else 0)) * shape.shard_params(shards)
