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
    ("bhqd,bhkd->bhqk", {"pa": None, "pb": (0, 1, 3, 2), "po": None}),
    ("bhqk,bhkd->bhqd", {"pa": None, "pb": None, "po": None}),
    ("bhdq,bhkd->bhqk", {"pa": (0, 1, 3, 2), "pb": (0, 1, 3, 2), "po": None}),
    ("...qd,...kd->...qk", {"pa": None, "pb": (0, 1, 3, 2), "po": None}),
    ("bhqd,bhkd->bhkq", {"pa": None, "pb": (0, 1, 3, 2), "po": (0, 1, 3, 2)}),  # transposed output
    ("bqhd,bkhd->bhqk", {"pa": (0, 2, 1, 3), "pb": (0, 2, 3, 1), "po": None}),  # [B, N, H, D] operands
    ("bhqk,bkhd->bqhd", {"pa": None, "pb": (0, 2, 1, 3), "po": (0, 2, 1, 3)}),  # P V writing [B, N, H, D]
    ("bhqd,bhkd->bqk", None),   # a batch letter summed away
    ("bii,bij->bij", None),     # a diagonal
])
def test_einsum_as_matmul(eq, expect):
    """einsum(eq, A, B) == matmul(A.permute(pa), B.permute(pb)).permute(po), checked numerically."""
    size = dict(b=2, h=3, q=5, k=7, d=4, i=5, j=6, x=2, y=3)
    a_letters, b_letters = (t.replace("...", "xy") for t in eq.split("->")[0].split(","))
    got = _einsum_as_matmul(eq, len(a_letters), len(b_letters))
    assert got == expect
    if got is None:
        return
    a = torch.randn(*[size[c] for c in a_letters])
    b = torch.randn(*[size[c] for c in b_letters])
    out = torch.matmul(a.permute(got["pa"] or tuple(range(a.dim()))), b.permute(got["pb"] or tuple(range(b.dim()))))
    if got["po"] is not None:
        out = out.permute(got["po"])
    torch.testing.assert_close(out, torch.einsum(eq, a, b))


def test_loop_ops_are_canonical():
    # what an unrolled recurrence is made of: time selections, index writes, stacks, buffers,
    # einsums that are not matmuls
    def f(x, s):
        o = torch.zeros_like(x)
        b = x.new_empty(2, 3)
        parts = []
        for t in range(2):
            o[:, :, t] = x[:, :, t] * 2
            parts.append(x.select(2, t))
        y = x[..., 1, :]
        return o, b, torch.stack(parts, dim=-2), y, torch.einsum("bhk,bhkv->bhv", x[:, :, 0], s), \
            torch.einsum("bhk,bhv->bhkv", x[:, :, 0], x[:, :, 1])

    (gm, _), = testing.capture(f, torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6))
    view = GraphView(gm.graph)
    ops = {}
    for n in gm.graph.nodes:
        c = view.canon(n)
        if c is not None:
            ops.setdefault(c.op, []).append(c)
    assert [(c.attrs["dim"], c.attrs["index"]) for c in ops["select"]][:4] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert any(c.attrs["dim"] == 2 and c.attrs["index"] == 1 for c in ops["select"][4:])  # x[..., 1, :]
    assert [c.attrs["index"][2] for c in ops["setitem"]] == [0, 1]
    assert ops["stack"][0].attrs["dim"] == 2 and len(ops["stack"][0].args) == 2
    assert [(c.attrs["fill"], c.attrs["shape"]) for c in ops["alloc"]] == [(0.0, (2, 3, 4, 5)), (None, (2, 3))]
    eqs = [c.attrs["equation"] for c in ops["einsum"]]
    assert eqs == [(("b", "h", "k"), ("b", "h", "k", "v"), ("b", "h", "v")),
                   (("b", "h", "k"), ("b", "h", "v"), ("b", "h", "k", "v"))]
