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


def test_dynamic_sizes_are_symbols_and_evaluate_at_the_example():
    def f(a):
        i = torch.arange(a.size(0))
        return a + (i[None, :] <= i[:, None])

    gm, ev = _evaluator(f, torch.randn(6, 6), dynamic=True)
    le = next(n for n in gm.graph.nodes if n.target is operator.le)
    sl = ev.slice(le)
    assert sl.symbols
    assert torch.equal(ev.evaluate(le), torch.ones(6, 6, dtype=torch.bool).tril())


class _Sub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("causal", torch.ones(8, 8, dtype=torch.bool).tril())
        # a learned bias whose name contains "_buffers": a parameter, never a constant
        self.rel_buffers = torch.nn.Parameter(torch.zeros(8, 8))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Sub()])

    def forward(self, a, cache_buffers_mask):
        b = self.blocks[0]
        return a + b.causal + b.rel_buffers + cache_buffers_mask


def test_buffers_are_identified_by_dynamo_source_not_by_name():
    """Issue 8: a parameter named `rel_buffers` and an argument named `cache_buffers_mask`
    were taken for constant buffers because of their names."""
    gm, ev = _evaluator(_Model(), torch.randn(8, 8), torch.randn(8, 8))
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    by_kind = {}
    for name, n in phs.items():
        try:
            sl = ev.slice(n)
            by_kind[name] = ("static", sl.buffers)
        except NotStatic as exc:
            by_kind[name] = ("data", str(exc))
    static = {k: v[1] for k, v in by_kind.items() if v[0] == "static" and v[1]}
    assert list(static.values()) == [["blocks.0.causal"]], by_kind
    assert sum(1 for v in by_kind.values() if v[0] == "data") == 3, by_kind


@pytest.mark.parametrize("spelling", ["ones_like", "full_like", "new_full", "new_ones"])
def test_like_factories_read_only_metadata(spelling):
    """``ones_like(a)`` and its kin depend on a's shape, dtype and device only: static even
    though a is an input, and evaluated at the example size (and at other sizes when dynamic)."""
    def f(a):
        if spelling == "ones_like":
            m = torch.ones_like(a) * float("-inf")
        elif spelling == "full_like":
            m = torch.full_like(a, float("-inf"))
        elif spelling == "new_full":
            m = a.new_full(a.shape, float("-inf"))
        else:
            m = a.new_ones(a.shape) * float("-inf")
        return a + m.triu(1)

    for dynamic in (None, True):
        gm, ev = _evaluator(f, torch.randn(5, 5), dynamic=dynamic)
        triu = next(n for n in gm.graph.nodes if "triu" in str(n.target))
        want = torch.full((5, 5), float("-inf")).triu(1)
        assert torch.equal(ev.evaluate(triu), want)
        if dynamic:
            s = next(iter(ev.slice(triu).symbols))
            assert torch.equal(ev.evaluate(triu, {s: 3}), torch.full((3, 3), float("-inf")).triu(1))


def test_like_factory_with_a_fill_from_data_is_not_static():
    def f(a, b):
        return a + torch.full_like(a, 1.0) * b.sum()

    gm, ev = _evaluator(f, torch.randn(4, 4), torch.randn(3))
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    with pytest.raises(NotStatic, match="input tensor 'b'|L_b_"):
        ev.slice(mul)


def test_empty_like_is_not_static():
    # unlike ones_like, empty_like is not a metadata reader: its values are the memory's
    gm, ev = _evaluator(lambda a: torch.empty_like(a).triu(1), torch.randn(4, 4))
    triu = next(n for n in gm.graph.nodes if "triu" in str(n.target))
    with pytest.raises(NotStatic, match="input tensor"):
        ev.slice(triu)


def test_like_factory_written_in_place_before_the_reader():
    """A write into ``ones_like(a)``'s result before it is read is part of its value: a constant
    write is evaluated with it, a write of data makes it data."""
    def const_write(a):
        m = torch.ones_like(a)
        m[:, :2] = 0.0
        return a + m

    gm, ev = _evaluator(const_write, torch.randn(4, 4))
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    m = add.args[1]
    want = torch.ones(4, 4)
    want[:, :2] = 0.0
    assert torch.equal(ev.evaluate(m, at=add), want)

    def data_write(a, b):
        m = torch.ones_like(a)
        m[:, :2] = b
        return a + m

    gm, ev = _evaluator(data_write, torch.randn(4, 4), torch.randn(4, 2))
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    with pytest.raises(NotStatic, match="input tensor"):
        ev.slice(add.args[1], at=add)
