"""Cost models: FLOP formula against the docs/design.md table, quadratic fit, calibration on CPU."""

import numpy as np
import pytest
import torch

from odc_hf.balance.cost import FlopCostModel, QuadraticCostModel, TokenCostModel
from odc_hf.prediction.calibrate import calibrate
from odc_hf.prediction.workloads import qwen2_5_config


@pytest.mark.parametrize(
    ("size", "n_billions", "crossover_k"),
    [("1.5B", 1.544, 35.9), ("7B", 7.070, 70.5), ("14B", 13.99, 56.9), ("32B", 31.98, 97.6)],
)
def test_flop_model_matches_workloads_table(size, n_billions, crossover_k):
    model = FlopCostModel.from_config(qwen2_5_config(size))
    digits = 3 if n_billions < 10 else 2
    assert round(model.num_matmul_params / 1e9, digits) == n_billions
    assert round(model.crossover_length / 1e3, 1) == crossover_k
    assert model.attn_dim == qwen2_5_config(size).num_attention_heads * 128


def test_attention_makes_a_64k_sample_cost_about_120_times_a_1k_sample_on_7b():
    model = FlopCostModel.from_config(qwen2_5_config("7B"))
    short, long = model.doc_costs([1024, 65536])
    assert 115 < long / short < 125


def test_microbatch_cost_is_overhead_plus_per_document_costs():
    model = QuadraticCostModel(a=0.1, b=1e-5, c=1e-9)
    docs = [1000, 3000]
    expected = 0.1 + sum(1e-5 * s + 1e-9 * s * s for s in docs)
    assert model.microbatch_cost(docs) == pytest.approx(expected)
    assert model.microbatch_cost([]) == 0.0
    # packing is per document: one 4000-token document costs more attention than 1000 + 3000
    assert model.microbatch_cost([4000]) > model.microbatch_cost(docs)
    assert TokenCostModel().microbatch_cost(docs) == 4000


def test_quadratic_fit_recovers_noiseless_coefficients():
    lengths = np.array([512, 2048, 8192, 16384, 32768])
    seconds = 0.08 + 2e-6 * lengths + 1.5e-10 * lengths**2
    fitted = QuadraticCostModel.fit(lengths, seconds)
    assert fitted.a == pytest.approx(0.08, rel=1e-6)
    assert fitted.b == pytest.approx(2e-6, rel=1e-6)
    assert fitted.c == pytest.approx(1.5e-10, rel=1e-6)


def test_quadratic_fit_keeps_coefficients_non_negative():
    # launch-bound at short lengths: an unconstrained fit would give a negative linear term
    lengths = [512, 2048, 4096, 8192, 16384]
    seconds = [0.10, 0.10, 0.12, 0.24, 0.54]
    fitted = QuadraticCostModel.fit(lengths, seconds)
    assert min(fitted.a, fitted.b, fitted.c) >= 0
    predicted = np.array([fitted.microbatch_cost([s]) for s in lengths])
    assert np.allclose(predicted, seconds, atol=0.03)


def test_fit_finds_the_launch_bound_floor_and_prices_packed_rows_by_gpu_work():
    """Measured 1.5B/H200 shape: flat ~0.18 s up to 4k tokens, then GPU-bound (benchmarks/results/sft/sft_e2e_*)."""
    truth = QuadraticCostModel(a=0.0, b=3e-5, c=6e-10, floor=0.18)
    lengths = [512, 2048, 4096, 8192, 16384, 24576, 32768]
    fitted = QuadraticCostModel.fit(lengths, [truth.microbatch_cost([s]) for s in lengths])
    assert fitted.floor == pytest.approx(0.18, rel=1e-6)
    assert fitted.a == pytest.approx(0.0, abs=1e-9)
    assert fitted.b == pytest.approx(3e-5, rel=1e-6) and fitted.c == pytest.approx(6e-10, rel=1e-6)
    # a row of 4 documents costs their GPU work, not 4 floors and not one floor less than apart
    row = [7168] * 4
    assert fitted.microbatch_cost(row) == pytest.approx(3e-5 * 28672 + 6e-10 * 4 * 7168**2)
    assert fitted.microbatch_cost([100, 200]) == pytest.approx(0.18)
    assert QuadraticCostModel.from_dict(fitted.to_dict()) == fitted
    assert "max(0.18" in fitted.describe()


