"""What a pattern provides to the pass, and what a match is.

A pattern module in ``patterns/`` defines one :class:`Pattern` instance named ``PATTERN``.
The pass (``fuser/passes.py``) asks it for anchor nodes, tries to match at each, lets the
planner choose among the plans it offers, and asks it to emit the replacement.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from .cuts import Cuts
from .graph import GraphView
from .options import Options
from .static import StaticEvaluator


@dataclasses.dataclass
class Candidate:
    """One way to run a match.

    Attributes:
        name: short name shown in reports, e.g. ``"fuser[backward=two_kernel]"``.
        params: what the pattern needs to emit it, e.g. ``{"impl": "fuser", "backward": ...}``.
        cost: symbolic cost terms (sympy expressions in the match's shape symbols):
            ``flops``, ``exps``, ``bytes``, ``tiles``, ``launches``, ...
        estimate_ms: the cost model's time at the example shapes.
        note: one line on what this candidate does.
        deterministic: False when its results may vary from run to run (e.g. gradients summed
            with atomics): such candidates are not chosen under
            ``torch.use_deterministic_algorithms(True)``.
    """

    name: str
    params: dict
    cost: dict
    estimate_ms: float
    note: str = ""
    deterministic: bool = True

    def __str__(self) -> str:
        return f"{self.name} (est. {self.estimate_ms:.3g} ms)"

    def __repr__(self) -> str:  # the cost terms are pages of sympy: left out
        return f"<Candidate {self}>"


@dataclasses.dataclass
class Match:
    """A region of the graph that a pattern can replace.

    Attributes:
        pattern: the pattern's name (``"attention"``, ...).
        root: the region's main output (its anchor in reports; one of :attr:`outputs`).
        region: the nodes the fused op replaces; only :attr:`outputs` may be read outside it.
        bindings: the pattern's analysis (inputs, scale, mask kind, ...), for emit.
        summary: a user-facing dict of what was recognised (shown by ``explain``).
        location: ``file:line`` of the user code.
        graph_index: which compiled graph it is in (with graph breaks there are several).
        plan: the chosen :class:`Candidate` (set by the planner).
        alternatives: every candidate with its estimate (set by the planner).
        reason: why the plan was chosen.
        kernels: rendered kernels the plan uses (``RenderedKernel``: ``.name``, ``.source``, ``.path``).
        inputs: the nodes outside the region whose values the replacement reads (operands,
            mask tensors, symbolic scale factors); the pass checks that none of them is written
            in place between its definition and the replacement.
        insert_before: where the replacement goes (set by the pass: the region's last node, or
            the first outside reader of an output when that comes earlier, or an earlier point an
            in-place write forces). Patterns emit at :attr:`insertion_point`.
        protected: notes on copies the pass made so that the backward's saved tensors survive
            later in-place writes (shown by ``explain``).
        outputs: the region's values read outside it, by name (``{"out": root}`` unless the
            pattern names several, e.g. ``{"out": pv, "score": column_sum}``). ``emit`` returns
            one replacement per name; the pass routes each output's readers to it.
        sharding: for a match whose inputs are sharded DTensors, which local shard shapes it was
            planned on (its estimates are per rank; ``fuser.distributed.planning_note``), shown
            by ``explain``; ``""`` otherwise.
        launch: why the emitted op will launch its kernels from Python on every call instead of
            from Inductor's generated wrapper (``codegen.launch.stays_opaque``: ``"symbolic
            sizes"``, ``"opaque ops"``), shown by ``explain``; ``""`` when Inductor launches them
            (or on CPU tensors, where the interpreter runs them).
    """

    pattern: str
    root: fx.Node
    region: frozenset
    bindings: dict
    summary: dict
    location: str
    graph_index: int = 0
    plan: Optional[Candidate] = None
    alternatives: list = dataclasses.field(default_factory=list)
    reason: str = ""
    kernels: list = dataclasses.field(default_factory=list)
    inputs: tuple = ()
    insert_before: Optional[fx.Node] = None
    protected: list = dataclasses.field(default_factory=list)
    outputs: dict = dataclasses.field(default_factory=dict)
    sharding: str = ""
    launch: str = ""

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = {"out": self.root}
        if not any(n is self.root for n in self.outputs.values()):
            raise ValueError(f"the root {self.root.name} must be one of the outputs {list(self.outputs)}")

    @property
    def insertion_point(self) -> fx.Node:
        """The node the replacement is inserted before."""
        return self.insert_before if self.insert_before is not None else self.root

    @property
    def fused(self) -> bool:
        """True when the plan replaces the region with fuser's kernels."""
        return self.plan is not None and self.plan.params.get("impl") == "fuser"

    def __repr__(self) -> str:  # the region, bindings and kernels (with their source) left out
        plan = self.plan.name if self.plan is not None else "not planned"
        return f"<Match {self.pattern} at {self.location} (graph {self.graph_index}), plan {plan}>"


