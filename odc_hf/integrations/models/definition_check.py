"""A behavioural check, before training, that packed rows train the model in hand exactly as it is defined.

A list of families cannot keep up with transformers' releases, and what breaks packed training is in the modeling
code, not in a name: a decoder layer that does not hand its ``**kwargs`` on (the document boundaries
``cu_seq_lens_q/k`` never reach the attention, which then sees one long document), a sliding window that lives only in
the model's mask (the attention never receives it), an attention argument applied nowhere. So odc_hf runs the model's
own code on a packed row and compares:

- **the probe**: a small copy of the model, built from its own class (the modeling code it will train) on its config
  with the widths shrunk (hidden 32, 4 heads, 4 experts ...; layer count, layer types, norms, rotary, biases and every
  other switch kept), every window shrunk to :data:`PROBE_WINDOW` tokens and every attention soft-cap to
  :data:`PROBE_SOFTCAP`, fp32 on the CPU, seeded;
- **packed**: one row of :data:`PROBE_DOCUMENTS` (each longer than the window), with ``position_ids`` restarting at
  every document and the boundaries ``cu_seq_lens_q/k`` / ``max_length_q/k``, exactly what odc_hf's collators give the
  model, through the attention odc_hf will train it with;
- **reference**: each document alone (batch of one, no packing) through the model's own attention (``sdpa``, or
  ``eager`` for families transformers runs without SDPA): the model's definition;
- **control**: the packed row with its boundaries removed (one document of the whole row), which shows that the probe
  sees documents attending to each other (its difference to the reference must exceed :data:`SENSITIVITY` x the
  threshold, else the check itself is refused as blind).

The packed logits must equal the reference's within :data:`THRESHOLD` (relative to the logits' scale; fp32 float noise
on these probes is ~1e-7). Otherwise the run is refused by name: the family, the first attention layer whose output
differed, what differed (documents attending to each other; else found by taking the soft-caps, then the windows,
away and checking again: the one whose removal makes the check pass was not applied), and a setting that works,
itself checked the same way (transformers' masks over packed rows: ``ODCConfig(attention="model")`` with
``attn_implementation="sdpa"``), or TRL's own trainer when none does.

Every rank computes the same verdict from the same config and seed, without a collective. The verdict is cached per
model class, config and attention for the process. Cost: a few forwards of a model of width 32, a fraction of a
second (:data:`LAST_COST` records it; docs/models.md has the measured range), against a training step of seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import time

import torch

from odc_hf.integrations.models.family import transformers_model
from odc_hf.integrations.upstream.transformers import attn_implementation

logger = logging.getLogger(__name__)

PROBE_WINDOW = 4
"""Tokens of every sliding window in the probe (documents are longer, so a window not applied shows)."""
PROBE_SOFTCAP = 1e-3
"""Every attention-logit soft-cap of the probe (``attn_logit_softcapping``). A small copy's attention logits are far
below a real cap (Gemma 2's 50), where a cap not applied changes nothing measurable; at this cap, a cap dropped moves
the probe's logits by ~4e-3 relative, 40x the threshold (docs/models.md)."""
PROBE_DOCUMENTS = (11, 6, 9)
"""Document lengths of the probe's packed row."""
THRESHOLD = 1e-4
"""Largest relative difference of the packed logits to the reference's that counts as float noise (fp32)."""
SENSITIVITY = 100.0
"""The control (boundaries removed) must differ from the reference by at least this many thresholds."""
HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
WIDTHS = {
    "intermediate_size": 64, "ffn_hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "intermediate_size_mlp": 64, "ffn_dim": 64, "n_inner": 64,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "qk_head_dim": 8, "hidden_size_per_layer_input": 8, "laurel_rank": 8, "vocab_size_per_layer_input": 512,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "embedding_dim": HIDDEN,
}  # fmt: skip
"""Widths shrunk where a config has them (an int value): MLPs, experts, latent attention ranks."""
SEQ2SEQ_HEADS = ("encoder_attention_heads", "decoder_attention_heads", "num_heads")
"""Other names of head counts (encoder-decoder configs' causal-LM decoders, xLSTM), set to the probe's."""
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_top_k")
LAST_COST: dict = {}
"""What the last check measured: ``{"family", "seconds", "difference", "control"}``."""

_verdicts: dict = {}


class DefinitionMismatch(ValueError):
    """Packed rows would train a different model than the one defined."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The check's outcome for one model and attention."""

    family: str
    implementation: str
    difference: float  # packed vs reference, relative
    control: float  # boundaries removed vs reference, relative
    seconds: float
    layer: str | None = None  # the first attention layer whose output differed
    what: str | None = None
    works: str | None = None  # a setting that passed the same check

    @property
    def exact(self) -> bool:
        return self.difference <= THRESHOLD


def _get(config, name: str):
    try:  # some configs raise on attributes that vary per layer (Gemma 4)
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return None


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _set(config, name: str, value) -> None:
    if _int(_get(config, name)) and value:
        try:
            setattr(config, name, value)
        except (AttributeError, TypeError):  # a derived property (Falcon's head_dim)
            pass


def probe_config(config):
    """A copy of ``config`` with the widths shrunk and every window at :data:`PROBE_WINDOW` tokens; everything that
    says how the model computes (layers, layer types, norms, rotary, biases, routers) kept."""
    config = copy.deepcopy(config)
    heads, kv = _get(config, "num_attention_heads"), _get(config, "num_key_value_heads")
    head_dim, hidden = _get(config, "head_dim"), _get(config, "hidden_size")
    if not _int(head_dim) and _int(heads) and _int(hidden) and heads:
        head_dim = hidden // heads
    rotary = _get(config, "rotary_dim")  # rotary on part of each head (GPT-J, CodeGen): the same share of the probe's
    if _int(rotary) and _int(head_dim) and head_dim:
        rotary = max(2, 2 * round(HEAD_DIM * min(rotary, head_dim) / head_dim / 2))
    latent = _get(config, "qk_rope_head_dim")  # latent attention (DeepSeek): head_dim is the rotary part
    rotary_head = _int(latent) and _get(config, "head_dim") == latent
    if _int(heads):
        config.num_attention_heads = HEADS
        if isinstance(kv, int) and kv:
            config.num_key_value_heads = HEADS if kv >= heads else (1 if kv == 1 else 2)
        elif hasattr(config, "num_key_value_heads"):  # None: as many as the query heads (transformers' convention)
            config.num_key_value_heads = HEADS
    _set(config, "hidden_size", HIDDEN)
    _set(config, "head_dim", HEAD_DIM)
    for name, value in WIDTHS.items():
        _set(config, name, value)
    for name in SEQ2SEQ_HEADS:
        _set(config, name, HEADS)
    if _int(rotary):
        _set(config, "rotary_dim", rotary)
    if rotary_head:
        _set(config, "head_dim", WIDTHS["qk_rope_head_dim"])
    if _int(_get(config, "qk_head_dim")) and _int(_get(config, "qk_nope_head_dim")):
        _set(config, "qk_head_dim", config.qk_nope_head_dim + config.qk_rope_head_dim)
    for name in EXPERTS:
        if _int(_get(config, name)) and _get(config, name) > 4:
            _set(config, name, 4)
    for name in EXPERTS_PER_TOKEN:
        if _int(_get(config, name)):
            _set(config, name, min(_get(config, name), 2))
    for name in ("n_group", "topk_group"):
        _set(config, name, 1)
    for name, value in list(vars(config).items()):
        if "window" in name and _int(value) and value > PROBE_WINDOW:
            setattr(config, name, PROBE_WINDOW)
    for name in _softcaps(config):
        setattr(config, name, PROBE_SOFTCAP)
    config.use_cache = False
    return config


def _softcaps(config) -> list[str]:
    """Names of ``config``'s attention-logit soft-caps that are set."""
    return [n for n, v in vars(config).items() if "attn" in n and "softcap" in n and _number(v) and v]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _without_softcaps(config):
    config = copy.deepcopy(config)
    for name in _softcaps(config):
        setattr(config, name, None)
    return config


UNBOUND_WINDOW = 4096
"""A window wider than the probe's row: what "the windows taken away" sets (layer types kept: families such as Gemma 2
build their sliding masks whatever the layer types say, and fail on a window of None)."""


def _without_windows(config):
    config = copy.deepcopy(config)
    for name in [n for n, v in vars(config).items() if "window" in n and _int(v) and v > 0]:
        setattr(config, name, UNBOUND_WINDOW)
    return config


def _logits(model, **inputs) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits.float()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().clamp_min(1e-12)
    return float((a - b).abs().max() / scale)


def _probe_ids(config, length: int, device=None) -> torch.Tensor:
    """``(1, length)`` random token ids from the caller's (seeded) generator, below the first 512 of ``config``'s
    vocabulary and above the ids special tokens usually take."""
    vocab = int(_get(config, "vocab_size") or 512)
    ids = torch.randint(3, max(min(vocab, 512), 4), (1, length))
    return ids if device is None else ids.to(device)


def _packed_inputs(ids: torch.Tensor, bounds: list[tuple[int, int]], documents: bool = True) -> dict:
    """The model's inputs for a packed row of ``bounds`` as odc_hf's collators build it; ``documents=False``: the
    same row with its boundaries removed (positions still restarting, one document of the whole row)."""
    positions = torch.cat([torch.arange(b - a) for a, b in bounds])[None]
    if not documents:
        bounds = [(0, bounds[-1][1])]
    cu = torch.tensor([0, *(b for _, b in bounds)], dtype=torch.int32)
    longest = max(b - a for a, b in bounds)
    return dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                max_length_k=longest)  # fmt: skip