def test_floor_rows_are_the_ones_the_fit_prices_below_the_floor():
    """Measured H200 points (1.5B): the 8192-token point is GPU-bound, so it is fitted, not averaged into the floor."""
    lengths = [512, 2048, 4096, 8192, 16384, 24576, 32768]
    seconds = [0.1749, 0.1909, 0.1746, 0.2860, 0.6472, 1.1238, 1.6393]
    fitted = QuadraticCostModel.fit(lengths, seconds)
    assert fitted.floor == pytest.approx(0.1749)  # median of the three launch-bound points
    assert fitted.microbatch_cost([8192]) == pytest.approx(0.286, rel=0.02)
    assert fitted.microbatch_cost([17920, 10752]) == pytest.approx(1.133, rel=0.01)  # measured packed row
    assert fitted.microbatch_cost([7168] * 4) == pytest.approx(0.990, rel=0.01)


def test_floor_is_not_invented_for_timings_without_one():
    lengths = np.array([512, 2048, 8192, 16384, 32768])
    fitted = QuadraticCostModel.fit(lengths, 0.08 + 2e-6 * lengths + 1.5e-10 * lengths**2)
    assert fitted.floor == 0.0
    assert QuadraticCostModel.from_dict({"a": 1, "b": 2, "c": 3}).floor == 0.0  # files from before the floor


def test_planners_price_microbatches_with_the_floor():
    from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini

    model = QuadraticCostModel(a=0.0, b=1e-4, c=0.0, floor=1.0)
    for plan in (plan_lb_mini([100] * 6, 2, 1000, model), plan_lb_micro([100] * 6, 2, 1000, model)):
        costs = [c for per_rank in plan.microbatch_costs for c in per_rank if c]
        assert costs and all(c == pytest.approx(1.0) for c in costs)


