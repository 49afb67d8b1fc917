"""ODCBatchSampler: each sample once per epoch, identical plans on every rank, resumable."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_hf.balance.cost import FlopCostModel
from odc_hf.balance.sampler import ODCBatchSampler
from odc_hf.prediction.workloads import qwen2_5_config

BUDGET = 8192


def samplers(lengths, world_size, **kwargs):
    return [
        ODCBatchSampler(lengths, world_size=world_size, rank=r, max_tokens_per_microbatch=BUDGET, **kwargs)
        for r in range(world_size)
    ]


@st.composite
def setups(draw):
    lengths = draw(st.lists(st.integers(1, BUDGET), min_size=1, max_size=50))
    world_size = draw(st.integers(1, 6))
    kwargs = dict(
        minibatch_size=draw(st.integers(1, 20)),
        mode=draw(st.sampled_from(["lb_mini", "lb_micro", "none"])),
        seed=draw(st.integers(0, 3)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
    )
    return lengths, world_size, kwargs


@settings(max_examples=80, deadline=None)
@given(setup=setups(), epoch=st.integers(0, 2))
def test_every_sample_once_per_epoch_and_every_microbatch_in_budget(setup, epoch):
    lengths, world_size, kwargs = setup
    ranks = samplers(lengths, world_size, **kwargs)
    seen = []
    for sampler in ranks:
        sampler.set_epoch(epoch)
        bundles = list(sampler)
        assert len(bundles) == len(sampler)
        for bundle in bundles:
            for microbatch in bundle:
                assert sum(lengths[i] for i in microbatch) <= BUDGET
                seen.extend(microbatch)
    n, size = len(lengths), kwargs["minibatch_size"]
    expected = n if not kwargs["drop_last"] else (n // size) * size
    assert len(seen) == len(set(seen)) == expected
    if kwargs["drop_last"]:
        kept = {int(i) for step in range(len(ranks[0])) for i in ranks[0].minibatch_indices(step)}
        assert set(seen) == kept


@settings(max_examples=30, deadline=None)
@given(setup=setups())
def test_every_rank_computes_the_same_plan(setup):
    lengths, world_size, kwargs = setup
    ranks = samplers(lengths, world_size, **kwargs)
    for step in range(len(ranks[0])):
        plans = [sampler.plan(step) for sampler in ranks]
        assert all(plan == plans[0] for plan in plans)
        for rank in range(world_size):
            assert plans[0].for_rank(rank) == plans[rank].for_rank(rank)
    yielded = [list(sampler) for sampler in ranks]
    for step in range(len(ranks[0])):
        assert [yielded[r][step] for r in range(world_size)] == ranks[0].plan(step).microbatches


def test_epochs_reshuffle_deterministically():
    lengths = np.arange(1, 41) * 100
    a, b = samplers(lengths, 1, minibatch_size=8)[0], samplers(lengths, 1, minibatch_size=8)[0]
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(b) == list(a)
    unshuffled = samplers(lengths, 2, minibatch_size=8, shuffle=False)[0]
    assert unshuffled.minibatch_indices(1).tolist() == list(range(8, 16))


def test_state_dict_resumes_mid_epoch():
    lengths = np.arange(1, 65) * 50
    sampler = samplers(lengths, 2, minibatch_size=8, seed=3)[1]
    sampler.set_epoch(2)
    full = list(sampler)
    iterator = iter(sampler)
    next(iterator), next(iterator), next(iterator)
    state = sampler.state_dict()
    assert state == {"epoch": 2, "step": 3}
    fresh = samplers(lengths, 2, minibatch_size=8, seed=3)[1]
    fresh.load_state_dict(state)
    assert list(fresh) == full[3:]
    assert list(fresh) == full  # the next pass of the same epoch starts from the top
    with pytest.raises(ValueError, match="invalid sampler state"):
        fresh.load_state_dict({"epoch": 0, "step": 99})


def test_minibatch_smaller_than_world_gives_empty_bundles():
    ranks = samplers([100, 200, 300], 4, minibatch_size=3, mode="lb_mini")
    bundles = [list(sampler)[0] for sampler in ranks]
    assert sorted(len(bundle) for bundle in bundles) == [0, 1, 1, 1]


def test_flop_cost_model_balances_compute_not_samples():
    # one 64k sample costs about as much as many short ones on a 1.5B model: LB-Mini gives its rank
    # fewer samples
    lengths = [65536] + [4096] * 23
    cost = FlopCostModel.from_config(qwen2_5_config("1.5B"))
    plan = ODCBatchSampler(
        lengths,
        world_size=2,
        rank=0,
        minibatch_size=24,
        max_tokens_per_microbatch=65536,
        cost_model=cost,
        shuffle=False,
    ).plan(0)
    counts = sorted(sum(len(mb) for mb in mbs) for mbs in plan.microbatches)
    assert counts[0] < 12 < counts[1]


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dataset sample 1 has 9000 tokens"):
        ODCBatchSampler([10, 9000], world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET)
    ODCBatchSampler(
        [10, 9000], world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET, truncate=True
    )
    with pytest.raises(ValueError, match="rank"):
        ODCBatchSampler([10], world_size=2, rank=2, minibatch_size=1, max_tokens_per_microbatch=BUDGET)
    with pytest.raises(ValueError, match="mode"):
        ODCBatchSampler(
            [10], world_size=1, rank=0, minibatch_size=1, max_tokens_per_microbatch=BUDGET, mode="fast"
        )
    with pytest.raises(ValueError, match="minibatch_size"):
        ODCBatchSampler([10], world_size=1, rank=0, minibatch_size=0, max_tokens_per_microbatch=BUDGET)


class SlowSampler(ODCBatchSampler):
    """An artificially slow planner: every plan takes PLAN_S more (what 65,536 samples over 1,024 ranks cost)."""

    PLAN_S = 0.3

    def plan(self, step):
        time.sleep(self.PLAN_S)
        return super().plan(step)


def test_plan_ahead_gives_the_same_bundles_and_takes_planning_off_the_critical_path():
    """With plan_ahead=1, a step's plan is made while the previous step trains: asking for the next bundle costs no
    planning time (measured: < 0.05 s against 0.3 s of planning; the bound leaves room for a loaded machine)."""
    lengths = np.random.default_rng(1).integers(10, 500, size=96)
    args = dict(world_size=2, minibatch_size=16, max_tokens_per_microbatch=512, seed=3)
    inline = [list(ODCBatchSampler(lengths, rank=1, **args))]
    ahead = SlowSampler(lengths, rank=1, plan_ahead=1, **args)
    waits, got = [], []
    it = iter(ahead)
    for _ in range(len(ahead)):
        start = time.perf_counter()
        got.append(next(it))
        waits.append(time.perf_counter() - start)
        time.sleep(2 * SlowSampler.PLAN_S)  # the training step, longer than a plan
    assert got == inline[0]
    assert waits[0] >= SlowSampler.PLAN_S  # the first plan has nothing to overlap
    assert max(waits[1:]) < SlowSampler.PLAN_S / 2, waits
    state = ahead.state_dict()  # resuming counts the steps handed out, not the ones planned ahead
    assert state["step"] == len(ahead)
    partial = SlowSampler(lengths, rank=1, plan_ahead=2, **args)
    first_two = [b for _, b in zip(range(2), partial)]
    assert first_two == inline[0][:2] and partial.state_dict()["step"] == 2
    with pytest.raises(ValueError, match="plan_ahead must be an integer >= 0"):
        ODCBatchSampler(lengths, rank=0, plan_ahead=-1, **args)


class RecordingSampler(ODCBatchSampler):
    """Records each step it is asked to plan, the thread that plans it and how many plans run at once; a step in
    ``held`` waits for ``release`` before its plan is made."""

    def __init__(self, *args, held=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.asked, self.finished, self.threads, self.most = [], [], set(), 0
        self.held, self.release, self._lock, self._running = set(held), threading.Event(), threading.Lock(), 0

    def plan(self, step):
        with self._lock:
            self.asked.append(step)
            self.threads.add(threading.current_thread().name)
            self._running += 1
            self.most = max(self.most, self._running)
        if step in self.held:
            assert self.release.wait(10)
        time.sleep(0.02)  # long enough for a second worker, if there were one, to start the next plan meanwhile
        with self._lock:
            self._running -= 1
            self.finished.append(step)
        return super().plan(step)


def _eventually(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the planning thread did not get there"
        time.sleep(0.005)


@pytest.mark.parametrize("plan_ahead", [1, 2, 3])
def test_plan_ahead_plans_that_many_steps_beyond_the_one_handed_out_one_at_a_time_in_its_named_thread(plan_ahead):
    """While step s is handed out, steps up to s + plan_ahead are planned (all of them, once the thread has caught up,
    and not one more), one plan at a time, in the thread named odc-plan-ahead_0."""
    lengths = np.random.default_rng(2).integers(10, 500, size=96)
    sampler = RecordingSampler(lengths, world_size=2, rank=0, minibatch_size=16, max_tokens_per_microbatch=512,
                               seed=3, plan_ahead=plan_ahead)  # fmt: skip
    last = len(sampler) - 1
    for s, _ in enumerate(sampler):
        expected = list(range(min(s + plan_ahead, last) + 1))
        _eventually(lambda expected=expected: sampler.finished[-1:] == expected[-1:])
        time.sleep(0.05)  # a plan queued beyond them would have started by now
        assert sampler.asked == expected, s
    assert sampler.threads == {"odc-plan-ahead_0"} and sampler.most == 1


def test_an_iteration_stopped_early_drops_its_queued_plans_and_does_not_wait_for_the_one_in_progress():
    lengths = np.random.default_rng(2).integers(10, 500, size=96)
    sampler = RecordingSampler(lengths, world_size=2, rank=0, minibatch_size=16, max_tokens_per_microbatch=512,
                               seed=3, plan_ahead=3, held={1})  # fmt: skip
    it = iter(sampler)
    next(it)  # step 0 handed out; step 1's plan is held in progress, steps 2 and 3 are queued behind it
    _eventually(lambda: sampler.asked == [0, 1])
    it.close()  # as when training stops before the epoch ends
    assert sampler.finished == [0]  # closing did not wait for step 1's plan
    sampler.release.set()
    _eventually(lambda: sampler.finished == [0, 1])
    time.sleep(0.1)  # a queued plan would have started by now
    assert sampler.asked == [0, 1]


def test_a_resume_state_is_accepted_exactly_within_its_bounds():
    """epoch >= 0 and 0 <= step <= steps per epoch (step == steps: the epoch is done, the next one starts)."""
    sampler = ODCBatchSampler([10] * 8, world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET)
    steps = len(sampler)
    assert steps == 4
    for epoch, step in ((0, 0), (0, steps), (3, 1)):
        sampler.load_state_dict({"epoch": epoch, "step": step})
        assert sampler.state_dict()["epoch"] == epoch
    for epoch, step in ((-1, 0), (0, -1), (0, steps + 1)):
        with pytest.raises(ValueError, match=rf"^invalid sampler state .* for {steps} steps per epoch$"):
            sampler.load_state_dict({"epoch": epoch, "step": step})


def test_the_documented_defaults_and_a_fresh_state():
    """Defaults as documented (seed 0, drop_last, no planning ahead, the token cost model); a new sampler stands at
    step 0 of epoch 0; lengths are token counts (int64) whatever they came as; a given cost model is the one used."""
    from odc_hf.balance import TokenCostModel

    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90]  # 9 samples, minibatches of 2: a last, partial one
    default = ODCBatchSampler(lengths, world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET)
    assert default.state_dict()["epoch"] == 0 and default.state_dict()["step"] == 0
    explicit = ODCBatchSampler(lengths, world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET,
                               seed=0, drop_last=True, plan_ahead=0)  # fmt: skip
    assert list(default) == list(explicit) and default.plan_ahead == 0
    assert isinstance(default.cost_model, TokenCostModel) and default.lengths.dtype == np.int64
    kept = ODCBatchSampler(lengths, world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET,
                           drop_last=False)  # fmt: skip
    assert (len(default), len(kept)) == (4, 5)  # 9 // 2, ceil(9 / 2)
    model = TokenCostModel()
    assert ODCBatchSampler(lengths, world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET,
                           cost_model=model).cost_model is model  # fmt: skip


def test_bad_sizes_and_steps_are_named():
    for name in ("world_size", "minibatch_size"):
        kwargs = {"world_size": 1, "minibatch_size": 2, name: 0}
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got 0$"):
            ODCBatchSampler([10] * 4, rank=0, max_tokens_per_microbatch=BUDGET, **kwargs)
    sampler = ODCBatchSampler([10] * 8, world_size=1, rank=0, minibatch_size=2, max_tokens_per_microbatch=BUDGET)
    with pytest.raises(ValueError, match=r"^step must be in \[0, 4\), got 4$"):
        sampler.minibatch_indices(4)


def test_planning_ahead_resumes_at_the_saved_step():
    """A sampler that plans ahead and resumes mid-epoch yields the steps after the saved one, as one that does not."""
    lengths = np.random.default_rng(2).integers(10, 500, size=48)
    args = dict(world_size=2, minibatch_size=8, max_tokens_per_microbatch=512, seed=1, rank=0)
    inline = list(ODCBatchSampler(lengths, **args))
    resumed = ODCBatchSampler(lengths, plan_ahead=2, **args)
    resumed.load_state_dict({"epoch": 0, "step": 3})
    assert list(resumed) == inline[3:]
