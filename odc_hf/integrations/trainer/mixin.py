"""ODC in the transformers Trainer: one bundle of microbatches per rank per optimizer step.

The Trainer ties microbatches per step to ``gradient_accumulation_steps``; ODC needs each rank to run its own
number. So (docs/design.md, "One bundle per optimizer step"): the Trainer runs with gradient accumulation 1, and
each "batch" it sees is a :class:`~odc_hf.integrations.trainer.bundle.Bundle`, this rank's list of packed microbatches for
one optimizer step, planned by :class:`~odc_hf.balance.ODCBatchSampler`; ``training_step`` loops over it.
Everything the Trainer does once per step (token counting, clipping, optimizer step, logging, saving) stays matched
across ranks. The user's ``per_device_train_batch_size x gradient_accumulation_steps x world size`` is the global
minibatch.

Losses are normalised by the GLOBAL number of label tokens of the minibatch (one all-reduce per step),
so ranks running different numbers of microbatches do not reweight samples.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import time

import torch
import transformers
from accelerate.utils import DistributedType, send_to_device
from accelerate.utils.memory import clear_device_cache
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from odc_hf.balance import ODCBatchSampler
from odc_hf.config import ODCConfig
from odc_hf.fsdp import is_sharded
from odc_hf.integrations.accelerate import parallelism
from odc_hf.integrations.accelerate.accelerator import adopt
from odc_hf.integrations.accelerate.plugin import as_odc_plugin
from odc_hf.integrations.accelerate.refusals import (
    check_cpu_ranks_have_no_gpu_to_pick,
    check_fsdp_config,
    check_launch_before_accelerate,
    fsdp_state_dict_type,
    refuse_other_engines,
)
from odc_hf.integrations.checkpoint.sharded import save_full_model
from odc_hf.integrations.checkpoint.trainer import CheckpointPart
from odc_hf.integrations.compute import activation_checkpointing, fused_head
from odc_hf.integrations.compute.attention import AttentionChoice, choose_attention, prepare_attention
from odc_hf.integrations.compute.cost_model import cost_model
from odc_hf.integrations.launch import cuda_allocator, shared_gpu
from odc_hf.integrations.models import definition_check, family
from odc_hf.integrations.trainer import loss_scale
from odc_hf.integrations.trainer.arguments import odc_config_from_args
from odc_hf.integrations.trainer.bundle import (
    MASK_KEYS,
    Bundle,
    BundleDataset,
    BundleLoader,
    TrainerBundleCollator,
)
from odc_hf.integrations.trainer.collator_labels import CollatorLabels, collator_labels
from odc_hf.integrations.trainer.failure_guard import failure_guard
from odc_hf.integrations.trainer.metrics import LocalGathers, weigh_router_loss
from odc_hf.integrations.trainer.observability import ObservabilityPart, one_progress_bar
from odc_hf.integrations.trainer.stats import MicrobatchClock, RunStats, document_lengths
from odc_hf.integrations.trainer.train_data import (
    check_minibatch_fits,
    check_not_empty,
    packed_worst_case,
    resolve_max_tokens,
    train_lengths,
    warn_no_label_tokens,
)
from odc_hf.integrations.upstream.transformers import (
    TrainerHooks,
    check_trainer,
    collator_as_trainer_calls_it,
    keep_label_smoothing_causal,
)

logger = logging.getLogger(__name__)


class _ODCCallback(TrainerCallback):
    def __init__(self, trainer: ODCMixin):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        odc = self.trainer.odc
        if odc is not None:
            odc.publish()  # a checkpoint may have been loaded after prepare(): peers must read those shards

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.odc_finish_run()


class ODCMixin(CheckpointPart, ObservabilityPart, TrainerHooks):
    """Mix into a ``transformers.Trainer`` subclass: ``ODCTrainer``, ``make_odc_trainer(MyTrainer)``.

    Reads top to bottom: setup (``__init__``, the accelerator, the run), data (the planned bundles), one optimizer
    step (``training_step`` over the bundle, the loss), save. The checkpoint cycle and the statistics are its two
    parts (:class:`~odc_hf.integrations.checkpoint.trainer.CheckpointPart`,
    :class:`~odc_hf.integrations.trainer.observability.ObservabilityPart`)."""

    odc_compute_path = False
    """Whether odc_hf sets up the microbatch compute path (kernels, fused loss, activation checkpointing; see
    ``compute_path``). ``ODCTrainer``, ``ODCSFTTrainer`` and ``make_odc_trainer`` classes do; GRPO keeps TRL's own."""

    odc_sampler_class: type[ODCBatchSampler] = ODCBatchSampler
    """The batch sampler that cuts each epoch into global minibatches and plans every step over the ranks. Set a
    subclass (overriding ``plan(step)``, say) on your trainer class to plan differently; every rank must get the same
    plans from the same arguments, without communicating."""

    odc_global_batch_option = True
    """Whether ``ODCConfig.global_batch_size`` can set this trainer's samples per optimizer step."""

    odc_probe_loss_scale = True
    """Whether the first microbatch checks that ``compute_loss`` divides by ``num_items_in_batch``
    (:func:`~odc_hf.integrations.trainer.loss_scale.probe`); GRPO weighs its own loss per sample."""

    # -- setup -------------------------------------------------------------------------------------
    def __init__(self, *args, odc_config: ODCConfig | None = None, **kwargs):
        training_args = self._odc_argument("args", args, kwargs)  # GRPO's is 3rd, not 2nd
        # before the base trainer's first barrier (TRL prepares its dataset "main process first")
        check_cpu_ranks_have_no_gpu_to_pick(use_cpu=bool(getattr(training_args, "use_cpu", False)))
        # ranks sharing a GPU: gloo before the base trainer's first collective (an unused NCCL group that the
        # arguments started is replaced), and accelerate told the group's backend (its gathers depend on it)
        shared_gpu.settle_process_group(timeout_s=float(getattr(training_args, "ddp_timeout", 1800) or 1800))
        check_trainer(type(self))  # the private Trainer methods overridden below exist in this transformers
        one_progress_bar(training_args)  # before the base trainer prepares the data on every rank
        if getattr(training_args, "use_liger_kernel", False):  # where the base trainer applies Liger itself (GRPO)
            fused_head.pin_liger_rope()
        if odc_config is None:  # trainer arguments' odc_* fields, then ODC_* variables, then defaults
            odc_config = odc_config_from_args(training_args)
        self.odc_config = odc_config
        self.odc_stats = RunStats()
        self.odc_microbatch_timings: list[tuple[list[int], float]] = []
        self.odc_loss_scale_checked = False  # see training_step
        self.odc_attention_warm_up: dict | None = None  # {"kind", "shapes", "seconds", "dtype"} once a warm-up ran
        self.odc_attention_choice: AttentionChoice | None = None  # ODCConfig.attention resolved, after the base init
        self.odc_compute: fused_head.ComputePath | None = None
        # before the base trainer reads the first row (TRL's SFTTrainer: a bare StopIteration on an empty dataset)
        check_not_empty(self._odc_argument("train_dataset", args, kwargs))
        # a data collator of the user's: its labels are read before training (collator_labels.py)
        self.odc_user_collator = self._odc_argument("data_collator", args, kwargs) is not None
        # a multimodal model: refused before the base trainer prepares the data (TRL tokenizes it all in __init__)
        family.check_text_only(self._odc_argument("model", args, kwargs))
        super().__init__(*args, **kwargs)
        self._odc_check_best_model()
        keep_label_smoothing_causal(self, self.accelerator.unwrap_model(self.model))  # before FSDP2 renames its class
        self.add_callback(_ODCCallback(self))
        self.odc_attention_choice = choose_attention(self)
        if self.odc_trl_loss_head():  # the loss is TRL's fused LM head (SFT, GRPO): the family's own loss, or refused
            definition_check.verify_fused_head(self.accelerator.unwrap_model(self.model))
            # the head's weight is read without calling the head: torch 2.11's FSDP2 warns of it on every correct run
            fused_head.quiet_unread_head_warning(self.accelerator.unwrap_model(self.model))
        if getattr(self, "aux_loss_enabled", False):  # TRL's router loss (SFT, GRPO): the family's own, or refused
            definition_check.verify_router_loss(self.accelerator.unwrap_model(self.model))
        if self.odc_compute_path:
            self.odc_compute = fused_head.setup(self)
        device = self.accelerator.device
        self.odc_cuda_allocator = cuda_allocator.check(device, main_process=self.accelerator.is_main_process)
        self._odc_alloc_retries = cuda_allocator.RetryCounter(device)

    def _odc_check_best_model(self) -> None:
        """``load_best_model_at_end`` of an adapter on the CPU path is refused before training: its checkpoints hold
        the adapter alone, which odc_hf loads into no sharded model (a whole model's weights it does load)."""
        cpu_path = self.accelerator.distributed_type != DistributedType.FSDP and self.accelerator.num_processes > 1
        adapter = hasattr(self.accelerator.unwrap_model(self.model), "peft_config")
        if self.args.load_best_model_at_end and adapter and cpu_path:
            raise ValueError(
                "load_best_model_at_end=True with a PEFT adapter on CPU processes: odc_hf cannot load an adapter "
                "checkpoint into the sharded model there. Set load_best_model_at_end=False and, after training, load "
                "the adapter saved in trainer.state.best_model_checkpoint (PeftModel.from_pretrained)"
            )

    def _odc_argument(self, name: str, args: tuple, kwargs: dict):
        """The base trainer's ``name`` argument as this call passes it (by keyword or by position), else ``None``."""
        try:
            bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        except TypeError:  # the base trainer will report the bad call itself
            return None
        return bound.arguments.get(name)

    def create_accelerator_and_postprocess(self):
        self.args = args = copy.copy(self.args)  # the user's object stays as they made it
        if self.odc_config.global_batch_size is not None and not self.odc_global_batch_option:
            raise ValueError(
                f"{type(self).__name__} sizes its batch from its own arguments (per_device_train_batch_size, "
                "gradient_accumulation_steps, ...): leave ODCConfig.global_batch_size (--odc_global_batch_size, "
                "ODC_GLOBAL_BATCH_SIZE) unset"
            )
        self.odc_minibatch_per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.odc_folded_accumulation = args.gradient_accumulation_steps
        args.gradient_accumulation_steps = 1
        # Gradients are SUMS over ranks under ODC; the loss is already divided by the global token count.
        args.average_tokens_across_devices = False
        check_launch_before_accelerate()
        check_fsdp_config(args.fsdp_config, "the training arguments' fsdp_config")
        self.odc_plugin = None
        # HSDP on a CPU host: accelerate refuses a ParallelismConfig there; odc_hf builds its mesh (parallelism.py)
        held = parallelism.take(args.parallelism_config, cpu=args.use_cpu)
        if held is not None:
            args.parallelism_config = None
        with parallelism.hidden_from_accelerate(held is not None):
            super().create_accelerator_and_postprocess()
        if self.odc_plugin is None:
            raise RuntimeError(
                f"transformers {transformers.__version__}: Trainer.create_accelerator_and_postprocess no longer builds "
                "its accelerator through Trainer._build_accelerator_args, where odc_hf gives it its ODCFSDPPlugin"
            )
        adopt(self.accelerator, self.odc_plugin, parallelism_config=held)
        from_arguments = self.odc_minibatch_per_rank * self.accelerator.num_processes
        self.odc_global_batch_size = self.odc_config.global_batch_size or from_arguments
        """Samples per optimizer step, all ranks together (the global minibatch)."""
        # Notices of settings odc_hf changed: warnings, so that transformers' default verbosity shows them (rank 0)
        if self.odc_global_batch_size != from_arguments and self.accelerator.is_main_process:
            logger.warning(
                "odc_hf: global_batch_size=%d samples per optimizer step (per_device_train_batch_size %d x "
                "gradient_accumulation_steps %d x %d processes = %d is not used)", self.odc_global_batch_size,
                args.per_device_train_batch_size, self.odc_folded_accumulation, self.accelerator.num_processes,
                from_arguments,
            )  # fmt: skip
        elif self.odc_folded_accumulation != 1 and self.accelerator.is_main_process:
            logger.warning(
                "odc_hf: gradient_accumulation_steps=%d becomes part of the minibatch (%d samples per rank per step, "
                "on average); the Trainer itself runs with gradient_accumulation_steps set to 1",
                self.odc_folded_accumulation, self.odc_minibatch_per_rank,
            )  # fmt: skip
        if args.auto_find_batch_size:
            # The Trainer halves per_device_train_batch_size after an out-of-memory error and starts again: under ODC
            # a microbatch's memory is set by the token budget, not the batch size, and the batch size is what is
            # trained (one rank retrying alone would also leave its peers waiting)
            args.auto_find_batch_size = False
            if self.accelerator.is_main_process:
                logger.warning(
                    "odc_hf: auto_find_batch_size=True is turned off: under ODC a microbatch's memory is set by "
                    "max_tokens_per_microbatch (--odc_max_tokens_per_microbatch, ODC_MAX_TOKENS_PER_MICROBATCH), not "
                    "by the batch size, which is what the run trains; lower the budget (or raise "
                    "activation_checkpointing) if memory runs out"
                )

    def odc_build_accelerator_args(self, parent, **kwargs):
        # The one way ODC's options reach an accelerator: an ODCFSDPPlugin (odc_hf/integrations/accelerate/plugin.py), here the
        # Trainer's own FSDP plugin (TrainingArguments.fsdp / fsdp_config) plus self.odc_config, or a new one.
        args = parent(**kwargs)
        refuse_other_engines(args.get("deepspeed_plugin"))
        self.odc_plugin = args["fsdp_plugin"] = as_odc_plugin(args.get("fsdp_plugin"), self.odc_config)
        return args

    def get_total_train_batch_size(self, args) -> int:
        """Samples per optimizer step, all ranks together: the Trainer's figure (per device x accumulation x data
        parallel ranks) times the gradient accumulation ODC folded into each bundle (the Trainer runs with 1), so that
        ``train_samples_per_second`` and the "Total train batch size" line count the samples really trained."""
        if getattr(self, "odc_global_batch_size", None):
            return self.odc_global_batch_size
        return super().get_total_train_batch_size(args) * getattr(self, "odc_folded_accumulation", 1)

    @property
    def odc(self):
        return getattr(self.accelerator, "odc", None)

    @property
    def odc_attention(self) -> dict | None:
        """The run's attention as written to JSON, ``{"choice", "implementation", "reason"}`` (the record:
        ``odc_attention_choice``)."""
        return None if self.odc_attention_choice is None else self.odc_attention_choice.to_dict()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train`` under :func:`odc_hf.failure_guard`: an exception anywhere in a step (microbatches,
        clipping, optimizer step, logging, evaluation, saving) reaches every peer within a second, with its text.
        A checkpoint to resume from is checked first (:mod:`odc_hf.integrations.checkpoint.resume`)."""
        resume_from_checkpoint = self._odc_resolve_resume(resume_from_checkpoint)
        with failure_guard(lambda: self.odc):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with failure_guard(lambda: self.odc):
            return super().evaluate(*args, **kwargs)

    # -- data: one bundle of planned microbatches per rank per optimizer step --------------------
    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        lengths = train_lengths(dataset)  # raises, saying what to change, on an empty or unusable dataset
        self.odc_note_dataset(len(lengths), lengths)
        # The data-parallel world is every process, HSDP's replicas included: each rank plans its own share.
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        check_minibatch_fits(len(lengths), per_device=self.args.per_device_train_batch_size, world=world,
                             accumulation=self.odc_folded_accumulation, drop_last=self.args.dataloader_drop_last,
                             global_batch_size=self.odc_config.global_batch_size)  # fmt: skip
        # the budget of one microbatch, resolved and checked against the samples once, then passed on trusted
        max_tokens_per_microbatch = resolve_max_tokens(self.odc_config, lengths, packed_worst_case(lengths),
                                                       is_main_process=self.accelerator.is_main_process)  # fmt: skip
        prepare_attention(self, max_tokens_per_microbatch)  # the attention's warm-up on a GPU, before step 1
        if self.odc_compute is not None:  # activation checkpointing for this budget, before prepare()
            activation_checkpointing.plan(self, max_tokens_per_microbatch)
        config = self.odc_config
        data_seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed  # as the Trainer's
        sampler = self.odc_sampler_class(
            lengths, world_size=world, rank=rank, minibatch_size=self.odc_global_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch, mode=config.balance, cost_model=self._odc_cost_model(),
            seed=data_seed, shuffle=True, drop_last=self.args.dataloader_drop_last, truncate=config.truncate,
            plan_ahead=config.plan_ahead,
        )  # fmt: skip
        pad = getattr(self.processing_class, "pad_token_id", None)
        collator = TrainerBundleCollator(max_tokens_per_microbatch=max_tokens_per_microbatch, truncate=config.truncate,
                                         pad_token_id=pad if pad is not None else 0, mask_keys=self.odc_mask_keys(),
                                         labels_from=self._odc_collator_labels(dataset))  # fmt: skip
        self.odc_sampler = sampler
        # No pin_memory: torch's pinning rebuilds Mapping batches as their type from a dict, which a Bundle is
        # not; training_step copies each microbatch to the device itself.
        return BundleLoader(BundleDataset(dataset), batch_sampler=sampler, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers)  # fmt: skip

    def _odc_collator_labels(self, dataset) -> CollatorLabels | None:
        """The labels of the data collator the user gave, where they are not the dataset's (``collator_labels``)."""
        if not self.odc_user_collator or self.data_collator is None:
            return None
        collate = collator_as_trainer_calls_it(self, self.data_collator)
        return collator_labels(collate, type(self.data_collator).__name__, dataset,
                               is_main_process=self.accelerator.is_main_process)  # fmt: skip

    def odc_mask_keys(self) -> tuple[str, ...]:
        """Example columns whose zeros mask labels (none for TRL's SFT trainer: its labels carry the masks)."""
        return MASK_KEYS

    def _odc_cost_model(self):
        """``ODCConfig.cost_model`` as a cost model (:func:`odc_hf.integrations.compute.cost_model.cost_model`)."""
        choice = self.odc_config.cost_model
        model = self.accelerator.unwrap_model(self.model) if choice == "flop" else None
        return cost_model(choice, model, getattr(self, "odc_compute", None))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        try:
            bundle = next(epoch_iterator)
        except StopIteration:
            return [], None
        local = torch.tensor(float(bundle.label_tokens), device=self.accelerator.device)
        total = (
            self.accelerator.reduce(local, reduction="sum") if self.accelerator.num_processes > 1 else local
        )
        if total.item() == 0 and self.accelerator.is_main_process:
            warn_no_label_tokens(self.state.global_step + 1, self.odc_mask_keys())
        return [bundle], total.clamp(min=1)

    # -- one optimizer step ------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(inputs, Bundle):
            raise TypeError("ODC trainers train on bundles from get_train_dataloader(); got a plain batch")
        model.train()
        device = self.accelerator.device
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        snapshot = self.odc_before_bundle()
        router_coef = weigh_router_loss(self, len(inputs.microbatches))  # MoE: TRL's weight on these microbatches
        real_accelerator = self.accelerator
        self.accelerator = LocalGathers(real_accelerator)
        guard = self.odc.failure_guard() if self.odc is not None else contextlib.nullcontext()
        clock = MicrobatchClock(device) if self._odc_time_microbatches() else None
        # TRL's SFT trainer offloads activations (activation_offloading=True) around each training step's forward
        # and backward, that is each microbatch's: here too
        offload = getattr(self, "maybe_activation_offload_context", None) or contextlib.nullcontext()
        every = self.args.torch_empty_cache_steps  # as the Trainer: the device cache emptied after each forward
        empty_cache = every is not None and self.state.global_step % every == 0
        try:
            # a rank that raises tells its peers at once instead of leaving them to time out; an OOM names the plan
            with guard, fused_head.oom_guard(self.odc_compute):
                for microbatch in inputs.microbatches:
                    batch = send_to_device(
                        {k: v for k, v in microbatch.items() if k != "num_label_tokens"}, device
                    )
                    probe = None
                    if not self.odc_loss_scale_checked and microbatch["num_label_tokens"] > 0:
                        self.odc_loss_scale_checked = True
                        if self._odc_loss_is_users():
                            probe = loss_scale.probe(self, model, batch, num_items_in_batch)
                    with offload:
                        with self.compute_loss_context_manager():
                            loss = self.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)
                        if probe is not None:
                            loss_scale.check(self, probe, loss, num_items_in_batch)
                        del batch
                        if empty_cache:
                            clear_device_cache()
                        real_accelerator.backward(loss)
                    loss_sum += loss.detach()
                    if clock is not None:
                        clock.lap(document_lengths(microbatch))
        finally:
            self.accelerator = real_accelerator
            if router_coef is not None:
                self.router_aux_loss_coef = router_coef
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        busy = time.perf_counter() - start
        if clock is not None:
            self.odc_microbatch_timings.extend(clock.laps())
            del self.odc_microbatch_timings[: -self.ODC_MAX_TIMINGS]
        if self.odc is not None:
            self.odc.finish_minibatch(inputs.label_tokens)
        wait = time.perf_counter() - start - busy
        global_loss = self._odc_record(busy, wait, inputs, loss_sum)
        self.odc_after_bundle(snapshot, inputs)
        # The step's loss over every rank, returned on every rank: the Trainer's logged loss (a mean over ranks of
        # what the ranks return) and its final train_loss (which adds rank 0's own unlogged remainder) both read it.
        return global_loss

    def _odc_loss_is_users(self) -> bool:
        """Whether the microbatch loss comes from the trainer's ``compute_loss`` (its own, a ``compute_loss_func``, the
        model's) rather than odc_hf's fused loss, and so must be checked to divide by ``num_items_in_batch``."""
        fused = self.odc_compute is not None and self.odc_compute.fused_by_odc
        return self.odc_probe_loss_scale and not fused

    def odc_restore_after_probe(self):
        """Hook: a callable that undoes what one extra ``compute_loss`` call recorded (TRL's metrics: ODCSFTTrainer)."""
        return lambda: None

    def odc_before_bundle(self):
        """Hook: state to aggregate per-microbatch metrics once per step (see ODCSFTTrainer)."""
        return None

    def odc_after_bundle(self, snapshot, bundle: Bundle) -> None:
        """Hook: aggregate what ``odc_before_bundle`` snapshotted; runs once per step on every rank, with the step's
        bundle (this rank's microbatches, each with its ``num_label_tokens``)."""

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, Bundle):
            return sum(super(ODCMixin, self).floating_point_ops(mb) for mb in inputs.microbatches)
        return super().floating_point_ops(inputs)

    def odc_base_fused_head(self) -> bool:
        """Hook: True where the base trainer's ``compute_loss`` runs TRL's fused LM head itself (SFTTrainer)."""
        return False

    def odc_trl_loss_head(self) -> bool:
        """Hook: True where the base trainer computes its loss (or log-probabilities) with TRL's fused LM head, which
        it installs itself (SFTTrainer, GRPOTrainer)."""
        return self.odc_base_fused_head()

    def odc_base_loss_is_plain(self) -> bool:
        """Whether the trainer below the mixin computes the loss as ``transformers.Trainer`` does (the model's own)."""
        return getattr(super().compute_loss, "__func__", None) is Trainer.compute_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.odc_compute is not None and self.odc_compute.fused_by_odc and model.training and not return_outputs:
            return fused_head.fused_head_loss(model, inputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    # -- save --------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The model whole, loadable with ``from_pretrained``: what the Trainer writes (the model, the processing
        class and ``training_args.bin``, with the user's ``gradient_accumulation_steps``: see
        :meth:`_odc_users_arguments`), from the main process, after a gather on every rank (a collective).

        On the CPU path odc_hf sharded the model and gathers it. On GPUs accelerate's FSDP2 path saves; with
        ``fsdp_state_dict_type: SHARDED_STATE_DICT`` (``accelerate_configs/odc.yaml``: ranks sharing a GPU cannot
        gather FULL_STATE_DICT checkpoints) ``Trainer.save_model`` writes no weights at all, so a save you call
        (a TRL script's final ``trainer.save_model(output_dir)``) gathers the full model through
        ``ODCAccelerator.get_state_dict``; the Trainer's own checkpoints stay sharded."""
        with self._odc_users_arguments():
            if self._odc_self_sharded():
                state = None  # gathered by save_full_model
            elif _internal_call or not self._odc_sharded_state_dicts():
                return super().save_model(output_dir, _internal_call)
            else:
                state = self.accelerator.get_state_dict(self.model)  # the main process's; empty elsewhere
            save_full_model(self, output_dir or self.args.output_dir, state)
            if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model pushes
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _odc_sharded_state_dicts(self) -> bool:
        """Whether accelerate's FSDP saves this model as SHARDED_STATE_DICT (``Trainer.save_model`` then writes no
        weights)."""
        kind = fsdp_state_dict_type(self.accelerator)
        return bool(getattr(self, "is_fsdp_enabled", False) and kind and "FULL_STATE_DICT" not in kind)

    @contextlib.contextmanager
    def _odc_users_arguments(self):
        """The training arguments with the user's ``gradient_accumulation_steps`` inside the block: the Trainer runs
        with 1 (the accumulation is folded into each step's bundle), but a reader must see the user's value: a
        resumed run and model-card tools reading ``training_args.bin`` (written by this class or by
        ``Trainer._save``; nothing reads the setting while a model is saved), and TRL's GRPO generation, which
        decides from it whether to compute old log-probs."""
        folded = self.args.gradient_accumulation_steps
        self.args.gradient_accumulation_steps = self.odc_folded_accumulation
        try:
            yield
        finally:
            self.args.gradient_accumulation_steps = folded

    def _odc_self_sharded(self) -> bool:
        """Whether odc_hf, not accelerate, sharded the model (the CPU path)."""
        return self.accelerator.distributed_type != DistributedType.FSDP and is_sharded(self.model)


class ODCTrainer(ODCMixin, Trainer):
    """``transformers.Trainer`` with ODC."""

    odc_compute_path = True


def make_odc_trainer(trainer_cls: type[Trainer]) -> type[Trainer]:
    """``ODCX = make_odc_trainer(X)`` for any other Trainer subclass X (your own, ...): ``class ODCX(ODCMixin, X)``
    with the compute path on, as ``ODCTrainer``."""
    return type(f"ODC{trainer_cls.__name__}", (ODCMixin, trainer_cls),
                {"__module__": __name__, "odc_compute_path": True})  # fmt: skip
