"""ODC in the transformers Trainer: one bundle of microbatches per rank per optimizer step.

The Trainer ties microbatches per step to ``gradient_accumulation_steps``; ODC needs each rank to run its own
number. So (DESIGN.md §5): the Trainer runs with gradient accumulation 1, and each "batch" it sees is a
:class:`Bundle`, this rank's list of packed microbatches for one optimizer step, planned by
:class:`~odc_hf.balance.ODCBatchSampler`; ``training_step`` loops over it. Everything the Trainer does once
per step (token counting, clipping, optimizer step, logging, saving) stays matched across ranks. The user's
``per_device_train_batch_size x gradient_accumulation_steps x world size`` is the global minibatch.

Losses are normalised by the GLOBAL number of label tokens of the minibatch (one all-reduce per step),
so ranks running different numbers of microbatches do not reweight samples.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

import odc_hf.attention  # registers attn_implementation="sdpa_varlen"; warm_up
from odc_hf.balance import (
    BundleCollator,
    BundleDataset,
    FlopCostModel,
    ODCBatchSampler,
    QuadraticCostModel,
    TokenCostModel,
)
from odc_hf.config import ODCConfig
from odc_hf.integrations.accelerator import adopt, destroy_gloo_group_at_exit
from odc_hf.integrations.stats import DeviceClock, RunStats, StepStats, plot_timeline

logger = logging.getLogger(__name__)


def attention_dtype(mixed_precision: str | None, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """The attention's compute dtype in training: autocast's under accelerate's ``mixed_precision`` ("bf16"/"fp16"),
    else the parameters' if half precision, else ``None`` (fp32 attention: cuDNN's attention, whose plans
    ``odc_hf.attention.warm_up`` builds, runs half precision only, so there is nothing to plan)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(mixed_precision))
    if dtype is None and param_dtype in (torch.float16, torch.bfloat16):
        dtype = param_dtype
    return dtype


class Bundle(Mapping):
    """This rank's microbatches for one optimizer step.

    As a Mapping it shows each key concatenated over the microbatches, which is what the Trainer's once-per-step
    helpers read (token counting, FLOP estimate); ``training_step`` iterates ``microbatches``.
    """

    def __init__(self, microbatches: list[dict]):
        self.microbatches = microbatches

    def __getitem__(self, key: str) -> torch.Tensor:
        parts = [mb[key] for mb in self.microbatches if isinstance(mb.get(key), torch.Tensor)]
        if not parts:
            if key == "input_ids":
                return torch.zeros((1, 0), dtype=torch.long)
            raise KeyError(key)
        return torch.cat(parts, dim=-1)

    def __iter__(self):
        keys = self.microbatches[0].keys() if self.microbatches else ("input_ids",)
        return iter(
            [k for k in keys if k == "input_ids" or isinstance(self.microbatches[0].get(k), torch.Tensor)]
        )

    def __len__(self) -> int:
        return len(list(iter(self)))

    @property
    def label_tokens(self) -> int:
        return sum(int(mb["num_label_tokens"]) for mb in self.microbatches)

    @property
    def input_tokens(self) -> int:
        return sum(int(mb["input_ids"].numel()) for mb in self.microbatches)


class _BundleCollator(BundleCollator):
    def __call__(self, bundle):
        return Bundle(super().__call__(bundle))


