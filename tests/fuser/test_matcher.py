"""The rule engine on small graphs."""

import torch

from fuser import testing
from fuser.graph import GraphView
from fuser.matcher import HOLE, Alt, Chain, Op, Same, Var, match

x = torch.randn(4, 4)


def _graph(fn, *args):
    (gm, _), = testing.capture(fn, *args)
    return gm, GraphView(gm.graph)


def _last(gm, view, op):
    return [n for n in gm.graph.nodes if view.op(n) == op][-1]


def test_op_captures_and_region():
    gm, view = _graph(lambda a: torch.exp(a * 3.0), x)
    rule = Op("exp", Op("mul", Var("a"), Var("c"), name="m"), name="e")
    (b,) = list(match(rule, _last(gm, view, "exp"), view))
    assert b["c"] == 3.0 and b["a"].op == "placeholder"
    assert {n.name for n in b.region} == {b["m"].name, b["e"].name}


def test_commutative():
    gm, view = _graph(lambda a: 3.0 * a, x)
    rule = Op("mul", Var("a", check=lambda n: hasattr(n, "op")), Var("c"), commutative=True)
    (b,) = list(match(rule, _last(gm, view, "mul"), view))
    assert b["c"] == 3.0


def test_alt_and_same():
    gm, view = _graph(lambda a: torch.exp(a) / torch.exp(a).sum(-1, keepdim=True), x)
    # the two exp nodes are distinct, so Same("e") does not hold
    rule = Op("div", Op("exp", Var(), name="e"), Op("sum", Same("e")))
    assert not list(match(rule, _last(gm, view, "div"), view))
    gm, view = _graph(lambda a: (lambda e: e / e.sum(-1, keepdim=True))(torch.exp(a)), x)
    assert len(list(match(rule, _last(gm, view, "div"), view))) == 1


def test_look_through():
    gm, view = _graph(lambda a: torch.exp(a.float().contiguous()), x)
    rule = Op("exp", Var("a", through={"cast", "identity"}))
    (b,) = list(match(rule, _last(gm, view, "exp"), view))
    assert b["a"].op == "placeholder" and len(b.region) == 3


def test_chain_collects_steps_outermost_first():
    gm, view = _graph(lambda a: torch.softmax((a @ a) * 2.0 + 1.0, -1), x)
    steps = (Op("mul", HOLE, Var("f"), label="scale"), Op("add", HOLE, Var("b"), label="add"))
    rule = Op("softmax", Chain(Op("matmul", Var(), Var(), name="mm"), steps, name="steps", root="S"))
    (b,) = list(match(rule, _last(gm, view, "softmax"), view))
    assert [lbl for lbl, _, _ in b["steps"]] == ["add", "scale"]
    assert [cap for _, _, cap in b["steps"]] == [{"b": 1.0}, {"f": 2.0}]
    assert view.op(b["S"]) == "add"


def test_chain_zero_steps():
    gm, view = _graph(lambda a: torch.softmax(a @ a, -1), x)
    rule = Op("softmax", Chain(Op("matmul", Var(), Var()), (Op("mul", HOLE, Var(), label="s"),), name="steps"))
    (b,) = list(match(rule, _last(gm, view, "softmax"), view))
    assert b["steps"] == []


def test_alternatives_backtrack():
    gm, view = _graph(lambda a: torch.exp(a) + a, x)
    rule = Alt(Op("add", Op("mul", Var(), Var()), Var()), Op("add", Op("exp", Var("i")), Var("o")))
    (b,) = list(match(rule, _last(gm, view, "add"), view))
    assert b["i"] is b["o"]