class _Recorder:
    """Outputs of the model's attention layers (modules named ``*Attention`` directly under a decoder layer)."""

    def __init__(self, model):
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if type(module).__name__.endswith(("Attention", "Attention2")) and name.count(".") >= 2:
                self.handles.append(module.register_forward_hook(self._hook(name, module)))

    def _hook(self, name, module):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor):
                self.outputs.setdefault(f"{name} ({type(module).__name__})", []).append(out.detach().float())

        return hook

    def close(self):
        for handle in self.handles:
            handle.remove()


def _first_difference(packed: dict, alone: dict) -> str | None:
    for name, outputs in packed.items():
        reference = alone.get(name)
        if not reference or len(outputs) != 1:
            continue
        whole = torch.cat(reference, dim=1) if reference[0].dim() == 3 else None
        if whole is not None and whole.shape == outputs[0].shape and _relative(outputs[0], whole) > THRESHOLD:
            return name
    return None


def _document_bounds(lengths) -> list[tuple[int, int]]:
    bounds, total = [], 0
    for n in lengths:
        bounds.append((total, total + n))
        total += n
    return bounds


def _run(model, implementation: str, reference: str, ids, bounds, record: bool = False):
    """(packed logits, per-document reference logits, layer outputs packed, alone) of ``model``."""
    recorder = _Recorder(model) if record else None
    try:
        model.set_attn_implementation(reference)
        alone = torch.cat([_logits(model, input_ids=ids[:, a:b]) for a, b in bounds], dim=1)
        alone_layers = dict(recorder.outputs) if recorder else None
        if recorder:
            recorder.outputs = {}
        model.set_attn_implementation(implementation)
        packed = _logits(model, **_packed_inputs(ids, bounds))
        packed_layers = dict(recorder.outputs) if recorder else None
    finally:
        if recorder:
            recorder.close()
    return packed, alone, packed_layers, alone_layers


