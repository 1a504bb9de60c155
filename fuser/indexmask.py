"""Masks built from indices, proven for every size: a symbolic evaluation of static mask slices.

Masks are often computed in the traced graph from sizes alone: ``arange`` comparisons
(transformers' mask utilities), ``tril``/``triu`` of ``ones``, a slice of a registered causal
buffer, sliding windows ``(j <= i) & (j > i - w)``, prefix-LM ``(j <= i) | (j < p)``, padding by
lengths ``j < L``. Under dynamic shapes the graph serves every size, so evaluating such a mask at
a few sizes is no proof (a window of 32 looks causal below 32). This module evaluates the slice
*symbolically*: every value is an abstract tensor whose element at index ``(…, i, j)`` is a
closed form in the indices and the symbolic sizes:

- :class:`Index`: an integer tensor ``c + Σ_a coef_a · idx_a`` (``arange`` and affine arithmetic);
- :class:`Bool`: a boolean formula over *atoms* ``Σ_a coef_a · idx_a + c ≥ 0`` (comparisons,
  ``& | ~ ^``, ``tril``/``triu``);
- :class:`Num`: ``where(pred, a, b)`` with scalar ``a``, ``b`` (additive masks such as
  ``torch.where(causal, 0.0, finfo.min)``, ``zeros().masked_fill(j > i, -inf)``);
- :class:`Scalar`: a number or a sympy expression in the sizes.

Axes are numbered from the right (``-1`` is the key axis ``j``, ``-2`` the query axis ``i``), so
broadcasting needs no bookkeeping. A registered buffer (a constant tensor) enters through
:func:`concrete_predicate`, which recognises ``tril``/``triu``-shaped boolean or two-valued
tensors; slicing it with symbolic bounds (``bias[:, :, Nk - Nq:Nk, :Nk]``) shifts the indices.

:func:`mask_predicate` returns the mask's *visible-key predicate* over ``(i, j)`` and, for additive
masks, the value hidden entries get; :func:`classify` proves it equal to "all visible",
top-left causal (``j ≤ i``) or bottom-right causal (``j ≤ i + Nk − Nq``) for every size, or
reports it general. Anything this module cannot evaluate raises :class:`NotIndexed`, and the
caller treats the mask as data (computed at run time and loaded by the kernel): never a guess.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from .graph import GraphView, val, written_args
from .static import reads_metadata_of_first_arg

__all__ = ["NotIndexed", "Atom", "MaskPredicate", "Prover", "mask_predicate", "classify", "concrete_predicate", "shape_env_of", "evaluate"]


class NotIndexed(Exception):
    """The value is not a closed form of indices and sizes this module knows."""


# --------------------------------------------------------------------------------------------
# Facts about the sizes
# --------------------------------------------------------------------------------------------

class Prover:
    """Decides ``e ≥ 0`` for expressions in the symbolic sizes, soundly (True only with a
    proof): from each symbol's value range and from the guards Dynamo recorded for the graph
    (e.g. ``Nq ≤ Nk`` when a buffer is sliced ``[Nk − Nq:Nk]``): ``e`` is non-negative when
    ``e`` or ``e − g`` (for a guarded ``g ≥ 0``) is non-negative on the ranges.

    Args:
        shape_env: the graph's ``ShapeEnv`` (None for static graphs: numbers only).
    """

    def __init__(self, shape_env: Any = None):
        self.ranges = dict(getattr(shape_env, "var_to_range", {}) or {}) if shape_env is not None else {}
        self.facts: list = []
        for g in getattr(shape_env, "guards", ()) if shape_env is not None else ():
            self.facts.extend(_nonneg_forms(getattr(g, "expr", g)))

    def nonneg(self, e: Any) -> bool:
        e = _simp(e)
        if isinstance(e, (int, float)):
            return e >= 0
        if e.is_nonnegative:
            return True
        for f in [0] + self.facts:
            if self._lower(e - f) >= 0:
                return True
        return False

    def _lower(self, e: Any) -> float:
        e = sympy.expand(e)
        if e.is_number:
            return float(e)
        try:
            from torch.utils._sympy.value_ranges import bound_sympy

            lo = bound_sympy(e, self.ranges).lower
            return float(lo) if lo.is_number else -math.inf
        except Exception:  # noqa: BLE001 - no proof
            return -math.inf


def _nonneg_forms(expr: Any) -> list:
    """The guard ``expr`` (a sympy boolean) as expressions known to be ``≥ 0``."""
    if isinstance(expr, sympy.And):
        out = []
        for a in expr.args:
            out += _nonneg_forms(a)
        return out
    if isinstance(expr, (sympy.GreaterThan, sympy.StrictGreaterThan, sympy.LessThan, sympy.StrictLessThan)):
        lhs, rhs = expr.lhs, expr.rhs
        d = lhs - rhs if isinstance(expr, (sympy.GreaterThan, sympy.StrictGreaterThan)) else rhs - lhs
        if isinstance(expr, (sympy.StrictGreaterThan, sympy.StrictLessThan)):
            d = d - 1 if d.is_integer else d
        return [sympy.expand(d)]
    if isinstance(expr, sympy.Eq):
        d = sympy.expand(expr.lhs - expr.rhs)
        return [d, -d]
    return []


def shape_env_of(view: GraphView) -> Any:
    """The ShapeEnv of the first symbolic size in the graph (None if every size is static)."""
    for n in view.nodes:
        v = val(n)
        xs = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        for x in xs:
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return x.node.shape_env
    return None


_PROVER = Prover()


# --------------------------------------------------------------------------------------------
# Boolean formulas over affine atoms
# --------------------------------------------------------------------------------------------

TRUE: tuple = ("true",)
FALSE: tuple = ("false",)


@dataclasses.dataclass(frozen=True)
class Atom:
    """``Σ_a coef[a] · idx_a + const ≥ 0`` (axes from the right; integer coefficients)."""

    coef: tuple  # sorted ((axis, int coefficient), ...), no zero coefficients
    const: Any   # int or sympy expression

    @staticmethod
    def make(coef: dict, const: Any) -> "Atom":
        return Atom(tuple(sorted((a, int(c)) for a, c in coef.items() if c != 0)), _simp(const))

    def negate(self) -> "Atom":
        """``not (e ≥ 0)`` ⇔ ``-e - 1 ≥ 0`` (integers)."""
        return Atom(tuple((a, -c) for a, c in self.coef), _simp(-self.const - 1))


def _simp(x: Any) -> Any:
    if isinstance(x, sympy.Basic):
        x = sympy.simplify(x)
        if x.is_Integer:
            return int(x)
    return x


def _and(*ps: tuple) -> tuple:
    parts = []
    for p in ps:
        if p == FALSE:
            return FALSE
        if p == TRUE:
            continue
        parts.extend(p[1:] if p[0] == "and" else [p])
    if not parts:
        return TRUE
    return parts[0] if len(parts) == 1 else ("and", *parts)


def _or(*ps: tuple) -> tuple:
    parts = []
    for p in ps:
        if p == TRUE:
            return TRUE
        if p == FALSE:
            continue
        parts.extend(p[1:] if p[0] == "or" else [p])
    if not parts:
        return FALSE
    return parts[0] if len(parts) == 1 else ("or", *parts)


def _not(p: tuple) -> tuple:
    """Negation pushed down to the atoms (De Morgan), so formulas stay negation-free."""
    if p == TRUE:
        return FALSE
    if p == FALSE:
        return TRUE
    if p[0] == "atom":
        return ("atom", p[1].negate())
    if p[0] == "and":
        return _or(*[_not(x) for x in p[1:]])
    if p[0] == "or":
        return _and(*[_not(x) for x in p[1:]])
    raise AssertionError(p)


def _atom(coef: dict, const: Any, prover: Prover = _PROVER) -> tuple:
    a = Atom.make(coef, const)
    if not a.coef:  # a condition on sizes only: decide it, or give up
        c = a.const
        if prover.nonneg(c):
            return TRUE
        if prover.nonneg(-sympy.sympify(c) - 1):
            return FALSE
        raise NotIndexed(f"the mask depends on the sign of {c}, a condition on the sizes")
    return ("atom", a)


def _map_axes(p: tuple, fn) -> tuple:
    """Rewrite every atom's coefficients with ``fn(coef dict, const) -> (coef dict, const)``."""
    if p in (TRUE, FALSE):
        return p
    if p[0] == "atom":
        coef, const = fn(dict(p[1].coef), p[1].const)
        return _atom(coef, const)
    return (_and if p[0] == "and" else _or)(*[_map_axes(x, fn) for x in p[1:]])


