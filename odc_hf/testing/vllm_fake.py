"""A stand-in for vLLM's ``LLM`` on CPU, for the wiring tests of ``ODCGRPOTrainer(use_vllm=True)`` (vLLM itself needs
CUDA and pins another torch).

:func:`install` makes TRL's ``trl.generation.vllm_generation`` build :class:`FakeLLM` where it would build vLLM's
``LLM`` (its module-level names ``LLM``, ``SamplingParams`` and ``is_vllm_available``; in the calling process only), and
lets odc_hf's version check see vllm 0.26.0. Everything else TRL's ``VLLMGeneration`` does (the engine's arguments,
``generate``'s sampling parameters and output handling, sleep mode, the ``_last_loaded_step`` bookkeeping, the
importance-sampling correction) runs as TRL wrote it.

The engine's model, :class:`StackedQwen2`, has vLLM's Qwen2 layout at tensor parallel 1, not transformers': one
``qkv_proj`` (weight and bias: q, k, v rows stacked on dim 0) and one ``gate_up_proj`` (gate, up) per layer, the
embedding padded to a multiple of 64 rows (vLLM's vocabulary padding; zero rows), the head tied to the embedding when
the config ties them. Its ``load_weights`` takes transformers' names as vLLM's does (each q / k / v / gate / up tensor
written into its slice of the stacked parameter; the stacked name reported as loaded as soon as one part arrived,
so a part that never arrives is not reported missing: as in vLLM); an unknown name or a wrong shape is an error. Its
forward is written here from the architecture (RMSNorm, rotary embedding on halves, grouped-query causal attention,
SwiGLU) over the stacked weights, not taken from transformers' modules: tests/grpo/test_vllm_stand_in.py checks it
against transformers' own forward.

The engine starts from the checkpoint at the ``model`` path TRL passes (as vLLM does) when that folder exists, else
from its OWN random weights (norm and bias vectors included): until a weight sync writes the trainer's weights into
it, its log-probabilities are far from the trainer's. It samples each completion token by token (seeded per engine,
as vLLM's ``seed``; ``logit_bias`` and ``stop_token_ids`` honoured), returns the sampled tokens' log-probabilities
after temperature (vLLM's ``logprobs_mode="processed_logprobs"``, which TRL asks for), and records every event
(syncs, resets, sleep / wake-up, generations), every generation's prompts and completions, and a copy of its
parameters at every generation (``weights_at_generate``: what it generated with).

For timing checks (tests/benchmark_runs/test_grpo_vllm_benchmark.py), two environment variables: ``VLLM_STAND_IN_DELAYS``
(``generate=S,sync=S``) makes every ``generate`` call, and the first weight load after a generation (the start of a
sync), sleep that long; ``VLLM_STAND_IN_LOG`` (a file) gets one JSON line per ``generate`` and per weight load
(``engine``, ``event``, ``seconds`` measured inside the engine).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
import types

import torch
import torch.nn.functional as F

_ENGINES = itertools.count()
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: embedding rows are padded to a multiple of it
STACKED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int = 1


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[Completion]


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Vector(torch.nn.Module):
    """A module holding one parameter named ``weight`` (norms, the embedding)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


