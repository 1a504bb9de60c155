"""Static evaluation: masks computed from sizes are known by their values."""

import operator

import pytest
import torch

from fuser import testing
from fuser.graph import GraphView
from fuser.static import NotStatic, StaticEvaluator


def _evaluator(fn, *args, dynamic=None):
    (gm, ex), = testing.capture(fn, *args, dynamic=dynamic)
    view = GraphView(gm.graph)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, StaticEvaluator(view, dict(zip(phs, ex)), owner=gm)


def test_arange_mask_is_static_and_evaluates():
    def f(a):
        n = a.size(0)
        i = torch.arange(n)
        causal = i[None, :] <= i[:, None]
        return a + causal

    gm, ev = _evaluator(f, torch.randn(5, 5))
    le = next(n for n in gm.graph.nodes if n.target is operator.le)
    assert torch.equal(ev.evaluate(le), torch.ones(5, 5, dtype=torch.bool).tril())


def test_input_dependent_is_not_static():
    gm, ev = _evaluator(lambda a, m: a + (m > 0), torch.randn(5, 5), torch.randn(5, 5))
    gt = next(n for n in gm.graph.nodes if n.target is operator.gt)
    with pytest.raises(NotStatic, match="input tensor"):
        ev.slice(gt)


def test_random_is_not_static():
    gm, ev = _evaluator(lambda a: a + (torch.rand(5, 5) > 0.5), torch.randn(5, 5))
    gt = next(n for n in gm.graph.nodes if n.target is operator.gt)
    with pytest.raises(NotStatic, match="random"):
        ev.slice(gt)


def test_dynamic_sizes_probe_other_sizes():
    def f(a):
        i = torch.arange(a.size(0))
        return a + (i[None, :] <= i[:, None])

    gm, ev = _evaluator(f, torch.randn(6, 6), dynamic=True)
    le = next(n for n in gm.graph.nodes if n.target is operator.le)
    sl = ev.slice(le)
    assert sl.symbols
    shapes = {tuple(ev.evaluate(le, a or None).shape) for a in ev.probe_assignments(sl.symbols)}
    assert (6, 6) in shapes and len(shapes) >= 2
