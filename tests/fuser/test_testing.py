"""fuser.testing: numeric summary values, misspelt keys, run_rewritten's return value."""

from __future__ import annotations

import pytest
import torch

from fuser import testing


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 12, 16, generator=g) for _ in range(3)]


def test_numbers_compare_numerically():
    q, k, v = _qkv()
    (m,) = testing.assert_fuses(attn, q, k, v, scale=0.125, gqa_group=1, causal="none")
    assert isinstance(m.summary["scale"], str)  # the summary spells it; 0.125 still matches
    testing.assert_fuses(attn, q, k, v, scale=0.125 * (1 + 1e-8))
    with pytest.raises(AssertionError, match=r"scale='0.125', expected 0.126"):
        testing.assert_fuses(attn, q, k, v, scale=0.126)
    with pytest.raises(AssertionError, match="causal="):
        testing.assert_fuses(attn, q, k, v, causal="top_left")


def test_a_misspelt_key_lists_the_keys():
    q, k, v = _qkv()
    with pytest.raises(AssertionError, match=r"the summary has no key 'causl'; its keys: .*causal"):
        testing.assert_fuses(attn, q, k, v, causl="none")


def test_run_rewritten_returns_what_the_function_returns():
    q, k, v = _qkv()
    graphs, result = testing.fuse(attn, q, k, v)
    assert len(result.matches) == 1 and "fuser" in graphs[0][0].code
    out = testing.run_rewritten(graphs, q, k, v)
    assert isinstance(out, torch.Tensor) and torch.allclose(out, attn(q, k, v), atol=1e-5)

    def two(q, k, v):
        o = attn(q, k, v)
        return o, {"sum": o.sum()}

    graphs, _ = testing.fuse(two, q, k, v)
    o, d = testing.run_rewritten(graphs, q, k, v)
    assert torch.allclose(o, attn(q, k, v), atol=1e-5) and torch.allclose(d["sum"], o.sum(), atol=1e-4)


def test_run_rewritten_wants_one_graph():
    def broken(q, k, v):
        a = attn(q, k, v)
        torch._dynamo.graph_break()
        return attn(a, k, v)

    graphs, _ = testing.fuse(broken, *_qkv())
    with pytest.raises(ValueError, match="expected one graph, got 2"):
        testing.run_rewritten(graphs, *_qkv())


def test_run_rewritten_maps_a_modules_arguments_and_state():
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Linear(16, 32, bias=False)
            self.register_buffer("scale", torch.tensor(0.25))

        def forward(self, x, extra):
            q, k = self.qk(x).split(16, -1)
            return torch.softmax(q @ k.mT * 0.25, -1) @ extra["v"]

    m = M()
    x, v = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    graphs, result = testing.fuse(m, x, {"v": v})
    assert len(result.matches) == 1
    x2, v2 = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    out = testing.run_rewritten(graphs, x2, extra={"v": v2})
    assert torch.allclose(out, m(x2, {"v": v2}), atol=1e-5)
