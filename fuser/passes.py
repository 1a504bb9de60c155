"""The pass: match every enabled pattern in a graph, plan each match, rewrite the graph.

:func:`apply` works on any ``torch.fx.GraphModule`` whose nodes carry value metadata (Dynamo's
``example_value``, make_fx's ``val``, or ShapeProp's ``tensor_meta``); the backend calls it on
Dynamo's graph before handing the result to Inductor, and :func:`fuser.rewrite` exposes it
for unit tests of pattern rewrites.

Each application is timed by phase (:class:`fuser.report.CompileTimes`, on
``PassResult.times``): the backend logs it and ``explain()`` reports it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import distributed, planner, registry
from .cuts import Cuts, current as current_cuts
from . import copies  # noqa: F401  (registers torch.ops.fuser.saved_copy)
from .codegen import render
from .graph import GraphView, annotate, flat_args, location, ndim, val, written_args
from .options import Options
from .pattern import Match, MatchContext, Pattern, Rejection, match_device
from .report import CompileTimes, PhaseTimer
from .static import StaticEvaluator

log = logging.getLogger("fuser")

def load_patterns(options: Options) -> list[Pattern]:
    """The enabled patterns' objects, in matching order (see :mod:`fuser.registry`). A pattern
    module that fails to import is skipped with a warning (once) rather than taking every other
    pattern down with it."""
    return registry.enabled(options.patterns)


@dataclasses.dataclass
class PassResult:
    """What one application of the pass did to one graph.

    Attributes:
        matches: every match, fused or left to Inductor by the planner.
        rejected: near-misses, each with its reason.
        times: where the pass's time went (:class:`fuser.report.CompileTimes`); the backend
            adds Inductor's compile time to it.
    """

    matches: list[Match] = dataclasses.field(default_factory=list)
    rejected: list[Rejection] = dataclasses.field(default_factory=list)
    times: Optional[CompileTimes] = None


def _placeholder_inputs(gm: fx.GraphModule, example_inputs: Optional[Sequence[Any]]) -> dict:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is None:
        return {}
    return {p: x for p, x in zip(phs, example_inputs)}


# Readers that use only a tensor's metadata, never its values: the *_like factories (shape,
# dtype, device; strides too under their default preserve_format), new_* (dtype, device),
# size/dim/numel (shape). One of them may read a region node that is no output: the pass
# re-points it to a proxy with the same metadata built outside the region (_proxy_readers),
# so that the region's value is never needed.
_aten = torch.ops.aten
_LIKE = {torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like,
         _aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default}
_NEW_METHODS = {"new_ones", "new_zeros", "new_empty", "new_full"}
_NEW_FNS = {_aten.new_ones.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.new_full.default}
_SHAPE_METHODS = {"size", "dim", "numel", "nelement", "ndimension"}
_SHAPE_FNS = {_aten.sym_size.int, _aten.sym_numel.default, _aten.dim.default, torch.numel}
# what each kind of reader needs of the proxy, in increasing order
_NEEDS = ("dtype", "shape", "strides")


def _metadata_need(u: fx.Node, n: fx.Node) -> Optional[str]:
    """What ``u`` reads of ``n`` when it reads only ``n``'s metadata (``"dtype"``: dtype and
    device; ``"shape"``: and the sizes; ``"strides"``: and the strides), ``n`` being its
    first operand and no other; else None (``u`` may read ``n``'s values)."""
    if not u.args or u.args[0] is not n or sum(a is n for a in flat_args(u)) != 1:
        return None
    fn, meth = u.op == "call_function", u.op == "call_method"
    if (fn and u.target in _NEW_FNS) or (meth and u.target in _NEW_METHODS):
        return "dtype"
    if (fn and u.target in _SHAPE_FNS) or (meth and u.target in _SHAPE_METHODS):
        return "shape"
    if fn and u.target in _LIKE:
        return "shape" if u.kwargs.get("memory_format") is torch.contiguous_format else "strides"
    return None


def _metadata_readers(m: Match, view: GraphView) -> tuple[dict, Optional[str]]:
    """``({region node: (readers outside the region, what they need)}, reason)``: the nodes of
    ``m``'s region, other than its outputs, read outside it by metadata readers only (see
    :func:`_metadata_need`); the reason names the first node read outside for its values."""
    outputs = set(m.outputs.values())
    found: dict = {}
    for n in m.region:
        if n in outputs:
            continue
        outside = list(dict.fromkeys([u for u in view.readers(n) if u not in m.region]
                                     + [u for u in n.users if u not in m.region]))
        if not outside:
            continue
        needs = [_metadata_need(u, n) for u in outside]
        if None in needs:
            u = outside[needs.index(None)]
            return found, (f"intermediate '{n.name}' is also used by '{u.name}' ({location(u)}); fusing would "
                           f"need it materialised")
        found[n] = (outside, max(needs, key=_NEEDS.index))
    return found, None


def _contiguous(t: torch.Tensor) -> bool:
    """``t``'s strides are the contiguous ones for its sizes, provably for every size (no guard)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not _same_size(size, 1) and not _same_size(stride, expected):
            return False
        expected = expected * size
    return True


def _size_sources(graph: fx.Graph, before: fx.Node, avoid: set) -> dict:
    """Size expression -> ``(node, dim)`` (``dim`` None for a SymInt node): where the graph
    holds each symbolic size before ``before``, outside ``avoid``; placeholders first."""
    found: dict = {}
    nodes = []
    for x in graph.nodes:
        if x is before:
            break
        if x not in avoid:
            nodes.append(x)
    for x in sorted(nodes, key=lambda x: x.op != "placeholder"):
        v = val(x)
        if isinstance(v, torch.SymInt):
            found.setdefault(v.node.expr, (x, None))
        elif isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt):
                    found.setdefault(size.node.expr, (x, d))
    return found


def _size_terms(size: Any, sources: dict) -> Optional[list]:
    """``size`` as ``[(coefficient, source key or None for a constant)]``: an int, a symbolic
    size the graph holds (``sources``), or a sum of integer multiples of such sizes; None when
    it is neither."""
    import sympy

    if isinstance(size, int):
        return [(size, None)]
    expr = size.node.expr
    if expr.is_number:
        return [(int(expr), None)]
    if expr in sources:
        return [(1, expr)]
    out = []
    for term in sympy.Add.make_args(sympy.expand(expr)):
        c, r = term.as_coeff_Mul()
        if not c.is_Integer or not (r == 1 or r in sources):
            return None
        out.append((int(c), None if r == 1 else r))
    return out


def _opaque_launch(nodes) -> str:
    """Why the fused ops among ``nodes`` (just emitted) will launch their kernels from Python on
    every call instead of from Inductor's generated wrapper: ``codegen.launch.stays_opaque`` on the
    values the nodes carry (``"symbolic sizes"``, ``"opaque ops"``), or ``""``. CPU tensors
    (``"device"``: the interpreter runs every kernel) count as ``""``: explain() says so already.
    On symbolic sizes an op's rule may add the guard its trace would add anyway (``launch.at_most``)."""
    from .codegen import launch

    for n in nodes:
        if n.op != "call_function" or not launch.is_fused_op(n.target):
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        try:
            why = launch.stays_opaque(args, kwargs, n.target)
        except Exception as exc:  # noqa: BLE001 - a report line must never decline the match
            log.debug("fuser: could not tell how %s will be launched: %r", n.target, exc)
            return ""
        if why and why != "device":
            return why
    return ""


def _emit_size(terms: list, sources: dict, graph: fx.Graph) -> Any:
    """Graph nodes (or an int) computing the sum :func:`_size_terms` gave."""
    total: Any = 0
    for c, key in terms:
        if key is None:
            part: Any = c
        else:
            node, dim = sources[key]
            part = node if dim is None else annotate(graph.call_method("size", (node, dim)))
            if c != 1:
                part = annotate(graph.call_function(operator.mul, (part, c)))
        if isinstance(total, int) and total == 0:
            total = part
        else:
            total = annotate(graph.call_function(operator.add, (total, part)))
    return total


def _proxy_readers(m: Match, view: GraphView, graph: fx.Graph, avoid: set, dry_run: bool = False,
                   readers: Optional[dict] = None) -> Optional[str]:
    """Re-point every metadata reader of a region node that is no output (``ones_like(s)``,
    ``s.new_zeros(n)``, ``s.size(-1)``: :func:`_metadata_readers`) to a proxy built outside the
    region with the same metadata — ``src.new_empty(sizes, dtype=, device=)`` (contiguous; its
    sizes read off nodes outside ``avoid``, every region to be erased, that precede the
    reader), 0 elements where the readers need dtype and device only — so that the region's
    value is never needed. The proxy's values are never read: the readers read none. With
    ``dry_run`` only checks; ``readers``: :func:`_metadata_readers`'s, when known. Returns None,
    or the reason it cannot be done: a size no node outside the regions holds, or strides a
    contiguous proxy would not have (a ``*_like`` keeps the strides of a non-contiguous node)."""
    if readers is None:
        readers, why = _metadata_readers(m, view)
        if why is not None:
            return why
    if not readers:
        return None
    position = {x: i for i, x in enumerate(graph.nodes)}
    for n, (users, need) in readers.items():
        v = val(n)
        users = sorted((u for u in users if u in position), key=position.__getitem__)
        if not users:
            continue
        first = users[0]
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
            return f"intermediate '{n.name}' is read for its metadata by '{first.name}' but is no strided tensor"
        if need == "strides" and not _contiguous(v):
            return (f"intermediate '{n.name}' is read by '{first.name}' ({location(first)}), which keeps its "
                    "strides, and is not contiguous; fusing would need it materialised")
        sources = _size_sources(graph, first, avoid)
        terms = [[(0, None)]] if need == "dtype" else [_size_terms(sz, sources) for sz in v.shape]
        if None in terms:
            return (f"intermediate '{n.name}' is read for its shape by '{first.name}' ({location(first)}), and no "
                    f"node outside the region holds its size {v.shape[terms.index(None)]}")
        src = next((x for x in graph.nodes if x.op == "placeholder" and isinstance(val(x), torch.Tensor)), None) \
            or next((x for x in graph.nodes if position[x] < position[first] and x not in avoid
                     and isinstance(val(x), torch.Tensor)), None)
        if src is None:
            return f"intermediate '{n.name}' is read for its metadata by '{first.name}' and no tensor precedes it"
        if dry_run:
            continue
        with graph.inserting_before(first):
            sizes = [_emit_size(t, sources, graph) for t in terms]
            proxy = annotate(graph.call_method("new_empty", (src, sizes), {"dtype": v.dtype, "device": v.device}))
        if need != "dtype" and not isinstance(val(proxy), torch.Tensor):
            proxy.meta["val"] = proxy.meta["example_value"] = v
        proxy.meta.setdefault("stack_trace", first.meta.get("stack_trace"))
        for u in users:
            u.replace_input_with(n, proxy)
        log.info("fuser: %s read only the metadata of '%s' (in a %s region): re-pointed to '%s'",
                 ", ".join(f"'{u.name}'" for u in users), n.name, m.pattern, proxy.name)
    return None


def _check_region(m: Match, view: GraphView, memo: Optional[dict] = None) -> Optional[str]:
    """None if no node of the region but its outputs is read outside it — except by readers
    of its metadata alone, which :func:`_proxy_readers` can re-point (kept in ``memo`` under
    ``id(m)``) — and the region writes no memory that outlives it; else the reason."""
    outputs = set(m.outputs.values())
    if not outputs <= m.region:
        return "internal error while matching: the match names outputs outside its region"
    end = max(view.order[n] for n in m.region)
    # memory the region allocates (o = torch.zeros_like(v) before a loop that fills it): what
    # aliases it after the region reads the region's output, which the replacement provides
    fresh = {view.alias_key(n) for n in m.region if view.op(n) == "alloc" and n in outputs}
    for n in m.region:
        for target in written_args(n):
            key = view.alias_key(target)
            outside = [u for u in view.aliases(key) if u not in m.region
                       and not (key in fresh and view.order[u] > end)]
            if target not in m.region or outside:
                return (
                    f"'{n.name}' ({location(n)}) writes '{target.name}' in place, and that memory is "
                    "also seen outside the region; the fused op would not write it"
                )
    readers, why = _metadata_readers(m, view)
    if why is None and memo is not None:
        memo[id(m)] = readers
    return why or _proxy_readers(m, view, view.graph, set(m.region), dry_run=True, readers=readers)


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
        The :class:`PassResult`, with the time of each phase in ``times``.
    """
    timer = PhaseTimer()
    patterns = load_patterns(options) if options.enabled else []
    t0 = time.perf_counter()
    with render.timing(timer.phase):
        result = _apply(gm, example_inputs, options, grad_enabled, graph_index, patterns, timer, cuts=current_cuts())
    wall_ms = (time.perf_counter() - t0) * 1e3
    ms = timer.ms
    order = (["canonicalise", "static masks"] + [f"match[{p.name}]" for p in patterns]
             + ["regions", "plan", "render", "import kernels", "emit", "recompile"])
    phases = {name: ms.pop(name, 0.0) for name in order} if options.enabled else {}
    phases.update(ms)  # none expected: every phase is named above
    if options.enabled:
        phases["other"] = max(0.0, wall_ms - sum(phases.values()))
    result.times = CompileTimes(phases=phases, graph_index=graph_index)
    return result


def _device_decline(m: Match, options: Options) -> Optional[str]:
    """Why a match cannot be fused on its tensors' device, or None: fuser's kernels run on CUDA
    tensors, and on CPU tensors only in Triton's interpreter, which ``fuser.interpret`` asks for
    (``"auto"``: when ``TRITON_INTERPRET=1`` is set). Checked here, once for every pattern, so a
    pattern cannot forget it: a CPU region fused without being asked for would run its kernels
    in the interpreter, seconds a call where Inductor takes milliseconds. A match whose device is
    unknown (no value metadata) is not declined here."""
    dev = match_device(m)
    if dev is None or dev.type == "cuda":
        return None
    if dev.type == "cpu":
        return None if options.interpret_cpu else options.cpu_decline
    return f"tensors are on {dev.type}: fuser's kernels run on CUDA tensors (and on the CPU in Triton's interpreter)"


def _weak_method(obj: Any, name: str) -> Callable:
    """``obj.name`` as a function that holds ``obj`` weakly: stored back on ``obj`` (timed), a
    bound method would make ``obj`` a reference cycle, freed only by a later collection (see
    :meth:`fuser.static.StaticEvaluator.slice` for why a compile leaves no garbage behind)."""
    fn, ref = getattr(type(obj), name), weakref.ref(obj)
    return functools.wraps(fn)(lambda *args, **kwargs: fn(ref(), *args, **kwargs))


def _apply(gm: fx.GraphModule, example_inputs: Optional[Sequence[Any]], options: Options, grad_enabled: bool,
           graph_index: int, patterns: list[Pattern], timer: PhaseTimer, *, inputs: Optional[dict] = None,
           match_only: Optional[str] = None, cuts: Optional[Cuts] = None) -> PassResult:
    """:func:`apply`'s work, each phase timed by ``timer`` (wrapped callables: the pass's
    steps are as they would be untimed); then the same in the bodies of the higher-order ops
    the graph calls (:func:`_apply_bodies`). ``inputs`` (placeholder -> example value) stands
    for ``example_inputs`` when given; with ``match_only`` (a reason) the pass matches without
    rewriting anything and returns every match as a near-miss with that reason, and nothing
    else (in a body the pass does not enter)."""
    result = PassResult()
    if not options.enabled:
        return result
    view = timer.wrap("canonicalise", GraphView)(gm.graph, grad_enabled=grad_enabled)
    view._canonicalize = timer.wrap("canonicalise", view._canonicalize)  # each node's first canon()
    if inputs is None:
        inputs = _placeholder_inputs(gm, example_inputs)
    evaluator = StaticEvaluator(view, inputs, owner=gm)
    for name in ("slice", "evaluate", "max_numel", "constant"):
        setattr(evaluator, name, timer.wrap("static masks", _weak_method(evaluator, name)))
    check_region, place = timer.wrap("regions", _check_region), timer.wrap("regions", _place)
    remap, stale_placement = timer.wrap("regions", _remap), timer.wrap("regions", _stale_placement)
    choose = timer.wrap("plan", planner.choose)
    ctx = MatchContext(view=view, evaluator=evaluator, options=options, grad_enabled=grad_enabled, graph_index=graph_index,
                       cuts=cuts)
    taken: set[fx.Node] = set()
    matched: dict[str, str] = {}  # node name -> the pattern whose match (fused or not) holds it
    found: list[tuple[Pattern, Match]] = []
    metadata_readers: dict = {}  # id(match) -> its region's metadata readers (_check_region)

    def decline(m: Match, why: str) -> None:
        result.rejected.append(Rejection(m.pattern, why, m.location, m.root.name, graph_index))
        log.info("fuser: not fused: %s at %s: %s", m.pattern, m.location, why)

    for pattern in patterns:
        phase = f"match[{pattern.name}]"
        anchors = timer.wrap(phase, lambda v: list(pattern.anchors(v)))(view)
        match = timer.wrap(phase, pattern.match)
        for anchor in anchors:
            if anchor in taken:
                continue
            try:
                r = match(anchor, ctx)
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
            for n in r.region:
                matched.setdefault(n.name, r.pattern)
            why = (_device_decline(r, options) or check_region(r, view, metadata_readers)
                   or distributed.sharding_decline(r, view))
            if why is None and r.region & taken:
                why = "overlaps another match"
            why = why or place(r, view)
            if why is not None:
                decline(r, why)
                continue
            taken |= r.region
            found.append((pattern, r))
    # a pattern that declined an anchor another pattern then matched (attention declines a
    # softmax whose probabilities also feed a column sum; a later pattern takes the region):
    # the report shows the match, or the pass's reason for declining it, not the stale near-miss
    taken_names = {n.name for n in taken}

    def superseded(r: Rejection) -> bool:
        return r.node in taken_names or matched.get(r.node, r.pattern) != r.pattern

    for r in filter(superseded, result.rejected):
        log.debug("fuser: near-miss of %s at %s superseded by a match of the same region", r.pattern, r.location)
    result.rejected = [r for r in result.rejected if not superseded(r)]
    if match_only is not None:
        # a body the pass does not enter: only what it would have fused there is worth saying
        result.rejected = [Rejection(p.name, match_only, m.location, m.root.name, graph_index) for p, m in found]
        _apply_bodies(gm, view, inputs, options, graph_index, patterns, timer, result, match_only=match_only)
        return result
    bodies = _hop_bodies(gm, view)  # before the rewrite: the call sites' grad modes are in the view

    replaced: dict = {}  # an output of an emitted match -> its replacement
    erased: set = set()  # the regions of emitted matches
    regions = set().union(*(r.region for _, r in found))  # every region that may be erased
    for pattern, m in found:
        if replaced:
            # a match that reads an earlier match's output (one loop's o feeding the next) was
            # found on the graph before that output was replaced: read the replacement, which
            # must come before this match's insertion point
            remap(m, replaced)
            why = stale_placement(m, gm.graph, set(replaced.values()), erased)
            if why:
                decline(m, why)
                continue
        # planned on each rank's shapes (DTensors seen as their local shards; a plain graph: as is)
        with distributed.planning_view():
            cands = timer.wrap("plan", pattern.candidates)(m, ctx)
            plan, reason = choose(m, cands, options, pattern)  # a bad forced plan is the user's error
        m.plan, m.alternatives, m.reason = plan, cands, reason
        m.sharding = distributed.planning_note(m)
        if plan.params.get("impl") == "inductor" or plan.params.get("keep"):
            result.matches.append(m)
            log.info("fuser: %s at %s left as written (%s): %s", m.pattern, m.location, plan.name, reason)
            continue
        # readers of a region node's metadata alone (kvpress' ones_like(attn_weights)) read a
        # proxy built outside every region from now on: the same values, whether or not the
        # emission below succeeds
        try:
            why = _proxy_readers(m, view, gm.graph, regions, readers=metadata_readers.get(id(m)))
        except Exception as exc:  # noqa: BLE001 - a bug here must not break the user's model
            why = f"internal error while re-pointing metadata readers: {exc!r}"
        if why:
            decline(m, why)
            continue
        before = set(gm.graph.nodes)
        try:
            with distributed.planning_view():
                m.kernels = timer.wrap("render", pattern.kernels)(m, plan)  # for the shapes they run on
            with timer.phase("emit"):
                new = _as_outputs(m, pattern.emit(m, plan, gm.graph))
                for name, node in new.items():
                    mismatch = _mismatch(node, m.outputs[name])
                    if mismatch:
                        raise RuntimeError(f"the replacement of output '{name}' {mismatch}")
                # the region's own ops ran on each rank's shards without communication
                # (sharding_decline); a fused op whose sharding rule keeps fewer dims sharded
                # would make DTensor gather its inputs: more memory and traffic than the program
                gathers = distributed.communication([n for n in gm.graph.nodes if n not in before]) \
                    if m.sharding else None
                if gathers:
                    _undo(gm.graph, before)
                    decline(m, distributed.gather_reason(gathers))
                    continue
                new = _protect_saved(m, new, view, gm.graph, before)
                _replace(m, new, gm.graph)
                m.launch = _opaque_launch([n for n in gm.graph.nodes if n not in before])
            replaced.update({m.outputs[name]: node for name, node in new.items()})
            erased |= m.region
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
    guarded = timer.wrap("emit", _guard_softmax_axis)(gm.graph, view)
    guarded |= timer.wrap("emit", _guard_normalisation_axis)(gm.graph, view)
    for r in result.rejected:
        if r.node in guarded:
            r.reason += (" (rewritten as a softmax over the last dim of the transposed scores, so that "
                         "Inductor's attention rewrite, which ignores the axis, does not take it)")
    if result.matches or guarded:
        with timer.phase("recompile"):
            gm.graph.lint()
            gm.recompile()
    _apply_bodies(gm, view, inputs, options, graph_index, patterns, timer, result, bodies=bodies)
    return result


# ---------------------------------------------------------------------------------------------
# Bodies of higher-order ops. Dynamo puts some of the user's code into a subgraph that a
# higher-order op (HOP) of the graph calls: ``torch.utils.checkpoint(fn, ..., use_reentrant=False)``
# becomes ``tag_activation_checkpoint(body, *operands)`` and a ``torch.compiler.nested_compile_region``
# function ``invoke_subgraph(body, identifier, *operands)``, the body a ``get_attr`` GraphModule.
# The pass runs on such a body as on the graph itself: a match lives wholly inside one graph, so
# its escape analysis is the same, the body's outputs being what the HOP's caller reads.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BodyCall:
    """How a higher-order op the pass enters calls its body.

    Attributes:
        first: index, in the op's ``args``, of the first operand bound to the body's
            placeholders (the body itself is ``args[0]``).
        what: how reports name code inside it.
    """

    first: int
    what: str


#: Higher-order ops (by their ``name()``) whose body the pass enters. Each runs its body
#: (``args[0]``, a GraphModule) as a plain function of its operands (``args[first:]``), under
#: the caller's grad mode, and returns the body's outputs; AOTAutograd then traces the body as
#: it stands, and ``tag_activation_checkpoint`` tags every op in it, a fused op too, to be
#: recomputed in the backward or saved as the checkpoint's policy says. Replacing a region of
#: such a body by an op that computes the same values is as exact as in the graph itself.
#: Every other higher-order op (``cond``, ``while_loop``, ``map``, ``flex_attention``,
#: ``autograd_function_apply``, ...) is left as it is: its bodies are only matched, so that
#: ``explain()`` names what would have been fused there.
ENTERED_HOPS = {
    "tag_activation_checkpoint": BodyCall(1, "torch.utils.checkpoint"),
    "invoke_subgraph": BodyCall(2, "torch.compiler.nested_compile_region"),
    "wrap": BodyCall(1, "torch._higher_order_ops.wrap"),
}


@dataclasses.dataclass
class _Body:
    """A GraphModule that higher-order ops of a graph call (``uses``: ``(HOP node, the get_attr
    node naming the body)``)."""

    module: fx.GraphModule
    attr: str
    uses: list = dataclasses.field(default_factory=list)


def _hop_name(target: Any) -> str:
    name = getattr(target, "_name", None)
    if not isinstance(name, str):
        name = target.name() if callable(getattr(target, "name", None)) else str(target)
    return name


def _hop_bodies(gm: fx.GraphModule, view: GraphView) -> list[_Body]:
    """The GraphModules that the higher-order ops of ``gm`` take as operands, each once (an
    ``invoke_subgraph`` body may be called from several places), in graph order."""
    from torch._ops import HigherOrderOperator

    found: dict[int, _Body] = {}
    for n in view.nodes:
        if n.op != "call_function" or not isinstance(n.target, HigherOrderOperator):
            continue
        for a in flat_args(n):
            if not (isinstance(a, fx.Node) and a.op == "get_attr"):
                continue
            sub: Any = gm
            for part in str(a.target).split("."):
                sub = getattr(sub, part, None)
            if isinstance(sub, fx.GraphModule):
                found.setdefault(id(sub), _Body(sub, str(a.target))).uses.append((n, a))
    return list(found.values())


def _body_operands(body: _Body) -> tuple[Optional[BodyCall], Optional[list], str]:
    """``(how the body is called, per call the operands bound to its placeholders, "")`` when
    the pass may enter ``body``, else ``(None, None, why not)``."""
    names = {_hop_name(n.target) for n, _ in body.uses}
    hops = ", ".join(f"torch.ops.higher_order.{x}" for x in sorted(names))
    if len(names) != 1 or next(iter(names)) not in ENTERED_HOPS:
        return None, None, (f"it lies inside the body '{body.attr}' of {hops}, which fuser does not enter (it cannot "
                            "tell how that operator runs its body); left as written")
    call = ENTERED_HOPS[next(iter(names))]
    phs = [p for p in body.module.graph.nodes if p.op == "placeholder"]
    per_call = []
    for n, attr in body.uses:
        if not n.args or n.args[0] is not attr or attr in n.args[call.first:] or attr in n.kwargs.values():
            return None, None, (f"it lies inside the body '{body.attr}' of {hops}, which is passed to it other than as "
                                "the body it runs; left as written")
        ops = list(n.args[call.first:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)) and len(phs) != 1:
            ops = list(ops[0])  # torch versions that pass the operands as one tuple
        if len(ops) != len(phs):
            return None, None, (f"it lies inside the body '{body.attr}' of {hops}, whose {len(ops)} operands do not "
                                f"line up with the body's {len(phs)} inputs; left as written")
        per_call.append(ops)
    return call, per_call, ""


def _body_inputs(body: _Body, per_call: list, inputs: dict) -> dict:
    """Placeholder of the body -> example value, for each placeholder that every call binds to
    the same value of the caller: the caller's example value of it. A placeholder bound to a
    placeholder of the caller takes the caller's Dynamo source too (on ``meta["fuser_source"]``),
    so that a registered buffer passed into the body is still known as one (static masks)."""
    from .names import _source_of

    out: dict = {}
    phs = [p for p in body.module.graph.nodes if p.op == "placeholder"]
    for i, ph in enumerate(phs):
        bound = [ops[i] for ops in per_call]
        x = bound[0]
        if any(b is not x for b in bound[1:]):
            continue
        if not isinstance(x, fx.Node):
            out[ph] = x
            continue
        if x in inputs:
            out[ph] = inputs[x]
        source = _source_of(x) if x.op == "placeholder" else None
        if source is not None and _source_of(ph) is None:
            ph.meta["fuser_source"] = source
    return out


def _apply_bodies(gm: fx.GraphModule, view: GraphView, inputs: dict, options: Options, graph_index: int,
                  patterns: list[Pattern], timer: PhaseTimer, result: PassResult, *,
                  bodies: Optional[list] = None, match_only: Optional[str] = None) -> None:
    """Apply the pass to the bodies of the higher-order ops ``gm`` calls (``bodies``: from
    :func:`_hop_bodies`, taken before ``gm`` was rewritten; ``view`` is ``gm``'s view from
    then). A body of an op in :data:`ENTERED_HOPS` is matched and rewritten in place, in the
    grad mode of its callers (on if any caller records gradients), with the callers' example
    values where every call passes the same; any other body, and every body under
    ``match_only``, is only matched: what would have been fused there is reported as not
    fused, with the reason. Adds the bodies' matches and near-misses to ``result``, their
    locations saying which body they lie in."""
    if bodies is None:
        bodies = _hop_bodies(gm, view)
    for body in bodies:
        call, per_call, why = _body_operands(body)
        if match_only is not None:
            why = match_only
        grad = any(view.grad_enabled.get(n, True) for n, _ in body.uses)
        sub_inputs = _body_inputs(body, per_call, inputs) if call is not None else {}
        sub = _apply(body.module, None, options, grad, graph_index, patterns, timer, inputs=sub_inputs,
                     match_only=why or None)
        where = f" (inside {call.what}, '{body.attr}')" if call is not None else f" (inside '{body.attr}')"
        for item in list(sub.matches) + list(sub.rejected):
            if not item.location.endswith(")") or "(inside " not in item.location:
                item.location += where
        result.matches += sub.matches
        result.rejected += sub.rejected
        log.info("fuser: %s body '%s': %d fused, %d not fused", "entered" if not why else "matched (not entered)",
                 body.attr, sum(m.fused for m in sub.matches), len(sub.rejected))


def _remap(m: Match, mapping: dict) -> None:
    """Replace, in ``m``'s bindings and inputs, every node of ``mapping`` (an output of a match
    emitted before ``m``) by its replacement (in dicts, lists and tuples)."""

    def sub(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return mapping.get(x, x)
        if isinstance(x, dict):
            return {k: sub(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(sub(e) for e in x)
        return x

    m.bindings = sub(m.bindings)
    m.inputs = sub(m.inputs)


def _stale_placement(m: Match, graph: fx.Graph, replacements: set, erased: set) -> Optional[str]:
    """Why ``m`` cannot be emitted after earlier rewrites (its insertion point in an ``erased``
    region, or an input that is an earlier replacement defined after that point), or None."""
    at = m.insertion_point
    if at in erased:
        return "its insertion point was part of an earlier fused region"
    late = [x for x in m.inputs if isinstance(x, fx.Node) and x in replacements]
    if not late:
        return None
    position = {n: i for i, n in enumerate(graph.nodes)}  # only when a replacement is read
    for x in late:
        if position.get(x, len(position)) >= position[at]:
            return (f"it reads '{x.name}', the output of an earlier fused region, which is only computed after "
                    "the point where this region's replacement must go")
    return None


def _guard_softmax_axis(graph: fx.Graph, view: GraphView) -> set:
    """Rewrite ``softmax(x, d)`` over a dim other than the last, when it feeds a matmul, as
    ``softmax(x.transpose(d, -1), -1).transpose(d, -1)`` — the same values. Inductor's own
    attention rewrite (``fuse_attention``, torch 2.11 and 2.13) matches matmul -> softmax ->
    matmul without checking the softmax's axis and computes it over the last one (an open
    PyTorch bug: wrong results); the transposes keep that rewrite away. Returns the names of
    rewritten nodes."""
    done = set()
    for n in list(graph.nodes):
        if n not in view.order:
            continue
        c = view.canon(n)
        if c is None or c.op not in ("softmax", "log_softmax") or n.op not in ("call_function", "call_method"):
            continue
        rank = len(val(n).shape) if isinstance(val(n), torch.Tensor) else None
        if rank is None or rank < 2 or c.attrs["dim"] in (rank - 1, -1):
            continue
        if not any(view.op(u) == "matmul" for u in _through_casts(n, view)):
            continue
        fn = torch.softmax if c.op == "softmax" else torch.log_softmax
        kwargs = {"dtype": c.attrs["dtype"]} if c.attrs.get("dtype") is not None else {}
        _over_last_dim(graph, n, c.args[0], c.attrs["dim"], fn, kwargs)
        done.add(n.name)
    return done


def _over_last_dim(graph: fx.Graph, n: fx.Node, x: fx.Node, d: int, fn, kwargs: dict) -> None:
    """Replace ``n`` (``fn`` of ``x`` over dim ``d``) by ``fn(x.transpose(d, -1), -1, **kwargs)
    .transpose(d, -1)``: the same values, with the op over the last dim."""
    with graph.inserting_before(n):
        t = annotate(graph.call_method("transpose", (x, d, -1)))
        out = annotate(graph.call_function(fn, (t, -1), kwargs))
        back = annotate(graph.call_method("transpose", (out, d, -1)))
    back.meta.setdefault("stack_trace", n.meta.get("stack_trace"))
    n.replace_all_uses_with(back)
    graph.erase_node(n)


def _guard_normalisation_axis(graph: fx.Graph, view: GraphView) -> set:
    """The same guard for a softmax written by hand (``e = exp(x - x.amax(d, keepdim=True)); e /
    e.sum(d', keepdim=True)``): Inductor's attention rewrite matches its decomposed form without
    checking the axes either (measured with torch 2.13: ``e / e.sum(-2)`` before a matmul computed
    over the last dim, 40% off), so a ``sum`` of an ``exp``, or an ``amax`` subtracted before an
    ``exp``, over one dim other than the last (``keepdim=True``) is rewritten as the same reduction
    of the transposed tensor over its last dim, transposed back — the same values. Returns the
    names of rewritten nodes."""
    done = set()
    for n in list(graph.nodes):
        if n not in view.order or n.op not in ("call_function", "call_method"):
            continue
        c = view.canon(n)
        if c is None or c.op not in ("sum", "amax") or c.node is not n or not c.attrs.get("keepdim"):
            continue
        dims, rank = c.attrs.get("dim"), ndim(n)
        if not dims or len(dims) != 1 or rank is None or rank < 2 or dims[0] in (rank - 1, -1):
            continue
        x = c.args[0]
        if c.op == "sum":
            if c.attrs.get("dtype") is not None or not isinstance(x, fx.Node) or view.op(x) != "exp":
                continue
        elif not any(view.op(u) == "sub" and any(view.op(w) == "exp" for w in u.users) for u in n.users):
            continue
        _over_last_dim(graph, n, x, dims[0], torch.sum if c.op == "sum" else torch.amax, {"keepdim": True})
        done.add(n.name)
    return done


def _through_casts(n: fx.Node, view: GraphView) -> list:
    """The readers of ``n``, looking through casts, contiguous and dropout."""
    out, stack = [], list(n.users)
    while stack:
        u = stack.pop()
        if view.op(u) in ("cast", "identity", "dropout"):
            stack.extend(u.users)
        else:
            out.append(u)
    return out


def _inputs(m: Match, view: GraphView) -> list[fx.Node]:
    """The nodes outside the region the replacement reads: what the pattern declared, and
    every operand a region node reads from outside the region."""
    out = dict.fromkeys(x for x in m.inputs if isinstance(x, fx.Node))
    for n in m.region:
        for a in flat_args(n):
            if isinstance(a, fx.Node) and a not in m.region:
                out.setdefault(view.operand(a, n))
    return [x for x in out if x.op != "output"]


def _place(m: Match, view: GraphView) -> Optional[str]:
    """Choose where the replacement goes (``m.insert_before``) so that it reads every input
    as the user's program did: no in-place write to an input's memory may fall between the
    program's read of it (by the region, or by the nodes that feed the region) and the
    replacement. Tries just before the root, then just after the last input (in the root's
    grad mode). Returns None, or the reason to decline."""
    order = view.order
    inputs = _inputs(m, view)
    # nodes that feed the region: where the program reads an input on the region's behalf. Not
    # past a declared input: the op reads that input's memory as the program computed it (a later
    # write to the memory it was computed from does not change it; one to its own memory, views
    # included, is the conflict below), e.g. a loop's q computed from an earlier loop's output
    # buffer, which that loop wrote in place
    declared_nodes = {x for x in m.inputs if isinstance(x, fx.Node)}
    feeders: set = set()
    stack = [a for n in m.region for a in flat_args(n) if isinstance(a, fx.Node)]
    lowest = min(order[x] for x in inputs) if inputs else 0
    while stack:
        n = stack.pop()
        if n in feeders or n in m.region or order[n] < lowest:
            continue
        feeders.add(n)
        if n not in declared_nodes:
            stack.extend(a for a in flat_args(n) if isinstance(a, fx.Node))

    def read_span(x: fx.Node) -> tuple[int, int]:
        uses = [order[u] for u in x.users if u in m.region or u in feeders]
        return (min(uses), max(uses)) if uses else (order[x], order[x])

    reads = [(x, *read_span(x)) for x in inputs if view.alias_key(x) is not None]
    # values the pattern analysed *through* (``q = x * c`` folded into the scale: the op reads x
    # and recomputes q): the op never reads their memory, so an in-place write to it between
    # their definition and the region's last read (``q[:, 0] = 0``) changes what the program
    # computes but not what the op does
    declared = {view.alias_key(x) for x in m.inputs if isinstance(x, fx.Node)}
    last_read = max(order[n] for n in m.region)
    for x in dict.fromkeys(list(inputs) + sorted(feeders, key=order.__getitem__)):
        key = view.alias_key(x)
        if key is None or key in declared:
            continue
        hits = view.writes_between(key, order[x], last_read, exclude=m.region)
        if hits:
            w = hits[0]
            return (f"'{x.name}' is written in place by '{w.name}' ({location(w)}) before the {m.pattern} region "
                    f"reads it; the fused op computes '{x.name}' from its inputs and would not see the write")

    def conflict(pos: int):
        # the replacement reads each input once, at pos; the program read it from `first` to
        # `last` (an unrolled loop reads its inputs step after step): no write to its memory may
        # fall anywhere between those reads and pos
        for x, first, last in reads:
            hits = view.writes_between(view.alias_key(x), min(first, pos), max(last, pos), exclude=m.region)
            if hits:
                return x, hits[0]
        return None

    # before the region's last node, or before the first outside reader of an output if earlier
    outputs = set(m.outputs.values())
    readers = [order[u] for o in outputs for u in o.users if u not in m.region]
    root_pos = min([max(order[n] for n in m.region)] + readers)
    last = max((order[x] for x in inputs), default=-1)
    if last >= root_pos:
        x = view.nodes[last]
        return (
            f"an output of the {m.pattern} region is read ('{view.nodes[root_pos].name}', "
            f"{location(view.nodes[root_pos])}) before one of its inputs ('{x.name}') is computed"
        )
    c = conflict(root_pos)
    if c is None:
        m.insert_before = view.nodes[root_pos]
        return None
    early = view.nodes[last + 1] if last + 1 < len(view.nodes) else None
    if early is not None and order[early] < root_pos and view.grad_enabled[early] == view.grad_enabled[m.root] \
            and conflict(order[early]) is None:
        m.insert_before = early
        return None
    x, w = c
    return (
        f"'{x.name}' is written in place by '{w.name}' ({location(w)}) after the {m.pattern} reads it "
        f"and before its result is used, and an input is only ready after that write; the fused op "
        f"would read the new value"
    )


def _mismatch(new: fx.Node, root: fx.Node) -> Optional[str]:
    """How the replacement's value differs from the matched root's in shape or dtype (None
    when they agree or either is unknown): a last check that a rewrite never changes what
    the user's program computes."""
    a, b = val(new), val(root)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.dtype != b.dtype:
        return f"has dtype {a.dtype}, the matched value {b.dtype}"
    if len(a.shape) != len(b.shape) or not all(_same_size(x, y) for x, y in zip(a.shape, b.shape)):
        return f"has shape {tuple(a.shape)}, the matched value {tuple(b.shape)}"
    return None


def _same_size(x: Any, y: Any) -> bool:
    from .codegen import launch

    return launch.proven(x == y)


def _as_outputs(m: Match, emitted: Any) -> dict:
    """What ``emit`` returned as ``{output name: replacement node}`` for every output of ``m``."""
    if isinstance(emitted, fx.Node):
        if len(m.outputs) != 1:
            raise RuntimeError(f"emit returned one node for the outputs {list(m.outputs)}")
        return {next(iter(m.outputs)): emitted}
    if not isinstance(emitted, dict) or set(emitted) != set(m.outputs):
        raise RuntimeError(f"emit must return a node for each output {list(m.outputs)}, got {emitted!r}")
    return dict(emitted)


def _protect_saved(m: Match, new: dict, view: GraphView, graph: fx.Graph, before: set) -> dict:
    """Copies so that what a fused op saves for its backward survives in-place writes that
    come after it in the graph (``o.mul_(gate)`` on the output, ``q.add_(1)`` on an input):
    eager autograd saves only what it needs, fuser's ops save their inputs and outputs.
    Only when gradients are recorded at the insertion point. ``new`` maps each output's name
    to its replacement; returns the nodes to use in place of the outputs."""
    if not view.grad_enabled[m.insertion_point]:
        return new
    pos = view.order[m.insertion_point]
    later = {view.alias_key(t) for w, t in view.writes if view.order[w] >= pos and w not in m.region}
    later.discard(None)
    if not later:
        return new
    # every node the rewrite inserted may save its inputs: the fused op, and the helpers before it
    # (a run-time scale applied to q saves q for the scale's gradient)
    inserted = [n for n in graph.nodes if n not in before and n.op == "call_function"
                and n.target is not torch.ops.fuser.saved_copy.default]
    if not any(isinstance(val(a), torch.Tensor) and val(a).requires_grad
               for op in inserted for a in flat_args(op)):
        return new
    for op in inserted:
        for a in dict.fromkeys(x for x in flat_args(op) if isinstance(x, fx.Node)):
            if isinstance(val(a), torch.Tensor) and view.alias_key(a) in later:
                with graph.inserting_before(op):
                    c = annotate(graph.call_function(torch.ops.fuser.saved_copy.default, (a,)))
                op.replace_input_with(a, c)
                m.protected.append(f"copied '{a.name}' for the backward: it is written in place later")
    out = dict(new)
    for name, node in new.items():
        if view.alias_key(m.outputs[name]) in later:
            with graph.inserting_after(node):
                out[name] = annotate(graph.call_function(torch.ops.fuser.saved_copy.default, (node,)))
            what = "the output" if len(new) == 1 else f"the output '{name}'"
            m.protected.append(f"copied {what}: the program writes it in place later, the backward saves it")
    return out


def _replace(m: Match, new: dict, graph: fx.Graph) -> None:
    """Route each output's users to its replacement (``new``: output name -> node) and erase
    the region. Checks first that nothing outside the region reads a region node other than
    the outputs, so a failure leaves the region in place."""
    outputs = set(m.outputs.values())
    for n in m.region:
        if n not in outputs and any(u not in m.region for u in n.users):
            raise RuntimeError(f"{n.name} is read outside the matched region")
    for name, node in new.items():
        old = m.outputs[name]
        node.meta.setdefault("stack_trace", old.meta.get("stack_trace"))
        old.replace_all_uses_with(node)
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
