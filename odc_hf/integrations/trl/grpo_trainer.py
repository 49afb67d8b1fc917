"""TRL GRPO with ODC: ``ODCGRPOTrainer`` (its arguments: ``ODCGRPOConfig``, ``odc_hf.integrations.trl.grpo_config``).

One optimizer step of TRL's ``GRPOTrainer`` (``steps_per_generation == gradient_accumulation_steps``, TRL's
default; a multiple of it spreads a generation batch over several steps, each of the same shape) trains on one
generation batch, split on every rank into ``gradient_accumulation_steps`` padded
microbatches of ``per_device_train_batch_size`` completions; under FSDP collectives the rank holding the longest
completions sets the pace of every layer of every microbatch. Here, per generation:

1. each rank generates its own prompts (``generate()`` under FSDP2 gathers peers' shards one-sidedly, so ranks
   finish at different times without waiting for each other; with ``use_vllm=True`` on its own colocated vLLM
   engine, TRL's ``VLLMGeneration``, its weights pushed from ODC's published shards:
   :mod:`odc_hf.integrations.vllm.sync`) and TRL scores them (advantages are final);
2. every sample gets the loss weight TRL's normalisation gives it (see :func:`sample_weights`): the collective
   trainer's loss is a fixed weighted sum of per-token terms, and only the weights depend on which rank and
   microbatch TRL put a sample in;
3. one exchange (``all_gather_object`` of the unpadded samples), then every rank plans the same split of the
   generation batch by cost (``ODCConfig.balance`` / ``cost_model``) into its microbatches within the budget; ranks
   run different numbers of them. ``ODCConfig.grpo_layout``: ``packed`` microbatches are one row of prompt +
   completion sequences back to back (per-sequence positions, varlen attention: FlashAttention-4 or sdpa_varlen;
   planned as packed rows, like SFT); ``padded`` ones are TRL's layout (planned by :func:`plan_padded`);
4. TRL's own ``compute_loss`` runs per microbatch with the weights folded into the loss mask, so its per-token
   loss (clipping, ``delta``, KL, masks) is used as is; its per-microbatch metric collectives stay local, and the
   metrics are recomputed per TRL microbatch (slice) and aggregated once per step as TRL defines them
   (:mod:`odc_hf.integrations.trl.grpo_metrics`). In the packed layout the model's forward runs on the packed row and
   its per-token log-probs and entropies are put back into TRL's (rows, completion columns) tensors
   (:func:`~odc_hf.integrations.trl.grpo_batch.pack_rows`), where TRL's loss and metrics run unchanged; the reference
   model's (and old-policy) log-probs of the generation phase are taken from packed rows the same way.

TRL private surfaces used, all reached through :mod:`odc_hf.integrations.upstream.trl` (the one TRL version policy,
which lists them and checks them at construction; ``tests/grpo/test_grpo_trl_surface.py``):
``_generate_and_score_completions`` (generation + scoring), ``_get_train_sampler`` (overridden: one dataloader
batch per optimizer step), ``_metrics`` (per-step aggregation), ``_get_per_token_logps_and_entropies`` and
``_compute_loss`` (the metrics' recomputation per slice), and the key names of the batch dict that
``_compute_loss`` reads (``tool_mask`` multiplies the loss mask, ``num_items_in_batch`` normalises ``dapo``). With
vLLM, ``VLLMGeneration``'s sleep flag and the ``LLM`` name its engine is built through
(:mod:`odc_hf.integrations.vllm.sync`, ``tests/grpo/test_grpo_vllm.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler, shuffle_sequence_dict

from odc_hf.balance.padded import plan_padded
from odc_hf.balance.planner import PLANNERS
from odc_hf.fsdp import install_odc, is_sharded, shard_model
from odc_hf.integrations.compute.attention import prepare_attention
from odc_hf.integrations.trainer.metrics import every_rank_values
from odc_hf.integrations.trainer.mixin import ODCMixin
from odc_hf.integrations.trainer.train_data import padded_worst_case, resolve_max_tokens
from odc_hf.integrations.trl.grpo_batch import (
    LOSS_CODE,
    PACKED_KEY,
    TOKEN_COUNT_NORMALISED,
    GRPOBundle,
    collate,
    loss_mask,
    pack_rows,
    padded_columns_multiple,
    sample_length,
    sample_weights,
    scatter_packed,
    unbatch,
)
from odc_hf.integrations.trl.grpo_config import check_arguments, refusals
from odc_hf.integrations.trl.grpo_metrics import MetricRecorder, SliceMetrics, rows
from odc_hf.integrations.upstream.deprecations import quiet_upstream_deprecations
from odc_hf.integrations.upstream.trl import (
    GRPOHooks,
    check_trl_grpo,
    entropy_bonus_enabled,
    generate_and_score_completions,
    last_world_entropy,
    logged_metrics,
    set_last_world_entropy,
    token_entropies,
    trl_entropy_bonus_off,
)
from odc_hf.integrations.vllm.sync import adopt_generation
from odc_hf.integrations.vllm.weights import LoraMerge

logger = logging.getLogger(__name__)


class _PublishSyncedReference(TrainerCallback):
    """``sync_ref_model=True``: TRL's ``SyncRefModelCallback`` mixes the policy into the reference model's
    parameters at the end of every ``ref_model_sync_steps``-th step (``ref = (1 - alpha) ref + alpha policy``, shard
    by shard: both are sharded alike). Peers' gathers of the reference read its published shards, so they are
    published again right after (this callback is added after TRL's)."""

    def __init__(self, handle):
        self.handle = handle

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.handle.publish()


class _GRPOPart:
    """The GRPO specifics on top of :class:`ODCMixin`; see the module docstring."""

    odc_global_batch_option = False  # the batch is TRL's generation batch, sized from its own arguments
    odc_probe_loss_scale = False  # each sample's loss is weighted by odc_hf itself (grpo_batch.sample_weights)

    def __init__(self, *args, **kwargs):
        base = {k: v for k, v in kwargs.items() if k != "odc_config"}  # the base trainer's arguments
        arguments = self._odc_argument("args", args, base)
        if arguments is not None:  # None: TRL's default GRPOConfig, checked below
            check_arguments(arguments, arguments.gradient_accumulation_steps,
                            self._odc_argument("peft_config", args, base))  # fmt: skip
        # Ranks sharing a GPU: TRL sets LOCAL_RANK to accelerate's local process index before it builds each rank's
        # vLLM engine, and vLLM takes that as the engine's GPU; in the shared-GPU mode that index is the rank's GPU
        # (shared_gpu.localize_rank), so each engine starts on the GPU its rank computes on.
        super().__init__(*args, **kwargs)
        check_trl_grpo(self)
        refuse = refusals(self.args, self.odc_folded_accumulation)
        if not self.odc_config.enabled:
            refuse.append("ODCConfig(enabled=False): for the collective baseline use trl.GRPOTrainer itself")
        if refuse:
            raise ValueError("ODCGRPOTrainer does not support " + "; ".join(refuse))
        if self.use_vllm:  # TRL's engine, ODC's weight sync (odc_hf/integrations/vllm/sync.py)
            adopt_generation(self.vllm_generation, self._odc_full_weights, self._odc_lora_merge())
        self.odc_generation_steps = 0  # optimizer steps trained since the last generation
        # optimizer steps one generation batch spans (TRL's steps_per_generation / gradient_accumulation_steps)
        self.odc_steps_per_generation = self.args.steps_per_generation // self.odc_folded_accumulation
        self.odc_bundles: list[tuple[GRPOBundle, dict]] = []  # per step of the generation: its bundle, its plan
        self.odc_root_initialised = False  # see _odc_generate_without_lockstep
        self.odc_plan_summary: dict = {}
        # TRL logs an entropy bonus run's policy loss before dividing it by the accumulation steps, but for the loss
        # types whose normaliser already counts them
        self.odc_policy_loss_factor = 1 if self.loss_type in TOKEN_COUNT_NORMALISED else self.odc_folded_accumulation
        self.odc_ref = self._odc_install_ref() if self.ref_model is not None else None
        if self.odc_ref is not None and self.args.sync_ref_model:
            self.add_callback(_PublishSyncedReference(self.odc_ref))  # after TRL's SyncRefModelCallback
        self.odc_slice_metrics: SliceMetrics | None = None
        self._odc_forward: tuple | None = None  # (log-probs, entropies) of the last training forward
        self._odc_replay: tuple | None = None  # what _get_per_token_logps_and_entropies returns while recomputing
        self._odc_packed: dict | None = None  # the packed row of the microbatch compute_loss is on (packed layout)
        self.odc_entropy_thresholds: torch.Tensor | None = None  # top_entropy_quantile: this step's, per TRL slice
        self._odc_step_entropies: list[torch.Tensor] = []  # the step's entropies per microbatch, from that pass
        self._odc_keep: torch.Tensor | None = None  # the tokens kept in the microbatch compute_loss is on
        self.odc_kept_tokens: torch.Tensor | None = None  # the tokens kept per (rank, TRL slice) of the step
        self.odc_grpo_packed = self._odc_packed_layout()
        if self.accelerator.is_main_process:
            logger.info("odc_hf: GRPO training microbatches %s (grpo_layout=%r)",
                        "packed" if self.odc_grpo_packed else "padded", self.odc_config.grpo_layout)  # fmt: skip

    def _odc_full_weights(self):
        """The policy's whole parameters for the vLLM sync: from ODC's published shards (no collective), or,
        in one process (no ODC, no sharding), the parameters themselves."""
        if self.odc is not None:
            return self.odc.full_parameters()
        model = self.accelerator.unwrap_model(self.model)
        return ((name, param.detach()) for name, param in model.named_parameters())

    def _odc_lora_merge(self) -> LoraMerge | None:
        """How the vLLM sync merges the policy's LoRA adapter (peft's config), ``None`` without one."""
        model = self.accelerator.unwrap_model(self.model)
        configs = getattr(model, "peft_config", None)
        if not configs:
            return None
        adapter = model.active_adapter
        if not isinstance(adapter, str):  # several active adapters
            raise NotImplementedError(f"odc_hf's vLLM weight sync merges one active adapter, got {adapter}")
        return LoraMerge.from_config(configs[adapter], adapter)

    def _odc_packed_layout(self) -> bool:
        """``ODCConfig.grpo_layout`` resolved. ``auto`` packs under a varlen attention that gains from it: the flash
        implementations (faster packed than padded, docs/benchmarks.md has the measurements) and sdpa_varlen off CUDA. It
        keeps the padded rows under sdpa_varlen on CUDA (per-document SDPA calls there are slower packed than padded)
        and under dense-mask attentions (``sdpa``, ``eager``: a packed row would cost full-row attention)."""
        layout = self.odc_config.grpo_layout
        if layout != "auto":
            return layout == "packed"
        attention = self.odc_attention_choice
        return attention.is_flash or (attention.is_varlen and self.accelerator.device.type != "cuda")

    def _odc_install_ref(self):
        """Put the (frozen) reference model on ODC too: its no-grad forwards gather one-sidedly. Published here, and
        again after each of TRL's reference syncs (``sync_ref_model``: :class:`_PublishSyncedReference`)."""
        if self.accelerator.num_processes < 2:
            return None
        ref = self.ref_model
        if not is_sharded(ref):  # CPU path: TRL kept a full replica; shard it like the policy
            ref.to(self.accelerator.device)
            shard_model(ref)
        config = self.odc_config
        return install_odc(ref, timeout_s=config.timeout_s, shm_dir=config.shm_dir, peer_memory=config.cuda_peer_memory,
                           deterministic=config.deterministic)

    # -- data: one dataloader batch (this rank's part of a generation batch) per optimizer step --------------
    def get_train_dataloader(self):
        prepare_attention(self, None)  # FlashAttention-4's kernels compiled before step 1 (no-op elsewhere)
        if hasattr(self.train_dataset, "__len__"):
            self.odc_note_dataset(len(self.train_dataset))  # prompts: their count (no token counts read here)
        return super(ODCMixin, self).get_train_dataloader()  # TRL's loader, with the sampler below

    def odc_train_sampler(self, dataset=None):
        """TRL's ``RepeatSampler`` with one dataloader batch per optimizer step."""
        return RepeatSampler(
            data_source=self.train_dataset if dataset is None else dataset,
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            # TRL: num_iterations * steps_per_generation microsteps, of which an optimizer step takes
            # gradient_accumulation_steps
            repeat_count=self.num_iterations * self.odc_steps_per_generation,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        try:
            return [next(epoch_iterator)], None
        except StopIteration:
            return [], None

    # -- one optimizer step ---------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()  # as Trainer.training_step does before TRL's _prepare_inputs: TRL reads the mode from it
        # TRL trains a generation batch's steps_per_generation slices in order, num_iterations times over: step t after
        # the generation trains its part t mod (steps_per_generation / gradient_accumulation_steps)
        period = self.num_iterations * self.odc_steps_per_generation
        if not self.odc_bundles or self.odc_generation_steps % period == 0:
            self.odc_bundles = self.odc_generate_and_plan(inputs)
            self.odc_generation_steps = 0
        bundle, self.odc_plan_summary = self.odc_bundles[self.odc_generation_steps % self.odc_steps_per_generation]
        self.odc_generation_steps += 1
        if self.top_entropy_quantile < 1.0:
            self.odc_entropy_thresholds, self._odc_step_entropies, self.odc_kept_tokens = (
                self._odc_entropy_thresholds(model, bundle))
        return super().training_step(model, bundle, num_items_in_batch)

    @torch.no_grad()
    def _odc_entropy_thresholds(self, model, bundle: GRPOBundle):
        """``top_entropy_quantile``: TRL keeps, in each of its microbatches, the tokens whose entropy reaches the
        ``1 - top_entropy_quantile`` quantile of that microbatch's entropies on every rank (``get_high_entropy_mask``
        gathers them). ODC's microbatches hold other samples, so before the step's training forwards each rank runs its
        microbatches once without gradients (the same rows and parameters: the entropies the training forwards then
        compute), and one exchange gives every rank the values of each TRL microbatch (slice) of each rank.

        Returns the threshold per slice of the step (``inf`` for a slice without tokens: TRL then keeps none); each
        microbatch's entropies, which decide its tokens (:meth:`get_high_entropy_mask`: the values the thresholds were
        taken from, so that a token whose entropy is its slice's quantile itself is kept, as in TRL); and the tokens
        kept in each rank's TRL microbatch, (ranks, slices): an entropy bonus's normaliser, which TRL takes per
        microbatch on one rank."""
        local: dict[tuple[int, int], list[torch.Tensor]] = {}
        per_microbatch = []
        for microbatch in bundle.microbatches:
            batch = send_to_device(dict(microbatch), self.accelerator.device)
            self._odc_packed = batch.pop(PACKED_KEY, None)
            try:
                input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
                entropies = token_entropies(self, model, input_ids, attention_mask, batch["completion_ids"].size(1))
            finally:
                self._odc_packed = self._odc_forward = None
            per_microbatch.append(entropies.detach())
            keep = loss_mask(batch).bool()
            owners = torch.stack([batch["odc_origin"], batch["odc_slice"]], dim=1)
            for origin, g in owners.unique(dim=0).tolist():
                rows_of = ((batch["odc_origin"] == origin) & (batch["odc_slice"] == g)).to(keep.device)
                local.setdefault((origin, g), []).append(entropies[rows_of][keep[rows_of]].float().cpu())
        mine = {key: torch.cat(values) for key, values in local.items()}
        parts = [mine]
        if self.accelerator.num_processes > 1:
            parts = [None] * self.accelerator.num_processes
            dist.all_gather_object(parts, mine)
        every: dict[tuple[int, int], torch.Tensor] = {}  # a TRL microbatch's rows may sit on several ranks
        for part in parts:
            for key, values in part.items():
                every[key] = torch.cat([every[key], values]) if key in every else values
        slices = self.odc_folded_accumulation
        thresholds = torch.full((slices,), float("inf"))
        kept = torch.zeros(self.accelerator.num_processes, slices)
        for g in range(slices):
            values = [v for (_, h), v in every.items() if h == g]
            values = torch.cat(values) if values else torch.zeros(0)
            if values.numel():
                thresholds[g] = torch.quantile(values, 1 - self.top_entropy_quantile)
        for (origin, g), values in every.items():
            kept[origin, g] += float((values >= thresholds[g]).sum())
        return thresholds, per_microbatch, kept

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's mask of the tokens whose entropy reaches its microbatch's quantile; on an ODC microbatch the tokens
        ``compute_loss`` found reaching their own TRL microbatch's (:meth:`_odc_entropy_thresholds`). ``mask`` there
        carries ODC's sample weights (>= 1 on the loss's tokens): only its non-zero entries are read."""
        if self._odc_keep is None:  # evaluation, or TRL's own layout
            return super().get_high_entropy_mask(entropies, mask, threshold)
        return self._odc_keep & mask.bool()

    @contextlib.contextmanager
    def _odc_generate_without_lockstep(self):
        """``generate()`` with ``synced_gpus=False`` under ODC, for TRL's call (which passes none).

        transformers turns ``synced_gpus`` on for every FSDP2 model (``fully_shard`` marks its modules
        ``_is_fsdp_managed_module``, which ``generate()`` reads): each rank then all-reduces a "finished" flag after
        every token and keeps stepping until the slowest rank is done, the lockstep ODC removes (a collective per token,
        found by tests/fsdp/test_collective_audit.py). Under ODC a forward gathers one-sidedly and needs no peer, so each rank
        stops at its own length. The model object TRL generates with gets that default for the call, then loses it.
        With PEFT, generation also enters below FSDP's root unit (see the comments below).
        """
        model = self.accelerator.unwrap_model(self.model_wrapped)  # what TRL's unwrap_model_for_generation yields
        if self.odc is None or self.use_vllm or "generate" in vars(model):  # vLLM: no policy generate()
            yield
            return
        root = self.model_wrapped
        bypassed = hasattr(model, "peft_config") and isinstance(root, FSDPModule)
        if bypassed and not self.odc_root_initialised:
            # FSDP2 makes the first FSDP module that runs forward its root. The root is the PeftModel, but PEFT's
            # generate() enters the wrapped transformers model, so a first generate would start at an inner unit and
            # fail ("FSDP requires a single root module"). One token through the PeftModel settles the root first
            # (no collective under ODC: the gathers are one-sided).
            with torch.no_grad():
                root(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.accelerator.device))
            self.odc_root_initialised = True
        model.generate = functools.partial(type(model).generate, model, synced_gpus=False)
        try:
            if bypassed:  # the root's own parameters (a PEFT model's final norm) are not gathered by any inner unit
                root.unshard()
            yield
        finally:
            del model.generate
            if bypassed:
                root.reshard()

    def odc_generate_and_plan(self, inputs) -> list[tuple[GRPOBundle, dict]]:
        """Generate and score this rank's prompts, exchange the samples once, return this rank's bundle (and the plan's
        summary) for each optimizer step the generation batch spans."""
        with self._odc_users_arguments(), quiet_upstream_deprecations(), self._odc_generate_without_lockstep():
            batch = generate_and_score_completions(self, inputs)
        if self.odc_ref is not None:  # its scoring forwards left its root gathered (whole tensors, until resharded)
            self.odc_ref.reshard()
        # The microbatches TRL would train on: its shuffle (same RNG draw, so runs stay comparable) and split.
        batch = shuffle_sequence_dict(batch)
        num_slices, size = self.args.steps_per_generation, batch["completion_ids"].size(0)
        accumulation = self.odc_folded_accumulation
        slice_of = torch.arange(size) // max(1, size // num_slices)
        mask = loss_mask(batch).cpu()
        weights = sample_weights(mask, slice_of, loss_type=self.loss_type, num_slices=num_slices,
                                 accumulation=accumulation, world_size=self.accelerator.num_processes,
                                 max_completion_length=self.max_completion_length,
                                 num_items_in_batch=float(batch["num_items_in_batch"]))  # fmt: skip
        local = unbatch(batch, weights)
        if entropy_bonus_enabled(self):  # TRL's bonus: a token mean per TRL microbatch, bnpo's normaliser
            bonus = sample_weights(mask, slice_of, loss_type="bnpo", num_slices=num_slices,
                                   accumulation=accumulation, world_size=self.accelerator.num_processes,
                                   max_completion_length=self.max_completion_length, num_items_in_batch=0.0)  # fmt: skip
            for sample, e in zip(local, bonus.tolist()):
                sample["entropy_weight"] = e
        for sample, g in zip(local, slice_of.tolist()):
            # the optimizer step of the generation that trains it, and its TRL microbatch (slice) within that step:
            # TRL's metrics are defined per slice
            sample["odc_step"], sample["odc_slice"] = divmod(g, accumulation)
            sample["odc_origin"] = self.accelerator.process_index  # the rank whose TRL microbatch holds it
        gathered: list = [local]
        if self.accelerator.num_processes > 1:  # one process: no process group, nothing to exchange
            gathered = [None] * self.accelerator.num_processes
            dist.all_gather_object(gathered, local)  # the one exchange per generation
        steps: list[list[dict]] = [[] for _ in range(self.odc_steps_per_generation)]
        for part in gathered:
            for sample in part:
                steps[sample.pop("odc_step")].append(sample)
        self.odc_weight_scale = min(s["weight"] for step in steps for s in step)  # relative weights >= 1: compute_loss
        return [self._odc_plan_step(samples) for samples in steps]

    def _odc_plan_step(self, samples: list[dict]) -> tuple[GRPOBundle, dict]:
        """One optimizer step's samples (every rank's) -> this rank's bundle of planned microbatches, the summary."""
        lengths = [sample_length(s) for s in samples]
        packed = self.odc_grpo_packed
        # the cuDNN NaN workaround (CUDA_PAD_TO_MULTIPLE_OF) concerns masked padded rows on cuDNN only
        multiple = 1 if packed else padded_columns_multiple(self.accelerator.device.type,
                                                            self.odc_attention_choice.implementation)  # fmt: skip
        prompts = [int(s["prompt_ids"].numel()) for s in samples]
        worst_case = padded_worst_case(lengths, prompts, rows=self.args.per_device_train_batch_size, multiple=multiple)
        max_tokens_per_microbatch = resolve_max_tokens(self.odc_config, lengths, worst_case, truncatable=False)
        world, rank, balance = self.accelerator.num_processes, self.accelerator.process_index, self.odc_config.balance
        if packed:  # rows of whole sequences within the budget, as SFT plans them (dummy microbatches dropped)
            plan = PLANNERS[balance](lengths, world, max_tokens_per_microbatch, self._odc_cost_model())
        else:
            plan = plan_padded(lengths, world, max_tokens_per_microbatch, self._odc_cost_model(), balance,
                               prompts=prompts, multiple=multiple)  # fmt: skip
        mine = [mb for mb in plan.for_rank(rank) if mb]
        pad = getattr(self.processing_class, "tokenizer", self.processing_class).pad_token_id
        bundle = GRPOBundle([collate([samples[i] for i in mb], pad, "cpu", pad_to_multiple_of=multiple, packed=packed)
                             for mb in mine])  # fmt: skip
        return bundle, plan.summary()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on one ODC microbatch, each sample weighted as the collective trainer weighs it.

        TRL's ``dapo`` branch computes ``sum(per_token_loss * mask) / normaliser`` with ``mask = completion_mask *
        tool_mask``. Passing ``tool_mask`` = the sample's weight relative to the smallest one (>= 1, so TRL's
        ``mask.sum().clamp(min=1)`` guards never bite) and a ``num_items_in_batch`` that makes the normaliser the
        inverse of that smallest weight gives ``sum_i w_i * sum_t(per_token_loss * mask)``: every loss type with
        that per-token loss (``LOSS_CODE``: different normalisers only) becomes this one weighted sum, and ``cispo``
        and ``vespo`` (their own per-token losses, ``dapo``'s normaliser, equal weights) run their own branches the
        same way. ``sapo``'s branch takes each sequence's token mean (a weight in the mask cancels there) and their
        mean over the microbatch's B rows; its weights times the sequences' token counts are one value v (1 / (P x G
        x W), TRL's microbatches all holding P rows), so its result times B x v is the weighted sum.
        """
        if "odc_weight" not in inputs:  # evaluation: TRL's own path
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        self._odc_packed = inputs.pop(PACKED_KEY, None)
        slices = inputs.pop("odc_slice")
        weights = inputs.pop("odc_weight")
        entropy_weights = inputs.pop("odc_entropy_weight", None)
        origins = inputs.pop("odc_origin", None)
        kept = None  # the tokens an entropy bonus acts on: all of the loss mask's but with top_entropy_quantile
        if self.odc_entropy_thresholds is not None:  # this microbatch's, in the order the step runs them
            own = self._odc_step_entropies.pop(0)
            thresholds = self.odc_entropy_thresholds[slices.cpu()].to(own.device, own.dtype).unsqueeze(1)
            kept = self._odc_keep = (own >= thresholds) & loss_mask(inputs).bool()
            if entropy_bonus_enabled(self):  # TRL's bonus: a mean over the kept tokens of each (rank, slice)
                tokens = self.odc_kept_tokens[origins.cpu(), slices.cpu()].double().clamp(min=1.0)
                entropy_weights = 1.0 / (tokens * self.odc_folded_accumulation * self.accelerator.num_processes)
        # TRL: normaliser = num_items / W * current_gradient_accumulation_steps (1 here) / steps_per_generation
        inputs["num_items_in_batch"] = torch.tensor(
            self.accelerator.num_processes * self.args.steps_per_generation / self.odc_weight_scale,
            dtype=torch.float32, device=inputs["completion_mask"].device,
        )  # fmt: skip
        # TRL's entropy bonus is a token mean per TRL microbatch: ODC adds it below with those weights instead
        loss_type, self.loss_type = self.loss_type, LOSS_CODE[self.loss_type]
        bonus = entropy_bonus_enabled(self)
        try:
            with trl_entropy_bonus_off(self):
                loss = self._odc_weighted_loss(model, inputs, weights, return_outputs, num_items_in_batch)
                entropies = self._odc_forward[1]
                self._odc_recompute_metrics(model, inputs, slices, weights if bonus else None)
        finally:
            self.loss_type = loss_type
            self._odc_forward = self._odc_packed = self._odc_keep = None
        if bonus:
            loss = loss - self._odc_entropy_bonus(inputs, entropies, entropy_weights, kept)
        return loss

    def _odc_weighted_loss(self, model, inputs: dict, weights: torch.Tensor, *args, policy_only: bool = False):
        """``sum_i w_i * sum_t(per_token_loss * mask)`` over the rows of ``inputs``, through the branch of TRL's loss
        that ``self.loss_type`` names here (a :data:`LOSS_CODE` value; see :meth:`compute_loss`), plus TRL's MoE
        router loss as weighed for this step (none with ``policy_only``: TRL's ``policy_loss`` metric has none). TRL
        adds the router loss to its branch's result, so where that result is scaled (``sapo``) the router loss's
        coefficient is divided by the scale for the call."""
        scale = 1.0
        if self.loss_type == "sapo":
            scale = self._odc_sequence_mean_scale(inputs, weights)
            weights = torch.full_like(weights, self.odc_weight_scale)
        relative = (weights / self.odc_weight_scale).float().unsqueeze(1)
        tool = inputs.get("tool_mask")
        weighted = dict(inputs, tool_mask=relative if tool is None else tool * relative)
        coefficient = self.router_aux_loss_coef
        if self.aux_loss_enabled:
            self.router_aux_loss_coef = 0.0 if policy_only else coefficient / scale
        try:
            loss = super().compute_loss(model, weighted, *args)
        finally:
            self.router_aux_loss_coef = coefficient
        return loss * scale if scale != 1.0 else loss

    def _odc_entropy_bonus(self, inputs: dict, entropies: torch.Tensor, weights: torch.Tensor,
                           kept: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """TRL's entropy bonus of this microbatch's samples: the coefficient TRL applies this step times ``sum_i e_i *
        sum_t(entropy * mask)``, e_i = 1 / (tokens of the sample's TRL microbatch x G x W) (TRL subtracts each of its
        microbatches' token mean, divided by the accumulation steps; DDP averages over ranks). With
        ``use_adaptive_entropy`` the step's token totals are kept for the coefficient's update at its end. ``kept``:
        the tokens it acts on where ``top_entropy_quantile`` keeps only some (the weights then count those)."""
        mask = loss_mask(inputs) if kept is None else loss_mask(inputs) * kept
        per_sample = (entropies * mask).sum(-1)
        if self.use_adaptive_entropy:
            apply = self.entropy_coef if last_world_entropy(self) <= self.args.entropy_target else 0.0
            self.odc_slice_metrics.add_entropy(float(per_sample.detach().sum()), float(mask.sum()))
        else:
            apply = self.entropy_coef
        return apply * (weights.to(per_sample.device, per_sample.dtype) * per_sample).sum()

    def _odc_sequence_mean_scale(self, inputs: dict, weights: torch.Tensor) -> float:
        """What turns ``sapo``'s branch (mean over the B rows of each sequence's token mean, over the accumulation
        steps) into ``sum_i w_i * sum_t(per_token_loss * mask)``: B x v x accumulation steps, v = w_i x max(tokens_i,
        1), the same for every sample (see :meth:`compute_loss`)."""
        mask = loss_mask(inputs)
        per_sequence = weights.to(mask.device) * mask.sum(-1).double().clamp(min=1.0)
        v = float(per_sequence[0])
        if not torch.allclose(per_sequence, torch.full_like(per_sequence, v), rtol=1e-12, atol=0.0):
            raise RuntimeError(f"loss_type='sapo': sequences weigh {per_sequence.tolist()} in one microbatch; ODC "
                               "expects TRL's microbatches to hold equally many sequences")  # fmt: skip
        return float(per_sequence.numel()) * v * self.current_gradient_accumulation_steps

    def odc_per_token_logps_and_entropies(self, parent, model, input_ids, attention_mask, logits_to_keep, *args,
                                          **kwargs):  # fmt: skip
        """TRL's per-token log-probs: replayed while recomputing a slice's metrics, on packed rows for text-only
        inputs, else TRL's own (``parent``)."""
        if self._odc_replay is not None:  # recomputing a slice's metrics: the training forward's values, no forward
            return self._odc_replay
        if self.odc_grpo_packed and not args and all(
            kwargs.get(k) is None for k in kwargs if k not in ("batch_size", "compute_entropy", "compute_aux_loss")
        ):  # text-only inputs: packed rows
            out = self._odc_packed_logps(model, input_ids, attention_mask, logits_to_keep, kwargs.get("batch_size"),
                                         kwargs.get("compute_entropy", False), kwargs.get("compute_aux_loss", False))  # fmt: skip
        else:
            out = parent(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if model.training:
            self._odc_forward = out
        return out

    def _odc_packed_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                          compute_aux_loss=False):  # fmt: skip
        """TRL's per-token log-probs (and entropies, and a MoE model's router loss) of a padded (rows, columns)
        batch, from forwards on packed rows.

        The training microbatch brings its packed row (built on the CPU by the collator); other calls (the reference
        model's and old-policy log-probs during generation, evaluation) pack TRL's chunks of ``batch_size`` rows
        here, reading the mask once per chunk. The router loss of a packed row counts its real tokens, as TRL's over
        the padded rows' attention mask does; several chunks give their mean, as in TRL."""
        size = input_ids.size(0)
        batch_size = batch_size or size
        logps, entropies, aux = [], [], []
        router = {"output_router_logits": True} if compute_aux_loss else {}
        for start in range(0, size, batch_size):
            packed = self._odc_packed
            if packed is None or start > 0 or packed["index"].shape != (size, logits_to_keep) or batch_size < size:
                packed = pack_rows(input_ids[start : start + batch_size], attention_mask[start : start + batch_size],
                                   logits_to_keep)  # fmt: skip
            packed = {k: v.to(input_ids.device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
            index = packed.pop("index")
            with self.accelerator.autocast():
                out = model(**packed, fused_lm_head=True, **router)
            logps.append(scatter_packed(out.log_probs, index))
            entropies.append(scatter_packed(out.entropy, index) if compute_entropy else None)
            aux.append(out.aux_loss)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)  # fmt: skip

    @torch.no_grad()
    def _odc_recompute_metrics(self, model, inputs: dict, slices: torch.Tensor, weights=None) -> None:
        """TRL's ``_compute_loss`` on each slice's rows of this microbatch, TRL's own mask, the forward's values:
        records what TRL would reduce / gather for its metrics (:mod:`odc_hf.integrations.trl.grpo_metrics`). With
        the sample ``weights`` (an entropy bonus), also each slice's share of TRL's ``policy_loss``: the weighted
        loss of its rows, times G for the loss types whose logged policy loss is taken before TRL divides by the
        accumulation steps."""
        logps, entropies, aux = self._odc_forward
        size, accelerator = slices.numel(), self.accelerator
        keep = self._odc_keep
        metrics = logged_metrics(self)
        appended = {key: len(values) for key, values in metrics.items()}  # what the replays append is dropped below
        try:
            for g in slices.unique().tolist():
                index = (slices == g).nonzero().flatten().to(logps.device)
                self._odc_replay = (logps[index].detach(), entropies[index].detach(), aux)
                if keep is not None:
                    self._odc_keep = keep[index.to(keep.device)]
                self.accelerator = recorder = MetricRecorder(accelerator)
                super().compute_loss(model, rows(inputs, index, size))
                self.odc_slice_metrics.add(int(g), recorder)
                if weights is not None:
                    self.accelerator = MetricRecorder(accelerator)  # this replay's metrics are not TRL's
                    share = self._odc_weighted_loss(model, rows(inputs, index, size), weights[index.to(weights.device)],
                                                    policy_only=True)  # fmt: skip
                    self.odc_slice_metrics.add_policy_loss(int(g), float(share) * self.odc_policy_loss_factor)
        finally:
            self._odc_replay, self.accelerator = None, accelerator
            self._odc_keep = keep
            for key in list(metrics):
                del metrics[key][appended.get(key, 0) :]

    # -- once-per-step metrics ------------------------------------------------------------------------
    def odc_trl_loss_head(self) -> bool:  # GRPOTrainer scores completions with TRL's fused LM head
        return True

    def odc_before_bundle(self):
        bonus = entropy_bonus_enabled(self)
        self.odc_slice_metrics = slices = SliceMetrics(self.odc_folded_accumulation, self.beta,
                                                       LOSS_CODE[self.loss_type], entropy_bonus=bonus)  # fmt: skip
        metrics = logged_metrics(self)
        router = ("aux_loss",) if self.aux_loss_enabled else ()
        policy = ("policy_loss",) if bonus else ()
        return {k: len(metrics[k]) for k in (*slices.means, *slices.extreme_keys, *policy, *router)}

    def odc_after_bundle(self, snapshot, bundle) -> None:
        """Replace what TRL's ``_compute_loss`` appended per ODC microbatch by its per-slice values (one gather)."""
        local = self.odc_slice_metrics.vector().to(self.accelerator.device)
        every = self.accelerator.gather(local.unsqueeze(0)).reshape(self.accelerator.num_processes, -1).cpu()
        metrics = logged_metrics(self)
        for key, values in self.odc_slice_metrics.combine(every).items():
            del metrics[key][snapshot[key] :]
            metrics[key].extend(values)
        if self.aux_loss_enabled:  # MoE: one value per microbatch, as TRL appends them, every rank's
            start = snapshot["aux_loss"]
            metrics["aux_loss"][start:] = every_rank_values(self.accelerator, metrics["aux_loss"][start:])
        if entropy_bonus_enabled(self):
            if self.use_adaptive_entropy:  # TRL's update at the end of a step, from the step's token mean (all ranks)
                total, tokens = self.odc_slice_metrics.world_window
                world_entropy = total / max(tokens, 1.0)
                set_last_world_entropy(self, world_entropy)
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
            metrics["entropy_coef"].append(self.entropy_coef)  # once per step, after the update, as TRL logs it

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self.odc_plan_summary:
            logs = {**logs, "odc/predicted_bubble": round(self.odc_plan_summary["predicted_bubble_odc"], 4)}
        synced = getattr(getattr(self, "vllm_generation", None), "odc_sync_seconds", None)
        if "loss" in logs and synced:  # this rank's last push of the weights into its vLLM engine
            logs = {**logs, "odc/vllm_sync_s": round(synced[-1], 4)}
        return super().log(logs, *args, **kwargs)


class ODCGRPOTrainer(_GRPOPart, ODCMixin, GRPOHooks, GRPOTrainer):
    """``trl.GRPOTrainer`` with ODC."""


def make_odc_grpo_trainer(grpo_cls: type[GRPOTrainer]) -> type[GRPOTrainer]:
    """``ODCX = make_odc_grpo_trainer(X)`` for a subclass X of ``trl.GRPOTrainer``: ``class ODCX(_GRPOPart, ODCMixin,
    X)``, as ``ODCGRPOTrainer``."""
    return type(f"ODC{grpo_cls.__name__}", (_GRPOPart, ODCMixin, grpo_cls), {"__module__": __name__})


__all__ = ["ODCGRPOTrainer", "make_odc_grpo_trainer"]