def _axes(p: tuple) -> set:
    if p in (TRUE, FALSE):
        return set()
    if p[0] == "atom":
        return {a for a, _ in p[1].coef}
    out: set = set()
    for x in p[1:]:
        out |= _axes(x)
    return out


# --------------------------------------------------------------------------------------------
# Abstract values
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Scalar:
    """A number or a sympy expression of the sizes."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Index:
    """An integer-valued tensor of rank ``rank``: ``const + Σ coef[a] · idx_a``."""

    rank: int
    coef: tuple  # ((axis, coefficient), ...)
    const: Any


@dataclasses.dataclass(frozen=True)
class Bool:
    """A boolean tensor of rank ``rank``: true where the formula ``pred`` holds."""

    rank: int
    pred: tuple


@dataclasses.dataclass(frozen=True)
class Num:
    """A numeric tensor of rank ``rank``: ``a`` where ``pred`` holds, else ``b`` (Python
    floats, possibly ±inf), of dtype ``dtype``."""

    rank: int
    pred: tuple
    a: float
    b: float
    dtype: torch.dtype


#: The integers each dtype holds exactly: every one in the closed range (int64: any position).
_EXACT_INTEGERS = {
    torch.int32: (-2 ** 31, 2 ** 31 - 1), torch.int16: (-2 ** 15, 2 ** 15 - 1), torch.int8: (-2 ** 7, 2 ** 7 - 1),
    torch.uint8: (0, 2 ** 8 - 1), torch.float64: (-2 ** 53, 2 ** 53), torch.float32: (-2 ** 24, 2 ** 24),
    torch.float16: (-2 ** 11, 2 ** 11), torch.bfloat16: (-2 ** 8, 2 ** 8),
}


def _index_fits(x: "Index", shape: tuple, dtype: torch.dtype) -> bool:
    """Whether every value of ``x`` over a tensor of ``shape`` is an integer that ``dtype`` holds
    exactly, so that eager's ``dtype`` arithmetic gives the formula's values: always for int64; for
    other dtypes only with static sizes, integer coefficients and a range inside
    :data:`_EXACT_INTEGERS` (``arange(n, dtype=torch.bfloat16) + 250`` rounds, an int16 position
    past 32767 wraps: such a node is not read as a formula)."""
    if dtype == torch.int64:
        return True
    limits = _EXACT_INTEGERS.get(dtype)
    if limits is None or not isinstance(x.const, int) or isinstance(x.const, bool):
        return False
    lo = hi = x.const
    for axis, c in x.coef:
        size = shape[axis] if -len(shape) <= axis < 0 else None  # axes count from the last
        if not isinstance(size, int) or not isinstance(c, int):
            return False
        span = c * (size - 1)
        lo, hi = lo + min(0, span), hi + max(0, span)
    return limits[0] <= lo and hi <= limits[1]


def _expr(x: Any) -> Any:
    """A SymInt/SymFloat/int/float as an int, float or sympy expression."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        e = x.node.expr
        return int(e) if getattr(e, "is_Integer", False) else e
    if isinstance(x, bool):
        return int(x)
    return x