def test_bad_inputs_raise_clear_errors():
    """Each error names what is wrong and what was given: matched by type and by the words the user reads."""
    with pytest.raises(ValueError, match="fitting a \\+ b·s \\+ c·s² needs timings at >= 3 distinct lengths"):
        QuadraticCostModel.fit([100, 100, 200], [1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"lengths and seconds must have the same length, got \(3,\) and \(2,\)"):
        QuadraticCostModel.fit([100, 200, 300], [1.0, 2.0])
    for seconds in ([1.0, -2.0, 3.0], [1.0, float("inf"), 3.0]):
        with pytest.raises(ValueError, match="seconds must be finite and >= 0"):
            QuadraticCostModel.fit([100, 200, 300], seconds)
    with pytest.raises(ValueError, match="all timings are zero; cannot fit a cost model"):
        QuadraticCostModel.fit([100, 200, 300], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"QuadraticCostModel.a must be finite and >= 0, got -1.0"):
        QuadraticCostModel(a=-1.0, b=1.0, c=0.0)
    with pytest.raises(ValueError, match="QuadraticCostModel needs a, b or c > 0, otherwise everything costs nothing"):
        QuadraticCostModel(a=0.0, b=0.0, c=0.0, floor=1.0)
    for one in ({"a": 1.0}, {"b": 1.0}, {"c": 1.0}):  # any one coefficient is a model
        assert QuadraticCostModel(**{"a": 0.0, "b": 0.0, "c": 0.0, **one}).microbatch_cost([10]) > 0
    with pytest.raises(ValueError, match=r"a cost model needs keys a, b, c \(and optionally floor\); missing \['c'\]"):
        QuadraticCostModel.from_dict({"a": 1, "b": 2})
    with pytest.raises(ValueError, match=r"lengths must be finite and >= 0, got min -1.0"):
        TokenCostModel().doc_costs([10, -1])
    with pytest.raises(ValueError, match=r"lengths must be a 1-D sequence of token counts, got shape \(1, 2\)"):
        TokenCostModel().doc_costs([[10, 1]])
    with pytest.raises(ValueError, match="lengths must be numeric, got dtype <U2"):
        TokenCostModel().doc_costs(["10"])
    assert TokenCostModel().doc_costs(np.array([3, 4], dtype=np.int16)).dtype == np.float64  # s² never overflows
    with pytest.raises(ValueError, match=r"FlopCostModel.num_layers must be > 0, got 0"):
        FlopCostModel(num_matmul_params=10, num_layers=0, attn_dim=4)
    assert FlopCostModel(num_matmul_params=1, num_layers=1, attn_dim=1).doc_costs([1])[0] == 12.0  # 1 is a size

    class NotADecoder:
        hidden_size = 8

    with pytest.raises(ValueError, match=r"config NotADecoder lacks \['num_hidden_layers', 'num_attention_heads', "
                                         r"'intermediate_size', 'vocab_size'\]: not a dense decoder config; build "
                                         r"FlopCostModel\(\.\.\.\) directly"):  # fmt: skip
        FlopCostModel.from_config(NotADecoder())
    with pytest.raises(ValueError, match=r"got 1 microbatches but 3 timings"):
        QuadraticCostModel.fit_microbatches([[1]], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="an empty microbatch has no cost to fit; drop dummy microbatches"):
        QuadraticCostModel.fit_microbatches([[1], [], [3]], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"microbatch document lengths must be finite and >= 0, got min -3.0"):
        QuadraticCostModel.fit_microbatches([[1], [2], [-3]], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="fitting needs microbatches of >= 3 distinct token counts"):
        QuadraticCostModel.fit_microbatches([[1, 2], [3], [4]], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="seconds must be finite and >= 0"):
        QuadraticCostModel.fit_microbatches([[1], [2], [3]], [1.0, -2.0, 3.0])
    assert QuadraticCostModel.fit_microbatches([[1], [2], [3]], [0.0, 0.0, 1.0]).c > 0  # a zero timing is a timing


def test_descriptions_state_the_model_and_its_numbers():
    model = FlopCostModel.from_config(qwen2_5_config("7B"))
    assert model.describe() == (
        f"FLOP model 6·N·s + 6·L·d_attn·s² (N={model.num_matmul_params / 1e9:.3f}B, L=28, d_attn=3584, "
        f"s*={model.crossover_length / 1e3:.1f}k)"
    )
    assert model.describe().startswith("FLOP model 6·N·s + 6·L·d_attn·s² (N=7.") and model.describe().endswith("k)")
    assert TokenCostModel().describe() == "token-linear model (cost = tokens)"
    assert QuadraticCostModel(a=0.1, b=2e-6, c=1.5e-10).describe() == (
        "calibrated model 0.1 + 2e-06·s + 1.5e-10·s² per microbatch (seconds)"
    )
    assert QuadraticCostModel(a=0.0, b=2e-6, c=1.5e-10, floor=0.18).describe() == (
        "calibrated model max(0.18, 0 + 2e-06·s + 1.5e-10·s²) per microbatch (seconds)"
    )


def test_fit_finds_the_floor_when_each_length_is_timed_several_times():
    """Calibration may time every length more than once: a floor split only falls between distinct token counts,
    and a split inside a repeated count is skipped, not the end of the search."""
    truth = QuadraticCostModel(a=0.0, b=3e-5, c=6e-10, floor=0.18)
    lengths = [s for s in (512, 2048, 4096, 8192, 16384, 24576, 32768) for _ in range(3)]
    fitted = QuadraticCostModel.fit(lengths, [truth.microbatch_cost([s]) for s in lengths])
    assert fitted.floor == pytest.approx(0.18, rel=1e-6)
    assert fitted.b == pytest.approx(3e-5, rel=1e-6) and fitted.c == pytest.approx(6e-10, rel=1e-6)
    rows = [[s] for s in lengths]
    assert QuadraticCostModel.fit_microbatches(rows, [truth.microbatch_cost(r) for r in rows]) == fitted


def test_calibrate_times_a_tiny_model_on_cpu(one_torch_thread, monkeypatch):
    import math

    from transformers import Qwen2ForCausalLM

    import odc_hf.prediction.calibrate
    from odc_hf.prediction.calibrate import time_lengths
    from odc_hf.testing.data import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(128)
    model = Qwen2ForCausalLM(config).eval()
    lengths = [16, 64, 256]
    seconds = time_lengths(model, lengths, repeats=1)
    assert len(seconds) == 3 and all(math.isfinite(t) and 0 < t < 60 for t in seconds), seconds
    fitted = calibrate(model, lengths, repeats=1)
    assert isinstance(fitted, QuadraticCostModel) and "calibrated" in fitted.describe()
    assert not model.training  # calibration restores the mode
    assert all(p.grad is None for p in model.parameters())
    # CPU timings differ from call to call: what calibrate returns is checked as the fit of the timings it measured
    # (the timings replaced by the ones above), not against fixed numbers.
    calls = []
    monkeypatch.setattr(odc_hf.prediction.calibrate, "time_lengths",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or seconds)  # fmt: skip
    fitted = calibrate(model, lengths, repeats=1, device="cpu", forward_kwargs={"fused_lm_head": True})
    assert fitted.to_dict() == QuadraticCostModel.fit(lengths, seconds).to_dict()
    assert calls == [((model, lengths), dict(repeats=1, device="cpu", forward_kwargs={"fused_lm_head": True}))]
    calibrate(model, lengths)
    assert calls[1] == ((model, lengths), dict(repeats=3, device=None, forward_kwargs=None))  # the defaults


def test_time_lengths_keeps_the_median_of_the_timed_runs_after_one_warm_up(monkeypatch):
    """Per length: one warm-up run (not counted), then ``repeats`` runs of the same random sequence, the median kept;
    the model in training mode while timed and its own mode afterwards (also after a failing run), gradients cleared,
    ``forward_kwargs`` passed through, refusals by their words. A fake clock makes the timings exact."""
    from types import SimpleNamespace

    import odc_hf.prediction.calibrate as calibrate_module
    from odc_hf.prediction.calibrate import time_lengths

    class Recording(torch.nn.Module):
        def __init__(self, fail_at=None):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=7)
            self.weight = torch.nn.Parameter(torch.ones(()))
            self.calls, self.fail_at = [], fail_at

        def forward(self, input_ids, labels, **kwargs):
            assert labels is input_ids and all(p.grad is None for p in self.parameters())  # cleared after each run
            self.calls.append((input_ids.clone(), kwargs, self.training))
            if len(self.calls) == self.fail_at:
                raise RuntimeError("out of memory")
            clock.elapsed = durations.pop(0)
            return SimpleNamespace(loss=self.weight * input_ids.float().sum())

    class Clock:  # perf_counter: start of a run at `now`, its end `elapsed` later
        now, elapsed, started = 0.0, 0.0, False

        def __call__(self):
            if self.started:
                self.now += self.elapsed
            self.started = not self.started
            return self.now

    clock = Clock()
    monkeypatch.setattr(calibrate_module.time, "perf_counter", clock)
    durations = [100.0, 3.0, 1.0, 8.0, 100.0, 30.0, 50.0, 100.0]  # warm-up, then 3 repeats; twice (median, not mean)
    model = Recording().eval()
    assert time_lengths(model, [2, 5], repeats=3, forward_kwargs={"fused_lm_head": True}) == [3.0, 50.0]
    assert not durations and len(model.calls) == 8 and not model.training and model.weight.grad is None
    for i, (ids, kwargs, training) in enumerate(model.calls):
        assert ids.shape == (1, 2 if i < 4 else 5) and kwargs == {"fused_lm_head": True} and training
        assert 0 <= int(ids.min()) and int(ids.max()) < 7
        assert torch.equal(ids, model.calls[0 if i < 4 else 4][0])  # warm-up and repeats on one sequence
    durations = [0.0, 5.0, 7.0, 6.0]
    assert time_lengths(Recording(), [3]) == [6.0] and not durations  # three repeats by default
    seeded = Recording()  # left in training mode: stays in it; one repeat: that run's time
    durations = [9.0, 4.0]
    assert time_lengths(seeded, [2], repeats=1, device="cpu") == [4.0] and seeded.training
    assert seeded.calls[0][1] == {} and torch.equal(seeded.calls[0][0], model.calls[0][0])  # the same seed each call
    failing = Recording(fail_at=2).eval()
    durations = [1.0]
    with pytest.raises(RuntimeError, match="^out of memory$"):
        time_lengths(failing, [4], repeats=2)
    assert not failing.training  # restored although a run failed
    with pytest.raises(ValueError, match=r"^repeats must be >= 1, got 0$"):
        time_lengths(model, [4], repeats=0)
    with pytest.raises(ValueError, match=r"^calibration lengths must be >= 2 tokens$"):
        time_lengths(model, [4, 1])