SOFTCAP_NOT_APPLIED = ("the model's attention soft-capping ({names}) is applied by only one of {trained!r} and the "
                       "model's own {reference!r} (the other drops the softcap argument): the same check without it "
                       "passes")  # fmt: skip
WINDOW_NOT_APPLIED = ("the model's sliding window is not applied inside each document (it lives in the model's mask, "
                      "and the attention layer is not handed it)")  # fmt: skip
BOTH_NOT_APPLIED = ("the model's attention soft-capping ({names}) and its sliding window are both applied by only one "
                    "of {trained!r} and the model's own {reference!r}: the same check passes with both taken away, "
                    "and with neither alone")  # fmt: skip
OUTPUTS_DIFFER = "the packed row's outputs differ from each document's alone"
WINDOW_UNCONFIRMED = (OUTPUTS_DIFFER + "; the model has sliding windows, likely not applied inside each document "
                      "(checked on the model itself, which cannot be checked again without them)")  # fmt: skip
OTHER_DIFFERENCE = (OUTPUTS_DIFFER + ", also with the model's {what} taken away (something else differs: attention "
                    "sinks, scaling or dropout applied differently, or a layer that reads the whole row)")  # fmt: skip
BOUNDARIES_LOST = ("documents of the packed row attend to each other: the document boundaries (cu_seq_lens_q/k) do "
                   "not reach the attention (a decoder layer that does not pass its keyword arguments on)")  # fmt: skip
