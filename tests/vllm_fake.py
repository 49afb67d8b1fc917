"""A stand-in for vLLM's ``LLM`` on CPU, for the wiring tests of ``ODCGRPOTrainer(use_vllm=True)`` (vLLM itself needs
CUDA and pins another torch).

:func:`install` makes TRL's ``trl.generation.vllm_generation`` build :class:`FakeLLM` where it would build vLLM's
``LLM`` (its module-level names ``LLM``, ``SamplingParams`` and ``is_vllm_available``; in the test's ranks only), and
lets odc_hf's version check see vllm 0.26.0. Everything else TRL's ``VLLMGeneration`` does (the engine's arguments,
``generate``'s sampling parameters and output handling, sleep mode, the ``_last_loaded_step`` bookkeeping, the
importance-sampling correction) runs as TRL wrote it.

The engine's model is a transformers model of the trainer's config with its OWN random initialisation: until a weight
sync writes the trainer's weights into it, its log-probabilities are far from the trainer's. It samples each
completion token by token (seeded per engine, as vLLM's ``seed``), returns the sampled tokens' log-probabilities after
temperature (vLLM's ``logprobs_mode="processed_logprobs"``, which TRL asks for), and records every event (syncs, resets,
sleep / wake-up, generations) and every loaded tensor.
"""

from __future__ import annotations

import dataclasses
import types

import torch


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


def loadable_model(config, seed: int):
    """A transformers causal LM with vLLM's ``load_weights`` contract: ``(name, tensor)`` pairs in, the names
    loaded out; an unknown name is an error (as vLLM's ``AutoWeightsLoader`` raises)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    model.loaded: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        record = {}
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"There is no parameter named {name!r} in the engine's model")
            with torch.no_grad():
                params[name].copy_(tensor)
            record[name] = tensor.detach().clone()
        self.loaded.append(record)
        return set(record)

    model.load_weights = types.MethodType(load_weights, model)
    return model


class FakeLLM:
    """vLLM's ``LLM`` as TRL 1.16's ``VLLMGeneration`` uses it in colocate mode (see the module docstring)."""

    config = None  # the trainer model's config: set by the test before the trainer builds the engine
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.model = loadable_model(type(self).config, seed=12345)
        self.generator = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        self.events: list[str] = []
        # the path TRL's own sync_weights writes through (llm_engine.model_executor.driver_worker.model_runner.model)
        runner = types.SimpleNamespace(model=self.model)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
        )
        type(self).instances.append(self)

    def apply_model(self, fn):
        self.events.append("apply_model")
        return [fn(self.model)]

    def reset_prefix_cache(self, *args, **kwargs):
        self.events.append("reset_prefix_cache")
        return True

    def sleep(self, level: int = 1, **kwargs):
        self.events.append(f"sleep:{level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake_up:{','.join(tags or ['all'])}")

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.events.append("generate")
        params = sampling_params
        eos = self.model.config.eos_token_id
        results = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            tokens, logprobs = [], []
            for _ in range(params.max_tokens):
                logits = self.model(input_ids=torch.tensor([ids + tokens])).logits[0, -1].float()
                logp = torch.log_softmax(logits / params.temperature, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                tokens.append(token)
                logprobs.append({token: Logprob(float(logp[token]))})
                if token == eos:
                    break
            results.append(RequestOutput(ids, [Completion(tokens, logprobs)]))
        return results


def install(config) -> type[FakeLLM]:
    """Make TRL build :class:`FakeLLM` (for ``config``'s model) and odc_hf see vllm 0.26.0, in this process."""
    import trl.generation.vllm_generation as generation

    from odc_hf.integrations import vllm_version

    FakeLLM.config = config
    FakeLLM.instances = []
    generation.is_vllm_available = lambda *args, **kwargs: True
    generation.LLM = FakeLLM
    generation.SamplingParams = SamplingParams
    vllm_version.installed_vllm = lambda: "0.26.0"
    return FakeLLM