def test_fit_microbatches_recovers_per_document_model():
    import numpy as np

    from odc_hf.balance.cost import QuadraticCostModel

    truth = QuadraticCostModel(a=0.15, b=3e-5, c=6e-10)
    rng = np.random.default_rng(0)
    microbatches = [rng.integers(500, 16_000, size=rng.integers(1, 4)).tolist() for _ in range(40)]
    seconds = [truth.microbatch_cost(mb) for mb in microbatches]
    fitted = QuadraticCostModel.fit_microbatches(microbatches, seconds)
    assert np.allclose([fitted.a, fitted.b, fitted.c], [truth.a, truth.b, truth.c], rtol=1e-6)
    import pytest

    with pytest.raises(ValueError, match="empty microbatch"):
        QuadraticCostModel.fit_microbatches([[100], [], [300]], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="2 microbatches but 1"):
        QuadraticCostModel.fit_microbatches([[100], [200]], [1.0])


def test_trainer_reads_every_cost_model_json_form(tmp_path):
    """ODCConfig(cost_model=<json>): coefficients, single-document timings, or a run's microbatch timings."""
    import json
    from types import SimpleNamespace

    import numpy as np

    from odc_hf.balance.cost import QuadraticCostModel
    from odc_hf.config import ODCConfig
    from odc_hf.integrations.trainer.mixin import ODCMixin

    truth = QuadraticCostModel(a=0.1, b=2e-5, c=5e-10)
    microbatches = [[1000], [4000, 2000], [8000], [3000, 3000, 500], [16000]]
    forms = {
        "coefficients": {"a": 0.1, "b": 2e-5, "c": 5e-10},
        "timings": {"lengths": [1000, 4000, 8000, 16000], "seconds": [truth.microbatch_cost([s]) for s in (1000, 4000, 8000, 16000)]},
        "run": {"microbatches": microbatches, "seconds": [truth.microbatch_cost(mb) for mb in microbatches]},
    }  # fmt: skip
    for name, data in forms.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        trainer = SimpleNamespace(odc_config=ODCConfig(cost_model=str(path)))
        model = ODCMixin._odc_cost_model(trainer)
        assert np.allclose([model.a, model.b, model.c], [truth.a, truth.b, truth.c], rtol=1e-6), name


