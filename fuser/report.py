"""Reports: ``fuser.explain`` (what fuser fused, why, with which plan, and the Triton source it
runs), ``collecting()`` (the report of every graph compiled inside a block) and the pass's
``record`` hook. (Module named ``report`` so that ``fuser.explain`` is only ever the function.)"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch

_session: contextvars.ContextVar[Optional["Report"]] = contextvars.ContextVar("fuser_session", default=None)


@dataclasses.dataclass
class KernelInfo:
    """A rendered kernel module: ``name``, ``source`` (the Triton Python) and ``path`` on disk."""

    name: str
    source: str
    path: str


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
        graphs: how many graphs Dynamo captured (more than one means graph breaks).
        output: what the function returned when it ran.
    """

    matches: list = dataclasses.field(default_factory=list)
    rejected: list = dataclasses.field(default_factory=list)
    graphs: int = 0
    output: Any = None

    @property
    def kernels(self) -> list[KernelInfo]:
        seen: dict[str, KernelInfo] = {}
        for m in self.matches:
            for k in m.kernels:
                seen.setdefault(k.path, KernelInfo(k.name, k.source, k.path))
        return list(seen.values())

    @property
    def fused(self) -> list:
        """The matches replaced by fuser's own kernels."""
        return [m for m in self.matches if m.fused]

    def __str__(self) -> str:
        lines = [f"fuser: {self.graphs_desc()}"]
        for i, m in enumerate(self.matches):
            plan = m.plan.name if m.plan else "-"
            lines.append(f"  [{i}] {m.pattern} at {m.location} (graph {m.graph_index}) -> plan {plan}")
            lines.append(f"      why: {m.reason}")
            summ = ", ".join(f"{k}={v}" for k, v in m.summary.items())
            lines.append(f"      recognised: {summ}")
            for c in m.alternatives:
                mark = "*" if c is m.plan else " "
                lines.append(f"      {mark} {c.name:<28} est. {c.estimate_ms:10.4g} ms  {c.note}")
            for k in m.kernels:
                lines.append(f"      kernel {k.name}: {k.path}")
        if self.rejected:
            lines.append(f"  not fused ({len(self.rejected)}):")
            for r in self.rejected:
                lines.append(f"    {r.pattern} at {r.location} (graph {r.graph_index}): {r.reason}")
        return "\n".join(lines)

    def graphs_desc(self) -> str:
        return (
            f"{self.graphs} graph(s), {len(self.fused)} region(s) fused, "
            f"{len(self.matches) - len(self.fused)} left to Inductor/SDPA by the planner, "
            f"{len(self.rejected)} near-miss(es)"
        )


def record(result: Any) -> None:
    """Called by the backend for every graph it compiles: add its results to the active report."""
    rep = _session.get()
    if rep is None:
        return
    rep.graphs += 1
    rep.matches.extend(result.matches)
    rep.rejected.extend(result.rejected)


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
        options, dynamic, mode: as for ``torch.compile``.

    Returns:
        A :class:`Report`; ``str(report)`` is a readable summary.

    Note:
        Like ``torch._dynamo.explain``, this resets Dynamo's caches first so that ``fn`` is
        compiled afresh.
    """
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fuser", options=options, dynamic=dynamic, mode=mode)
    with collecting() as rep:
        rep.output = compiled(*args, **kwargs)
    return rep
