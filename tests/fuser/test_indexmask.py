"""Masks built from indices are proven for every size (fuser/indexmask.py), never guessed
from a few probe sizes: causal, bottom-right, all-visible; windows and prefixes are general."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser import indexmask, testing
from fuser.graph import GraphView, val
from fuser.static import StaticEvaluator


def _analyse(fn, *args, kind="bool_keep", dynamic=True):
    """The mask `fn` returns, analysed: (class, hidden value, predicate, view, node, evaluator)."""
    (gm, ex), = testing.capture(fn, *args, dynamic=dynamic)
    view = GraphView(gm.graph)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ev = StaticEvaluator(view, dict(zip(phs, ex)), owner=gm)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    sl = ev.slice(node)
    mp = indexmask.mask_predicate(node, sl.nodes, kind, view, ev.constant)
    shape = val(node).shape
    prover = indexmask.Prover(indexmask.shape_env_of(view))
    return indexmask.classify(mp.visible, shape[-2], shape[-1], prover), mp.hidden_value, mp.visible


def _ij(q, k=None):
    nq = q.shape[-2]
    nk = nq if k is None else k.shape[-2]
    return torch.arange(nq)[:, None], torch.arange(nk)[None, :], nq, nk


X = torch.randn(1, 2, 30, 8)


def test_arange_causal_is_top_left():
    def f(q):
        i, j, _, _ = _ij(q)
        return j <= i

    assert _analyse(f, X)[0] == "top_left"


@pytest.mark.parametrize("spelling", ["tril", "triu_drop", "unsqueeze", "float"])
def test_causal_spellings(spelling):
    def f(q):
        n = q.shape[-2]
        if spelling == "tril":
            return torch.ones(n, n, dtype=torch.bool).tril()
        if spelling == "triu_drop":
            return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        if spelling == "unsqueeze":
            i, j = torch.arange(n).unsqueeze(-1), torch.arange(n).unsqueeze(0)
            return (i - j) >= 0
        return (1.0 - torch.ones(n, n).tril()) * -10000.0

    kind = {"triu_drop": "bool_drop", "float": "additive"}.get(spelling, "bool_keep")
    cls, hidden, _ = _analyse(f, X, kind=kind)
    assert cls == "top_left"
    assert hidden == (-10000.0 if spelling == "float" else None)


def test_sliding_window_is_general_at_every_first_size():
    """Issue 8: a window of 32 first seen at N=30 looks causal at that size."""
    def f(q):
        i, j, _, _ = _ij(q)
        return (j <= i) & (j > i - 32)

    assert _analyse(f, X)[0] == "general"


def test_prefix_lm_is_general():
    def f(q):
        i, j, _, _ = _ij(q)
        return (j <= i) | (j < 48)

    assert _analyse(f, X)[0] == "general"


def test_additive_finfo_min_bottom_right():
    def f(q, k):
        i, j, nq, nk = _ij(q, k)
        return torch.zeros(nq, nk).masked_fill(j > i + nk - nq, torch.finfo(torch.float32).min)

    cls, hidden, _ = _analyse(f, torch.randn(1, 2, 40, 8), torch.randn(1, 2, 24, 8), kind="additive")
    assert cls == "bottom_right" and hidden == torch.finfo(torch.float32).min


def test_transformers_style_where_in_bfloat16():
    """`finfo(bfloat16).min` kept in bfloat16; the hidden value is what the mask holds."""
    def f(q, k):
        i, j, nq, nk = _ij(q, k)
        m = (j <= i + (nk - nq))[None, None]
        return torch.where(m, torch.tensor(0.0), torch.finfo(torch.bfloat16).min).expand(2, 1, nq, nk)

    cls, hidden, _ = _analyse(f, torch.randn(1, 2, 40, 8), torch.randn(1, 2, 44, 8), kind="additive")
    assert cls == "bottom_right" and hidden == torch.finfo(torch.bfloat16).min


class _GPT2Bias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))

    def forward(self, q, k):
        nq, nk = q.shape[-2], k.shape[-2]
        return self.bias[:, :, nk - nq:nk, :nk] == 0


def test_sliced_registered_buffer_is_bottom_right_using_dynamo_guards():
    """`bias[:, :, Nk-Nq:Nk, :Nk]`: the slice start is non-negative only by Dynamo's guard."""
    cls, _, _ = _analyse(_GPT2Bias(), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 30, 8), kind="bool_drop")
    assert cls == "bottom_right"


def test_padding_by_the_full_length_is_all_visible():
    def f(q):
        n = q.shape[-2]
        return torch.arange(n)[None, :] < n

    assert _analyse(f, X)[0] == "none"


def test_mask_depending_on_batch_index_is_not_a_predicate():
    def f(q):
        i, j, _, _ = _ij(q)
        b = torch.arange(2)[:, None, None]
        return (j <= i) | (b > 0)

    with pytest.raises(indexmask.NotIndexed, match="batch or head"):
        _analyse(f, X)


