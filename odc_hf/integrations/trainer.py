"""ODC in the transformers Trainer: one bundle of microbatches per rank per optimizer step.

The Trainer ties microbatches per step to ``gradient_accumulation_steps``; ODC needs each rank to run its own
number. So (docs/design.md, "One bundle per optimizer step"): the Trainer runs with gradient accumulation 1, and
each "batch" it sees is a :class:`~odc_hf.integrations.bundle.Bundle`, this rank's list of packed microbatches for
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
import json
import logging
import time
from pathlib import Path

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from odc_hf.balance import FlopCostModel, ODCBatchSampler, QuadraticCostModel, TokenCostModel
from odc_hf.config import ODCConfig
from odc_hf.fsdp import is_sharded
from odc_hf.integrations import compute_path, cuda_allocator, parallelism, shared_gpu
from odc_hf.integrations.accelerator import (
    adopt,
    check_cpu_ranks_have_no_gpu_to_pick,
    check_launch_before_accelerate,
)
from odc_hf.integrations.attention_setup import choose_attention, prepare_attention
from odc_hf.integrations.bundle import MASK_KEYS, Bundle, BundleDataset, BundleLoader, TrainerBundleCollator
from odc_hf.integrations.exit_cleanup import destroy_gloo_group_at_exit
from odc_hf.integrations.failures import failure_guard
from odc_hf.integrations.launch_config import check_fsdp_config
from odc_hf.integrations.plugin import as_odc_plugin, refuse_other_engines
from odc_hf.integrations.stats import MicrobatchClock, RunStats, StepStats, document_lengths, plot_timeline
from odc_hf.integrations.train_data import (
    check_budget,
    check_minibatch_fits,
    check_not_empty,
    train_lengths,
    warn_no_label_tokens,
)

logger = logging.getLogger(__name__)


class _LocalGathers:
    """Stands in for the Accelerator inside the bundle loop: metric gathers stay local.

    Libraries (TRL's ``compute_loss``) gather or reduce metrics once per microbatch; with uneven microbatch counts those
    collectives would pair up different microbatches or deadlock. Inside the loop they return the local value;
    the trainer aggregates once per step instead. Everything else goes to the real Accelerator.
    """

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def gather_for_metrics(self, tensor, use_gather_object=False):
        return tensor.reshape(1) if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 else tensor

    gather = gather_for_metrics

    def reduce(self, tensor, reduction="sum", scale=1.0):  # TRL GRPO's global_masked_mean: local sums
        return tensor * scale if scale != 1.0 else tensor

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


class _ODCCallback(TrainerCallback):
    def __init__(self, trainer: ODCMixin):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        odc = self.trainer.odc
        if odc is not None:
            odc.publish()  # a checkpoint may have been loaded after prepare(): peers must read those shards

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.odc_finish_run()


class ODCMixin:
    """Mix into a ``transformers.Trainer`` subclass: ``make_odc_trainer(SFTTrainer)`` or ``ODCTrainer``."""

    odc_compute_path = False
    """Whether odc_hf sets up the microbatch compute path (kernels, fused loss, activation checkpointing; see
    ``compute_path``). ``make_odc_trainer`` classes do; GRPO keeps TRL's own."""

    def __init__(self, *args, odc_config: ODCConfig | None = None, **kwargs):
        training_args = self._odc_argument("args", args, kwargs)  # GRPO's is 3rd, not 2nd
        # before the base trainer's first barrier (TRL prepares its dataset "main process first")
        check_cpu_ranks_have_no_gpu_to_pick(use_cpu=bool(getattr(training_args, "use_cpu", False)))
        shared_gpu.check_backend()  # ranks sharing a GPU: the arguments must have started gloo, not NCCL
        if getattr(training_args, "use_liger_kernel", False):  # where the base trainer applies Liger itself (GRPO)
            compute_path.pin_liger_rope()
        if odc_config is None:  # trainer arguments' odc_* fields, then ODC_* variables, then defaults
            from odc_hf.integrations.arguments import odc_config_from_args

            odc_config = odc_config_from_args(training_args)
        self.odc_config = odc_config
        self.odc_stats = RunStats()
        self.odc_microbatch_timings: list[tuple[list[int], float]] = []
        self.odc_attention_warm_up: dict | None = None  # {"kind", "shapes", "seconds", "dtype"} once a warm-up ran
        self.odc_attention: dict | None = None  # {"choice", "implementation", "reason"}: ODCConfig.attention resolved
        self.odc_compute: compute_path.ComputePath | None = None
        self.odc_dataset: dict | None = None  # the training data's size and fingerprint, for checkpoints
        self._odc_resume_checkpoint: str | None = None  # the checkpoint train() resumes from
        # before the base trainer reads the first row (TRL's SFTTrainer: a bare StopIteration on an empty dataset)
        check_not_empty(self._odc_argument("train_dataset", args, kwargs))
        super().__init__(*args, **kwargs)
        self.add_callback(_ODCCallback(self))
        self.odc_attention = choose_attention(self)
        if self.odc_compute_path:
            self.odc_compute = compute_path.setup(self)
        device = self.accelerator.device
        self.odc_cuda_allocator = cuda_allocator.check(device, main_process=self.accelerator.is_main_process)
        self._odc_alloc_retries = cuda_allocator.RetryCounter(device)

    def _odc_argument(self, name: str, args: tuple, kwargs: dict):
        """The base trainer's ``name`` argument as this call passes it (by keyword or by position), else ``None``."""
        try:
            bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        except TypeError:  # the base trainer will report the bad call itself
            return None
        return bound.arguments.get(name)

    def odc_base_fused_head(self) -> bool:
        """Hook: True where the base trainer's ``compute_loss`` runs TRL's fused LM head itself (SFTTrainer)."""
        return False

    def odc_base_loss_is_plain(self) -> bool:
        """Whether the trainer below the mixin computes the loss as ``transformers.Trainer`` does (the model's own)."""
        return getattr(super().compute_loss, "__func__", None) is Trainer.compute_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.odc_compute is not None and self.odc_compute.fused_by_odc and model.training and not return_outputs:
            return compute_path.fused_head_loss(model, inputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    odc_sampler_class: type[ODCBatchSampler] = ODCBatchSampler
    """The batch sampler that cuts each epoch into global minibatches and plans every step over the ranks. Set a
    subclass (overriding ``plan(step)``, say) on your trainer class to plan differently; every rank must get the same
    plans from the same arguments, without communicating."""

    odc_global_batch_option = True
    """Whether ``ODCConfig.global_batch_size`` can set this trainer's samples per optimizer step."""

    # -- setup -------------------------------------------------------------------------------------
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
            import transformers

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

    def _build_accelerator_args(self, **kwargs):
        # The one way ODC's options reach an accelerator: an ODCFSDPPlugin (odc_hf/integrations/plugin.py), here the
        # Trainer's own FSDP plugin (TrainingArguments.fsdp / fsdp_config) plus self.odc_config, or a new one.
        args = super()._build_accelerator_args(**kwargs)
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

    def _odc_cost_model(self):
        choice = self.odc_config.cost_model
        if choice == "flop":
            config = self.accelerator.unwrap_model(self.model).config
            return FlopCostModel.from_config(config)
        if choice == "tokens":
            return TokenCostModel()
        data = json.loads(Path(choice).read_text())
        compute_path.check_recorded(data, getattr(self, "odc_compute", None), choice)
        if all(k in data for k in "abc"):
            return QuadraticCostModel.from_dict(data)
        if "lengths" in data and "seconds" in data:  # raw timings: fit them
            return QuadraticCostModel.fit(data["lengths"], data["seconds"])
        if "microbatches" in data and "seconds" in data:  # a run's odc_microbatch_timings.json
            return QuadraticCostModel.fit_microbatches(data["microbatches"], data["seconds"])
        raise ValueError(
            f"{choice}: expected a JSON object with a, b, c and optionally floor (or lengths and seconds, or "
            "microbatches and seconds, to fit)"
        )

    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        lengths = train_lengths(dataset)  # raises, saying what to change, on an empty or unusable dataset
        self.odc_note_dataset(len(lengths), lengths)
        # The data-parallel world is every process, HSDP's replicas included: each rank plans its own share.
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        check_minibatch_fits(len(lengths), per_device=self.args.per_device_train_batch_size, world=world,
                             accumulation=self.odc_folded_accumulation, drop_last=self.args.dataloader_drop_last,
                             global_batch_size=self.odc_config.global_batch_size)  # fmt: skip
        # ODCConfig validated the budget; None: the smallest budget that holds the worst-case microbatch of this
        # layout, one packed row (docs/configuration.md), i.e. the longest sample.
        budget = self.odc_config.max_tokens_per_microbatch or max(lengths)
        check_budget(lengths, budget, truncate=self.odc_config.truncate, is_main_process=self.accelerator.is_main_process)
        self._odc_check_attention(budget)
        if self.odc_compute is not None:
            compute_path.plan(self, budget)  # activation checkpointing for this budget, before prepare()
        sampler = self.odc_sampler_class(
            lengths, world_size=world, rank=rank, minibatch_size=self.odc_global_batch_size,
            max_tokens_per_microbatch=budget, mode=self.odc_config.balance, cost_model=self._odc_cost_model(),
            seed=self.args.seed, shuffle=True, drop_last=self.args.dataloader_drop_last,
            truncate=self.odc_config.truncate, plan_ahead=self.odc_config.plan_ahead,
        )  # fmt: skip
        pad = getattr(self.processing_class, "pad_token_id", None)
        collator = TrainerBundleCollator(max_tokens_per_microbatch=budget, truncate=self.odc_config.truncate,
                                         pad_token_id=pad if pad is not None else 0, mask_keys=self.odc_mask_keys())  # fmt: skip
        self.odc_sampler = sampler
        # No pin_memory: torch's pinning rebuilds Mapping batches as their type from a dict, which a Bundle is
        # not; training_step copies each microbatch to the device itself.
        return BundleLoader(BundleDataset(dataset), batch_sampler=sampler, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers)  # fmt: skip

    def odc_note_dataset(self, num_samples: int, lengths: list[int] | None = None) -> None:
        """Record the training data's size (and its samples' token counts' fingerprint) for the checkpoints; resuming,
        warn when it is not the checkpoint's (:func:`odc_hf.integrations.resume.check_dataset`)."""
        from odc_hf.integrations import resume

        self.odc_dataset = resume.dataset_record(num_samples, lengths)
        if self._odc_resume_checkpoint is not None:
            resume.check_dataset(self, self._odc_resume_checkpoint, self.odc_dataset)

    def _odc_check_attention(self, budget: int) -> None:
        """The attention's warm-up on a GPU (cuDNN plans of sdpa_varlen, FA4's kernel compilation) before step 1
        (:func:`odc_hf.integrations.attention_setup.prepare_attention`)."""
        prepare_attention(self, budget)

    def odc_mask_keys(self) -> tuple[str, ...]:
        """Example columns whose zeros mask labels (TRL's trainer narrows this to what its settings enable)."""
        return MASK_KEYS

    # -- failure reporting -------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train`` under :func:`odc_hf.failure_guard`: an exception anywhere in a step (microbatches,
        clipping, optimizer step, logging, evaluation, saving) reaches every peer within a second, with its text.
        A checkpoint to resume from is checked first (:mod:`odc_hf.integrations.resume`)."""
        from odc_hf.integrations import resume

        if resume_from_checkpoint:  # True: the last COMPLETE checkpoint of the output directory
            resume_from_checkpoint = resume.resolve(self, resume_from_checkpoint)
        resuming = isinstance(resume_from_checkpoint, str)
        self._odc_resume_checkpoint = resume_from_checkpoint if resuming else None
        with failure_guard(lambda: self.odc):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with failure_guard(lambda: self.odc):
            return super().evaluate(*args, **kwargs)

    # -- one optimizer step ------------------------------------------------------------------------
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

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(inputs, Bundle):
            raise TypeError("ODC trainers train on bundles from get_train_dataloader(); got a plain batch")
        model.train()
        device = self.accelerator.device
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        snapshot = self.odc_before_bundle()
        real_accelerator = self.accelerator
        self.accelerator = _LocalGathers(real_accelerator)
        guard = self.odc.failure_guard() if self.odc is not None else contextlib.nullcontext()
        clock = MicrobatchClock(device) if self._odc_time_microbatches() else None
        try:
            # a rank that raises tells its peers at once instead of leaving them to time out; an OOM names the plan
            with guard, compute_path.oom_guard(self.odc_compute):
                for microbatch in inputs.microbatches:
                    batch = send_to_device(
                        {k: v for k, v in microbatch.items() if k != "num_label_tokens"}, device
                    )
                    with self.compute_loss_context_manager():
                        loss = self.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)
                    real_accelerator.backward(loss)
                    loss_sum += loss.detach()
                    if clock is not None:
                        clock.lap(document_lengths(microbatch))
        finally:
            self.accelerator = real_accelerator
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

    ODC_MAX_TIMINGS = 20_000
    """Microbatch timings kept per rank for ``odc_microbatch_timings.json`` (the most recent)."""
    ODC_TIMING_WARMUP_STEPS = 2
    """Optimizer steps whose microbatches are not timed (kernel compilation, allocator warm-up)."""

    def _odc_time_microbatches(self) -> bool:
        return self.odc is not None and self.state.global_step >= self.ODC_TIMING_WARMUP_STEPS

    def _odc_record(self, busy: float, wait: float, bundle: Bundle, loss_sum: torch.Tensor) -> torch.Tensor:
        """Gather every rank's step statistics and loss (the step's one gather); returns the step's global loss.

        Each microbatch loss is already divided by the global label-token count, so the ranks' sums add up to the
        step's loss. It rides on the statistics' gather: no collective of its own."""
        row = torch.tensor([busy, wait, len(bundle.microbatches), bundle.input_tokens, float(loss_sum)],
                           dtype=torch.float64, device=self.accelerator.device)  # fmt: skip
        rows = self.accelerator.gather(row) if self.accelerator.num_processes > 1 else row
        rows = rows.reshape(-1, 5)
        self.odc_stats.add(StepStats.from_gathered(rows[:, :4]))
        return rows[:, 4].sum().to(loss_sum.dtype)

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

    # -- saving ------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """On GPUs accelerate's FSDP2 path saves; on the CPU path (sharded by odc_hf) gather a full state dict
        on every rank (a collective) and write from the main process what the Trainer writes: the model, the
        processing class and ``training_args.bin`` (with the user's ``gradient_accumulation_steps``: see
        :meth:`_odc_users_arguments`)."""
        with self._odc_users_arguments():
            self._odc_save_model(output_dir, _internal_call)

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

    def _odc_save_model(self, output_dir: str | None, _internal_call: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers.trainer import TRAINING_ARGS_NAME

        if not self._odc_self_sharded():
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        # Tied parameters (lm_head / embed_tokens) come back as two gathered copies, which save_pretrained cannot
        # recognise as one tensor: make them one again, so that it drops the tied name as it does for its own
        # state dict (the model's _tied_weights_keys decide which).
        model = self.accelerator.unwrap_model(self.model)
        first_name: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            first = first_name.setdefault(id(param), name)
            if first != name and first in state and name in state:
                state[name] = state[first]
        if self.accelerator.is_main_process:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            model.save_pretrained(output_dir, state_dict=state)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, Path(output_dir) / TRAINING_ARGS_NAME)  # as Trainer._save: tools read it
        self.accelerator.wait_for_everyone()

    def _odc_self_sharded(self) -> bool:
        from accelerate.utils import DistributedType

        return self.accelerator.distributed_type != DistributedType.FSDP and is_sharded(self.model)

    def _save_checkpoint(self, model, trial):
        """The Trainer's save, then a completion marker once every rank has written every part, then the rotation of
        old checkpoints (``save_total_limit``): a job killed while saving leaves the previous checkpoint loadable,
        and ``resume_from_checkpoint=True`` takes the last complete one (:mod:`odc_hf.integrations.resume`)."""
        import os

        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        from odc_hf.integrations import resume

        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            resume.unmark(checkpoint)  # overwriting an older save of this step: incomplete until marked again
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # self.args is odc_hf's copy
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's parts are on disk
        if self.args.should_save:
            resume.mark_complete(self, checkpoint)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)  # fmt: skip

    # Private Trainer methods (TRAINER_HOOKS in odc_hf/integrations/checkpoint.py; the optimizer's own format on the
    # CPU path only).
    def _save_optimizer_and_scheduler(self, output_dir):
        if not self._odc_self_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        from odc_hf.integrations.checkpoint import save_optimizer_and_scheduler

        save_optimizer_and_scheduler(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        from odc_hf.integrations.checkpoint import check_trainer_optimizer, load_optimizer_and_scheduler
        from odc_hf.integrations.resume import reads_sharded_optimizer

        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self._odc_self_sharded() or reads_sharded_optimizer(self, checkpoint):
            return load_optimizer_and_scheduler(self, checkpoint)
        check_trainer_optimizer(checkpoint, scheduler=self.lr_scheduler is not None)  # the Trainer skips silently
        return super()._load_optimizer_and_scheduler(checkpoint)

    def _issue_warnings_after_load(self, load_result):
        # A tied copy (lm_head.weight sharing the embedding) is never saved, so every correct checkpoint "misses" it:
        # warn only about keys that are really missing.
        from odc_hf.integrations.checkpoint import missing_tied_keys

        if hasattr(load_result, "_replace"):  # torch's _IncompatibleKeys (a namedtuple)
            tied = missing_tied_keys(self.accelerator.unwrap_model(self.model), load_result.missing_keys)
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        return super()._issue_warnings_after_load(load_result)

    # -- observability -----------------------------------------------------------------------------
    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            window = self.odc_stats.window()
            if (
                self.odc is None
            ):  # collectives: waits hide inside FSDP's per-layer collectives, not measurable here
                window = {k: v for k, v in window.items() if k not in ("odc/bubble_rate", "odc/wait_s_mean")}
            logs = {**logs, **{k: round(v, 4) for k, v in window.items()}}
            retries = self._odc_alloc_retries.delta()  # CUDA only: the caching allocator's flush-and-retry count
            if retries is not None:
                logs["odc/cuda_alloc_retries"] = retries
        return super().log(logs, *args, **kwargs)

    def _odc_write_timings(self) -> None:
        """Gather every rank's microbatch timings; the main process writes them with a cost model fitted to them.

        ``<output_dir>/odc_microbatch_timings.json`` holds ``microbatches`` (document lengths), ``seconds`` and,
        when they allow a fit, ``a``, ``b``, ``c``: pass the file as ``cost_model`` in the next run to balance with
        the costs this run measured (sharding, packing and kernels included).
        """
        if self.odc is None:  # same on every rank: the collective below runs everywhere or nowhere
            return
        timings = list(self.odc_microbatch_timings)
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            gathered: list = [None] * self.accelerator.num_processes
            dist.all_gather_object(gathered, timings)
            timings = [t for part in gathered for t in part]
        if not timings or not self.accelerator.is_main_process:
            return
        payload: dict = {
            "microbatches": [docs for docs, _ in timings],
            "seconds": [seconds for _, seconds in timings],
            "device": str(self.accelerator.device),
            "warmup_steps_skipped": self.ODC_TIMING_WARMUP_STEPS,
        }
        if self.odc_compute is not None:  # costs per token depend on the kernels and checkpointing
            payload["compute_path"] = self.odc_compute.describe()
        payload["attention"] = self.odc_attention  # and on the attention kernel
        try:
            fitted = QuadraticCostModel.fit_microbatches(payload["microbatches"], payload["seconds"])
            payload.update(fitted.to_dict())
            logger.info("odc_hf: microbatch costs of this run fit %s", fitted.describe())
        except ValueError as err:
            payload["fit_error"] = str(err)
        path = Path(self.args.output_dir) / "odc_microbatch_timings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload))

    def odc_finish_run(self) -> None:
        self._odc_write_timings()
        destroy_gloo_group_at_exit()  # the gather above must not race interpreter exit (see its docstring)
        summary = self.odc_stats.total()
        if not summary or not self.accelerator.is_main_process:
            return
        if self.odc is None:  # collectives: the bubble is hidden inside FSDP's collectives (see log())
            summary = {k: v for k, v in summary.items() if k not in ("odc/bubble_rate", "odc/wait_s_mean")}
        self.odc_summary = summary
        if self.odc_config.log_timeline:
            title = f"ODC per-rank timeline ({(self.odc_attention or {}).get('implementation')} attention)"
            path = plot_timeline(self.odc_stats.steps[-50:], Path(self.args.output_dir) / "odc_timeline.png", title=title)
            logger.info("odc_hf: timeline written to %s", path)


def make_odc_trainer(trainer_cls: type[Trainer]) -> type[Trainer]:
    """``ODCX = make_odc_trainer(X)`` for any Trainer subclass X (TRL's SFTTrainer, your own, ...)."""
    return type(f"ODC{trainer_cls.__name__}", (ODCMixin, trainer_cls),
                {"__module__": __name__, "odc_compute_path": True})  # fmt: skip


ODCTrainer = make_odc_trainer(Trainer)
