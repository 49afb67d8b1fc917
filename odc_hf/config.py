"""ODCConfig: every odc_hf knob in one place.

Set it from Python (``ODCConfig(balance="lb_mini", ...)``), or from ``ODC_*`` environment variables
(``ODC_BALANCE=lb_micro accelerate launch ...``: the way to reach recipe scripts you do not edit). An
accelerate YAML cannot carry extra keys (accelerate rejects unknown top-level keys and drops unknown
``fsdp_config`` keys), so ODC options never live there. ``ODCConfig(...)`` uses only what you pass;
``ODCConfig.from_env(**overrides)`` (what the trainers use when you pass no config) starts from the defaults,
applies the environment, then your non-None overrides; an ``ODC_*`` variable whose name is close to one odc_hf
reads but is not one (``ODC_BALANSE``) gets a warning naming the one it resembles.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from dataclasses import field
from typing import Any

logger = logging.getLogger(__name__)

BALANCE_MODES = ("lb_mini", "lb_micro", "none")
CHECKPOINTING_NAMES = ("auto", "full", "none")
KERNEL_CHOICES = ("auto", "liger", "none")
ATTENTION_CHOICES = ("auto", "flash_attention_4", "sdpa_varlen", "model")
GRPO_LAYOUTS = ("auto", "packed", "padded")
PEER_MEMORY_CHOICES = ("auto", "symmetric_memory", "ipc")  # odc_hf.transport.peer_memory (checked equal in a test)

OTHER_ENV_VARIABLES = {
    "ODC_ACCUMULATE_MAX_CTAS": "the GPU transport's accumulate-kernel grid cap, odc_hf/transport/cuda.py",
    "ODC_ERROR_DIR": "where launched ranks record an uncaught exception, odc_hf/integrations/launch/rank_errors.py",
    "ODC_EXPANDABLE_SEGMENTS": "0 keeps torch's default CUDA allocator, odc_hf/integrations/launch/cuda_allocator.py",
    "ODC_NO_RELAUNCH": "set in the processes odc_hf's relauncher starts, odc_hf/integrations/launch/relaunch.py",
}
"""The ``ODC_*`` variables odc_hf reads that are not ODCConfig fields, and where (every ``ODC_<FIELD>`` of ODCConfig
is read by :meth:`ODCConfig.from_env`). With those, the one list of valid names: :func:`env_variables`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ODCConfig:
    """Options of On-Demand Communication and its load balancing.

    Each field's ``help`` (its metadata) is its documentation, written once: the trainer arguments' ``--odc_<field>``
    help (:mod:`odc_hf.integrations.trainer.arguments`) and the table of docs/configuration.md (checked against it by
    ``tests/project/test_config_docs.py``) are made from it.

    The integer knobs (``max_tokens_per_microbatch``, ``attention_shape_bucket``, ``global_batch_size``,
    ``plan_ahead``) take an int, a whole float (``2048.0``, stored as 2048) or a string such as ``"2048"`` or ``"32k"``
    (k = 1024, as in the ``ODC_*`` variables): :func:`to_count`. Anything else (``True``, NaN, ``"abc"``) is refused
    with the field's name and an example. ``timeout_s`` and ``device_memory_gib`` take a number or its string.
    """

    enabled: bool = field(default=True, metadata={"help": (
        "Use ODC: one-sided gathers and scatter-accumulates, one synchronisation per minibatch. `False` runs plain "
        "FSDP2 collectives with the same bundle data path and the same SUM-plus-global-normaliser semantics (an A/B "
        "baseline).")})  # fmt: skip
    balance: str = field(default="lb_mini", metadata={"help": (
        "How each global minibatch is split over ranks (docs/balancing.md). `lb_mini`: equal estimated compute, any "
        "number of microbatches per rank (needs `enabled=True`). `lb_micro`: the same number of microbatches on "
        "every rank, balanced per microbatch index (works with collectives). `none`: sample `i` to rank `i mod W`, "
        "padded with dummy microbatches to equal counts.")})  # fmt: skip
    cost_model: str = field(default="flop", metadata={"help": (
        "How a sample's compute is estimated from its length. `flop`: `FlopCostModel.from_config(model.config)`, "
        "`6·N·s + 6·L·d_attn·s²`. `tokens`: linear in length. A path ending in `.json` holding `{\"a\", \"b\", "
        "\"c\"}` and optionally `\"floor\"` (`QuadraticCostModel`: seconds per microbatch, per token, per token², "
        "least seconds of any microbatch; `odc_hf.prediction.calibrate` writes one), or timings to fit: `{\"lengths\", "
        "\"seconds\"}` (single documents) or `{\"microbatches\", \"seconds\"}` (a run's "
        "`odc_microbatch_timings.json`).")})  # fmt: skip
    max_tokens_per_microbatch: int | None = field(default=None, metadata={"help": (
        "Token budget of one microbatch (the memory bound), a positive integer. `None`: the smallest budget that "
        "holds the worst-case microbatch of the trainer's layout: the longest sample (SFT, Trainer: one packed "
        "row), or TRL's own widest microbatch (GRPO: `per_device_train_batch_size` rows of the widest padded row "
        "of the generation batch).")})  # fmt: skip
    truncate: bool = field(default=False, metadata={"help": (
        "Cut samples longer than the budget to the budget, instead of raising `ValueError` (how many, the longest, "
        "and every way to set this) before training. Rank 0 logs once how many samples are cut. GRPO samples are "
        "never truncated.")})  # fmt: skip
    timeout_s: float = field(default=600.0, metadata={"help": (
        "How long a rank waits at an ODC barrier before raising `PeerTimeoutError` that names the missing ranks. "
        "Keep it generous: a rank may legitimately run many more microbatches than another.")})  # fmt: skip
    shm_dir: str | None = field(default=None, metadata={"help": (
        "Directory for the shared-memory files of the control block (both transports) and of the CPU transport's "
        "buffers, an existing writable one. `None`: `/dev/shm` when it has room for the buffer plus 25%, otherwise "
        "the temp directory.")})  # fmt: skip
    log_timeline: bool = field(default=True, metadata={"help": (
        "At the end of `train()`, the main process writes `<output_dir>/odc_timeline.png` (per-rank busy and "
        "waiting time of the last 50 steps). Uses matplotlib (a dependency of odc_hf).")})  # fmt: skip
    attention_shape_bucket: int = field(default=1024, metadata={"help": (
        "For a model on `attn_implementation=\"sdpa_varlen\"`: each document's attention inputs are padded to a "
        "multiple of this many tokens, so cuDNN meets few shapes and the trainer plans them all before training "
        "(docs/attention.md). `0`: exact shapes.")})  # fmt: skip
    attention_varlen_kernel: bool = field(default=False, metadata={"help": (
        "For a model on `\"sdpa_varlen\"` on CUDA: one torch flash-varlen call per layer instead of one SDPA call "
        "per document (slower on an H200, docs/attention.md).")})  # fmt: skip
    activation_checkpointing: str = field(default="auto", metadata={"help": (
        "Which decoder layers recompute their activations in backward (docs/performance.md). `auto`: the fewest "
        "checkpointed layers whose predicted peak memory fits 0.9 x the GPU at the token budget (memory model "
        "calibrated on the GPU with the run's kernels and loss; no checkpointing on CPU). `full`, `none`, or a "
        "fraction such as `\"0.5\"`: that share of the decoder layers, spread evenly. The ODC SFT / plain trainers "
        "only (GRPO keeps TRL's). Under `auto` a `gradient_checkpointing=True` you set in the training arguments "
        "wins; otherwise odc_hf sets it to `False` (docs/configuration.md).")})  # fmt: skip
    device_memory_gib: float | None = field(default=None, metadata={"help": (
        "The device memory `activation_checkpointing=\"auto\"` plans against, in GiB. `None`: the GPU's total "
        "memory (ranks sharing a GPU: their share of it). Lower it when something else shares the GPU.")})  # fmt: skip
    kernels: str = field(default="auto", metadata={"help": (
        "Liger's Triton kernels (RMSNorm, SwiGLU, RoPE; `ODCTrainer` also its fused linear cross-entropy), applied "
        "before sharding. `auto`: when `liger-kernel` is installed (`pip install \"odc_hf[kernels]\"`) and "
        "training runs on CUDA; `liger`: required, a clear error otherwise (`use_liger_kernel=True` in the "
        "training arguments means the same); `none`: off. In fp32 training `auto` keeps a Mixture-of-Experts "
        "model's float32 experts off Liger's fused MoE kernel (its products run on TF32) and applies the rest; "
        "asked for by name, Liger applies whole, with a warning (docs/performance.md).")})  # fmt: skip
    attention: str = field(default="auto", metadata={"help": (
        "The attention the ODC trainers give the model (and GRPO's reference model), through transformers' "
        "`set_attn_implementation` (docs/attention.md). `auto`: transformers' `flash_attention_4` (FlashAttention-4 "
        "varlen; `pip install \"odc_hf[kernels]\"`) where it runs: installed, CUDA compute capability >= 9.0, "
        "bf16/fp16 compute (parameters or mixed precision), a model that supports flash attention; else "
        "`sdpa_varlen` (CPU, older GPUs, fp32). `auto` replaces only transformers' default (`sdpa`; `eager` for "
        "families with soft-capping or sinks) and odc_hf's `sdpa_varlen`: a model on another implementation "
        "(`eager`, `flash_attention_2`, a hub kernel, ...) was given it by its user and keeps it. `flash_attention_4` / `sdpa_varlen`: that one (`flash_attention_4` "
        "raises where it cannot run, saying why); `model`: leave the model's own (packed rows on `sdpa` / `eager` "
        "then log a warning: dense mask). The choice and why are logged once (rank 0), kept in "
        "`trainer.odc_attention` and written to `odc_microbatch_timings.json` (`\"attention\"`) and the timeline's "
        "title.")})  # fmt: skip
    grpo_layout: str = field(default="auto", metadata={"help": (
        "`ODCGRPOTrainer`'s training microbatches (docs/grpo.md). `packed`: each microbatch is one row of "
        "prompt+completion sequences back to back (per-sequence positions, varlen attention, no padding; the "
        "reference model's log-probs too); `padded`: TRL's layout (prompts left-padded, completions right-padded; "
        "rounded to 128 columns on CUDA unless the attention is FlashAttention); `auto`: `packed` under "
        "FlashAttention (`flash_attention_4`, ...) and under `sdpa_varlen` off CUDA; `padded` under `sdpa_varlen` "
        "on CUDA, where padded rows measured faster, and under dense-mask attentions (`sdpa`, `eager`).")})  # fmt: skip
    global_batch_size: int | None = field(default=None, metadata={"help": (
        "Samples per optimizer step, all ranks together (the global minibatch). `None`: "
        "`per_device_train_batch_size x gradient_accumulation_steps x` number of processes. Set it to keep the "
        "run's batch whatever the number of ranks, e.g. to resume a checkpoint on a different number of GPUs "
        "(docs/troubleshooting.md#resuming-from-a-checkpoint); `per_device_train_batch_size` then plays no part "
        "(LB-Mini gives each rank a share by cost, not by count; rank 0 says so once, as a warning). The SFT / "
        "plain trainers only: `ODCGRPOTrainer` refuses it (TRL sizes its generation batch from its own "
        "arguments).")})  # fmt: skip
    plan_ahead: int = field(default=0, metadata={"help": (
        "Optimizer steps the data loader plans ahead in a background thread (`ODCBatchSampler(plan_ahead=...)`), "
        "so a step's plan is ready when training asks for it: planning 65,536 samples over 1,024 ranks takes "
        "0.1-0.4 s on one core, and `1` overlaps it with the previous step. The plans are the same (each is a pure "
        "function of its step's samples). `0`: plan each step when asked. The SFT / Trainer path (`ODCTrainer`, "
        "`ODCSFTTrainer`); GRPO plans each generation batch itself.")})  # fmt: skip
    cuda_peer_memory: str = field(default="auto", metadata={"help": (
        "How the CUDA transport's ranks map each other's buffers (docs/transports.md). `auto`: torch symmetric "
        "memory when every rank has a GPU of its own, CUDA IPC when ranks share a GPU (or symmetric memory is "
        "missing); `symmetric_memory` or `ipc` to force one. Logged once.")})  # fmt: skip
    deterministic: bool = field(default=False, metadata={"help": (
        "Bit-identical accumulation on CUDA: every owner keeps one fp32 accumulator slot per sender and sums them "
        "in rank order (as the CPU transport always does), instead of atomic adds in arrival order. Costs "
        "`world_size - 1` more fp32 copies of each rank's trainable shard (docs/transports.md).")})  # fmt: skip

    def __post_init__(self) -> None:
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"ODCConfig.balance must be one of {BALANCE_MODES}, got {self.balance!r}")
        if self.balance == "lb_mini" and not self.enabled:
            raise ValueError(
                "balance='lb_mini' gives ranks different microbatch counts, which FSDP collectives cannot run: "
                "use balance='lb_micro' or 'none' with enabled=False"
            )
        # Every integer knob through one parser (Python values and ODC_* strings alike): 32768, "32k", 2048.0.
        self._set_count("max_tokens_per_microbatch", 1, "a positive integer", "32768 or '32k'", optional=True)
        self._set_count("attention_shape_bucket", 0, "an integer >= 0", "1024, '1k' or 0")
        self._set_count("global_batch_size", 1, "a positive integer (samples per optimizer step)", "64",
                        optional=True)  # fmt: skip
        self._set_count("plan_ahead", 0, "an integer >= 0 (optimizer steps planned ahead)", "0 or 2")
        self._set_number("timeout_s")
        self._set_number("device_memory_gib", optional=True)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):  # NaN compares False: a wait never ends
            raise ValueError(
                f"timeout_s must be a finite number of seconds > 0 (ODC_TIMEOUT_S, --odc_timeout_s), got {self.timeout_s}"
            )
        if self.shm_dir is not None:
            check_shm_dir(self.shm_dir)
        if isinstance(self.activation_checkpointing, (int, float)):  # ODCConfig(activation_checkpointing=0.5)
            object.__setattr__(self, "activation_checkpointing", str(self.activation_checkpointing))
        if self.activation_checkpointing not in CHECKPOINTING_NAMES:
            try:
                fraction = float(self.activation_checkpointing)
            except ValueError:
                fraction = -1.0
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(
                    f"activation_checkpointing must be one of {CHECKPOINTING_NAMES} or a fraction of the decoder "
                    f"layers between 0 and 1 such as '0.5', got {self.activation_checkpointing!r}"
                )
        if self.device_memory_gib is not None and not (
            math.isfinite(self.device_memory_gib) and self.device_memory_gib > 0
        ):
            raise ValueError(f"device_memory_gib must be a finite number > 0, got {self.device_memory_gib}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        if self.cuda_peer_memory not in PEER_MEMORY_CHOICES:
            raise ValueError(f"cuda_peer_memory must be one of {PEER_MEMORY_CHOICES}, got {self.cuda_peer_memory!r}")
        if self.grpo_layout not in GRPO_LAYOUTS:
            raise ValueError(f"grpo_layout must be one of {GRPO_LAYOUTS}, got {self.grpo_layout!r}")
        if self.cost_model not in ("flop", "tokens") and not self.cost_model.endswith(".json"):
            raise ValueError(
                f"cost_model must be 'flop', 'tokens' or a calibration .json path, got {self.cost_model!r}"
            )

    def _set_count(self, name: str, minimum: int, what: str, example: str, *, optional: bool = False) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        object.__setattr__(self, name, to_count(value, name, minimum=minimum, what=what, example=example))

    def _set_number(self, name: str, *, optional: bool = False) -> None:
        """A float knob: a number or a string of one (``"600"``, from a YAML or a command line) becomes a float; the
        range checks below keep their own messages (NaN and infinity included)."""
        value = getattr(self, name)
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            kind = type(value).__name__
            raise ValueError(f"{name} must be a number, e.g. 600 or 1.5; got {value!r} (a {kind})")
        try:
            object.__setattr__(self, name, float(value))
        except ValueError:
            raise ValueError(f"{name} must be a number, e.g. 600 or 1.5; got the text {value!r}") from None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> ODCConfig:
        """Defaults, overridden by ``ODC_<FIELD>`` environment variables, overridden by ``overrides``."""
        environ = os.environ if environ is None else environ
        warn_misspelt_variables(environ)
        values: dict[str, Any] = {}
        for option in dataclasses.fields(cls):
            raw = environ.get(f"ODC_{option.name.upper()}")
            if raw is not None and raw != "":
                values[option.name] = _parse(option, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def env_variables() -> tuple[str, ...]:
    """Every ``ODC_*`` environment variable odc_hf reads: one per ODCConfig field, and :data:`OTHER_ENV_VARIABLES`."""
    return (*(f"ODC_{f.name.upper()}" for f in dataclasses.fields(ODCConfig)), *OTHER_ENV_VARIABLES)


def closest_env_variable(name: str) -> str | None:
    """The variable odc_hf reads that ``name`` (not one of them) most resembles, or ``None`` when none is close:
    difflib's ratio on the part after ``ODC_`` (>= 0.6), or a valid name that begins with it (``ODC_MAX_TOKENS``)."""
    known = {variable.removeprefix("ODC_"): variable for variable in env_variables()}
    suffix = name.upper().removeprefix("ODC_")
    close = difflib.get_close_matches(suffix, list(known), n=1, cutoff=0.6)
    if close:
        return known[close[0]]
    starting = [k for k in known if len(suffix) >= 3 and k.startswith(suffix)]
    return known[starting[0]] if len(starting) == 1 else None


_WARNED_VARIABLES: set[str] = set()  # once per process and name


def warn_misspelt_variables(environ) -> None:
    """Warn about each ``ODC_*`` variable of ``environ`` that odc_hf does not read but whose name is close to one it
    does (``ODC_BALANSE=lb_micro`` would otherwise be ignored without a word), naming that one. Once per process and
    name, on the first rank of a node (``LOCAL_RANK`` unset or 0; each node's environment may differ). A name close to
    none of them is left alone: other tools use the ``ODC_`` prefix too."""
    if str(environ.get("LOCAL_RANK", "0")) not in ("0", ""):
        return
    valid = set(env_variables())
    for name in sorted(environ):
        if not name.upper().startswith("ODC_") or name in valid or name in _WARNED_VARIABLES:
            continue
        closest = closest_env_variable(name)
        if closest is not None:
            _WARNED_VARIABLES.add(name)
            logger.warning(
                "odc_hf: the environment variable %s is not one odc_hf reads, so it has no effect: did you mean %s? "
                "(the ODC_* variables: docs/configuration.md)", name, closest,
            )  # fmt: skip


def check_shm_dir(path: str) -> None:
    """``shm_dir`` must be an existing, writable directory: checked when the config is made, before any rank imports a
    model or tokenizes (the transport creates its files there only at ``prepare()``)."""
    if not os.path.isdir(path):
        raise ValueError(
            f"shm_dir {path!r} (ODC_SHM_DIR, --odc_shm_dir) is not an existing directory: create it, or unset it to use "
            "/dev/shm (or the temp directory when /dev/shm is too small)"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"shm_dir {path!r} (ODC_SHM_DIR, --odc_shm_dir) is not writable by this process")


def parse_count(text: str) -> int:
    """An integer written plainly (``32768``) or with a binary suffix: ``2k`` = 2048, ``32k`` = 32768, ``1m`` =
    1048576 (k = 1024, m = 1024², case-insensitive; ``_`` allowed as a digit separator). Token budgets and context
    lengths are quoted that way (a "32k context" holds 32768 tokens), so ``k`` is 1024 here, not 1000."""
    value = text.strip().lower().replace("_", "")
    scale = {"k": 1024, "m": 1024 * 1024}.get(value[-1:], 1)
    digits = value[:-1] if scale != 1 else value
    if not digits.isdigit():
        raise ValueError(f"expected an integer such as 32768 or 32k, got {text!r}")
    return int(digits) * scale


def to_count(value: Any, name: str, *, minimum: int, what: str, example: str) -> int:
    """``value`` as the integer it means, for the ODCConfig field ``name``, or a ``ValueError`` naming the field and
    giving an example. The one parser of ODC's integer knobs, whether the value comes from Python or from an
    ``ODC_*`` variable:

    - an int is itself; ``True`` / ``False`` are refused (a bool is an int in Python, and ``True`` would read as 1);
    - a float is accepted when it is a whole number (``2048.0``, as YAML or arithmetic give it) and stored as the int;
      ``2048.5``, NaN and infinity are refused;
    - a string goes through :func:`parse_count`: ``"2048"``, ``"32k"`` and ``"1m"`` are accepted, as they are in the
      environment (``ODC_MAX_TOKENS_PER_MICROBATCH=32k``), so a value read from a config file or a command line as
      text means what it says.

    The result must be at least ``minimum``; ``what`` (the range) and ``example`` (valid values) go into the message.
    """
    number = isinstance(value, (int, float, str)) or hasattr(value, "__index__")  # __index__: numpy ints
    if isinstance(value, bool) or not number:
        raise ValueError(f"{name} must be {what}, e.g. {example}; got {value!r} (a {type(value).__name__})")
    if isinstance(value, str):
        try:
            count = parse_count(value)
        except ValueError:
            raise ValueError(f"{name} must be {what}, e.g. {example}; got the text {value!r}") from None
    elif isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{name} must be {what}, e.g. {example}; got {value!r}")
        count = int(value)
    else:
        count = int(value.__index__())
    if count < minimum:
        raise ValueError(f"{name} must be {what}, got {count} (e.g. {example})")
    return count


def _parse(field: dataclasses.Field, raw: str) -> Any:
    name = f"ODC_{field.name.upper()}"
    kind = str(field.type)
    if kind.startswith("bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean (use 1/true/yes/on or 0/false/no/off)")
    try:
        if kind.startswith("int"):
            return None if raw.lower() == "none" else parse_count(raw)
        if kind.startswith("float"):
            return None if raw.lower() == "none" else float(raw)
    except ValueError as err:
        raise ValueError(f"{name}={raw!r}: {err}") from None
    return raw
