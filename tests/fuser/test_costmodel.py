import pytest

from fuser import costmodel as cm
from fuser.options import FuserOptionError, resolve
from fuser.pattern import Candidate, Match
from fuser.planner import choose


@pytest.mark.parametrize("nq,nk,off", [(7, 7, 0), (5, 9, 4), (9, 5, -4), (5, 9, 0), (3, 3, 10), (4, 6, -10)])
def test_pairs_causal_matches_brute_force(nq, nk, off):
    brute = sum(1 for i in range(nq) for j in range(nk) if j <= i + off)
    expr = cm.pairs_causal(cm.NQ, cm.NK, off)
    assert cm.evaluate(expr, {cm.NQ: nq, cm.NK: nk}) == brute


def test_wave_efficiency():
    assert cm.wave_efficiency(132, 132) == 1.0
    assert cm.wave_efficiency(133, 132) == pytest.approx(133 / 264)


def test_estimate_is_bounded_by_the_slowest_resource():
    model = cm.H100
    t_math = cm.estimate_ms({"flops": 790e12, "launches": 0}, {}, model, "bf16", 1.0)
    assert t_math == pytest.approx(1000.0)
    t_mem = cm.estimate_ms({"bytes": 3e12, "flops": 1.0, "launches": 0}, {}, model, "bf16", 1.0)
    assert t_mem == pytest.approx(1000.0)


def test_a_graph_replay_launches_without_host_time():
    assert cm.device_model(cm.H100.name).launch_us == cm.H100.launch_us > 0
    assert cm.device_model(cm.H100.name, cuda_graphs=True).launch_us == cm.GRAPH_LAUNCH_US
    assert cm.device_model("other", 100, cuda_graphs=True).sm_count == 100
    est = {g: cm.estimate_ms({"bytes": 3e6, "launches": 4}, {}, cm.device_model(cm.H100.name, cuda_graphs=g), "bf16", 1.0)
           for g in (False, True)}
    assert est[False] == pytest.approx(est[True] + 4 * cm.H100.launch_us * 1e-3)


def test_the_reason_says_when_launches_are_replayed():
    a = Candidate("a", {"impl": "fuser"}, {}, 2.0)
    b = Candidate("b", {"impl": "fuser"}, {}, 1.0)
    on_gpu = Match("attention", None, frozenset(), {"device": "cuda"}, {}, "x.py:1")
    _, why = choose(on_gpu, [a, b], resolve(None, mode="reduce-overhead")[0])
    assert "CUDA graphs" in why
    assert "CUDA graphs" not in choose(on_gpu, [a, b], resolve(None)[0])[1]
    # CPU tensors (the interpreter) are never replayed from CUDA graphs
    on_cpu = Match("attention", None, frozenset(), {"device": "cpu"}, {}, "x.py:1")
    assert "CUDA graphs" not in choose(on_cpu, [a, b], resolve(None, mode="reduce-overhead")[0])[1]


def _match():
    return Match("attention", None, frozenset(), {}, {}, "x.py:1")


def test_planner_cheapest_and_forced():
    a = Candidate("fuser[backward=two_kernel]", {"impl": "fuser", "backward": "two_kernel"}, {}, 2.0)
    b = Candidate("fuser[backward=atomic_dq]", {"impl": "fuser", "backward": "atomic_dq"}, {}, 1.0)
    plan, why = choose(_match(), [a, b], resolve(None)[0])
    assert plan is b and "lowest estimated time" in why
    plan, why = choose(_match(), [a, b], resolve({"fuser.plan": "attention.backward=two_kernel"})[0])
    assert plan is a and "forced" in why
    with pytest.raises(FuserOptionError, match="takes one of: two_kernel, atomic_dq, autotune"):
        resolve({"fuser.plan": "attention.backward=three_kernel"})  # not a value at all
    from fuser.patterns.attention import AttentionPattern

    with pytest.raises(FuserOptionError, match="offers backward in .*only under fuser.autotune"):
        choose(_match(), [a, b], resolve({"fuser.plan": "attention.backward=autotune"})[0], AttentionPattern())
    # a choice the candidates do not have (inference: no backward) is ignored
    c = Candidate("fuser", {"impl": "fuser"}, {}, 1.0)
    assert choose(_match(), [c], resolve({"fuser.plan": "attention.backward=atomic_dq"})[0])[0] is c


@pytest.mark.parametrize("nq,nk", [(1, 1), (7, 7), (5, 9), (9, 5), (4096, 4096), (128, 8192)])
def test_evaluate_agrees_with_sympy_subs(nq, nk):
    """``evaluate`` replaces symbols structurally (fast): it must give what ``subs`` gives, for
    products, ceilings and the Piecewise of the causal pair count."""
    subs = {cm.B: 2, cm.H: 16, cm.HKV: 4, cm.NQ: nq, cm.NK: nk, cm.D: 64, cm.DV: 128}
    bh = cm.B * cm.H
    exprs = [
        2 * bh * cm.NQ * cm.NK * (cm.D + cm.DV),
        cm.pairs_causal(cm.NQ, cm.NK, 0) * bh,
        cm.pairs_causal(cm.NQ, cm.NK, cm.NK - cm.NQ),
        cm.sympy.ceiling(cm.NQ / 128) * bh + cm.sympy.ceiling(cm.NK / 64) * cm.B * cm.HKV,
        cm.sympy.Max(cm.NQ, cm.NK) / 3,
    ]
    for e in exprs:
        assert cm.evaluate(e, subs) == float(e.subs(subs))
    with pytest.raises(TypeError):
        cm.evaluate(cm.NQ * cm.NK, {cm.NQ: nq})  # a symbol without a value is an error, as before