class BundleLoader(DataLoader):
    """DataLoader over bundles; ``set_epoch`` reaches the sampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


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

    def __init__(self, *args, odc_config: ODCConfig | None = None, **kwargs):
        if odc_config is None:  # trainer arguments' odc_* fields, then ODC_* variables, then defaults
            from odc_hf.integrations.arguments import odc_config_from_args

            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            odc_config = odc_config_from_args(training_args)
        self.odc_config = odc_config
        self.odc_stats = RunStats()
        self.odc_microbatch_timings: list[tuple[list[int], float]] = []
        self.odc_attention_warm_up: dict | None = None  # {"shapes", "seconds", "dtype"} once warm_up ran
        super().__init__(*args, **kwargs)
        self.add_callback(_ODCCallback(self))

    odc_sampler_class: type[ODCBatchSampler] = ODCBatchSampler
    """The batch sampler that cuts each epoch into global minibatches and plans every step over the ranks. Set a
    subclass (overriding ``plan(step)``, say) on your trainer class to plan differently; every rank must get the same
    plans from the same arguments, without communicating."""

    # -- setup -------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        self.args = args = copy.copy(self.args)  # the user's object stays as they made it
        self.odc_minibatch_per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
        if args.gradient_accumulation_steps != 1:
            logger.info(
                "odc_hf: gradient_accumulation_steps=%d becomes part of the minibatch (%d samples per rank per step); "
                "the Trainer itself runs with 1", args.gradient_accumulation_steps, self.odc_minibatch_per_rank,
            )  # fmt: skip
        args.gradient_accumulation_steps = 1
        # Gradients are SUMS over ranks under ODC; the loss is already divided by the global token count.
        args.average_tokens_across_devices = False
        super().create_accelerator_and_postprocess()
        adopt(self.accelerator, self.odc_config)

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
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(
                "odc_hf plans each minibatch from sample lengths, so it needs a map-style dataset; got an iterable "
                "one (streaming, or accelerate's dispatch_batches): load it without streaming"
            )
        if "input_ids" not in getattr(dataset, "column_names", ["input_ids"]):
            raise ValueError("odc_hf needs a tokenized dataset with an 'input_ids' column")
        lengths = [len(ids) for ids in dataset["input_ids"]]
        budget = self.odc_config.max_tokens_per_microbatch or max(lengths)
        self._odc_check_attention(budget)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        sampler = self.odc_sampler_class(
            lengths, world_size=world, rank=rank, minibatch_size=self.odc_minibatch_per_rank * world,
            max_tokens_per_microbatch=budget, mode=self.odc_config.balance, cost_model=self._odc_cost_model(),
            seed=self.args.seed, shuffle=True, drop_last=self.args.dataloader_drop_last,
            truncate=self.odc_config.truncate,
        )  # fmt: skip
        pad = getattr(self.processing_class, "pad_token_id", None)
        collator = _BundleCollator(max_tokens_per_microbatch=budget, truncate=self.odc_config.truncate,
                                   pad_token_id=pad if pad is not None else 0, mask_keys=self.odc_mask_keys())  # fmt: skip
        self.odc_sampler = sampler
        # No pin_memory: torch's pinning rebuilds Mapping batches as their type from a dict, which a Bundle is
        # not; training_step copies each microbatch to the device itself.
        return BundleLoader(BundleDataset(dataset), batch_sampler=sampler, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers)  # fmt: skip

    def _odc_check_attention(self, budget: int) -> None:
        """Packed rows under "sdpa"/"eager" attention are slow: say so once, with the fix. Under "sdpa_varlen"
        on a GPU, plan the attention shapes of every length up to the token budget now (odc_hf.attention.warm_up)."""
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        param = next(model.parameters(), None)
        dtype = attention_dtype(self.accelerator.mixed_precision, param.dtype if param is not None else None)
        if (implementation == odc_hf.attention.VARLEN_ATTENTION and self.accelerator.device.type == "cuda"
                and dtype is not None):  # fmt: skip
            start = time.perf_counter()
            shapes = odc_hf.attention.warm_up(model, budget, dtype=dtype, device=self.accelerator.device)
            seconds = time.perf_counter() - start
            self.odc_attention_warm_up = {"shapes": shapes, "seconds": seconds, "dtype": str(dtype)}
            logger.info("odc_hf: planned %d attention shapes in %.1f s", shapes, seconds)
        if implementation in ("sdpa", "eager"):
            logger.warning(
                "odc_hf packs several documents per microbatch; with attn_implementation=%r transformers isolates "
                "them with a dense block-diagonal mask, which costs full-row attention (measured 2.6x slower for a "
                '2-document 28k-token row on an H200). Load the model with attn_implementation="sdpa_varlen" '
                '(registered by `import odc_hf.attention`, which the odc_hf trainers import; per-document SDPA, same results) or "flash_attention_2".',
                implementation,
            )

    def odc_mask_keys(self) -> tuple[str, ...]:
        """Example columns whose zeros mask labels (TRL's trainer narrows this to what its settings enable)."""
        from odc_hf.balance.collator import MASK_KEYS

        return MASK_KEYS

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
        clock = _MicrobatchClock(device) if self._odc_time_microbatches() else None
        try:
            with guard:  # a rank that raises tells its peers at once instead of leaving them to time out
                for microbatch in inputs.microbatches:
                    batch = send_to_device(
                        {k: v for k, v in microbatch.items() if k != "num_label_tokens"}, device
                    )
                    with self.compute_loss_context_manager():
                        loss = self.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)
                    real_accelerator.backward(loss)
                    loss_sum += loss.detach()
                    if clock is not None:
                        clock.lap(_document_lengths(microbatch))
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
        self._odc_record(busy, wait, inputs)
        self.odc_after_bundle(snapshot)
        # Trainer logs the mean over ranks of what we return: scale so that it is the global loss.
        return loss_sum * self.accelerator.num_processes

    ODC_MAX_TIMINGS = 20_000
    """Microbatch timings kept per rank for ``odc_microbatch_timings.json`` (the most recent)."""
    ODC_TIMING_WARMUP_STEPS = 2
    """Optimizer steps whose microbatches are not timed (kernel compilation, allocator warm-up)."""

    def _odc_time_microbatches(self) -> bool:
        return self.odc is not None and self.state.global_step >= self.ODC_TIMING_WARMUP_STEPS

    def _odc_record(self, busy: float, wait: float, bundle: Bundle) -> None:
        row = torch.tensor([busy, wait, len(bundle.microbatches), bundle.input_tokens], dtype=torch.float64,
                           device=self.accelerator.device)  # fmt: skip
        rows = self.accelerator.gather(row) if self.accelerator.num_processes > 1 else row
        self.odc_stats.add(StepStats.from_gathered(rows))

    def odc_before_bundle(self):
        """Hook: state to aggregate per-microbatch metrics once per step (see ODCSFTTrainer)."""
        return None

    def odc_after_bundle(self, snapshot) -> None:
        """Hook: aggregate what ``odc_before_bundle`` snapshotted; runs once per step on every rank."""

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, Bundle):
            return sum(super(ODCMixin, self).floating_point_ops(mb) for mb in inputs.microbatches)
        return super().floating_point_ops(inputs)

    # -- saving ------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """On GPUs accelerate's FSDP2 path saves; on the CPU path (sharded by odc_hf) gather a full state dict
        on every rank (a collective) and write it from the main process."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self._odc_self_sharded():
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.accelerator.is_main_process:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            self.accelerator.unwrap_model(self.model).save_pretrained(output_dir, state_dict=state)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        self.accelerator.wait_for_everyone()

    def _odc_self_sharded(self) -> bool:
        from accelerate.utils import DistributedType

        from odc_hf.integrations.accelerator import _is_sharded

        return self.accelerator.distributed_type != DistributedType.FSDP and _is_sharded(self.model)

    # Private Trainer methods, overridden for the CPU path only (see odc_hf/integrations/checkpoint.py).
    def _save_optimizer_and_scheduler(self, output_dir):
        if not self._odc_self_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        from odc_hf.integrations.checkpoint import save_optimizer_and_scheduler

        save_optimizer_and_scheduler(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        from odc_hf.integrations.checkpoint import load_optimizer_and_scheduler

        if (
            checkpoint is None
            or not self._odc_self_sharded()
            or not load_optimizer_and_scheduler(self, checkpoint)
        ):
            return super()._load_optimizer_and_scheduler(checkpoint)

    # -- observability -----------------------------------------------------------------------------
    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            window = self.odc_stats.window()
            if (
                self.odc is None
            ):  # collectives: waits hide inside FSDP's per-layer collectives, not measurable here
                window = {k: v for k, v in window.items() if k not in ("odc/bubble_rate", "odc/wait_s_mean")}
            logs = {**logs, **{k: round(v, 4) for k, v in window.items()}}
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
        self.odc_summary = summary
        if self.odc_config.log_timeline:
            path = plot_timeline(self.odc_stats.steps[-50:], Path(self.args.output_dir) / "odc_timeline.png")
            logger.info("odc_hf: timeline written to %s", path)


def _document_lengths(microbatch: Mapping) -> list[int]:
    """Token counts of the documents packed in a collated microbatch.

    [] (not timed) for an empty dummy microbatch and for batches that are not packed rows (no ``cu_seq_lens_q``,
    e.g. GRPO's padded microbatches), whose cost is not a sum over documents.
    """
    if microbatch.get("num_label_tokens", 1) == 0 and microbatch["input_ids"].numel() <= 1:
        return []
    bounds = microbatch.get("cu_seq_lens_q")
    if bounds is None:
        return []
    offsets = [int(x) for x in bounds.tolist()]
    return [b - a for a, b in zip(offsets, offsets[1:]) if b > a]


class _MicrobatchClock:
    """Forward+backward time of each microbatch, on the device's timeline (read after the step's sync).

    Under ODC a rank never waits for a peer inside a minibatch, so these are the microbatches' own costs.
    """

    def __init__(self, device: torch.device):
        self.clock = DeviceClock(device)
        self.marks = [self.clock.mark()]
        self.docs: list[list[int]] = []

    def lap(self, docs: list[int]) -> None:
        self.marks.append(self.clock.mark())
        self.docs.append(docs)

    def laps(self) -> list[tuple[list[int], float]]:
        """(document lengths, seconds) per real microbatch; call after the device is synchronised."""
        return [
            (docs, self.clock.seconds(a, b))
            for docs, a, b in zip(self.docs, self.marks, self.marks[1:])
            if docs
        ]


def make_odc_trainer(trainer_cls: type[Trainer]) -> type[Trainer]:
    """``ODCX = make_odc_trainer(X)`` for any Trainer subclass X (TRL's SFTTrainer, your own, ...)."""
    return type(f"ODC{trainer_cls.__name__}", (ODCMixin, trainer_cls), {"__module__": __name__})


ODCTrainer = make_odc_trainer(Trainer)