def _is_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    return isinstance(x, sympy.Basic) and bool(x.is_integer)


def _as_index(x: Any) -> Index:
    if isinstance(x, Index):
        return x
    if isinstance(x, Scalar) and _is_int(x.value):
        return Index(0, (), x.value)
    raise NotIndexed(f"{x!r} is not an integer index expression")


def _shape(node: Any) -> tuple:
    v = val(node)
    if not isinstance(v, torch.Tensor):
        raise NotIndexed(f"no shape for {getattr(node, 'name', node)}")
    return tuple(_expr(s) for s in v.shape)


def _unit(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _drop_unit_axes(av: Any, shape: tuple) -> Any:
    """Coefficients on axes of size 1 multiply index 0: drop them."""
    units = {a - len(shape) for a in range(len(shape)) if _unit(shape[a])}
    if not units:
        return av
    if isinstance(av, Index):
        return Index(av.rank, tuple((a, c) for a, c in av.coef if a not in units), av.const)

    def fn(coef, const):
        return {a: c for a, c in coef.items() if a not in units}, const

    if isinstance(av, Bool):
        return Bool(av.rank, _map_axes(av.pred, fn))
    if isinstance(av, Num):
        return Num(av.rank, _map_axes(av.pred, fn), av.a, av.b, av.dtype)
    return av


def _with_rank(av: Any, rank: int) -> Any:
    if isinstance(av, Index):
        return Index(rank, av.coef, av.const)
    if isinstance(av, Bool):
        return Bool(rank, av.pred)
    if isinstance(av, Num):
        return Num(rank, av.pred, av.a, av.b, av.dtype)
    return av


def _remap(av: Any, mapping: dict, rank: int, shift: Optional[dict] = None) -> Any:
    """Move axis ``a`` to ``mapping[a]`` (axes missing from ``mapping`` must carry no
    coefficient); ``shift[a]``: the index on old axis ``a`` is the new index plus this offset."""
    shift = shift or {}

    def fn(coef, const):
        out = {}
        for a, c in coef.items():
            if a in shift:
                const = const + c * shift[a]
            if a not in mapping:
                raise NotIndexed("an indexed axis is dropped")
            out[mapping[a]] = out.get(mapping[a], 0) + c
        return out, const

    if isinstance(av, Index):
        coef, const = fn(dict(av.coef), av.const)
        return Index(rank, tuple(sorted(coef.items())), _simp(const))
    if isinstance(av, Bool):
        return Bool(rank, _map_axes(av.pred, fn))
    if isinstance(av, Num):
        return Num(rank, _map_axes(av.pred, fn), av.a, av.b, av.dtype)
    raise NotIndexed("cannot re-index a scalar")


# --------------------------------------------------------------------------------------------
# Concrete constant tensors (registered buffers) as predicates
# --------------------------------------------------------------------------------------------

def concrete_predicate(t: torch.Tensor) -> Any:
    """A constant tensor as an abstract value, when its last two axes form a ``tril``/``triu``
    pattern (``j − i ≤ d`` or ``j − i ≥ d``) or are constant, the same for every leading index:
    :class:`Bool` for boolean tensors, :class:`Num` for two-valued numeric ones. Raises
    :class:`NotIndexed` otherwise."""
    rank = t.dim()
    if t.numel() == 0:
        raise NotIndexed("an empty constant")
    if rank < 2:
        x = t.reshape(1, -1) if rank == 1 else t.reshape(1, 1)
    else:
        x = t.reshape(-1, t.shape[-2], t.shape[-1])
        if not bool((x == x[:1]).all()):
            raise NotIndexed("a constant that differs across leading dims")
        x = x[0]
    if t.dtype == torch.bool:
        hi, lo, truth = True, False, x
    else:
        values = torch.unique(x.double())
        if values.numel() == 1:
            c = float(values[0])
            return Num(rank, TRUE, c, c, t.dtype)
        if values.numel() != 2:
            raise NotIndexed("a constant with more than two values")
        lo, hi = float(values[0]), float(values[1])
        truth = x.double() == hi
    pred = _concrete_pattern(truth)
    if t.dtype == torch.bool:
        return Bool(rank, pred)
    return Num(rank, pred, hi, lo, t.dtype)


def _concrete_pattern(truth: torch.Tensor) -> tuple:
    """The tril/triu formula of a boolean ``[Nq, Nk]`` matrix (all-true/all-false too)."""
    truth = truth.cpu()  # a buffer on the GPU; the index grids below live on the CPU
    nq, nk = truth.shape[-2], truth.shape[-1]
    if bool(truth.all()):
        return TRUE
    if not bool(truth.any()):
        return FALSE
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    counts = truth.sum(-1)
    partial = ((counts > 0) & (counts < nk)).nonzero()
    if partial.numel():
        r = int(partial[0, 0])
        c = int(counts[r])
        d = c - 1 - r  # tril(diagonal=d): row r keeps j <= r + d
        if bool((truth == (j - i <= d)).all()):
            return _atom({-2: 1, -1: -1}, d)
        d = nk - c - r  # triu(diagonal=d): row r keeps j >= r + d
        if bool((truth == (j - i >= d)).all()):
            return _atom({-2: -1, -1: 1}, -d)
    else:  # every row all-true or all-false: a condition on i alone
        first = int(truth.any(-1).nonzero()[0, 0])
        if bool((truth == (i >= first)).all()):
            return _atom({-2: 1}, -first)
        last = int(truth.any(-1).nonzero()[-1, 0])
        if bool((truth == (i <= last)).all()):
            return _atom({-2: -1}, last)
    raise NotIndexed("a constant that is not a tril/triu pattern")


# --------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------

_CMP = {
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": operator.ne,
}
_CMP_NAMES = {
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq", operator.ne: "ne",
    torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.eq: "eq", torch.ne: "ne",
    torch.less: "lt", torch.less_equal: "le", torch.greater: "gt", torch.greater_equal: "ge",
    torch.not_equal: "ne",
}
_CMP_METHODS = {
    "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "__lt__": "lt", "__le__": "le",
    "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne", "less": "lt", "less_equal": "le",
    "greater": "gt", "greater_equal": "ge", "not_equal": "ne",
}
_SWAP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_LOGIC = {
    operator.and_: "and", operator.or_: "or", operator.xor: "xor", torch.logical_and: "and",
    torch.logical_or: "or", torch.logical_xor: "xor", torch.bitwise_and: "and", torch.bitwise_or: "or",
    torch.bitwise_xor: "xor",
}
_LOGIC_METHODS = {"__and__": "and", "__or__": "or", "__xor__": "xor", "logical_and": "and", "logical_or": "or",
                  "logical_xor": "xor", "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
                  "__rand__": "and", "__ror__": "or"}
_NOT = {operator.invert, torch.logical_not, torch.bitwise_not}
_NOT_METHODS = {"__invert__", "logical_not", "bitwise_not"}
_ARITH = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", torch.add: "add", torch.sub: "sub",
          torch.mul: "mul", operator.neg: "neg", torch.neg: "neg", operator.truediv: "div", torch.div: "div",
          operator.floordiv: "floordiv", operator.pow: "pow"}