NO_ATTENTION_CALLS = ("documents of the packed row attend to each other: the model never calls the attention odc_hf "
                      "trains with (its layers are recurrent, state-space or convolutional, or compute an attention of "
                      "their own that transformers' attention interface does not reach), so nothing keeps the "
                      "documents apart")  # fmt: skip


def _compare(model, trained: str, reference: str, varlen: str, lengths, windowed: bool) -> tuple:
    """(difference, control, layer, what, works) of ``model`` (its device and dtype) on a packed row of ``lengths``."""
    bounds = _document_bounds(lengths)
    device = next(model.parameters()).device
    ids = _probe_ids(model.config, bounds[-1][1], device)
    family = model.config.model_type
    parameters = inspect.signature(model.forward).parameters
    if "cu_seq_lens_q" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise DefinitionMismatch(
            f"{family} ({type(model).__name__}) does not take a packed row's document boundaries (cu_seq_lens_q, "
            "max_length_q, ...) in its forward. Train it with TRL's own trainer")  # fmt: skip
    packed, alone, _, _ = _run(model, trained, reference, ids, bounds)
    model.set_attn_implementation(varlen)
    control = _logits(model, **_packed_inputs(ids, bounds, documents=False))
    difference, blind = _relative(packed, alone), _relative(control, alone)
    layer = what = works = None
    if difference > THRESHOLD:
        _, _, packed_layers, alone_layers = _run(model, trained, reference, ids, bounds, record=True)
        layer = _first_difference(packed_layers, alone_layers)
        if _relative(packed, control) <= THRESHOLD:
            what = BOUNDARIES_LOST if _attention_calls(model, trained, ids, bounds) else NO_ATTENTION_CALLS
        elif windowed:  # a small copy then confirms it by taking the windows away (_what_differed)
            what = WINDOW_UNCONFIRMED
        else:
            what = OUTPUTS_DIFFER
        if trained != reference:
            masked, alone_again, _, _ = _run(model, reference, reference, ids, bounds)
            if _relative(masked, alone_again) <= THRESHOLD:
                works = (f"ODCConfig(attention='model') with the model loaded with attn_implementation='{reference}' "
                         "(transformers' own masks over packed rows: exact, at full-row attention cost)")  # fmt: skip
    return difference, blind, layer, what, works


def _attention_calls(model, trained: str, ids, bounds) -> int:
    """How often odc_hf's per-document attention ran in one packed forward of ``model``."""
    import odc_hf.attention.varlen

    before = sum(odc_hf.attention.varlen.CALLS.values())
    model.set_attn_implementation(trained)
    _logits(model, **_packed_inputs(ids, bounds))
    return sum(odc_hf.attention.varlen.CALLS.values()) - before


def _windows(config) -> list[int]:
    return [v for n, v in vars(config).items() if "window" in n and _int(v) and v > 0]


def check_definition(model, implementation: str, *, sdpa: bool = True) -> Verdict:
    """Run the check (module docstring) for ``model`` trained with ``attn_implementation=implementation``; cached.

    ``sdpa``: transformers lets the family run SDPA (the reference then runs ``sdpa``, else ``eager``)."""
    base = transformers_model(model)
    return check_class(type(base), base.config, implementation, sdpa=sdpa, instance=base)


PROBE_PARAMETER_LIMIT = 100_000_000
"""A config whose small copy would still be larger (sub-configs the shrinking does not reach) is checked on the model
itself instead."""


def _build_probe(cls, probe_cfg):
    """The small copy, seeded by the caller; counted on the meta device first, so an unshrunk config is never built."""
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(probe_cfg).parameters())
    if size > PROBE_PARAMETER_LIMIT:
        raise ValueError(f"its small copy would have {size / 1e6:.0f}M parameters")
    return cls(probe_cfg).float().eval()


