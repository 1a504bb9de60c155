"""fuser.names on real Dynamo graphs: readable names from placeholders' sources, module buffers
proved by source (never by name)."""

from __future__ import annotations

import torch
import torch.nn as nn

from fuser.names import is_module_buffer, user_name


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("causal", torch.ones(4, 4, dtype=torch.bool).tril())
        self.causal_like = torch.ones(4, 4)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        return (x @ self.w).masked_fill(~self.causal[:, :1], 0.0) + self.causal_like[:, :1]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attn(), Attn()])
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, extra):
        for b in self.blocks:
            x = b(x)
        return x * self.scale + extra["bias"]


def _graph(fn, *args, dynamic=None):
    graphs = []

    def backend(gm, example_inputs, **_):
        names = {n.name: (user_name(n), is_module_buffer(n), n.op) for n in gm.graph.nodes}
        graphs.append((gm, names))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    assert len(graphs) == 1
    return graphs[0]


def test_placeholders_are_named_from_their_sources_and_buffers_proved():
    net = Net()
    gm, names = _graph(net, torch.randn(4, 8), {"bias": torch.randn(1)})
    by_user = {u: (buf, op) for u, buf, op in names.values() if op == "placeholder"}
    assert by_user["x"] == (None, "placeholder")
    assert by_user["extra['bias']"] == (None, "placeholder")
    assert by_user["blocks.0.w"] == (None, "placeholder")  # a parameter is never a buffer
    assert by_user["blocks.1.w"] == (None, "placeholder")
    assert by_user["blocks.0.causal"] == ("blocks.0.causal", "placeholder")
    assert by_user["blocks.1.causal"] == ("blocks.1.causal", "placeholder")
    assert by_user["scale"] == ("scale", "placeholder")
    # a plain tensor attribute with a buffer-like name is not a buffer
    assert by_user["blocks.0.causal_like"] == (None, "placeholder")
    # Dynamo's own placeholder names are unreadable: that is what user_name is for
    assert any(name.startswith("l_self_modules_blocks_modules_0") for name in names)


def test_other_nodes_lose_dynamos_numeric_suffix():
    def f(q):
        q = q * 2
        q = q + 1
        q = q.relu()
        return q

    gm, names = _graph(f, torch.randn(3))
    computed = {n: u for n, (u, _, op) in names.items() if op in ("call_function", "call_method")}
    assert set(computed.values()) == {"q"} and len(computed) == 3
    assert any(n != "q" for n in computed)  # q_1, q_2, ...: de-duplicated by Dynamo


def test_name_that_is_only_a_suffix_is_kept():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.relu, (x,), name="_3")
    n.name = "_3"
    assert user_name(n) == "_3" and user_name(x) == "x"  # no source: the node's name
    assert is_module_buffer(x) is None  # no source: never a buffer, whatever the name


def test_symbolic_size_placeholders_fall_back_to_the_source_text():
    gm, names = _graph(lambda x: x * x.shape[0], torch.randn(5, 2), dynamic=True)
    sym = [u for u, buf, op in names.values() if op == "placeholder" and u != "x"]
    assert sym and all(u.startswith("L['x'].size()") for u in sym), sym
