"""The canonical view: one op name per computation, whatever the spelling."""

import pytest
import torch
import torch.nn.functional as F

from fuser import testing
from fuser.graph import GraphView, _einsum_as_matmul


def _view(fn, *args):
    (gm, _), = testing.capture(fn, *args)
    return gm, GraphView(gm.graph)


def _ops(fn, *args):
    gm, view = _view(fn, *args)
    return [view.op(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


x = torch.randn(2, 3, 4, 4)


@pytest.mark.parametrize("fn", [
    lambda a: a @ a, lambda a: torch.matmul(a, a), lambda a: a.matmul(a),
    lambda a: torch.bmm(a[0], a[0]), lambda a: torch.einsum("bhij,bhjk->bhik", a, a),
])
def test_matmul_spellings(fn):
    assert "matmul" in _ops(fn, x)


@pytest.mark.parametrize("fn,op", [
    (lambda a: F.softmax(a, -1), "softmax"), (lambda a: a.softmax(dim=-1), "softmax"),
    (lambda a: torch.softmax(a, -1, dtype=torch.float32), "softmax"),
    (lambda a: F.log_softmax(a, -1), "log_softmax"),
    (lambda a: a * 2, "mul"), (lambda a: 2 * a, "mul"), (lambda a: torch.mul(a, 2), "mul"),
    (lambda a: a / 2, "div"), (lambda a: a.div(2), "div"),
    (lambda a: a.float(), "cast"), (lambda a: a.to(torch.float16), "cast"), (lambda a: a.type(torch.float16), "cast"),
    (lambda a: a.transpose(-1, -2), "permute"), (lambda a: a.mT, "permute"), (lambda a: a.permute(0, 1, 3, 2), "permute"),
    (lambda a: a.amax(-1, keepdim=True), "amax"), (lambda a: a.max(-1, keepdim=True).values, "amax"),
    (lambda a: torch.where(a > 0, a, 0.0), "where"), (lambda a: a.masked_fill(a > 0, 0.0), "masked_fill"),
    (lambda a: a.repeat_interleave(2, dim=1), "repeat_interleave"),
])
def test_unary_spellings(fn, op):
    assert op in _ops(fn, x)


def test_softmax_dim_normalised():
    gm, view = _view(lambda a: F.softmax(a, dim=-1), x)
    (sm,) = [n for n in gm.graph.nodes if view.op(n) == "softmax"]
    assert view.canon(sm).attrs["dim"] == 3


def test_inplace_resolution():
    def f(a):
        s = a * 2
        s.masked_fill_(s > 1, 0.0)
        return s.softmax(-1)

    gm, view = _view(f, x)
    (sm,) = [n for n in gm.graph.nodes if view.op(n) == "softmax"]
    # the softmax reads the value after masked_fill_, not the mul's
    assert view.op(view.canon(sm).args[0]) == "masked_fill"


@pytest.mark.parametrize("eq,expect", [
    ("bhqd,bhkd->bhqk", {"ta": False, "tb": True}),
    ("bhqk,bhkd->bhqd", {"ta": False, "tb": False}),
    ("bhdq,bhkd->bhqk", {"ta": True, "tb": True}),
    ("...qd,...kd->...qk", {"ta": False, "tb": True}),
    ("bhqd,bhkd->bhkq", None),  # transposed output
    ("bqhd,bkhd->bhqk", None),  # batch dims out of place
])
def test_einsum_as_matmul(eq, expect):
    assert _einsum_as_matmul(eq, 4, 4) == expect