def check_class(cls, config, implementation: str, *, sdpa: bool = True, instance=None) -> Verdict:
    """:func:`check_definition` for a model class and its config (the probe is built from them). When no small copy
    can be built, the check runs on ``instance`` (the model itself, put back as it was) if given."""
    import odc_hf.attention

    family = str(_get(config, "model_type") or cls.__name__)
    key = (cls, config.to_json_string(use_diff=False), implementation)
    if key in _verdicts:
        return _verdicts[key]
    start = time.perf_counter()
    reference = "sdpa" if sdpa else "eager"
    # what odc_hf runs on the probe's CPU: its per-document attention where FlashAttention runs on the GPU (the
    # plumbing of boundaries and arguments through the layers is the same)
    trained = implementation
    if implementation is None or implementation.startswith("flash_attention"):
        trained = odc_hf.attention.VARLEN_ATTENTION if sdpa else odc_hf.attention.EAGER_VARLEN_ATTENTION
    setting = odc_hf.attention.setting_named(trained)
    if setting is not None and not setting.eager:  # exact shapes: buckets change no result (tested), cost 1024 tokens
        trained = odc_hf.attention.register(dataclasses.replace(setting, shape_bucket=0))
    # the control's setting (the eager setting has no shape bucket: its name stays "eager_varlen")
    varlen = odc_hf.attention.register(odc_hf.attention.VarlenAttention(shape_bucket=0, eager=not sdpa))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        try:
            probe_cfg = probe_config(config)
            probe = _build_probe(cls, probe_cfg)
            outcome = _compare(probe, trained, reference, varlen, PROBE_DOCUMENTS, bool(_windows(probe_cfg)))
            where = "a small copy"
            if outcome[0] > THRESHOLD and outcome[3] not in (BOUNDARIES_LOST, NO_ATTENTION_CALLS):
                outcome = (*outcome[:3], _what_differed(cls, probe_cfg, trained, reference, varlen), outcome[4])
        except DefinitionMismatch:
            raise
        except Exception as error:  # noqa: BLE001 - no small copy of this config: the model itself, or the cause
            if instance is None:
                raise DefinitionMismatch(
                    f"odc_hf could not build a small copy of {family} ({cls.__name__}) to check that packed rows "
                    f"train it as it is defined: {type(error).__name__}: {error}") from error  # fmt: skip
            logger.info("odc_hf: no small copy of %s (%s: %s); checking packed rows on the model itself", family,
                        type(error).__name__, error)  # fmt: skip
            try:
                outcome, where = _on_instance(instance, trained, reference, varlen), "the model itself"
            except DefinitionMismatch:
                raise
            except Exception as failure:  # noqa: BLE001 - the family's code cannot run a packed row
                raise DefinitionMismatch(
                    f"{family} ({cls.__name__}) cannot run a packed row (several documents, no padding mask) as "
                    f"odc_hf trains it: {type(failure).__name__}: {failure}. Train it with TRL's own trainer "
                    "(padded rows)") from failure  # fmt: skip
    seconds = time.perf_counter() - start
    verdict = Verdict(family, str(implementation), outcome[0], outcome[1], seconds, *outcome[2:])
    LAST_COST.clear()
    LAST_COST.update(family=family, seconds=seconds, difference=outcome[0], control=outcome[1], on=where)
    _verdicts[key] = verdict
    return verdict


def _what_differed(cls, probe_cfg, trained: str, reference: str, varlen: str) -> str:
    """What differed on the small copy, found by taking each argument away (same weights and row) and checking again:
    the soft-cap, else the window, else both; the argument(s) whose removal makes the check pass were not applied."""
    candidates, names = [], []
    if _softcaps(probe_cfg):
        names.append("soft-caps")
        what = SOFTCAP_NOT_APPLIED.format(names=", ".join(_softcaps(probe_cfg)), trained=trained, reference=reference)
        candidates.append((_without_softcaps, what))
    if _windows(probe_cfg):
        names.append("windows")
        candidates.append((_without_windows, WINDOW_NOT_APPLIED))
    if len(candidates) == 2:  # both dropped: neither removal alone passes, both together do
        what = BOTH_NOT_APPLIED.format(names=", ".join(_softcaps(probe_cfg)), trained=trained, reference=reference)
        candidates.append((lambda config: _without_windows(_without_softcaps(config)), what))
    for remove, what in candidates:
        try:
            torch.manual_seed(0)
            probe = _build_probe(cls, remove(probe_cfg))
            if _compare(probe, trained, reference, varlen, PROBE_DOCUMENTS, False)[0] <= THRESHOLD:
                return what
        except DefinitionMismatch:
            raise
        except Exception:  # noqa: BLE001 - the family needs that argument to build: not this one
            continue
    return OTHER_DIFFERENCE.format(what=" and ".join(names)) if names else OUTPUTS_DIFFER


