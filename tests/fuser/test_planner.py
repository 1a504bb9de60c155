"""The planner: cheapest candidate, forced choices, and torch.use_deterministic_algorithms."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from fuser.options import FuserOptionError, Options
from fuser.pattern import Candidate
from fuser.planner import choose

MATCH = types.SimpleNamespace(pattern="attention_kl", location="loss.py:12")


def _candidates():
    return [
        Candidate("fuser[backward=two_kernel]", {"impl": "fuser", "backward": "two_kernel"}, {}, 4.0),
        Candidate("fuser[backward=atomic_dq]", {"impl": "fuser", "backward": "atomic_dq"}, {}, 3.0,
                  deterministic=False),
        Candidate("inductor", {"impl": "inductor"}, {}, 20.0),
    ]


@pytest.fixture
def deterministic():
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()

    def turn_on(warn_only_=False):
        torch.use_deterministic_algorithms(True, warn_only=warn_only_)

    yield turn_on
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_cheapest_wins_and_the_reason_names_the_runner_up():
    plan, reason = choose(MATCH, _candidates(), Options())
    assert plan.name == "fuser[backward=atomic_dq]"
    assert "3 ms vs 4 ms for fuser[backward=two_kernel]" in reason


def test_forced_value_filters_and_unknown_value_names_the_choices():
    plan, reason = choose(MATCH, _candidates(), Options(plan=(("attention_kl.impl", "inductor"),)))
    assert plan.name == "inductor" and "forced by fuser.plan" in reason
    with pytest.raises(FuserOptionError, match=r"offers backward in \['atomic_dq', 'two_kernel'\]"):
        choose(MATCH, _candidates(), Options(plan=(("attention_kl.backward", "fast"),)))


def test_deterministic_algorithms_leave_out_atomic_plans(deterministic):
    deterministic()
    plan, reason = choose(MATCH, _candidates(), Options())
    assert plan.name == "fuser[backward=two_kernel]"
    assert "nondeterministic plans left out" in reason


def test_forcing_a_nondeterministic_plan_under_deterministic_algorithms(deterministic):
    forced = Options(plan=(("attention_kl.backward", "atomic_dq"),))
    deterministic()
    with pytest.raises(FuserOptionError, match="not deterministic.*use_deterministic_algorithms"):
        choose(MATCH, _candidates(), forced)
    deterministic(warn_only_=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan, _ = choose(MATCH, _candidates(), forced)
    assert plan.name == "fuser[backward=atomic_dq]"
    assert any("use_deterministic_algorithms" in str(w.message) for w in caught)


def test_kl_and_attention_atomic_candidates_are_marked_nondeterministic(deterministic):
    # end to end on the interpreter: the planner's choice under deterministic algorithms
    import math

    import torch.nn.functional as F

    from fuser.report import collecting

    def kl(q1, k1, q2, k2):
        s1, s2 = q1 @ k1.mT / math.sqrt(8), q2 @ k2.mT / math.sqrt(8)
        return F.kl_div(F.log_softmax(s2, -1), F.log_softmax(s1, -1), reduction="batchmean", log_target=True)

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 2, 20, 8, generator=g).requires_grad_(i >= 2) for i in range(4)]
    deterministic()
    torch._dynamo.reset()
    with collecting() as rep:
        out = torch.compile(kl, backend="fuser")(*xs)
    (m,) = rep.fused
    assert "atomic_dq" not in m.plan.name and "left out" in m.reason
    assert all(c.deterministic == ("atomic_dq" not in c.name) for c in m.alternatives)
    torch.autograd.grad(out, xs[2:])


@pytest.mark.parametrize("impl", ["inductor", "sdpa"])
def test_forcing_inductor_or_sdpa_on_the_cpu_says_they_exist_only_on_cuda(impl):
    cpu_match = types.SimpleNamespace(pattern="attention", location="m.py:3", bindings={"device": torch.device("cpu")})
    fuser_only = [Candidate("fuser[backward=two_kernel]", {"impl": "fuser", "backward": "two_kernel"}, {}, 1.0)]
    from fuser.patterns.attention import AttentionPattern

    with pytest.raises(FuserOptionError, match=r"offers impl in \['fuser'\]: (Inductor|SDPA) plans exist only on "
                                               r"CUDA; these tensors are on the CPU"):
        choose(cpu_match, fuser_only, Options(plan=(("attention.impl", impl),)), AttentionPattern())


def test_forced_autotune_backward_without_autotune_names_the_option():
    from fuser.patterns.attention import AttentionPattern

    m = types.SimpleNamespace(pattern="attention", location="m.py:3", bindings={"device": torch.device("cuda")})
    with pytest.raises(FuserOptionError, match=r"backward=autotune is offered only under fuser.autotune=True"):
        choose(m, _candidates(), Options(plan=(("attention.backward", "autotune"),)), AttentionPattern())
    # without the pattern the planner says only what is offered
    with pytest.raises(FuserOptionError, match=r"offers backward in \['atomic_dq', 'two_kernel'\]$"):
        choose(m, _candidates(), Options(plan=(("attention.backward", "autotune"),)))
