"""The pieces of megatron.training.rerun and the optimizer's device-side rejection, by hand."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.fused_adamw import adamw_step
from megatron.training.rerun import SPIKE_FACTOR, SPIKE_WARMUP, ReplayIterators, StepGuard, first_bad_param


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))


def _set_grads(model, value=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) if value is None else torch.full_like(p, value)


def _state(opt, model):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.optimizer.state_dict())


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][name]), name


@pytest.mark.parametrize("first", [True, False])
def test_one_pass_adamw_skip_keeps_every_bit_even_of_nan_gradients(first):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    if not first:  # a skip after real steps, and a skip of the very first step (step count 0)
        for s in range(2):
            _set_grads(model, seed=s)
            adamw_step(opt, {}, None)
    before = ([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))
    _set_grads(model, value=math.nan)
    adamw_step(opt, {}, torch.tensor(math.nan), skip=torch.tensor(True))
    after = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(before[0], after[0]))
    for k, st in after[1]["state"].items():
        for name, v in st.items():
            if k in before[1]["state"]:
                assert torch.equal(v, before[1]["state"][k][name]), name
            else:  # a first step skipped: the fresh state (zero moments, step 0), as if never stepped
                assert not v.any(), name
    # keep = 1 is the ordinary step: the same as one that never heard of skipping
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    ref.load_state_dict(model.state_dict())
    if after[1]["state"]:
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _set_grads(model, seed=7)
    _set_grads(ref, seed=7)
    adamw_step(opt, {}, None, skip=torch.tensor(False))
    adamw_step(ref_opt, {}, None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("kind", ["adam", "adam-fused", "sgd"])
def test_optimizer_rejects_on_a_flag_or_a_non_finite_norm_and_only_then(kind):
    """step(reject=...) and skip_non_finite: the one-pass AdamW and torch's fused kernels skip by a
    device flag (update_successful a device bool with sync=False); the multi-tensor SGD reads it."""
    model = _mlp()
    name = "sgd" if kind == "sgd" else "adam"
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=0.1, sgd_momentum=0.9), [model])
    if kind == "adam-fused":
        opt._one_pass_adamw = False
        for group in opt.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    _set_grads(model, seed=0)
    assert opt.step(sync=True)[0] is True
    opt.skip_non_finite = True
    for reject, grad in ((torch.tensor(1.0), None), (torch.tensor(0.0), math.nan), (None, math.inf)):
        before = _state(opt, model)
        _set_grads(model, value=grad, seed=3)
        ok, norm, _ = opt.step(sync=False, reject=reject)
        assert not bool(ok)
        assert torch.is_tensor(ok)  # with sync=False always a device bool (SGD read it on the host)
        _same(before, _state(opt, model))
    before = _state(opt, model)
    _set_grads(model, seed=4)
    ok, norm, _ = opt.step(sync=True, reject=torch.tensor(0.0))
    assert ok is True and math.isfinite(norm)
    assert not all(torch.equal(a, b) for a, b in zip(before[0], _state(opt, model)[0]))


def test_replay_gives_each_steps_batches_again_in_order_for_shared_iterators():
    live = iter(range(100))
    other = iter(range(1000, 1100))
    r = ReplayIterators([live, None, live, other])  # virtual stages: the first and last chunk share one
    a, none, b, c = r.iterators
    assert none is None and a is b and c is not a
    drawn = {}
    for step in (1, 2, 3):
        r.begin(step)
        drawn[step] = [next(a), next(c), next(a), next(c)]
    r.rewind([2, 3])
    r.begin(2)
    assert [next(a), next(c), next(a), next(c)] == drawn[2]
    r.begin(3)
    assert [next(a), next(c), next(a), next(c)] == drawn[3]
    r.begin(4)
    assert next(a) == 6 and next(c) == 1006  # then the live iterators go on
    assert sorted(r.steps) == [3, 4]  # only the last two steps are kept


def _guard(**training) -> StepGuard:
    t = dict(
        rerun_mode="validate_results",
        check_for_nan_in_loss_and_grad=True,
        check_for_spiky_loss=True,
        iterations_to_skip=[],
        result_rejected_tracker_filename=None,
        error_injection_rate=0,
        error_injection_type="transient_error",
        error_injection_kind="nan_grad",
        error_injection_iterations=[],
        error_injection_ranks=None,
        seed=1234,
    )
    t.update(training)
    return StepGuard(SimpleNamespace(training=SimpleNamespace(**t)), torch.device("cpu"), rank=0)


def _loss(value: float, tokens: float = 4.0) -> dict:
    return {"lm loss": torch.tensor([value * tokens, tokens])}


def test_spike_flag_against_the_median_of_accepted_steps_by_hand():
    g = _guard()
    history = [5.0, 4.0, 100.0, 4.5, 3.0, 6.0]  # 100 is accepted here (not yet judged: warm-up)
    for i, v in enumerate(history):
        flags = g.reject_flags(i + 1, _loss(v), forced=False)
        assert flags[1] == 0.0, (i, v)  # warm-up: nothing is judged before SPIKE_WARMUP steps
        g.after_update(_loss(v), torch.tensor(True))
    assert len(history) > SPIKE_WARMUP
    median = torch.tensor(history).median().item()  # torch's lower median: 4.5
    for value, spiky in ((SPIKE_FACTOR * median * 0.99, False), (SPIKE_FACTOR * median * 1.01, True)):
        assert g.reject_flags(7, _loss(value), forced=False)[1].item() == float(spiky)
    # A rejected step does not enter the reference; a NaN loss is the NaN check's, not a spike.
    g.after_update(_loss(1e6), torch.tensor(False))
    assert g.reject_flags(8, _loss(SPIKE_FACTOR * median * 1.01), forced=False)[1].item() == 1.0
    nan = g.reject_flags(8, _loss(math.nan), forced=False)
    assert nan[0].item() == 1.0 and nan[1].item() == 0.0
    # With --rerun-mode disabled a spike does not reject (Megatron: not fatal); a NaN does.
    flags = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert g.reject(flags).item() == 1.0 and _guard(rerun_mode="disabled").reject(flags).item() == 0.0


@pytest.mark.parametrize(
    "kind, in_rerun", [("transient_error", False), ("persistent_error", True), ("correct_result", True)]
)
def test_injection_is_due_at_the_chosen_step_on_the_chosen_rank_and_in_the_rerun_by_type(kind, in_rerun):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    for rank, due in ((0, True), (1, False)):
        g = _guard(error_injection_iterations=[2], error_injection_ranks=[0], error_injection_type=kind)
        g.rank, g.inject_here = rank, rank == 0
        g.arm(1, [model], rerun=False)
        assert not g._hooks
        g.arm(2, [model], rerun=False)
        assert bool(g._hooks) == due
        g.arm(2, [model], rerun=True)
        assert bool(g._hooks) == (due and in_rerun)
        g.disarm()


def test_poisoned_gradients_name_the_first_parameter_in_model_order():
    model = _mlp()
    x = torch.randn(3, 4)
    g = _guard(error_injection_iterations=[1])
    g.arm(1, [model], rerun=False)
    model(x).sum().backward()
    g.disarm()
    params = list(model.parameters())
    norms = [(params[2:], torch.stack([p.grad.norm() for p in params[2:]])), (params[:2], torch.zeros(2))]
    assert all(torch.isnan(p.grad).all() for p in params)
    assert first_bad_param([model], norms) == "1.weight"  # the second layer's: the first one NaN here
    assert first_bad_param([model], [(params, torch.ones(4))]) is None


def test_injection_rate_is_about_one_in_n_never_at_iteration_one_and_fixed_by_the_seed():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))

    def due_iterations(seed: int, rank: int) -> list[int]:
        g = _guard(error_injection_rate=10, seed=seed)
        g.rank = rank
        g._draws.seed(seed * 1009 + rank)  # as StepGuard seeds it for this rank
        found = []
        for it in range(1, 2001):
            g.arm(it, [model], rerun=False)
            if g._hooks:
                found.append(it)
        g.disarm()
        return found

    a = due_iterations(1234, 0)
    assert 1 not in a and 150 < len(a) < 250  # about one step in ten
    assert a == due_iterations(1234, 0) and a != due_iterations(1234, 1) and a != due_iterations(99, 0)
