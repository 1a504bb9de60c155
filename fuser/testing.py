"""Helpers for unit-testing pattern rewrites on toy graphs (pytest-friendly).

Typical use::

    from fuser import testing

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v

    m = testing.assert_fuses(attn, q, k, v, pattern="attention", causal="none", gqa_group=1, scale=0.125)
    testing.assert_declines(lambda q, k, v: (attn(q, k, v), ...), q, k, v, reason="also used")

Nothing here compiles with Inductor or runs fused kernels: graphs are captured with Dynamo
(or given as ``GraphModule`` s) and rewritten; :func:`run_rewritten` runs a rewritten graph
when a test wants numbers too.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

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
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args, **kwargs)
    if len(graphs) == 1:  # for run_rewritten: the function and the structure of what it returned
        leaves, spec = pytree.tree_flatten(out)
        graphs[0][0].meta["fuser_output_spec"] = (spec, len(leaves))
        graphs[0][0].meta["fuser_function"] = fn
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


def _number(x: Any) -> Optional[float]:
    """``x`` as a float if it is a number or a string that parses as one (not a bool)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x.strip())
        except ValueError:
            return None
    return None


def _same(got: Any, want: Any) -> bool:
    """``got == want``; numbers (a summary's ``scale="0.125"`` against ``0.125``) compare
    within 1e-6 relative."""
    if got == want:
        return True
    g, w = _number(got), _number(want)
    if g is None or w is None or not isinstance(want, (int, float)):
        return False
    return math.isclose(g, w, rel_tol=1e-6, abs_tol=0.0)


def assert_fuses(fn: Callable, *args: Any, pattern: str = "attention", count: Optional[int] = 1,
                 options: Optional[dict] = None, dynamic: Optional[bool] = None, **expected: Any) -> list[Match]:
    """Assert ``fn(*args)`` has ``count`` (None: at least one) fused matches of ``pattern``
    whose ``summary`` has every ``expected`` key/value (e.g. ``causal="top_left"``,
    ``gqa_group=4``, ``scale=0.125``).

    A number expected (``int``/``float``) matches a summary number or numeric string within
    1e-6 relative; anything else must be equal.

    Returns:
        The fused matches.

    Raises:
        AssertionError: the wrong number of fused matches, an ``expected`` key the summary does
            not have (the message lists the keys it has), or a value that differs.
    """
    _, result = fuse(fn, *args, options=options, dynamic=dynamic)
    ms = [m for m in result.matches if m.pattern == pattern and m.fused]
    if count is None:
        assert ms, f"expected {pattern} to be fused; got\n{_fmt(result)}"
    else:
        assert len(ms) == count, f"expected {count} fused {pattern} match(es), got {len(ms)}\n{_fmt(result)}"
    for m in ms:
        for key, want in expected.items():
            assert key in m.summary, (
                f"{pattern} at {m.location}: the summary has no key {key!r}; its keys: "
                f"{', '.join(m.summary)}"
            )
            got = m.summary[key]
            assert _same(got, want), f"{pattern} at {m.location}: {key}={got!r}, expected {want!r}\n{_fmt(result)}"
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


class _NoValue(Exception):
    """A placeholder's source cannot be evaluated on the given call's arguments."""


def _evaluate(source: Any, scope: dict, fn: Callable) -> Any:
    """The value a Dynamo source names, for a call whose arguments are ``scope``."""
    from torch._dynamo import source as sources

    def cls(*names: str) -> tuple:
        return tuple(c for c in (getattr(sources, n, None) for n in names) if isinstance(c, type))

    if isinstance(source, cls("LocalSource")):
        if source.local_name not in scope:
            raise _NoValue(source)
        return scope[source.local_name]
    if isinstance(source, cls("GlobalSource")):
        glb = getattr(getattr(fn, "forward", fn), "__globals__", {})
        if source.global_name not in glb:
            raise _NoValue(source)
        return glb[source.global_name]
    if isinstance(source, cls("DictGetItemSource", "GetItemSource")):
        index = source.index
        if getattr(source, "index_is_slice", False) or not isinstance(index, (str, int)):
            raise _NoValue(source)
        return _evaluate(source.base, scope, fn)[index]
    if isinstance(source, cls("AttrSource")):
        return getattr(_evaluate(source.base, scope, fn), source.member)
    if isinstance(source, cls("NNModuleSource")):
        return _evaluate(source.base, scope, fn)
    if isinstance(source, cls("TensorPropertySource")):
        t = _evaluate(source.base, scope, fn)
        prop = getattr(source.prop, "name", str(source.prop)).upper()
        if prop.endswith("SIZE"):
            return t.size(source.idx)
        if prop.endswith("STRIDE"):
            return t.stride(source.idx)
        if prop.endswith("STORAGE_OFFSET"):
            return t.storage_offset()
    raise _NoValue(source)


def _placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> Optional[list]:
    """The graph's placeholder values for a call ``fn(*args, **kwargs)`` of the function it
    was captured from, found through each placeholder's Dynamo source; None if any is unknown."""
    import inspect

    from .names import _source_of

    fn = gm.meta.get("fuser_function")
    if fn is None:
        return None
    try:
        bound = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    scope = dict(bound.arguments)
    if isinstance(fn, torch.nn.Module):
        scope.setdefault("self", fn)
    elif inspect.ismethod(fn):
        scope.setdefault("self", fn.__self__)
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = _source_of(node)
        if source is None:
            return None
        try:
            values.append(_evaluate(source, scope, fn))
        except (_NoValue, AttributeError, KeyError, IndexError, TypeError):
            return None
    return values


def run_rewritten(graphs: list, *args: Any, **kwargs: Any) -> Any:
    """Run the single rewritten graph from :func:`fuse` on new inputs and return what the
    function returns: a single value for a function returning one tensor, its tuple (list,
    dict, ...) for one returning several. (A Dynamo graph itself returns a flat tuple.)

    Args:
        graphs: ``fuse(...)[0]`` (or :func:`capture`'s list): exactly one graph.
        *args, **kwargs: the arguments to call the function with, as for the function itself
            (``attn(q, k, v)`` -> ``run_rewritten(graphs, q, k, v)``); module parameters and
            buffers are the module's current ones. Where a placeholder's value cannot be found
            that way, ``args`` are taken as the placeholders' values in Dynamo's order.

    Raises:
        ValueError: not exactly one graph (a graph break splits the function), or arguments
            that fit neither the function nor the graph's placeholders.
    """
    if len(graphs) != 1:
        raise ValueError(f"expected one graph, got {len(graphs)} (graph breaks?)")
    gm, _ = graphs[0]
    values = _placeholder_values(gm, args, kwargs)
    if values is None:
        n = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
        if kwargs or len(args) != n:
            raise ValueError(
                f"cannot map the arguments to the graph's {n} placeholders: pass the function's "
                "arguments (graphs from fuser.testing.fuse/capture) or every placeholder's value "
                "in Dynamo's order"
            )
        values = list(args)
    out = gm(*values)
    if not isinstance(out, (tuple, list)):
        return out
    spec = gm.meta.get("fuser_output_spec")
    if spec is not None and spec[1] == len(out):
        return pytree.tree_unflatten(list(out), spec[0])
    return out[0] if len(out) == 1 else tuple(out)