_ARITH_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "__add__": "add", "__radd__": "add", "__sub__": "sub",
                  "__rsub__": "rsub", "__mul__": "mul", "__rmul__": "mul", "neg": "neg", "__neg__": "neg",
                  "div": "div", "__truediv__": "div"}
_FACTORIES = {torch.ones: True, torch.zeros: False, torch.full: None, torch.ones_like: True,
              torch.zeros_like: False, torch.full_like: None}
_IDENTITY_METHODS = {"contiguous", "clone", "detach", "requires_grad_"}
_RESHAPE_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "view_as", "reshape_as", "expand", "expand_as",
                    "broadcast_to"}
_RESHAPE_FNS = {torch.reshape, torch.unsqueeze, torch.squeeze, torch.broadcast_to}


class _Interpreter:
    def __init__(self, view: GraphView, concrete, prover: Prover):
        self.view = view
        self.concrete = concrete  # node -> concrete tensor for constant leaves (buffers)
        self.prover = prover
        self.env: dict[fx.Node, Any] = {}

    def run(self, nodes: list[fx.Node], target: fx.Node) -> Any:
        for n in nodes:
            if written_args(n):
                raise NotIndexed(f"'{n.name}' writes in place")
            self.env[n] = self.node(n)
        return self.env[target]

    def arg(self, x: Any) -> Any:
        if isinstance(x, fx.Node):
            return self.env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self.arg(v) for v in x)
        if isinstance(x, (torch.SymInt, torch.SymFloat, int, float, bool)):
            return Scalar(_expr(x))
        return x

    # ----------------------------------------------------------------------------------
    def node(self, n: fx.Node) -> Any:  # noqa: C901 - an op table
        v = val(n)
        if n.op in ("placeholder", "get_attr"):
            if isinstance(v, torch.Tensor) or n.op == "get_attr":
                t = self.concrete(n)
                if t is None:
                    raise NotIndexed(f"the value of '{n.name}' is not known")
                return concrete_predicate(t)
            if isinstance(v, (torch.SymInt, torch.SymFloat, int, float)):
                return Scalar(_expr(v))
            raise NotIndexed(f"input '{n.name}'")
        if not isinstance(v, torch.Tensor):
            # sizes, shapes and Python arithmetic on them: their recorded (symbolic) value
            if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                return Scalar(_expr(v))
            if isinstance(v, (tuple, list, torch.Size)):
                return tuple(Scalar(_expr(x)) for x in v)
            raise NotIndexed(f"'{n.name}' has no value metadata")
        t = n.target
        # ones_like(x) and its kin read x's metadata alone: x is not in the slice (fuser/static.py)
        skip_first = reads_metadata_of_first_arg(n)
        args = [None if (i == 0 and skip_first) else self.arg(a) for i, a in enumerate(n.args)]
        kwargs = {k: self.arg(a) for k, a in n.kwargs.items()}
        shape = _shape(n)
        rank = len(shape)
        fn, meth = n.op == "call_function", n.op == "call_method"
        name = t if meth else getattr(t, "__name__", "")
        out = self._op(n, t, name, fn, meth, args, kwargs, shape, rank, v)
        if isinstance(out, Index) and not _index_fits(out, shape, v.dtype):
            # eager computes this node in v.dtype: its values would wrap (integers) or round
            # (floats), which the exact integer formula would not reproduce
            raise NotIndexed(f"'{n.name}' holds positions in {v.dtype} whose values may not all be exact there")
        return _drop_unit_axes(_with_rank(out, rank), shape) if not isinstance(out, Scalar) else out

    def _op(self, n, t, name, fn, meth, args, kwargs, shape, rank, v):  # noqa: C901
        if fn and t is torch.arange:
            pos = [a.value for a in args if isinstance(a, Scalar)]
            start = kwargs.get("start", Scalar(0)).value if "start" in kwargs else None
            end = kwargs["end"].value if "end" in kwargs else None
            step = kwargs["step"].value if "step" in kwargs else 1
            if len(pos) == 1 and end is None:
                start, end = 0, pos[0]
            elif len(pos) >= 2:
                start, end = pos[0], pos[1]
                if len(pos) >= 3:
                    step = pos[2]
            if start is None:
                start = 0
            if not (_is_int(start) and isinstance(step, int) and step != 0):
                raise NotIndexed("arange with a non-integer start or step")
            return Index(1, ((-1, step),), start)
        if fn and t in (torch.tensor, torch.scalar_tensor, torch.as_tensor) and rank == 0:
            c = args[0].value if isinstance(args[0], Scalar) else None
            if not isinstance(c, (int, float)):
                raise NotIndexed("torch.tensor of a non-constant")
            return self._const(c, v.dtype, rank)
        if (fn and t in _FACTORIES) or (meth and name in ("new_ones", "new_zeros", "new_full")):
            if fn and t in (torch.full, torch.full_like):
                fill = (kwargs.get("fill_value") or args[1]).value
            elif meth and name == "new_full":
                fill = (kwargs.get("fill_value") or args[2]).value
            else:
                fill = {torch.ones: 1, torch.zeros: 0, torch.ones_like: 1, torch.zeros_like: 0}.get(t)
                if fill is None:
                    fill = 1 if name == "new_ones" else 0
            return self._const(fill, v.dtype, rank)
        if (fn and t in (torch.tril, torch.triu)) or (meth and name in ("tril", "triu")):
            x = args[0]
            d = kwargs.get("diagonal", args[1] if len(args) > 1 else Scalar(0)).value
            if not _is_int(d):
                raise NotIndexed("tril/triu with a non-integer diagonal")
            lower = (t is torch.tril) if fn else name == "tril"
            keep = _atom({-2: 1, -1: -1}, d) if lower else _atom({-2: -1, -1: 1}, -d)
            if isinstance(x, Bool):
                return Bool(rank, _and(x.pred, keep))
            if isinstance(x, Num) and x.pred == TRUE:
                return Num(rank, keep, x.a, 0.0, x.dtype)
            raise NotIndexed("tril/triu of a non-constant")
        if (meth and name in _IDENTITY_METHODS) or (fn and t in (torch.clone,)):
            return args[0]
        cmp = _CMP_NAMES.get(t) if fn else _CMP_METHODS.get(name)
        if cmp is not None:
            return self._compare(cmp, args[0], args[1], rank)
        logic = _LOGIC.get(t) if fn else _LOGIC_METHODS.get(name)
        if logic is not None:
            a, b = self._bool(args[0]), self._bool(args[1])
            if logic == "and":
                return Bool(rank, _and(a, b))
            if logic == "or":
                return Bool(rank, _or(a, b))
            return Bool(rank, _or(_and(a, _not(b)), _and(_not(a), b)))
        if (fn and t in _NOT) or (meth and name in _NOT_METHODS):
            return Bool(rank, _not(self._bool(args[0])))
        arith = _ARITH.get(t) if fn else _ARITH_METHODS.get(name)
        if arith is not None:
            return self._arith(arith, args, rank, v)
        if (meth and name in ("masked_fill", "masked_fill_")) or (fn and t is torch.masked_fill):
            x, cond, fill = args[0], self._bool(args[1]), args[2]
            return self._where(cond, self._num_scalar(fill), x, v.dtype, rank)
        if fn and t is torch.where and len(args) == 3:
            return self._where(self._bool(args[0]), args[1], args[2], v.dtype, rank)
        if meth and name in ("to", "type", "float", "half", "bfloat16", "double", "bool", "int", "long", "type_as"):
            return self._cast(args[0], v.dtype, rank)
        if (meth and name in _RESHAPE_METHODS) or (fn and t in _RESHAPE_FNS):
            return self._reshape(n, args[0], rank)
        if (meth and name in ("transpose", "swapaxes", "swapdims")) or (fn and t in (torch.transpose,)):
            return self._transpose(n, args[0], args[1].value, args[2].value, rank)
        if (meth and name == "permute") or (fn and t is torch.permute):
            dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            return self._permute(n, args[0], [d.value for d in dims], rank)
        if fn and t is operator.getitem:
            return self._getitem(n, args[0], n.args[1], rank)
        raise NotIndexed(f"op {name or t} is not supported")

    # ----------------------------------------------------------------------------------
    @staticmethod
    def _const(fill: Any, dtype: torch.dtype, rank: int) -> Any:
        if dtype == torch.bool:
            return Bool(rank, TRUE if fill else FALSE)
        if not isinstance(fill, (int, float)):
            raise NotIndexed("a constant tensor filled with a symbolic value")
        return Num(rank, TRUE, float(fill), float(fill), dtype)

    @staticmethod
    def _bool(x: Any) -> tuple:
        if isinstance(x, Bool):
            return x.pred
        if isinstance(x, Num):  # nonzero
            a, b = x.a != 0, x.b != 0
            if a and b:
                return TRUE
            if not a and not b:
                return FALSE
            return x.pred if a else _not(x.pred)
        if isinstance(x, Scalar) and isinstance(x.value, (int, float)):
            return TRUE if x.value else FALSE
        raise NotIndexed("not a boolean mask")

    @staticmethod
    def _num_scalar(x: Any) -> float:
        if isinstance(x, Scalar) and isinstance(x.value, (int, float)):
            return float(x.value)
        if isinstance(x, Num) and x.pred == TRUE:
            return x.a
        raise NotIndexed("a fill value that is not a constant")

    def _compare(self, op: str, a: Any, b: Any, rank: int) -> Bool:
        if isinstance(a, Scalar) and not isinstance(b, Scalar):
            a, b, op = b, a, _SWAP[op]
        if isinstance(a, (Num, Bool)) or isinstance(b, (Num, Bool)):
            if isinstance(a, Num) and isinstance(b, Scalar) and op in ("eq", "ne") and isinstance(b.value, (int, float)):
                c = float(b.value)
                pa, pb = (x == c for x in (a.a, a.b))
                p = TRUE if pa and pb else FALSE if not (pa or pb) else (a.pred if pa else _not(a.pred))
                return Bool(rank, p if op == "eq" else _not(p))
            if isinstance(a, Bool) and isinstance(b, Scalar) and op in ("eq", "ne"):
                truth = bool(b.value)
                p = a.pred if truth else _not(a.pred)
                return Bool(rank, p if op == "eq" else _not(p))
            raise NotIndexed("comparison of masks")
        x, y = _as_index(a), _as_index(b)
        coef = dict(x.coef)
        for ax, c in y.coef:
            coef[ax] = coef.get(ax, 0) - c
        diff = x.const - y.const  # a - b = Σ coef idx + diff
        neg = {ax: -c for ax, c in coef.items()}
        if op == "ge":
            p = _atom(coef, diff)
        elif op == "gt":
            p = _atom(coef, diff - 1)
        elif op == "le":
            p = _atom(neg, -diff)
        elif op == "lt":
            p = _atom(neg, -diff - 1)
        elif op == "eq":
            p = _and(_atom(coef, diff), _atom(neg, -diff))
        else:
            p = _not(_and(_atom(coef, diff), _atom(neg, -diff)))
        return Bool(rank, p)

    def _arith(self, op: str, args: list, rank: int, v: torch.Tensor) -> Any:
        if op == "neg":
            x = args[0]
            if isinstance(x, Index):
                return Index(rank, tuple((a, -c) for a, c in x.coef), _simp(-x.const))
            if isinstance(x, Num):
                return Num(rank, x.pred, -x.a, -x.b, x.dtype)
            raise NotIndexed("negation of a non-index")
        a, b = args[0], args[1]
        if op == "rsub":
            a, b, op = b, a, "sub"
        if isinstance(a, Num) or isinstance(b, Num):
            return self._num_arith(op, a, b, v.dtype, rank)
        if op in ("add", "sub"):
            x, y = _as_index(a), _as_index(b)
            sign = 1 if op == "add" else -1
            coef = dict(x.coef)
            for ax, c in y.coef:
                coef[ax] = coef.get(ax, 0) + sign * c
            return Index(rank, tuple(sorted((k, c) for k, c in coef.items() if c)), _simp(x.const + sign * y.const))
        if op == "mul":
            if isinstance(a, Scalar):
                a, b = b, a
            x = _as_index(a)
            if not (isinstance(b, Scalar) and isinstance(b.value, int)):
                raise NotIndexed("an index multiplied by a non-integer")
            k = b.value
            return Index(rank, tuple((ax, c * k) for ax, c in x.coef if c * k), _simp(x.const * k))
        raise NotIndexed(f"index arithmetic {op}")

    @staticmethod
    def _num_arith(op: str, a: Any, b: Any, dtype: torch.dtype, rank: int) -> Num:
        def scalar(x):
            if isinstance(x, Scalar) and isinstance(x.value, (int, float)):
                return float(x.value)
            raise NotIndexed("mask arithmetic with a non-constant")

        f = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}.get(op)
        if f is None:
            raise NotIndexed(f"mask arithmetic {op}")
        if isinstance(a, Num) and not isinstance(b, (Num, Bool, Index)):
            c = scalar(b)
            return Num(rank, a.pred, _round(_f(f, a.a, c), dtype), _round(_f(f, a.b, c), dtype), dtype)
        if isinstance(b, Num) and not isinstance(a, (Num, Bool, Index)):
            c = scalar(a)
            return Num(rank, b.pred, _round(_f(f, c, b.a), dtype), _round(_f(f, c, b.b), dtype), dtype)
        raise NotIndexed("arithmetic between two masks")

    def _where(self, cond: tuple, x: Any, y: Any, dtype: torch.dtype, rank: int) -> Any:
        if dtype == torch.bool:
            bx, by = self._bool(x), self._bool(y)
            return Bool(rank, _or(_and(cond, bx), _and(_not(cond), by)))
        vx, vy = self._two(x), self._two(y)
        if vx is not None and vy is not None:
            return Num(rank, cond, _round(vx, dtype), _round(vy, dtype), dtype)
        # where(cond, c, Num(p, a, b)) with a == b handled above; a nested two-valued case:
        if vx is not None and isinstance(y, Num):
            if cond == y.pred or y.a == vx:
                return Num(rank, _or(cond, y.pred), _round(vx, dtype), y.b, dtype)
            if y.b == vx:
                return Num(rank, _or(cond, _not(y.pred)), _round(vx, dtype), y.a, dtype)
        raise NotIndexed("where/masked_fill with more than two values")

    @staticmethod
    def _two(x: Any) -> Optional[float]:
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return float(x)
        if isinstance(x, Scalar) and isinstance(x.value, (int, float)):
            return float(x.value)
        if isinstance(x, Num) and (x.pred == TRUE or x.a == x.b):
            return x.a
        if isinstance(x, Bool) and x.pred in (TRUE, FALSE):
            return 1.0 if x.pred == TRUE else 0.0
        return None

    def _cast(self, x: Any, dtype: torch.dtype, rank: int) -> Any:
        if dtype == torch.bool:
            return Bool(rank, self._bool(x))
        if isinstance(x, Bool):
            return Num(rank, x.pred, 1.0, 0.0, dtype)
        if isinstance(x, Num):
            return Num(rank, x.pred, _round(x.a, dtype), _round(x.b, dtype), dtype)
        if isinstance(x, Index):
            if dtype.is_floating_point or dtype in _EXACT_INTEGERS or dtype == torch.int64:
                return Index(rank, x.coef, x.const)  # the caller checks that the values fit (_index_fits)
        raise NotIndexed(f"cast to {dtype}")

    def _reshape(self, n: fx.Node, x: Any, rank: int) -> Any:
        """Reshapes that only add, drop or broadcast size-1 axes (and expands)."""
        src = n.args[0]
        s_in, s_out = _shape(src), _shape(n)
        mapping, i, o = {}, len(s_in) - 1, len(s_out) - 1
        while i >= 0:
            if _unit(s_in[i]):
                i -= 1
                continue
            while o >= 0 and _unit(s_out[o]) and not _same(s_in[i], s_out[o]):
                o -= 1
            if o < 0:
                raise NotIndexed("a reshape that merges or splits axes")
            if not (_same(s_in[i], s_out[o]) or _unit(s_in[i])):
                raise NotIndexed("a reshape that merges or splits axes")
            mapping[i - len(s_in)] = o - len(s_out)
            i, o = i - 1, o - 1
        return _remap(x, mapping, rank)

    def _transpose(self, n: fx.Node, x: Any, d0: int, d1: int, rank: int) -> Any:
        r = len(_shape(n.args[0]))
        a0, a1 = (d0 % r) - r, (d1 % r) - r
        mapping = {a: a for a in range(-r, 0)}
        mapping[a0], mapping[a1] = a1, a0
        return _remap(x, mapping, rank)

    def _permute(self, n: fx.Node, x: Any, dims: list, rank: int) -> Any:
        r = len(_shape(n.args[0]))
        mapping = {(d % r) - r: k - r for k, d in enumerate(dims)}
        return _remap(x, mapping, rank)

    def _getitem(self, n: fx.Node, x: Any, index: Any, rank: int) -> Any:
        """Basic indexing: slices with step 1, integers, None and Ellipsis."""
        if isinstance(x, tuple):  # a shape tuple
            if not isinstance(index, int):
                raise NotIndexed("shape slicing")
            return x[index]
        s_in = _shape(n.args[0])
        r = len(s_in)
        idx = list(index) if isinstance(index, tuple) else [index]
        if sum(1 for e in idx if e is Ellipsis) > 1:
            raise NotIndexed("several Ellipsis")
        used = sum(1 for e in idx if e is not None and e is not Ellipsis)
        if Ellipsis in idx:
            k = idx.index(Ellipsis)
            idx = idx[:k] + [slice(None)] * (r - used) + idx[k + 1:]
        else:
            idx = idx + [slice(None)] * (r - used)
        mapping, shift, out_axis, in_axis = {}, {}, 0, 0
        out_rank = rank
        positions = []
        for e in idx:
            if e is None:
                out_axis += 1
                continue
            a_in = in_axis - r
            if isinstance(e, slice):
                if e.step not in (None, 1):
                    raise NotIndexed("a strided slice")
                start = e.start
                if isinstance(start, fx.Node):
                    start = val(start)
                start = _expr(start) if start is not None else 0
                if isinstance(start, int) and start < 0:
                    start = s_in[in_axis] + start
                elif not _is_int(start) or not self.prover.nonneg(start):
                    raise NotIndexed("a slice start of unknown sign")
                mapping[a_in] = out_axis - out_rank
                if start != 0:
                    shift[a_in] = start
                positions.append(out_axis)
                out_axis += 1
            else:
                k = _expr(val(e) if isinstance(e, fx.Node) else e)
                if not _is_int(k):
                    raise NotIndexed("advanced indexing")
                if isinstance(k, int) and k < 0:
                    k = s_in[in_axis] + k
                shift[a_in] = k  # the axis disappears: its index is fixed at k
            in_axis += 1
        if out_axis != out_rank:
            raise NotIndexed("indexing result rank mismatch")
        fixed = {a for a in shift if a not in mapping}
        if fixed:
            return self._fix_axes(x, mapping, shift, fixed, out_rank)
        return _remap(x, mapping, out_rank, shift)

    @staticmethod
    def _fix_axes(x, mapping, shift, fixed, rank):
        def fn(coef, const):
            out = {}
            for a, c in coef.items():
                if a in shift:
                    const = const + c * shift[a]
                if a in fixed:
                    continue
                out[mapping[a]] = out.get(mapping[a], 0) + c
            return out, const

        if isinstance(x, Index):
            coef, const = fn(dict(x.coef), x.const)
            return Index(rank, tuple(sorted(coef.items())), _simp(const))
        if isinstance(x, Bool):
            return Bool(rank, _map_axes(x.pred, fn))
        if isinstance(x, Num):
            return Num(rank, _map_axes(x.pred, fn), x.a, x.b, x.dtype)
        raise NotIndexed("indexing a scalar")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0
    except (TypeError, sympy.SympifyError):
        return False


