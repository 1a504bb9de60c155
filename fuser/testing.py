"""Helpers for unit-testing pattern rewrites on toy graphs (pytest-friendly).

Typical use::

    from fuser import testing

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v

    m = testing.assert_fuses(attn, q, k, v, pattern="attention", causal="none", gqa_group=1)
    testing.assert_declines(lambda q, k, v: (attn(q, k, v), ...), q, k, v, reason="also used")

Nothing here compiles with Inductor or runs fused kernels: graphs are captured with Dynamo
(or given as ``GraphModule`` s) and rewritten; :func:`run_rewritten` runs a rewritten graph
when a test wants numbers too.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import passes
from .options import resolve
from .pattern import Match, Rejection


def capture(fn: Callable, *args: Any, dynamic: Optional[bool] = None, **kwargs: Any) -> list[tuple[fx.GraphModule, list]]:
    """Dynamo's graphs of ``fn(*args, **kwargs)`` with their example inputs (``fn`` runs once,
    eagerly). Resets Dynamo's caches first."""
    graphs: list = []

    def backend(gm, example_inputs, **_):
        for n in gm.graph.nodes:  # Dynamo drops its source information after compiling
            source = getattr(n.meta.get("grapharg"), "source", None)
            if source is not None:
                n.meta["fuser_source"] = source
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args, **kwargs)
    return graphs


def _propagate(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake)


def rewrite(
    gm: fx.GraphModule,
    example_inputs: Optional[Sequence[Any]] = None,
    *,
    options: Optional[dict] = None,
    grad_enabled: Optional[bool] = None,
) -> tuple[fx.GraphModule, passes.PassResult]:
    """Apply fuser's pass to ``gm`` in place, without compiling.

    Args:
        gm: from Dynamo, ``torch.fx.symbolic_trace`` or ``make_fx``.
        example_inputs: placeholder values. Needed when the nodes carry no value metadata
            (``symbolic_trace``): fake-tensor propagation then fills it in. Buffers among them
            let static masks be evaluated.
        options: fuser options as for ``torch.compile(options=...)`` (``fuser.*`` keys).
        grad_enabled: training (save what backward needs) or inference; default: the
            current grad mode.

    Returns:
        ``(gm, result)``: the rewritten module and a :class:`fuser.passes.PassResult` with
        ``.matches`` and ``.rejected``.
    """
    if example_inputs is not None and not any(
        ("example_value" in n.meta or "val" in n.meta or "tensor_meta" in n.meta)
        for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method"
    ):
        _propagate(gm, example_inputs)
    opts, _ = resolve(options)
    if grad_enabled is None:
        grad_enabled = torch.is_grad_enabled()
    result = passes.apply(gm, example_inputs, opts, grad_enabled=grad_enabled)
    return gm, result


def fuse(fn: Callable, *args: Any, options: Optional[dict] = None, dynamic: Optional[bool] = None, **kwargs: Any):
    """Capture ``fn`` with Dynamo and rewrite every graph; returns ``(graphs, result)`` where
    ``result`` merges all graphs' matches and rejections."""
    merged = passes.PassResult()
    gms = []
    for i, (gm, ex) in enumerate(capture(fn, *args, dynamic=dynamic, **kwargs)):
        opts, _ = resolve(options)
        r = passes.apply(gm, ex, opts, grad_enabled=torch.is_grad_enabled(), graph_index=i)
        merged.matches += r.matches
        merged.rejected += r.rejected
        gms.append((gm, ex))
    return gms, merged


def _fmt(result: passes.PassResult) -> str:
    lines = [f"matches: {[(m.pattern, m.location, m.summary) for m in result.matches]}"]
    lines += [f"rejected: {[(r.pattern, r.location, r.reason) for r in result.rejected]}"]
    return "\n".join(lines)


def assert_fuses(fn: Callable, *args: Any, pattern: str = "attention", count: Optional[int] = 1,
                 options: Optional[dict] = None, dynamic: Optional[bool] = None, **expected: Any) -> list[Match]:
    """Assert ``fn(*args)`` has ``count`` (None: at least one) fused matches of ``pattern``
    whose ``summary`` has every ``expected`` key/value (e.g. ``causal="top_left"``,
    ``gqa_group=4``). Returns the matches."""
    _, result = fuse(fn, *args, options=options, dynamic=dynamic)
    ms = [m for m in result.matches if m.pattern == pattern and m.fused]
    if count is None:
        assert ms, f"expected {pattern} to be fused; got\n{_fmt(result)}"
    else:
        assert len(ms) == count, f"expected {count} fused {pattern} match(es), got {len(ms)}\n{_fmt(result)}"
    for m in ms:
        for key, want in expected.items():
            got = m.summary.get(key)
            assert got == want, f"{pattern} at {m.location}: {key}={got!r}, expected {want!r}\n{_fmt(result)}"
    return ms


def assert_declines(fn: Callable, *args: Any, pattern: str = "attention", reason: str = "",
                    options: Optional[dict] = None, dynamic: Optional[bool] = None) -> Rejection:
    """Assert nothing of ``pattern`` is fused in ``fn(*args)`` and a near-miss is reported
    whose reason matches the regular expression ``reason``. Returns that rejection."""
    _, result = fuse(fn, *args, options=options, dynamic=dynamic)
    fused = [m for m in result.matches if m.pattern == pattern and m.fused]
    assert not fused, f"expected {pattern} not to be fused\n{_fmt(result)}"
    rej = [r for r in result.rejected if r.pattern == pattern and re.search(reason, r.reason)]
    assert rej, f"expected a {pattern} near-miss with reason matching {reason!r}\n{_fmt(result)}"
    return rej[0]


def run_rewritten(graphs: list, *args: Any) -> Any:
    """Run the single rewritten graph from :func:`fuse` on new inputs (placeholders in
    Dynamo's order must match ``args``)."""
    if len(graphs) != 1:
        raise ValueError(f"expected one graph, got {len(graphs)} (graph breaks?)")
    gm, _ = graphs[0]
    return gm(*args)
