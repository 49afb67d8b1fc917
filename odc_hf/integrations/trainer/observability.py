"""What the ODC trainers measure and report: per-step statistics in the logs, microbatch timings, the end-of-run
summary and timeline.

A part of :class:`~odc_hf.integrations.trainer.mixin.ODCMixin` (a mixin on the trainer below it). Every rank's step
statistics (busy and waiting time, microbatches, tokens) and loss are gathered once per step (:meth:`_odc_record`);
the logs carry a window of them (:mod:`odc_hf.integrations.trainer.stats`). At the end of training the microbatch timings
are written with a cost model fitted to them (``odc_microbatch_timings.json``, to pass as ``cost_model`` in the
next run), and the main process keeps the run's summary (``trainer.odc_summary``) and draws its timeline. Inside
a step's microbatch loop the metric collectives of the libraries below stay local (:class:`~odc_hf.integrations.trainer.metrics.LocalGathers`): the
trainers aggregate their metrics once per step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from odc_hf.balance import QuadraticCostModel
from odc_hf.integrations.launch.exit_cleanup import destroy_gloo_group_at_exit
from odc_hf.integrations.trainer.bundle import Bundle
from odc_hf.integrations.trainer.stats import StepStats, plot_timeline

logger = logging.getLogger(__name__)

COLLECTIVE_HIDDEN = ("odc/bubble_rate", "odc/wait_s_mean")
"""Statistics not measurable under FSDP collectives (``enabled=False``): the waits hide inside each layer's
collectives."""


def one_progress_bar(training_args) -> None:
    """Progress bars on the main process only, as transformers draws its training bar: on the other ranks turn off
    the bars of ``datasets`` (TRL's dataset preparation runs on every rank, main process first) and of transformers
    (shard loading and writing). A process of a launched job serves that job alone, so the switch is process-wide;
    ``disable_tqdm=True`` in the arguments is left to the Trainer."""
    if int(getattr(training_args, "process_index", 0) or 0) == 0:
        return
    import datasets
    from transformers.utils import logging as transformers_logging

    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()


class ObservabilityPart:
    """Statistics, timings, summary and timeline of :class:`~odc_hf.integrations.trainer.mixin.ODCMixin`; see the module
    docstring."""

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

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            window = self.odc_stats.window()
            if self.odc is None:  # collectives: waits hide inside FSDP's per-layer collectives, not measurable here
                window = {k: v for k, v in window.items() if k not in COLLECTIVE_HIDDEN}
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

    odc_summary: dict = {}
    """The run's statistics over all its steps (main process, after ``train()``): ``odc/tokens_per_s``,
    ``odc/bubble_rate`` (ODC only), ``odc/microbatches_min`` / ``_max``, ... (:func:`odc_hf.integrations.trainer.stats.summarise`)."""
    odc_summary_text: str | None = None
    """The one-line summary the main process printed at the end of ``train()`` (:meth:`odc_summary_line`)."""

    def odc_finish_run(self) -> None:
        """At the end of ``train()``: the timings file, the summary and timeline (main process), and the summary
        line, printed by the main process as the run's last odc_hf output."""
        self._odc_write_timings()
        destroy_gloo_group_at_exit()  # the gather above must not race interpreter exit (see its docstring)
        if not self.accelerator.is_main_process:
            return
        summary = self.odc_stats.total()
        if self.odc is None:  # collectives: the bubble is hidden inside FSDP's collectives (see log())
            summary = {k: v for k, v in summary.items() if k not in COLLECTIVE_HIDDEN}
        self.odc_summary = summary
        timeline = None
        if summary and self.odc_config.log_timeline:
            implementation = self.odc_attention_choice.implementation if self.odc_attention_choice else None
            title = f"ODC per-rank timeline ({implementation} attention)"
            timeline = plot_timeline(self.odc_stats.steps[-50:], Path(self.args.output_dir) / "odc_timeline.png",
                                     title=title)  # fmt: skip
        self.odc_summary_text = self.odc_summary_line(timeline)
        print(f"\n{self.odc_summary_text}", flush=True)

    def odc_summary_line(self, timeline: Path | None = None) -> str:
        """One line: how the run trained (ODC's transport and mesh, or collectives), the balancing, processes and
        steps; the last logged loss (and reward, for GRPO), tokens/s, the bubble rate (ODC only: under collectives
        the waits hide inside FSDP's collectives), microbatches per rank; the timeline's file and the checkpoint the
        run resumed from, when there are."""
        world = self.accelerator.num_processes
        if self.odc is not None:
            mode = f"ODC over the {self.odc.describe()}"
        else:
            mode = "FSDP2 collectives" if world > 1 else "single process, no ODC"
        logged = [h for h in self.state.log_history if "loss" in h]
        parts = [f"final loss {logged[-1]['loss']:.4f}" if logged else "final loss n/a (no step logged)"]
        if logged and "reward" in logged[-1]:
            parts.append(f"reward {logged[-1]['reward']:.4f}")
        summary = self.odc_summary
        if summary:
            parts.append(f"tokens/s {summary['odc/tokens_per_s']:.0f}")
            if "odc/bubble_rate" in summary:
                parts.append(f"bubble rate {summary['odc/bubble_rate']:.1%}")
            parts.append(f"microbatches per rank {summary['odc/microbatches_min']:.0f}-{summary['odc/microbatches_max']:.0f}")
        line = (f"odc_hf summary ({mode}, {self.odc_config.balance}, {world} processes, {self.state.global_step} "
                f"steps): {', '.join(parts)}")  # fmt: skip
        if timeline is not None:
            line += f"; timeline: {timeline}"
        resumed = self.odc_resumed_from  # CheckpointPart's, the other part of the same mixin
        if resumed is not None:
            line += f"; resumed from {resumed[0]} (step {resumed[1]})"
        return line