def _on_instance(model, trained: str, reference: str, varlen: str) -> tuple:
    """:func:`_compare` on the model itself (documents longer than its shortest window up to 256 tokens), with its
    attention implementation and training mode put back afterwards."""
    implementation, training = attn_implementation(model), model.training
    windows = [w for w in _windows(model.config) if w <= 256]
    lengths = PROBE_DOCUMENTS if not windows else (min(windows) + 7, 6, min(windows) + 3)
    model.eval()
    try:
        return _compare(model, trained, reference, varlen, lengths, bool(windows))
    finally:
        model.set_attn_implementation(implementation)
        model.train(training)


def verify_definition(model, implementation: str, *, sdpa: bool = True) -> Verdict:
    """:func:`check_definition`, raising :class:`DefinitionMismatch` (naming the family, the layer, what differed and a
    setting that works) when packed rows would train ``model`` differently from its definition, or when the check
    cannot see documents attending to each other."""
    verdict = check_definition(model, implementation, sdpa=sdpa)
    if verdict.exact and verdict.control < SENSITIVITY * THRESHOLD:
        raise DefinitionMismatch(
            f"odc_hf cannot verify that packed rows train {verdict.family} as it is defined: its check row with the "
            f"document boundaries removed differs from the documents alone by only {verdict.control:.1e} (needs "
            f"> {SENSITIVITY * THRESHOLD:.0e}). Train it with TRL's own trainer")  # fmt: skip
    if not verdict.exact:
        where = f" in {verdict.layer}" if verdict.layer else ""
        works = verdict.works or "TRL's own trainer (no setting of odc_hf trains it exactly)"
        raise DefinitionMismatch(
            f"odc_hf would train {verdict.family} differently from its definition with attention "
            f"{verdict.implementation!r}: {verdict.what}{where}; a packed row's logits differ from each document's "
            f"alone by {verdict.difference:.1e} (float noise: < {THRESHOLD:.0e}). What works: {works}")  # fmt: skip
    logger.debug("odc_hf: %s trains as defined on packed rows (%.1e; control %.1e; %.2f s)", verdict.family,
                 verdict.difference, verdict.control, verdict.seconds)  # fmt: skip
    return verdict


ROUTER_LOSS_TOLERANCE = 1e-5
"""Relative difference between TRL's router loss and the model's own that counts as float noise."""


def router_loss_problem(model) -> str | None:
    """Why TRL's router loss (what its SFT and GRPO trainers add with ``router_aux_loss_coef``) is not this
    Mixture-of-Experts family's own, or None.

    TRL's fused LM head computes Mixtral's load-balancing loss from the config's ``num_experts`` and
    ``num_experts_per_tok``, for every family. The check runs the probe (a small copy, as :func:`check_definition`)
    with ``output_router_logits=True`` and compares the model's own ``aux_loss`` with that function on the same router
    logits; a config without those two names is a problem too (TRL's trainer stops there with an AttributeError)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    base = transformers_model(model)
    text = base.config.get_text_config()
    family = str(_get(text, "model_type") or type(base).__name__)
    missing = [name for name in ("num_experts", "num_experts_per_tok") if _get(text, name) is None]
    if missing:
        return (f"TRL's router loss (its fused LM head) reads config.{' and config.'.join(missing)}, which "
                f"{type(text).__name__} ({family}) does not have: TRL's own trainer stops there too")  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        try:
            probe_cfg = probe_config(base.config)
            probe = _build_probe(type(base), probe_cfg)
        except Exception:  # noqa: BLE001 - no small copy: the model itself
            probe, probe_cfg = base, base.config
        ids = _probe_ids(probe_cfg.get_text_config(), sum(PROBE_DOCUMENTS), next(probe.parameters()).device)
        training = probe.training
        probe.eval()
        try:
            out = probe(input_ids=ids, output_router_logits=True, use_cache=False)
        finally:
            probe.train(training)
        own, logits = getattr(out, "aux_loss", None), getattr(out, "router_logits", None)
        if own is None or not logits:
            return (f"{family} returns no router loss of its own (aux_loss) with output_router_logits=True, so "
                    "odc_hf cannot check the one TRL adds")  # fmt: skip
        probe_text = probe_cfg.get_text_config()
        trl = load_balancing_loss_func(logits, probe_text.num_experts, probe_text.num_experts_per_tok, None)
        difference = float((trl - own).abs() / own.abs().clamp_min(1e-12))
    if difference > ROUTER_LOSS_TOLERANCE:
        return (f"TRL's router loss (Mixtral's load-balancing loss, from its fused LM head) differs from {family}'s "
                f"own by {difference:.1e} (relative)")  # fmt: skip
    return None


def verify_router_loss(model) -> None:
    """Raise :class:`DefinitionMismatch` with :func:`router_loss_problem`'s reason and the settings that work."""
    problem = router_loss_problem(model)
    if problem is not None:
        raise DefinitionMismatch(
            f"odc_hf would not train this model's Mixture-of-Experts router loss as it is defined: {problem}. What "
            "works: ODCTrainer (transformers' Trainer: the model's own router loss), or router_aux_loss_coef=0.0 in "
            "the trainer's config (no router loss)")  # fmt: skip


