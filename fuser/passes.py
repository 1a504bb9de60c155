"""The pass: match every enabled pattern in a graph, plan each match, rewrite the graph.

:func:`apply` works on any ``torch.fx.GraphModule`` whose nodes carry value metadata (Dynamo's
``example_value``, make_fx's ``val``, or ShapeProp's ``tensor_meta``); the backend calls it on
Dynamo's graph before handing the result to Inductor, and :func:`fuser.rewrite` exposes it
for unit tests of pattern rewrites.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from . import planner
from .graph import GraphView, location, val
from .options import Options
from .pattern import Match, MatchContext, Pattern, Rejection
from .static import StaticEvaluator

log = logging.getLogger("fuser")

# Pattern modules, by pattern name. Each defines PATTERN (a fuser.pattern.Pattern).
PATTERN_MODULES = {
    "attention": "fuser.patterns.attention",
    "attention_kl": "fuser.patterns.attention_kl",
}


_broken: dict[str, str] = {}


def load_patterns(options: Options) -> list[Pattern]:
    """The enabled patterns' objects, in a fixed order. A pattern module that fails to import
    is skipped with a warning (once) rather than taking every other pattern down with it."""
    out = []
    for name, module in PATTERN_MODULES.items():
        if name not in options.patterns or name in _broken:
            continue
        try:
            out.append(importlib.import_module(module).PATTERN)
        except Exception as exc:  # pragma: no cover - only a broken installation gets here
            _broken[name] = repr(exc)
            log.warning("fuser: pattern %s is unavailable (%r); it will not be fused", name, exc)
    return out


@dataclasses.dataclass
class PassResult:
    """What one application of the pass did to one graph.

    Attributes:
        matches: every match, fused or left to Inductor by the planner.
        rejected: near-misses, each with its reason.
    """

    matches: list[Match] = dataclasses.field(default_factory=list)
    rejected: list[Rejection] = dataclasses.field(default_factory=list)


def _placeholder_inputs(gm: fx.GraphModule, example_inputs: Optional[Sequence[Any]]) -> dict:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is None:
        return {}
    return {p: x for p, x in zip(phs, example_inputs)}


def _check_region(m: Match, view: GraphView) -> Optional[str]:
    """None if no node of the region but the root is read outside it; else the reason."""
    for n in m.region:
        if n is m.root:
            continue
        outside = [u for u in view.readers(n) if u not in m.region]
        outside += [u for u in n.users if u not in m.region]
        if outside:
            u = outside[0]
            return (
                f"intermediate '{n.name}' is also used by '{u.name}' ({location(u)}); fusing would "
                f"need it materialised"
            )
    return None


def apply(
    gm: fx.GraphModule,
    example_inputs: Optional[Sequence[Any]],
    options: Options,
    *,
    grad_enabled: bool,
    graph_index: int = 0,
) -> PassResult:
    """Match, plan and rewrite ``gm`` in place (then ``gm.recompile()``).

    Args:
        gm: the graph module (Dynamo's, or any FX graph with value metadata).
        example_inputs: values of its placeholders in order (real tensors, SymInts), used to
            evaluate static masks; may be None (static evaluation then sees no buffers).
        options: fuser's options.
        grad_enabled: whether autograd is on (training: save what backward needs).
        graph_index: numbering for reports.

    Returns:
        The :class:`PassResult`.
    """
    result = PassResult()
    if not options.enabled:
        return result
    view = GraphView(gm.graph)
    evaluator = StaticEvaluator(view, _placeholder_inputs(gm, example_inputs), owner=gm)
    ctx = MatchContext(view=view, evaluator=evaluator, options=options, grad_enabled=grad_enabled, graph_index=graph_index)
    taken: set[fx.Node] = set()
    found: list[tuple[Pattern, Match]] = []
    for pattern in load_patterns(options):
        for anchor in list(pattern.anchors(view)):
            if anchor in taken:
                continue
            try:
                r = pattern.match(anchor, ctx)
            except Exception as exc:  # a bug in a pattern must not break the user's model
                log.warning("fuser: %s matcher failed at %s: %r; not fused", pattern.name, location(anchor), exc)
                r = Rejection(pattern.name, f"internal error while matching: {exc!r}", location(anchor), anchor.name)
            if r is None:
                continue
            r.graph_index = graph_index
            if isinstance(r, Rejection):
                result.rejected.append(r)
                log.info("fuser: not fused: %s at %s: %s", r.pattern, r.location, r.reason)
                continue
            why = _check_region(r, view)
            if why is None and r.region & taken:
                why = "overlaps another match"
            if why is not None:
                result.rejected.append(Rejection(pattern.name, why, r.location, r.root.name, graph_index))
                log.info("fuser: not fused: %s at %s: %s", pattern.name, r.location, why)
                continue
            taken |= r.region
            found.append((pattern, r))

    for pattern, m in found:
        cands = pattern.candidates(m, ctx)
        plan, reason = planner.choose(m, cands, options)  # a bad forced plan is the user's error
        m.plan, m.alternatives, m.reason = plan, cands, reason
        if plan.params.get("impl") == "inductor":
            result.matches.append(m)
            log.info("fuser: %s at %s left to Inductor: %s", m.pattern, m.location, reason)
            continue
        before = set(gm.graph.nodes)
        try:
            m.kernels = pattern.kernels(m, plan)
            new = pattern.emit(m, plan, gm.graph)
            _replace(m, new, gm.graph)
        except Exception as exc:  # a bug in a pattern must not break the user's model
            _undo(gm.graph, before)
            log.warning("fuser: %s at %s: emitting plan %s failed: %r; not fused", m.pattern, m.location, plan.name, exc)
            result.rejected.append(Rejection(m.pattern, f"internal error while rewriting: {exc!r}", m.location,
                                             m.root.name, graph_index))
            continue
        result.matches.append(m)
        log.info("fuser: fused %s at %s with plan %s (%s)", m.pattern, m.location, plan.name, reason)
        for k in m.kernels:
            log.info("fuser:   kernel %s: %s", k.name, k.path)
    if result.matches:
        gm.graph.lint()
        gm.recompile()
    return result


def _replace(m: Match, new: fx.Node, graph: fx.Graph) -> None:
    """Route the root's users to ``new`` and erase the region. Checks first that nothing
    outside the region reads a region node, so a failure leaves the region in place."""
    for n in m.region:
        if n is not m.root and any(u not in m.region for u in n.users):
            raise RuntimeError(f"{n.name} is read outside the matched region")
    new.meta.setdefault("stack_trace", m.root.meta.get("stack_trace"))
    m.root.replace_all_uses_with(new)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(m.region, key=lambda x: -order[x]):
        graph.erase_node(n)


def _undo(graph: fx.Graph, before: set) -> None:
    """Erase the nodes inserted since ``before`` (a failed emit), users first."""
    added = [n for n in graph.nodes if n not in before]
    for n in reversed(added):
        for u in list(n.users):
            if u in before:  # the root's users were already rerouted: impossible before _replace
                raise RuntimeError("fuser internal error: cannot undo a partial rewrite")
        graph.erase_node(n)


def annotate(node: fx.Node) -> fx.Node:
    """Set ``node.meta['example_value']`` (and ``val``) by running its target on the fake
    values of its inputs, so later passes see shapes of inserted nodes."""
    from torch._guards import detect_fake_mode

    args = fx.node.map_arg(node.args, val)
    kwargs = fx.node.map_arg(node.kwargs, val)
    fake_mode = detect_fake_mode(tuple(_tensors_in((args, kwargs))))
    if node.op == "call_function":
        fn = node.target
        call = lambda: fn(*args, **kwargs)  # noqa: E731
    elif node.op == "call_method":
        call = lambda: getattr(args[0], node.target)(*args[1:], **kwargs)  # noqa: E731
    else:
        return node
    try:
        if fake_mode is not None:
            with fake_mode:
                out = call()
        else:
            with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
                out = call()
    except Exception as exc:  # metadata is a courtesy to later passes, never a failure
        log.debug("fuser: could not annotate %s: %r", node.name, exc)
        return node
    node.meta["example_value"] = out
    node.meta["val"] = out
    return node


def _tensors_in(x: Any) -> list:
    out: list = []
    fx.node.map_aggregate(x, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out