# found by an adversarial review (2026-12-07): positions in a narrow dtype wrap or round in eager;
# they were read as exact integers (int16 positions past 32767 made a wrapped mask "causal")
@pytest.mark.parametrize("dtype,offset", [(torch.int16, 32760), (torch.int32, 2 ** 31 - 5), (torch.int8, 120),
                                          (torch.uint8, 250), (torch.bfloat16, 250), (torch.float16, 2040)])
def test_positions_that_do_not_fit_their_dtype_are_not_a_formula(dtype, offset):
    def f(q):
        n = q.shape[-2]
        i = torch.arange(n, dtype=dtype)[:, None] + offset
        j = torch.arange(n, dtype=dtype)[None, :] + offset
        return j <= i

    with pytest.raises(indexmask.NotIndexed, match="may not all be exact"):
        _analyse(f, X, dynamic=False)


def test_a_wrapping_subtraction_in_uint8_is_not_a_formula():
    def f(q):
        n = q.shape[-2]
        i, j = torch.arange(n, dtype=torch.uint8)[:, None], torch.arange(n, dtype=torch.uint8)[None, :]
        return j <= i - 3  # rows 0-2: i - 3 wraps to 253-255 in eager, every key visible

    with pytest.raises(indexmask.NotIndexed, match="may not all be exact"):
        _analyse(f, X, dynamic=False)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.float32, torch.bfloat16])
def test_positions_that_fit_their_dtype_are_still_a_formula(dtype):
    def f(q):
        n = q.shape[-2]
        return torch.arange(n, dtype=dtype)[None, :] <= torch.arange(n, dtype=dtype)[:, None] + 3

    assert _analyse(f, X, dynamic=False)[0] not in (None, "none")


# --- differential check of the interpreter: predicate vs real evaluation ------------------

_ATOMS = st.sampled_from([
    "j <= i", "j < i", "j >= i", "j > i - {w}", "j <= i + {w}", "j < {w}", "i >= {w}", "j == i",
    "j != i", "j <= i + nk - nq", "(i - j) <= {w}", "j * 2 <= i + {w}",
])


@st.composite
def _formulas(draw, depth=2):
    if depth == 0 or draw(st.booleans()):
        return "(" + draw(_ATOMS).format(w=draw(st.integers(-5, 40))) + ")"
    op = draw(st.sampled_from(["&", "|", "^"]))
    left = draw(_formulas(depth=depth - 1))
    if draw(st.booleans()):
        return f"~{left}"
    return f"({left} {op} {draw(_formulas(depth=depth - 1))})"


@settings(max_examples=25, deadline=None)
@given(formula=_formulas(), nq=st.integers(2, 40), nk=st.integers(2, 40), nq2=st.integers(2, 40), nk2=st.integers(2, 40))
def test_predicate_equals_evaluation_at_other_sizes(formula, nq, nk, nq2, nk2):
    """Capture at one size with dynamic shapes, then compare the symbolic predicate with the
    mask computed eagerly at another size: they must agree everywhere."""
    src = f"def f(q, k):\n    nq, nk = q.shape[-2], k.shape[-2]\n    i = torch.arange(nq)[:, None]\n" \
          f"    j = torch.arange(nk)[None, :]\n    return {formula}\n"
    env: dict = {"torch": torch}
    exec(src, env)  # noqa: S102 - a generated test program
    f = env["f"]
    (gm, ex), = testing.capture(f, torch.randn(1, 1, nq, 4), torch.randn(1, 1, nk, 4), dynamic=True)
    view = GraphView(gm.graph)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ev = StaticEvaluator(view, dict(zip(phs, ex)), owner=gm)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0][0]
    sl = ev.slice(node)
    try:
        mp = indexmask.mask_predicate(node, sl.nodes, "bool_keep", view, ev.constant)
    except indexmask.NotIndexed:
        return  # declining is always sound
    shape = val(node).shape
    syms = {}
    for s, size in zip((shape[-2], shape[-1]), (nq2, nk2)):
        if isinstance(s, torch.SymInt):
            syms[s.node.expr] = size
    if len(syms) < 2 and (nq2, nk2) != (nq, nk) and not (len(syms) == 1 and nq2 == nk2 and nq == nk):
        return  # a size Dynamo specialised: the graph serves only the captured value
    want = f(torch.randn(1, 1, nq2, 4), torch.randn(1, 1, nk2, 4))
    got = indexmask.evaluate(mp.visible, nq2, nk2, syms)
    assert torch.equal(got, want.expand(nq2, nk2)), (src, mp.visible)
    cls = indexmask.classify(mp.visible, shape[-2], shape[-1], indexmask.Prover(indexmask.shape_env_of(view)))
    i, j = torch.arange(nq2)[:, None], torch.arange(nk2)[None, :]
    if cls == "top_left":
        assert torch.equal(want, j <= i)
    elif cls == "bottom_right":
        assert torch.equal(want, j <= i + nk2 - nq2)
    elif cls == "none":
        assert bool(want.all())