def dropout_settings(model) -> dict[str, float]:
    """The config's dropout probabilities above 0 (``attention_dropout``, ``resid_pdrop``, ...): training is then
    random, applied per document as the model defines it, and two runs (ODC's and TRL's) agree in distribution, not
    bit for bit."""
    base = transformers_model(model)
    text = base.config.get_text_config()
    return {name: value for name, value in vars(text).items()
            if "drop" in name and isinstance(value, float) and value > 0}  # fmt: skip


FUSED_HEAD_TOLERANCE = 1e-5
"""Relative difference between TRL's fused LM head loss and the model's own loss that counts as float noise (fp32)."""
PROBE_FINAL_SOFTCAP = 0.1
"""The final-logit soft-cap (``final_logit_softcapping``) of the fused-head check's small copy. Its logits (at most
~0.4) are far below a real cap (Gemma 2's 30), where a head that drops the cap moves the loss by 1e-7; at this cap, by
2e-3, 200x the tolerance (docs/models.md)."""
_fused_verdicts: dict = {}


def fused_head_problem(model) -> str | None:
    """Why TRL's fused LM head (``add_fused_lm_head``: the loss SFTTrainer computes, and ODCTrainer's default) does not
    give this family's own loss, or None: it fails on the family's outputs, or its loss differs from the model's own
    (final-logit soft-capping, logit scaling, ...). Checked on the probe (a small copy); cached per class and config."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # trl < 1.16: no fused head
        return None
    base = transformers_model(model)
    if not hasattr(getattr(base, "config", None), "to_json_string"):  # not a transformers model: nothing to compare
        return None
    key = (type(base), base.config.to_json_string(use_diff=False))
    if key in _fused_verdicts:
        return _fused_verdicts[key]
    family = str(_get(base.config, "model_type") or type(base).__name__)
    problem = None
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        try:
            probe_cfg = probe_config(base.config)
            for config in {id(c): c for c in (probe_cfg, probe_cfg.get_text_config())}.values():
                if _get(config, "final_logit_softcapping"):
                    config.final_logit_softcapping = PROBE_FINAL_SOFTCAP
            probe = _build_probe(type(base), probe_cfg)
        except Exception:  # noqa: BLE001 - no small copy: nothing to check it on without touching the model
            _fused_verdicts[key] = None
            return None
        ids = _probe_ids(probe_cfg.get_text_config(), sum(PROBE_DOCUMENTS))
        own = probe(input_ids=ids, labels=ids, use_cache=False).loss
        try:
            add_fused_lm_head(probe)
            fused = probe(input_ids=ids, labels=ids, use_cache=False, fused_lm_head=True).loss
        except Exception as error:  # noqa: BLE001 - TRL's head cannot run this family
            problem = f"TRL's fused LM head fails on {family}: {type(error).__name__}: {error}"
        else:
            difference = float((fused - own).abs() / own.abs().clamp_min(1e-12))
            if difference > FUSED_HEAD_TOLERANCE:
                problem = f"TRL's fused LM head's loss differs from {family}'s own by {difference:.1e} (relative)"
    _fused_verdicts[key] = problem
    return problem


def verify_fused_head(model) -> None:
    """Raise :class:`DefinitionMismatch` when a trainer whose loss is TRL's fused LM head (SFT, GRPO) cannot train
    ``model``'s loss as it is defined (:func:`fused_head_problem`)."""
    problem = fused_head_problem(model)
    if problem is not None:
        raise DefinitionMismatch(
            f"odc_hf would not train this model's loss as it is defined: {problem}; TRL's SFTTrainer and GRPOTrainer "
            "compute their losses with that head too. What works: ODCTrainer (transformers' Trainer: odc_hf then keeps the model's own loss)")  # fmt: skip
