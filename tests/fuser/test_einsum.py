"""The einsum normal form: spellings of one contraction give one form (up to the names of the
index variables), and the roles a pattern reads off it are what the program computes."""

from __future__ import annotations

import torch

from fuser.einsum import monomial
from fuser.graph import GraphView
from fuser.testing import capture


def _view(fn, *args):
    (gm, _), = capture(fn, *args)
    return gm, GraphView(gm.graph)


def _out(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


S = torch.randn(2, 3, 4, 5)
K = torch.randn(2, 3, 4)
VEC = torch.randn(2, 3, 5)
ROLES = ("b", "h", "k", "v")


def _contraction(fn):
    """The roles of the factors of fn(k, S)'s form, with S's dims named."""
    gm, view = _view(fn, K, S)
    out = _out(gm)
    node = out[0] if isinstance(out, (tuple, list)) else out
    s_node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("s_"))
    m = monomial(node, view)
    names = m.roles({s_node: ROLES})
    return m, sorted(r for _, r in m.factor_roles(names)), tuple(names.get(v) for v in m.out)


def test_spellings_of_one_contraction_agree():
    spellings = [
        lambda k, s: torch.einsum("bhk,bhkv->bhv", k, s),
        lambda k, s: (k[..., None] * s).sum(-2),
        lambda k, s: (k.unsqueeze(-1) * s).sum(dim=2),
        lambda k, s: (k.unsqueeze(-2) @ s).squeeze(-2),
        lambda k, s: torch.einsum("...k,...kv->...v", k, s),
    ]
    seen = set()
    for fn in spellings:
        m, factors, out = _contraction(fn)
        assert len(m.summed) == 1 and m.const == 1.0
        seen.add((tuple(factors), out))
    assert seen == {((("b", "h", "k"), ("b", "h", "k", "v")), ("b", "h", "v"))}


def test_the_wrong_axis_is_seen():
    # summed over v instead of k: the roles say so (a pattern then declines)
    m, factors, out = _contraction(lambda k, s: (k.new_ones(5)[None, None, None, :] * s).sum(-1))
    assert out == ("b", "h", "k")


def test_outer_products_and_constants():
    def outer(a, b):
        return (a[..., :, None] * (0.5 * b)[..., None, :]) / 4, torch.einsum("bhk,bhv->bhkv", a, b)

    gm, view = _view(outer, K, VEC)
    x, y = _out(gm)
    mx, my = monomial(x, view), monomial(y, view)
    assert mx.const == 0.125 and my.const == 1.0
    for m in (mx, my):
        assert not m.summed and len(m.factors) == 2
        names = m.roles({}, ROLES)
        assert sorted(r for _, r in m.factor_roles(names)) == [("b", "h", "k"), ("b", "h", "v")]


def test_exp_of_a_leaf_and_unit_dims():
    def decay(s, g):
        return s * g.exp()[..., None], s * g[..., None].exp()

    gm, view = _view(decay, S, torch.randn(2, 3, 4))
    a, _ = _out(gm)
    m = monomial(a, view)
    s_node = [n for n in gm.graph.nodes if n.op == "placeholder"][0]
    names = m.roles({s_node: ROLES}, ROLES)
    roles = dict((f.leaf[0] if isinstance(f.leaf, tuple) else "leaf", r) for f, (_, r) in zip(m.factors, m.factor_roles(names)))
    assert roles == {"leaf": ROLES, "exp": ("b", "h", "k")}


def test_conflicting_names_are_refused():
    gm, view = _view(lambda k, s: (k[..., None] * s).sum(-2), K, S)
    out = _out(gm)
    m = monomial(out[0] if isinstance(out, (tuple, list)) else out, view)
    s_node = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    # the result's dims named as if the contraction kept k: a conflict with S's names
    assert m.roles({s_node: ROLES}, ("b", "h", "k")) is None