def _f(f, x: float, y: float) -> float:
    try:
        return f(x, y)
    except ZeroDivisionError:
        return math.nan


def _round(x: float, dtype: torch.dtype) -> float:
    """``x`` as the dtype stores it (``finfo(float32).min`` in bfloat16 rounds to ``-inf``)."""
    if dtype.is_floating_point:
        return float(torch.tensor(x, dtype=torch.float64).to(dtype))
    return float(x)


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MaskPredicate:
    """A mask term proven to be a function of the query index ``i`` and key index ``j`` only.

    Attributes:
        visible: formula over axes ``-2`` (``i``) and ``-1`` (``j``): True where the key is
            visible (the score is left unchanged).
        hidden_value: for an additive term, the value it adds at hidden entries (``-inf`` or a
            finite number; visible entries add exactly 0); None for boolean terms.
    """

    visible: tuple
    hidden_value: Optional[float]


def mask_predicate(node: fx.Node, nodes: list[fx.Node], kind: str, view: GraphView, concrete) -> MaskPredicate:
    """Evaluate the static slice ``nodes`` (in graph order, ``node`` last) of a mask term
    symbolically.

    Args:
        node: the mask term (the ``masked_fill``/``where`` condition, or the additive tensor).
        nodes: its static backward slice, in graph order.
        kind: ``"bool_keep"``, ``"bool_drop"`` or ``"additive"``.
        view: the graph view.
        concrete: ``node -> Optional[torch.Tensor]``, the values of constant leaves (buffers).

    Raises:
        NotIndexed: the slice uses an op or form this module cannot evaluate exactly, the
            mask depends on batch or head indices, or an additive mask's visible entries are
            not exactly 0.
    """
    av = _Interpreter(view, concrete, Prover(shape_env_of(view))).run(nodes, node)
    if kind == "additive":
        if not isinstance(av, Num):
            raise NotIndexed("an additive mask that is not two-valued")
        if av.a == 0 and av.b == 0:
            vis, hidden = TRUE, None
        elif av.a == 0:
            vis, hidden = av.pred, av.b
        elif av.b == 0:
            vis, hidden = _not(av.pred), av.a
        else:
            raise NotIndexed("an additive mask whose visible entries are not 0")
    else:
        p = _Interpreter._bool(av)
        vis, hidden = (p if kind == "bool_keep" else _not(p)), None
    if _axes(vis) - {-2, -1}:
        raise NotIndexed("the mask depends on batch or head indices")
    return MaskPredicate(vis, hidden)