def _reference_fit_error(lengths, seconds):
    """The least squared error of max(floor, a + b·s + c·s²) over the fit's candidates, written plainly from its
    documentation: the k shortest rows (a split between distinct lengths) on the floor = their median, (a, b, c) the
    non-negative least squares of the rest (>= 3 distinct lengths), the fit pricing its floor rows at or below the
    floor, something above the floor (b or c > 0) when k > 0; k = 0 is the plain fit."""
    from itertools import combinations

    order = np.argsort(lengths, kind="stable")
    s, t = np.asarray(lengths, dtype=float)[order], np.asarray(seconds, dtype=float)[order]
    design = np.stack([np.ones_like(s), s, s * s], axis=1)

    def nonnegative_least_squares(x, y):
        best = None
        for size in (1, 2, 3):
            for active in combinations(range(3), size):
                coef = np.zeros(3)
                coef[list(active)] = np.linalg.lstsq(x[:, active] / x[:, active].max(axis=0), y, rcond=None)[0]
                coef[list(active)] /= x[:, active].max(axis=0)
                if (coef >= 0).all() and coef.any():
                    error = float(np.sum((x @ coef - y) ** 2))
                    if best is None or error < best[0] - 1e-18:
                        best = (error, coef)
        return None if best is None else best[1]

    errors = []
    for k in range(len(s)):
        if len(set(s[k:])) < 3:
            break
        if k and s[k - 1] == s[k]:
            continue
        coef = nonnegative_least_squares(design[k:], t[k:])
        if coef is None or (k and coef[1] == 0 and coef[2] == 0):
            continue
        floor = float(np.median(t[:k])) if k else 0.0
        if k and float(design[k - 1] @ coef) > floor:
            continue
        errors.append(float(np.sum((np.maximum(floor, design @ coef) - t) ** 2)))
    return min(errors)