def match_device(m: Any) -> Optional[torch.device]:
    """The device of a match's tensors (from its bindings, else the root's value), or None."""
    dev = getattr(m, "bindings", {}).get("device") if isinstance(getattr(m, "bindings", None), dict) else None
    if isinstance(dev, (torch.device, str)):
        return torch.device(dev)
    root = getattr(m, "root", None)
    meta = getattr(root, "meta", {}) or {}
    for key in ("example_value", "val"):
        v = meta.get(key)
        if isinstance(v, (tuple, list)) and v:
            v = v[0]
        if isinstance(v, torch.Tensor):
            return v.device
    return None


@dataclasses.dataclass
class Rejection:
    """A near-miss: a subgraph that looks like ``pattern`` but cannot be fused exactly."""

    pattern: str
    reason: str
    location: str
    node: str
    graph_index: int = 0

    def __repr__(self) -> str:
        reason = self.reason if len(self.reason) <= 160 else self.reason[:157] + "..."
        return f"<Rejection {self.pattern} at {self.location} (graph {self.graph_index}): {reason}>"


@dataclasses.dataclass
class MatchContext:
    """What a pattern may consult while matching and planning.

    Attributes:
        view: the canonical graph view.
        evaluator: evaluates static (shape-only) slices of the graph.
        options: fuser's options.
        grad_enabled: autograd was on when the graph was captured (training).
        graph_index: index of this graph among those compiled in the session.
        cuts: where the graph was cut out of the program (:class:`fuser.cuts.Cuts`: a graph
            break, a DDPOptimizer boundary), None when unknown (a graph not from Dynamo, the
            body of a higher-order op): a region the program computes across a cut is reported
            only where the cut is known.
    """

    view: GraphView
    evaluator: StaticEvaluator
    options: Options
    grad_enabled: bool
    graph_index: int = 0
    cuts: Optional[Cuts] = None


class Pattern(abc.ABC):
    """One family of fusable subgraphs (see ``patterns/``).

    Attributes:
        name: the pattern's name in options and reports (``"attention"``, ...).
        plan_choices: the ``fuser.plan`` choices it offers: choice -> valid values
            (``"<positive integer>"`` stands for any positive integer). Whether a value is
            offered for a given match may also depend on the device and the match; the planner
            says so when a forced value is not offered.
    """

    name: str = ""
    plan_choices: dict = {}

    @abc.abstractmethod
    def anchors(self, view: GraphView) -> Iterable[fx.Node]:
        """Nodes where a match may be rooted or anchored (e.g. every softmax)."""

    @abc.abstractmethod
    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        """A :class:`Match`, a :class:`Rejection` with its reason, or None when ``anchor``
        is not this pattern at all."""

    @abc.abstractmethod
    def candidates(self, match: Match, ctx: MatchContext) -> list[Candidate]:
        """The plans this match can run with, each with its cost estimate."""

    @abc.abstractmethod
    def emit(self, match: Match, plan: Candidate, graph: fx.Graph) -> "fx.Node | dict[str, fx.Node]":
        """Insert the replacement before ``match.insertion_point``; return the node to use in
        place of each of ``match.outputs``: a dict with the same names, or, for a region with
        one output, the node itself."""

    def kernels(self, match: Match, plan: Candidate) -> list:
        """The rendered kernels ``plan`` runs (rendered now, not launched)."""
        return []

    def why_not_offered(self, match: Match, choice: str, value: str) -> str:
        """Why ``fuser.plan``'s valid value ``value`` of ``choice`` is not among ``match``'s
        candidates (a shape or option it needs), as a sentence that names the fix; "" when
        there is nothing to add. The planner appends it to the error it raises."""
        return ""