class StackedQwen2(torch.nn.Module):
    """vLLM's Qwen2ForCausalLM parameters (see the module docstring), its ``load_weights`` contract and a forward of
    its own."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // heads
        self.heads, self.kv_heads, self.vocab = heads, kv, config.vocab_size
        q, k = heads * self.head_dim, kv * self.head_dim
        self.parts = {"qkv_proj": (q, k, k), "gate_up_proj": (config.intermediate_size,) * 2}
        self.model = torch.nn.Module()
        self.model.embed_tokens = _Vector(padded_vocab(self.vocab), h)
        self.model.layers = torch.nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            layer = torch.nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = _Vector(h), _Vector(h)
            layer.self_attn = torch.nn.Module()
            layer.self_attn.qkv_proj = torch.nn.Linear(h, q + 2 * k, bias=True)
            layer.self_attn.o_proj = torch.nn.Linear(q, h, bias=False)
            layer.mlp = torch.nn.Module()
            layer.mlp.gate_up_proj = torch.nn.Linear(h, 2 * config.intermediate_size, bias=False)
            layer.mlp.down_proj = torch.nn.Linear(config.intermediate_size, h, bias=False)
            self.model.layers.append(layer)
        self.model.norm = _Vector(h)
        self.tied = bool(config.tie_word_embeddings)
        self.lm_head = self.model.embed_tokens if self.tied else _Vector(padded_vocab(self.vocab), h)
        for p in self.parameters():
            p.requires_grad_(False)

    def randomize(self, seed: int) -> None:
        """Random weights of its own: matrices ~ N(0, 0.05), norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.05)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.data.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
        for p in {id(self.model.embed_tokens.weight): self.model.embed_tokens.weight,
                  id(self.lm_head.weight): self.lm_head.weight}.values():  # fmt: skip
            p.data[self.vocab :] = 0.0

    # -- vLLM's load_weights contract ----------------------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tied and name.startswith("lm_head.")):
                continue  # vLLM skips both (the tied head is the embedding)
            module = name.split(".")[-2]
            target, rows = name, None
            if module in STACKED_PARTS:
                stacked, index = STACKED_PARTS[module]
                target = name.replace(f".{module}.", f".{stacked}.")
                sizes = self.parts[stacked]
                rows = (sum(sizes[:index]), sizes[index])
            if target not in params:
                raise ValueError(f"There is no parameter named {target!r} (from {name!r}) in the engine's model")
            param = params[target]
            tensor = tensor.detach().to(param.device, param.dtype)
            if rows is not None:
                dest = param.data.narrow(0, *rows)
            elif target.endswith(("embed_tokens.weight", "lm_head.weight")):
                dest = param.data[: tensor.shape[0]]
                param.data[tensor.shape[0] :] = 0.0  # vLLM zeroes the padding rows
            else:
                dest = param.data
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {target}'s {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target)
        return loaded

    # -- a forward of its own ------------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2  # neox style: the first half pairs with the second
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits (fp32) at every position of one sequence: ``(len(ids), vocab_size)``."""
        theta = (getattr(self.config, "rope_parameters", None) or {}).get("rope_theta") or getattr(
            self.config, "rope_theta", 10000.0)  # fmt: skip
        n = len(ids)
        x = self.model.embed_tokens.weight[torch.tensor(ids)].float()
        inv = theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angle = torch.arange(n, dtype=torch.float32)[:, None, None] * inv  # (n, 1, head_dim / 2)
        cos, sin = angle.cos(), angle.sin()
        group = self.heads // self.kv_heads
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        q_size, k_size, _ = self.parts["qkv_proj"]
        for layer in self.model.layers:
            y = self._norm(x, layer.input_layernorm.weight)
            qkv = y @ layer.self_attn.qkv_proj.weight.T + layer.self_attn.qkv_proj.bias
            q = self._rotate(qkv[:, :q_size].view(n, self.heads, self.head_dim), cos, sin)
            k = self._rotate(qkv[:, q_size : q_size + k_size].view(n, self.kv_heads, self.head_dim), cos, sin)
            v = qkv[:, q_size + k_size :].view(n, self.kv_heads, self.head_dim)
            heads = []
            for head in range(self.heads):
                kv = head // group
                scores = (q[:, head] @ k[:, kv].T) / math.sqrt(self.head_dim)
                heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, kv])
            x = x + torch.cat(heads, dim=-1) @ layer.self_attn.o_proj.weight.T
            y = self._norm(x, layer.post_attention_layernorm.weight)
            gate, up = (y @ layer.mlp.gate_up_proj.weight.T).split(self.parts["gate_up_proj"], dim=-1)
            x = x + (F.silu(gate) * up) @ layer.mlp.down_proj.weight.T
        x = self._norm(x, self.model.norm.weight)
        return (x @ self.lm_head.weight.T)[:, : self.vocab]


def load_checkpoint(model: StackedQwen2, path: str) -> None:
    """Load a transformers checkpoint folder (its ``*.safetensors`` files) through ``load_weights``, as vLLM does."""
    from safetensors.torch import load_file

    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    for name in names:
        model.load_weights(load_file(os.path.join(path, name)).items())


class FakeLLM:
    """vLLM's ``LLM`` as TRL 1.16's ``VLLMGeneration`` uses it in colocate mode (see the module docstring)."""

    config = None  # the trainer model's config: set by install() before the trainer builds the engine
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.model = StackedQwen2(type(self).config)
        path = kwargs.get("model")
        self.loaded_from_disk = bool(path) and os.path.isdir(str(path))
        if self.loaded_from_disk:
            load_checkpoint(self.model, str(path))
        else:
            self.model.randomize(seed=12345)
        self.model.eval()
        self.delays = {k: float(v) for k, v in (item.split("=") for item in
                                                os.environ.get("VLLM_STAND_IN_DELAYS", "").split(",") if item)}  # fmt: skip
        self.log = os.environ.get("VLLM_STAND_IN_LOG")
        self.name = f"{os.getpid()}-{next(_ENGINES)}"  # one engine per run, also several in a process
        self.syncing = False  # whether a weight load since the last generation started a sync already
        load = self.model.load_weights

        def timed_load(weights):  # TRL's own sync calls it once per parameter, ODC's once per sync
            start = time.perf_counter()
            if not self.syncing:
                self.syncing = True
                time.sleep(self.delays.get("sync", 0.0))
            loaded = load(weights)
            self._record("load", time.perf_counter() - start)
            return loaded

        self.model.load_weights = timed_load
        self.generator = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        self.events: list[str] = []
        self.generated: list[dict] = []  # per generate(): its prompts and completions
        self.weights_at_generate: list[dict[str, torch.Tensor]] = []
        # the path TRL's own sync_weights writes through (llm_engine.model_executor.driver_worker.model_runner.model)
        runner = types.SimpleNamespace(model=self.model)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
        )
        type(self).instances.append(self)

    def _record(self, event: str, seconds: float) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"engine": self.name, "event": event, "seconds": seconds}) + "\n")

    def apply_model(self, fn):
        self.events.append("apply_model")
        return [fn(self.model)]

    def reset_prefix_cache(self, *args, **kwargs):
        self.events.append("reset_prefix_cache")
        return True

    def sleep(self, level: int = 1, **kwargs):
        self.events.append(f"sleep:{level}")
        if level == 2:  # vLLM discards the weights at level 2: whatever a later sync does not write stays NaN
            for p in self.model.parameters():
                p.data.fill_(float("nan"))

    def wake_up(self, tags=None):
        self.events.append(f"wake_up:{','.join(tags or ['all'])}")

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        start = time.perf_counter()
        self.events.append("generate")
        self.syncing = False
        time.sleep(self.delays.get("generate", 0.0))
        self.weights_at_generate.append({n: p.detach().clone() for n, p in self.model.named_parameters()})
        params = sampling_params
        stop = {self.model.config.eos_token_id, *(getattr(params, "stop_token_ids", None) or ())}
        bias = torch.zeros(self.model.vocab)
        for token, value in (getattr(params, "logit_bias", None) or {}).items():
            bias[int(token)] = float(value)
        results = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            tokens, logprobs = [], []
            for _ in range(params.max_tokens):
                logits = self.model.logits(ids + tokens)[-1] + bias
                if not bool(torch.isfinite(logits).all()):
                    raise RuntimeError("the stand-in engine generates from weights that are not finite: a parameter "
                                       "left unwritten since sleep level 2 discarded the weights (NaN)")  # fmt: skip
                logp = torch.log_softmax(logits / params.temperature, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                tokens.append(token)
                logprobs.append({token: Logprob(float(logp[token]))})
                if token in stop:
                    break
            results.append(RequestOutput(ids, [Completion(tokens, logprobs)]))
        self.generated.append({"prompts": [r.prompt_token_ids for r in results],
                               "completions": [r.outputs[0].token_ids for r in results]})  # fmt: skip
        self._record("generate", time.perf_counter() - start)
        return results


def install(config) -> type[FakeLLM]:
    """Make TRL build :class:`FakeLLM` (for ``config``'s model) and odc_hf see vllm 0.26.0, in this process."""
    import trl.generation.vllm_generation as generation

    from odc_hf.integrations.upstream import vllm as vllm_version

    FakeLLM.config = config
    FakeLLM.instances = []
    generation.is_vllm_available = lambda *args, **kwargs: True
    generation.LLM = FakeLLM
    generation.SamplingParams = SamplingParams
    vllm_version.installed_vllm = lambda: "0.26.0"
    return FakeLLM