def test_fit_takes_the_candidate_with_the_least_squared_error():
    """On noisy launch-bound-then-quadratic timings (lengths timed once or twice), the fitted model's squared error is
    the least of all candidates' (a plain reference of the candidates, including the plain additive fit)."""
    rng = np.random.default_rng(7)
    truth = QuadraticCostModel(a=0.0, b=3e-5, c=6e-10, floor=0.18)
    for trial in range(40):
        lengths = np.sort(rng.choice([256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768], size=8))
        if trial % 2:
            lengths = np.repeat(lengths[:5], 2)
        seconds = np.array([truth.microbatch_cost([s]) for s in lengths]) * rng.uniform(0.9, 1.1, size=lengths.size)
        if len(set(lengths.tolist())) < 3:
            continue
        fitted = QuadraticCostModel.fit(lengths, seconds)
        error = float(np.sum((np.array([fitted.microbatch_cost([s]) for s in lengths]) - seconds) ** 2))
        assert error == pytest.approx(_reference_fit_error(lengths, seconds), rel=1e-6, abs=1e-15), trial


def test_flop_model_reads_an_explicit_head_dim_and_defaults_key_value_heads_to_the_heads():
    """A config whose head_dim is not hidden / heads (Qwen3: 128 at hidden 1024, 16 heads) prices attention with its
    own head_dim; a config without num_key_value_heads (multi-head attention) counts every head for K and V."""

    class Config:
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size = 1024, 2, 16, 3072, 1000
        num_key_value_heads, head_dim = 8, 128

    model = FlopCostModel.from_config(Config())
    assert model.attn_dim == 16 * 128
    q_and_o, k_and_v, mlp = 2 * 1024 * 16 * 128, 2 * 1024 * 8 * 128, 3 * 1024 * 3072
    assert model.num_matmul_params == 2 * (q_and_o + k_and_v + mlp) + 1024 * 1000

    class MultiHead:
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size = 64, 1, 4, 128, 10

    model = FlopCostModel.from_config(MultiHead())
    assert model.attn_dim == 64
    assert model.num_matmul_params == 4 * 64 * 64 + 3 * 64 * 128 + 64 * 10
