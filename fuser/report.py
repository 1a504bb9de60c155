"""Reports: ``fuser.explain`` (what fuser fused, why, with which plan, and the Triton source it
runs), ``collecting()`` (the report of every graph compiled inside a block) and the pass's
``record`` hook; :class:`PhaseTimer` and :class:`CompileTimes`, where fuser's own compile time
goes per graph. (Module named ``report`` so that ``fuser.explain`` is only ever the function.)"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import textwrap
import time
from typing import Any, Callable, Iterator, Optional

import torch

from .pattern import match_device

_session: contextvars.ContextVar[Optional["Report"]] = contextvars.ContextVar("fuser_session", default=None)
_process_graphs = itertools.count()  # graph numbers outside any report (log messages only)

#: Said under a match whose tensors are on the CPU (its kernels run in Triton's interpreter).
CPU_ESTIMATES_NOTE = (
    "tensors on the CPU: the kernels run in Triton's interpreter; the estimates are the cost "
    "model's for a nominal GPU (an H100) and only rank the plans; nothing is timed"
)


#: Said with every compile-time line: what is not in it. Where fuser's kernels are compiled
#: (``codegen.launch.inline_into_inductor``): on the GPU with static shapes Inductor compiles them
#: with its own kernels, in its parallel compile workers, inside ``compile_fx`` (so in Inductor's
#: time, and loaded from Triton's cache by a warm process); opaque ops (dynamic shapes,
#: ``FUSER_OPAQUE_OPS=1``) have Triton compile each kernel at its first launch, in the first call;
#: on CPU tensors the kernels run in Triton's interpreter and nothing is compiled.
TRITON_COMPILE_NOTE = ("compiling fuser's kernels is in no phase: on the GPU Inductor compiles them in "
                       "compile_fx (dynamic shapes, FUSER_OPAQUE_OPS=1: Triton, at their first launch); "
                       "the CPU interpreter compiles none")


class PhaseTimer:
    """Exclusive wall time per named phase, in ms (``time.perf_counter``).

    Phases nest: the time of a phase entered inside another (a static-mask evaluation inside a
    pattern's matching, a template rendered inside an emit) is counted in the inner phase only,
    so the phases' times add up to at most the wall time around them. One timer per compiled
    graph, used by one thread.
    """

    __slots__ = ("ms", "_stack")

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._stack: list[float] = []  # per open phase: the time of the phases nested in it (s)

    def start(self) -> float:
        self._stack.append(0.0)
        return time.perf_counter()

    def stop(self, name: str, started: float) -> None:
        elapsed = time.perf_counter() - started
        nested = self._stack.pop()
        self.ms[name] = self.ms.get(name, 0.0) + (elapsed - nested) * 1e3
        if self._stack:
            self._stack[-1] += elapsed

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name``."""
        t0 = self.start()
        try:
            yield
        finally:
            self.stop(name, t0)

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed as phase ``name`` at every call."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop(name, t0)

        return timed


@dataclasses.dataclass
class CompileTimes:
    """Where fuser's own compile time went for one graph (wall time, ms).

    Attributes:
        phases: phase -> ms, exclusive (a phase nested in another counts only in the inner one),
            in the order they are reported: ``canonicalise`` (the canonical graph view: building
            it and naming each node's op), ``static masks`` (slices of shape-only values found
            and evaluated at compile time; the symbolic proofs of index masks count in matching),
            ``match[<pattern>]`` (finding anchors and matching, per pattern), ``regions`` (the
            pass's checks of each match's region and where its replacement goes), ``plan`` (each
            match's candidates with their sympy cost terms and estimates, and the choice),
            ``render`` (kernel templates rendered and written), ``import kernels`` (rendered
            modules imported while compiling), ``emit`` (the replacement inserted into the graph),
            ``recompile`` (graph lint and ``recompile``), ``other`` (the rest of the pass),
            ``prefetch`` (with ``FUSER_PREFETCH=1``, on the GPU: the fused ops' calls traced to start, in the background,
            the compiles their fit checks wait on; ``fuser.backend.prefetch_kernel_compiles``).
        total_ms: the sum of the phases: fuser's own time on this graph.
        inductor_ms: Inductor's ``compile_fx`` on the rewritten graph (not fuser's; fuser's
            phases that run inside it, e.g. kernels imported while it traces, are not in it);
            None until it has run (or when the pass ran without the backend).
        graph_index: the graph's number in the report (or in the process).

    Compiling fuser's Triton kernels is in none of these (see :data:`TRITON_COMPILE_NOTE`): on
    the GPU with static shapes Inductor compiles them inside ``compile_fx`` (in ``inductor_ms``);
    opaque ops (dynamic shapes, ``FUSER_OPAQUE_OPS=1``) compile at their first launch, in the
    first call; interpreted kernels (CPU) are not compiled.
    """

    phases: dict = dataclasses.field(default_factory=dict)
    inductor_ms: Optional[float] = None
    graph_index: int = 0

    @property
    def total_ms(self) -> float:
        return sum(self.phases.values())

    def pieces(self) -> list[str]:
        """:meth:`text` in the pieces a wrapped line may break between: ``["canonicalise 1.2,",
        ..., "total 33.0;", "Inductor's compile_fx 2345.1 (not fuser's);", <the note's words>]``."""
        out = [f"{name} {ms:.1f}," for name, ms in self.phases.items()] + [f"total {self.total_ms:.1f};"]
        if self.inductor_ms is not None:
            out.append(f"Inductor's compile_fx {self.inductor_ms:.1f} (not fuser's);")
        return out + TRITON_COMPILE_NOTE.split(" ")

    def text(self) -> str:
        """``canonicalise 1.2, ..., total 33.0; Inductor's compile_fx 2345.1 (not fuser's); <note>``."""
        return " ".join(self.pieces())

    def __repr__(self) -> str:
        return f"<CompileTimes graph {self.graph_index}: fuser {self.total_ms:.1f} ms>"


@dataclasses.dataclass
class KernelInfo:
    """A rendered kernel module: ``name``, ``source`` (the Triton Python) and ``path`` on disk."""

    name: str
    source: str = dataclasses.field(repr=False)
    path: str


def _plural(n: int, word: str, plural: Optional[str] = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def _wrap(first: str, text: str, indent: int, width: int = 110) -> list[str]:
    """``first + text`` as lines of at most ``width`` characters (longer words are kept whole),
    continuation lines indented by ``indent`` spaces."""
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=" " * indent,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def _wrap_items(first: str, pieces: list[str], indent: int, width: int = 110) -> list[str]:
    """``first`` then ``pieces`` joined by spaces, as lines of at most ``width`` characters that
    break only between pieces (a piece longer than a line gets a line of its own)."""
    lines, line = [], first
    for piece in pieces:
        if line.strip() and line != first and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = " " * indent + piece
        else:
            line += piece if line == first else " " + piece
    return lines + [line]


def _interpreted(m: Any) -> bool:
    dev = match_device(m)
    return dev is not None and dev.type == "cpu"


@dataclasses.dataclass
class Report:
    """The result of :func:`explain`.

    Attributes:
        matches: every :class:`fuser.pattern.Match` (``.pattern``, ``.plan``, ``.reason``,
            ``.alternatives``, ``.summary``, ``.location``, ``.kernels``), fused or left to
            Inductor by the planner.
        rejected: near-misses (:class:`fuser.pattern.Rejection`: ``.pattern``, ``.reason``,
            ``.location``).
        kernels: the kernels the fused matches run (:class:`KernelInfo`), each once.
        graphs: how many graphs Dynamo captured (more than one means graph breaks); each
            match's ``graph_index`` counts from 0 in this report.
        disabled_graphs: how many of them were compiled with ``fuser.enabled=False``.
        output: what the function returned when it ran.
        compile_times: per graph, where fuser's own compile time went (:class:`CompileTimes`:
            ``.phases`` in ms, ``.total_ms``, ``.inductor_ms``, ``.graph_index``).
    """

    matches: list = dataclasses.field(default_factory=list)
    rejected: list = dataclasses.field(default_factory=list)
    graphs: int = 0
    output: Any = None
    disabled_graphs: int = 0
    compile_times: list = dataclasses.field(default_factory=list)

    @property
    def kernels(self) -> list[KernelInfo]:
        """The kernels the matches run (:class:`KernelInfo`), each once, in order of use."""
        seen: dict[str, KernelInfo] = {}
        for m in self.matches:
            for k in m.kernels:
                seen.setdefault(k.path, KernelInfo(k.name, k.source, k.path))
        return list(seen.values())

    @property
    def fused(self) -> list:
        """The matches replaced by fuser's own kernels."""
        return [m for m in self.matches if m.fused]

    @property
    def disabled(self) -> bool:
        """True when every graph was compiled with ``fuser.enabled=False`` (nothing matched)."""
        return self.graphs > 0 and self.disabled_graphs == self.graphs

    def __repr__(self) -> str:
        if self.disabled:
            return f"<fuser.Report: {_plural(self.graphs, 'graph')}, fuser disabled>"
        left = len(self.matches) - len(self.fused)
        return (f"<fuser.Report: {_plural(self.graphs, 'graph')}, {len(self.fused)} fused, "
                f"{left} left to Inductor, {_plural(len(self.rejected), 'near-miss', 'near-misses')}>")

    def __str__(self) -> str:
        if self.disabled:
            return (f"fuser: {_plural(self.graphs, 'graph')}; fuser is disabled (fuser.enabled=False): "
                    "nothing was matched, everything was compiled by Inductor")
        lines = [f"fuser: {self.graphs_desc()}"]
        interp = [i for i, m in enumerate(self.matches) if _interpreted(m)]
        if interp:
            which = "every match" if len(interp) == len(self.matches) else "matches " + ", ".join(f"[{i}]" for i in interp)
            lines += _wrap(f"  note ({which}): ", CPU_ESTIMATES_NOTE, 4)
        for i, m in enumerate(self.matches):
            plan = m.plan.name if m.plan else "-"
            lines.append(f"  [{i}] {m.pattern} at {m.location} (graph {m.graph_index}) -> plan {plan}")
            lines += _wrap("      why: ", m.reason, 11)
            if m.sharding:
                lines += _wrap("      per rank: ", m.sharding, 16)
            if m.launch:
                lines += _wrap("      launch: ", OPAQUE_LAUNCH_NOTES.get(m.launch, m.launch), 14)
            lines += _wrap("      recognised: ", ", ".join(f"{k}={v}" for k, v in m.summary.items()), 18)
            for c in m.alternatives:
                mark = "*" if c is m.plan else " "
                note = c.note
                if i in interp and (c.params.get("autotune") in ("1", True) or c.params.get("backward") == "autotune"):
                    note += " (on the interpreter nothing is timed: the first config is used)"
                head = f"      {mark} {c.name:<28} est. {c.estimate_ms:10.4g} ms  "
                lines += _wrap(head, note, len(head) if len(head) <= 70 else 10)
            for k in m.kernels:
                lines.append(f"      kernel {k.name}: {k.path}")
        if self.rejected:
            lines.append(f"  not fused ({len(self.rejected)}):")
            for r in self.rejected:
                lines += _wrap(f"    {r.pattern} at {r.location} (graph {r.graph_index}): ", r.reason, 8)
        for t in self.compile_times:
            lines += _wrap_items(f"  compile time, graph {t.graph_index} (ms): ", t.pieces(), 4)
        return "\n".join(lines)

    def graphs_desc(self) -> str:
        """The summary line: graphs, fused regions, regions left to Inductor, near-misses."""
        left = len(self.matches) - len(self.fused)
        return (
            f"{_plural(self.graphs, 'graph')}, {_plural(len(self.fused), 'region')} fused, "
            f"{left} left to Inductor/SDPA by the planner, "
            f"{_plural(len(self.rejected), 'near-miss', 'near-misses')}"
        )


#: What ``explain`` says of a match whose op launches its kernels from Python (``Match.launch``).
OPAQUE_LAUNCH_NOTES = {
    "symbolic sizes": (
        "its kernels are launched from Python on every call (an opaque op), not from Inductor's wrapper: "
        "the sizes are symbolic (dynamic shapes: dynamic=True, mark_dynamic, or a recompile after a size "
        "changed) and this op, as planned, chooses its kernels or launch configs from them (autotuning, "
        "H2O's diag_cache, attention-KL's split-K, atomic-dQ or masked variants, KDA's parallel plan, a "
        "symbolic head dim or head count). That costs host time on every call, forward and backward (an "
        "attention-KL training step at N=1024 ran 0.41-0.50x Inductor's so, against 1.23-1.36x with its "
        "kernels launched by Inductor, benchmarks/results/attention_kl_small_n.md); where it matters, "
        "compile with static sizes (dynamic=False), pick a plan that serves every size, or use "
        "mode=\"reduce-overhead\" (CUDA graphs)"),
    "opaque ops": ("its kernels are launched from Python on every call (an opaque op): FUSER_OPAQUE_OPS=1 "
                   "is set"),
}


def next_graph_index() -> int:
    """The number the next compiled graph gets: its index in the active report (0, 1, ... in
    the order compiled), or a process-wide count when no report is collecting."""
    rep = _session.get()
    return rep.graphs if rep is not None else next(_process_graphs)


def record(result: Any, options: Any = None) -> None:
    """Called by the backend for every graph it compiles: add its results to the active report.

    Args:
        result: the graph's :class:`fuser.passes.PassResult`.
        options: the :class:`fuser.options.Options` it was compiled with (None: enabled).
    """
    rep = _session.get()
    if rep is None:
        return
    index = rep.graphs
    rep.graphs += 1
    if options is not None and not options.enabled:
        rep.disabled_graphs += 1
    for item in list(result.matches) + list(result.rejected):
        item.graph_index = index
    rep.matches.extend(result.matches)
    rep.rejected.extend(result.rejected)
    times = getattr(result, "times", None)
    if times is not None and (options is None or options.enabled):
        times.graph_index = index
        rep.compile_times.append(times)


@contextlib.contextmanager
def collecting() -> Iterator[Report]:
    """Collect the results of every graph compiled by the fuser backend inside the block."""
    rep = Report()
    token = _session.set(rep)
    try:
        yield rep
    finally:
        _session.reset(token)


def explain(fn: Callable, *args: Any, options: Optional[dict] = None, dynamic: Optional[bool] = None,
            mode: Optional[str] = None, **kwargs: Any) -> Report:
    """Compile ``fn`` with the fuser backend, run it once on ``args``/``kwargs``, and report.

    Args:
        fn: a function or ``nn.Module``.
        *args, **kwargs: inputs to call it with (it is run once, so it is also compiled).
        options: as for ``torch.compile`` (``fuser.*`` keys and Inductor's), e.g.
            ``{"fuser.interpret": True}`` to fuse regions on CPU tensors.
        dynamic, mode: as for ``torch.compile``.

    Returns:
        A :class:`Report`; ``str(report)`` is a readable summary.

    Raises:
        fuser.FuserOptionError: a bad ``fuser.*`` option (checked before anything is compiled),
            or a ``fuser.plan`` value that a match does not offer.

    Note:
        Like ``torch._dynamo.explain``, this resets Dynamo's caches first so that ``fn`` is
        compiled afresh.
    """
    from .options import resolve

    resolve(options, mode)  # a bad option fails here, before Dynamo runs
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fuser", options=options, dynamic=dynamic, mode=mode)
    with collecting() as rep:
        rep.output = compiled(*args, **kwargs)
    return rep