def evaluate(pred: tuple, nq: int, nk: int, sizes: Optional[dict] = None) -> torch.Tensor:
    """The ``[nq, nk]`` boolean matrix of a formula over ``(i, j)``, with the size symbols
    replaced by ``sizes`` (symbol -> int). For tests and debugging."""
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    idx = {-2: i, -1: j}

    def ev(p):
        if p == TRUE:
            return torch.ones(nq, nk, dtype=torch.bool)
        if p == FALSE:
            return torch.zeros(nq, nk, dtype=torch.bool)
        if p[0] == "atom":
            a = p[1]
            c = a.const
            if isinstance(c, sympy.Basic):
                c = int(c.xreplace(sizes or {}))
            total = torch.full((nq, nk), c, dtype=torch.int64)
            for ax, k in a.coef:
                total = total + k * idx[ax]
            return total >= 0
        parts = [ev(x) for x in p[1:]]
        out = parts[0]
        for x in parts[1:]:
            out = (out & x) if p[0] == "and" else (out | x)
        return out

    return ev(pred)


def classify(pred: tuple, nq: Any, nk: Any, prover: Optional[Prover] = None) -> str:
    """``"none"`` (every key visible), ``"top_left"`` (``j ≤ i``), ``"bottom_right"``
    (``j ≤ i + Nk − Nq``), ``"empty"`` (no key visible anywhere) or ``"general"``, proven for
    every value of the sizes in ``nq``, ``nk`` (ints or sympy expressions; query index ``i`` in
    ``[0, nq)``, key index ``j`` in ``[0, nk)``)."""
    nq, nk = _expr(nq), _expr(nk)
    pred = _decide_on_box(pred, nq, nk, prover or _PROVER)
    if pred == TRUE:
        return "none"
    if pred == FALSE:
        return "empty"
    if pred[0] == "atom":
        a = pred[1]
        if dict(a.coef) == {-2: 1, -1: -1}:
            if _same(a.const, 0):
                return "top_left"
            if _same(a.const, sympy.sympify(nk) - sympy.sympify(nq)):
                return "bottom_right"
    return "general"


def _decide_on_box(p: tuple, nq: Any, nk: Any, prover: Prover) -> tuple:
    """Replace atoms that hold (or fail) for every ``(i, j)`` in the box by TRUE (FALSE)."""
    if p in (TRUE, FALSE):
        return p
    if p[0] == "atom":
        a = p[1]
        hi = {-2: sympy.sympify(nq) - 1, -1: sympy.sympify(nk) - 1}
        lo_sum, hi_sum = a.const, a.const
        for ax, c in a.coef:
            lo_sum = lo_sum + (c * hi[ax] if c < 0 else 0)
            hi_sum = hi_sum + (c * hi[ax] if c > 0 else 0)
        if prover.nonneg(lo_sum):
            return TRUE
        if prover.nonneg(-sympy.sympify(hi_sum) - 1):
            return FALSE
        return p
    parts = [_decide_on_box(x, nq, nk, prover) for x in p[1:]]
    return (_and if p[0] == "and" else _or)(*parts)

