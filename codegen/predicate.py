"""Index predicates: which key ``j`` a query ``i`` keeps, as a formula the kernels evaluate.

A predicate is a nested tuple (hashable, JSON-friendly):

- ``("atom", a, b, k)``: ``a*i + b*j + C[k] >= 0``; ``a``, ``b`` are Python ints (render-time
  constants), ``C[k]`` the k-th runtime integer constant (the kernel argument ``PC<k>``, never
  specialised, so a new length does not recompile);
- ``("and", p1, p2, ...)``, ``("or", p1, p2, ...)`` (at least one operand);
- ``("true",)``, ``("false",)``.

There is no "not": ``not (e >= 0)`` is ``-e - 1 >= 0``, with the ``- 1`` folded into the constant
by whoever builds the formula (``fuser/indexmask.py``). Sliding window ``i - w < j <= i`` with
``C = (0, w - 1)``: ``("and", ("atom", 1, -1, 0), ("atom", -1, 1, 1))``.

What this module provides (codegen knows no graph):

- :func:`serialize` / :func:`parse`: the canonical text, e.g. ``and(ge(1,-1,0),ge(-1,1,1))``
  (the custom op's ``pred`` argument and part of the kernel variant key);
- :func:`describe`: the formula in words for the rendered kernels' header
  (``j <= i + PC0 and j >= i - PC1``);
- :func:`render_elementwise`: the Triton expression of the predicate on a tile;
- :func:`render_bounds`: loop bounds for one block of rows, as straight-line Triton code on the
  block's scalar bounds: the key range ``[lo, hi)`` outside of which the predicate is false for
  every row of the block, and the range ``[full_lo, full_hi)`` where it is true for every
  (row, key) — tiles inside it need no per-element test. The same function gives the dK/dV
  kernel's query ranges for a block of keys on :func:`swap` ped roles;
- :func:`evaluate`: the predicate on Python ints or integer tensors (tests, the reference).

How the bounds are derived (``i`` ranges over the block's real rows ``[i_first, i_last]``, ``j``
over ``[0, size)``). An atom ``a*i + b*j + c >= 0`` with ``b > 0`` is a lower bound
``j >= ceil((-c - a*i) / b)``: for the hull its smallest value over the rows (``i_last`` when
``a > 0``, ``i_first`` when ``a < 0``), for the full range its largest. ``b < 0`` is an upper
bound ``j <= floor((c + a*i) / -b)``, maximised over the rows for the hull and minimised for the
full range. ``b == 0`` bounds nothing on ``j``: the range is everything or, when the atom is
false for every row (hull) / not true for every row (full), empty. ``and`` intersects. ``or``
takes the hull of the union for ``[lo, hi)``; for the full range the union of two fully true
intervals is fully true only where they overlap or touch, else the larger one is taken (folded
left over the operands). The rendered code clips to ``[0, size)``. Integer division in Triton
truncates toward zero: the bounds use :data:`FLOORDIV_HELPER` (exact floor division for a
positive divisor whatever the truncation), needed only where ``|b| > 1``. Conservative is
always allowed (a larger ``[lo, hi)`` or a smaller full range costs only speed); the brute-force
tests (``tests/codegen/test_predicate.py``) check that the reverse never happens.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Optional, Sequence

__all__ = [
    "TRUE",
    "FALSE",
    "validate",
    "simplify",
    "serialize",
    "parse",
    "n_consts",
    "swap",
    "digest",
    "describe",
    "evaluate",
    "render_elementwise",
    "render_bounds",
    "needs_floordiv",
    "FLOORDIV_HELPER",
    "eval_bounds",
]

TRUE = ("true",)
FALSE = ("false",)


# --------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------


def validate(pred: Any) -> tuple:
    """Return ``pred`` as nested tuples (lists accepted: JSON), or raise ``ValueError``."""
    if isinstance(pred, list):
        pred = tuple(pred)
    if not isinstance(pred, tuple) or not pred or not isinstance(pred[0], str):
        raise ValueError(f"not a predicate: {pred!r}")
    op = pred[0]
    if op in ("true", "false"):
        if len(pred) != 1:
            raise ValueError(f"{op!r} takes no operands: {pred!r}")
        return (op,)
    if op == "atom":
        if len(pred) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pred[1:]):
            raise ValueError(f"an atom is ('atom', a, b, k) with int a, b, k: {pred!r}")
        if pred[3] < 0:
            raise ValueError(f"an atom's constant index must be >= 0: {pred!r}")
        return ("atom", int(pred[1]), int(pred[2]), int(pred[3]))
    if op in ("and", "or"):
        if len(pred) < 2:
            raise ValueError(f"{op!r} needs at least one operand: {pred!r}")
        return (op,) + tuple(validate(p) for p in pred[1:])
    raise ValueError(f"unknown predicate operator {op!r} in {pred!r} (no 'not': push it into the atoms)")


def simplify(pred: tuple) -> tuple:
    """Fold ``true``/``false`` operands, flatten nested ``and``/``or`` of the same kind, drop a
    single operand's ``and``/``or``; atoms are kept as they are (their truth depends on C)."""
    pred = validate(pred)
    op = pred[0]
    if op not in ("and", "or"):
        return pred
    unit, zero = (TRUE, FALSE) if op == "and" else (FALSE, TRUE)
    parts: list = []
    for p in (simplify(p) for p in pred[1:]):
        if p == zero:
            return zero
        if p == unit:
            continue
        parts.extend(p[1:] if p[0] == op else [p])
    if not parts:
        return unit
    return parts[0] if len(parts) == 1 else (op,) + tuple(parts)


def n_consts(pred: tuple) -> int:
    """How many runtime constants the predicate reads: 1 + the largest ``k`` (0 for none)."""
    op = pred[0]
    if op == "atom":
        return pred[3] + 1
    if op in ("and", "or"):
        return max(n_consts(p) for p in pred[1:])
    return 0


def swap(pred: tuple) -> tuple:
    """The same predicate with the roles of ``i`` and ``j`` exchanged (``a`` <-> ``b``): ranges of
    queries for a block of keys come from :func:`render_bounds` on the swapped predicate."""
    op = pred[0]
    if op == "atom":
        return ("atom", pred[2], pred[1], pred[3])
    if op in ("and", "or"):
        return (op,) + tuple(swap(p) for p in pred[1:])
    return pred


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def serialize(pred: tuple) -> str:
    """Canonical text: ``ge(a,b,k)``, ``and(...)``, ``or(...)``, ``true``, ``false``; no spaces."""
    pred = validate(pred)
    op = pred[0]
    if op == "atom":
        return f"ge({pred[1]},{pred[2]},{pred[3]})"
    if op in ("and", "or"):
        return f"{op}(" + ",".join(serialize(p) for p in pred[1:]) + ")"
    return op


_TOKEN = re.compile(r"\s*(?:(-?\d+)|([a-z]+)|(.))")


def parse(text: str) -> tuple:
    """The predicate of a :func:`serialize` text (whitespace allowed); ``ValueError`` if malformed."""
    tokens = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            break
        num, word, sym = m.groups()
        tokens.append(("num", int(num)) if num is not None else ("word", word) if word is not None else ("sym", sym))
        pos = m.end()
    if not tokens:
        raise ValueError(f"empty predicate text {text!r}")
    at = 0

    def take(kind: str, value: Any = None) -> Any:
        nonlocal at
        if at >= len(tokens) or tokens[at][0] != kind or (value is not None and tokens[at][1] != value):
            got = tokens[at][1] if at < len(tokens) else "end of text"
            raise ValueError(f"malformed predicate {text!r}: expected {value or kind} at {got!r}")
        at += 1
        return tokens[at - 1][1]

    def node() -> tuple:
        word = take("word")
        if word in ("true", "false"):
            return (word,)
        if word == "ge":
            take("sym", "(")
            a = take("num")
            take("sym", ",")
            b = take("num")
            take("sym", ",")
            k = take("num")
            take("sym", ")")
            return ("atom", a, b, k)
        if word in ("and", "or"):
            take("sym", "(")
            parts = [node()]
            while at < len(tokens) and tokens[at] == ("sym", ","):
                take("sym", ",")
                parts.append(node())
            take("sym", ")")
            return (word,) + tuple(parts)
        raise ValueError(f"malformed predicate {text!r}: unknown operator {word!r}")

    result = node()
    if at != len(tokens):
        raise ValueError(f"malformed predicate {text!r}: trailing text")
    return validate(result)


def digest(pred: tuple) -> str:
    """A short digest of the canonical text (8 hex digits): part of kernel names."""
    return hashlib.sha256(serialize(pred).encode()).hexdigest()[:8]


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def evaluate(pred: tuple, i: Any, j: Any, consts: Sequence[int]) -> Any:
    """The predicate at query ``i`` and key ``j`` (Python ints, or broadcastable integer
    tensors: then a boolean tensor)."""
    op = pred[0]
    if op == "atom":
        _, a, b, k = pred
        return a * i + b * j + consts[k] >= 0
    if op == "true":
        return True if isinstance(i, int) and isinstance(j, int) else (i * 0 + j * 0) == 0
    if op == "false":
        return False if isinstance(i, int) and isinstance(j, int) else (i * 0 + j * 0) != 0
    parts = [evaluate(p, i, j, consts) for p in pred[1:]]
    out = parts[0]
    for p in parts[1:]:
        out = (out & p) if op == "and" else (out | p)
    return out


# --------------------------------------------------------------------------------------------
# Rendering: words and Triton expressions
# --------------------------------------------------------------------------------------------


def _term(coef: int, name: str, first: bool) -> str:
    """``coef * name`` as a term of a sum: ``i``, ``- i``, ``+ 2 * i``..."""
    mag = abs(coef)
    body = name if mag == 1 else f"{mag} * {name}"
    if first:
        return body if coef > 0 else f"-{body}"
    return f"+ {body}" if coef > 0 else f"- {body}"


def _sum(terms: Iterable[tuple[int, str]], const: int = 0) -> str:
    """A readable sum of ``coef * name`` terms and an integer constant (``0`` when empty)."""
    parts = []
    terms = [t for t in terms if t[0]]
    terms.sort(key=lambda t: t[0] < 0)  # positive terms first: "PC0 - i", not "-i + PC0"
    for coef, name in terms:
        parts.append(_term(coef, name, not parts))
    if const or not parts:
        if not parts:
            parts.append(str(const))
        else:
            parts.append(f"+ {const}" if const > 0 else f"- {-const}")
    return " ".join(parts)


def _atom_text(a: int, b: int, c: str, i: str, j: str) -> str:
    """``a*i + b*j + c >= 0`` solved for ``j`` where it can be: ``j <= i + PC0``."""
    if b < 0:  # |b| j <= a i + c
        return f"{_sum([(-b, j)])} <= {_sum([(a, i), (1, c)])}"
    if b > 0:  # b j >= -a i - c
        return f"{_sum([(b, j)])} >= {_sum([(-a, i), (-1, c)])}"
    if a < 0:  # |a| i <= c
        return f"{_sum([(-a, i)])} <= {c}"
    if a > 0:
        return f"{_sum([(a, i)])} >= -{c}"
    return f"{c} >= 0"


def describe(pred: tuple, consts: Optional[Sequence[str]] = None, i: str = "i", j: str = "j") -> str:
    """The predicate in words, e.g. ``j <= i + PC0 and j >= i - PC1`` (``or`` operands of an
    ``and`` and vice versa are parenthesised)."""
    pred = validate(pred)
    names = list(consts) if consts is not None else [f"PC{k}" for k in range(n_consts(pred))]

    def go(p: tuple, outer: Optional[str]) -> str:
        op = p[0]
        if op == "atom":
            return _atom_text(p[1], p[2], names[p[3]], i, j)
        if op in ("true", "false"):
            return op
        text = f" {op} ".join(go(q, op) for q in p[1:])
        return f"({text})" if outer is not None and outer != op else text

    return go(pred, None)


def render_elementwise(
    pred: tuple,
    i: str = "offs_m[:, None]",
    j: str = "offs_n[None, :]",
    consts: Optional[Sequence[str]] = None,
) -> str:
    """The Triton expression of the predicate on a tile: ``i`` and ``j`` are the broadcast index
    expressions, ``consts`` the names of the runtime constants (``PC0``, ...). An atom solved for
    ``j`` where it can be (``(offs_n[None, :] <= offs_m[:, None] + PC0)``); an atom without ``j``
    gives a ``[BLOCK_M, 1]`` column (broadcast by its use); ``true``/``false`` compare ``j`` to
    0 (always true / false for key indices)."""
    pred = validate(pred)
    names = list(consts) if consts is not None else [f"PC{k}" for k in range(n_consts(pred))]

    def go(p: tuple) -> str:
        op = p[0]
        if op == "atom":
            return f"({_atom_text(p[1], p[2], names[p[3]], i, j)})"
        if op == "true":
            return f"({j} >= 0)"
        if op == "false":
            return f"({j} < 0)"
        glue = " & " if op == "and" else " | "
        return "(" + glue.join(go(q) for q in p[1:]) + ")"

    return go(pred)


# --------------------------------------------------------------------------------------------
# Rendering: loop bounds
# --------------------------------------------------------------------------------------------

# Floor division by a positive int whatever the platform's integer division rounds to (Triton's
# ``//`` truncates toward zero): a truncated quotient that overshoots is one too large.
FLOORDIV_HELPER = '''@triton.jit
def _floordiv(x, d):
    """floor(x / d) for d > 0 (Triton's // truncates toward zero)."""
    q = x // d
    return tl.where(q * d > x, q - 1, q)'''


def needs_floordiv(pred: tuple) -> bool:
    """Whether :func:`render_bounds` uses ``_floordiv`` (an atom with ``|a|`` or ``|b| > 1``:
    the bounds of either role divide by it)."""
    op = pred[0]
    if op == "atom":
        return abs(pred[1]) > 1 or abs(pred[2]) > 1
    if op in ("and", "or"):
        return any(needs_floordiv(p) for p in pred[1:])
    return False


class _Bounds:
    """Straight-line code building [lo, hi) and [full_lo, full_hi) (None: unbounded side)."""

    def __init__(self, first: str, last: str, size: str, consts: Sequence[str], prefix: str):
        self.first, self.last, self.size, self.consts, self.prefix = first, last, size, consts, prefix
        self.lines: list[str] = []
        self.count = 0
        self.clipped: set[str] = {"0", size}  # expressions known to lie in [0, size]

    def tmp(self, expr: str, clipped: bool = False) -> str:
        name = f"{self.prefix}{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {expr}")
        if clipped:
            self.clipped.add(name)
        return name

    # -- one atom ----------------------------------------------------------------------------
    def atom(self, a: int, b: int, k: int, full: bool) -> tuple[Optional[str], Optional[str]]:
        """(lo, hi) of one atom: the hull over the rows, or with ``full`` where it holds for all."""
        c = self.consts[k]
        # (b > 0: j >= ceil(-(a*i + c) / b); b < 0: j <= floor((a*i + c) / -b); b == 0: the atom
        # holds for some row (hull) / every row (full)): each wants a*i + c at its largest over the
        # rows for the hull and at its smallest for the full range
        largest = self.last if a > 0 else self.first
        smallest = self.first if a > 0 else self.last
        row = smallest if full else largest
        if b > 0:
            if b == 1:
                return _sum([(-a, row), (-1, c)]), None
            # ceil(x / b) = -floor(-x / b)
            return f"-_floordiv({_sum([(a, row), (1, c)])}, {b})", None
        if b < 0:
            if b == -1:
                return None, _sum([(a, row), (1, c)], 1)
            return None, f"_floordiv({_sum([(a, row), (1, c)])}, {-b}) + 1"
        gate = f"tl.where({_sum([(a, row), (1, c)])} >= 0, {self.size}, 0)"
        self.clipped.add(gate)
        return None, gate

    # -- combinations ------------------------------------------------------------------------
    def node(self, p: tuple, full: bool) -> tuple[Optional[str], Optional[str]]:
        op = p[0]
        if op == "atom":
            return self.atom(p[1], p[2], p[3], full)
        if op == "true":
            return None, None
        if op == "false":
            return None, "0"
        parts = [self.node(q, full) for q in p[1:]]
        if op == "and":  # intersection
            return _fold("tl.maximum", [lo for lo, _ in parts]), _fold("tl.minimum", [hi for _, hi in parts])
        if not full:  # hull of the union
            los, his = [lo for lo, _ in parts], [hi for _, hi in parts]
            lo = None if any(x is None for x in los) else _fold("tl.minimum", los)
            hi = None if any(x is None for x in his) else _fold("tl.maximum", his)
            return lo, hi
        # full range of an "or": each operand's full range is fully true; the union of two such
        # intervals is one interval where they overlap or touch, else the larger one is kept
        lo, hi = self.concrete(*parts[0])
        for q in parts[1:]:
            lo2, hi2 = self.concrete(*q)
            if lo == lo2 == "0":  # both start at 0: the union is [0, max)
                hi = self.tmp(self.max(hi, hi2), clipped=True)
                continue
            if hi == hi2 == self.size:  # both end at size: the union is [min, size)
                lo = self.tmp(self.min(lo, lo2), clipped=True)
                continue
            joined = self.tmp(f"{self.max(lo, lo2)} <= {self.min(hi, hi2)}")
            larger = self.tmp(f"{_minus(hi, lo)} >= {_minus(hi2, lo2)}")
            new_lo = self.tmp(f"tl.where({joined}, {self.min(lo, lo2)}, tl.where({larger}, {lo}, {lo2}))", True)
            hi = self.tmp(f"tl.where({joined}, {self.max(hi, hi2)}, tl.where({larger}, {hi}, {hi2}))", True)
            lo = new_lo
        return lo, hi

    # min / max of two values within [0, size], simplified where one side is 0 or size
    def min(self, x: str, y: str) -> str:
        if "0" in (x, y):
            return "0"
        if x == self.size or x == y:
            return y
        return x if y == self.size else f"tl.minimum({x}, {y})"

    def max(self, x: str, y: str) -> str:
        if self.size in (x, y):
            return self.size
        if x == "0" or x == y:
            return y
        return x if y == "0" else f"tl.maximum({x}, {y})"

    def concrete(self, lo: Optional[str], hi: Optional[str]) -> tuple[str, str]:
        """Both sides as expressions within [0, size] (named when they need clipping)."""
        return self.clip(lo, "0"), self.clip(hi, self.size)

    def clip(self, x: Optional[str], default: str) -> str:
        if x is None:
            return default
        if x in self.clipped:
            return x if _simple(x) else self.tmp(x, clipped=True)
        return self.tmp(f"tl.minimum(tl.maximum({x}, 0), {self.size})", clipped=True)


def _simple(x: str) -> bool:
    """A name or a number (worth no temporary of its own)."""
    return re.fullmatch(r"-?\w+", x) is not None


def _minus(x: str, y: str) -> str:
    return x if y == "0" else f"{x} - {y}"


def _fold(fn: str, xs: list[Optional[str]]) -> Optional[str]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    out = xs[0]
    for x in xs[1:]:
        out = f"{fn}({out}, {x})"
    return out


def render_bounds(
    pred: tuple,
    *,
    hull: bool = True,
    first: str = "i_first",
    last: str = "i_last",
    size: str = "N_K",
    consts: Optional[Sequence[str]] = None,
    names: tuple[str, str, str, str] = ("lo", "hi", "full_lo", "full_hi"),
    tmp: str = "_b",
) -> list[str]:
    """Straight-line code (one statement a line) for a block of rows ``[first, last]`` (scalar
    expressions or names: the block's first and last real row) over keys ``[0, size)``: assigns
    ``names`` = (lo, hi, full_lo, full_hi) — ``lo``, ``full_lo`` >= 0, ``hi``, ``full_hi``
    <= ``size``; ``lo >= hi`` is an empty range — such that the predicate
    is false for every row of the block at every key outside ``[lo, hi)``, and true for every
    (row, key) with a key in ``[full_lo, full_hi)`` (empty when ``full_lo >= full_hi``).

    Uses ``tl.minimum``, ``tl.maximum``, ``tl.where`` and, where :func:`needs_floordiv`,
    ``_floordiv`` (:data:`FLOORDIV_HELPER`): valid Python on ints with those substituted
    (:func:`eval_bounds`). Temporaries are named ``tmp`` + a number. ``hull=False`` leaves out
    ``lo``, ``hi`` (for kernels that visit every key anyway: a finite fill)."""
    pred = simplify(pred)
    cnames = list(consts) if consts is not None else [f"PC{k}" for k in range(n_consts(pred))]
    b = _Bounds(first, last, size, cnames, tmp)
    lines = []
    for (lo_name, hi_name), full in (((names[0], names[1]), False), ((names[2], names[3]), True)):
        if not full and not hull:
            continue
        lo, hi = b.node(pred, full)
        lines += b.lines
        b.lines = []
        lines.append(f"{lo_name} = " + ("0" if lo is None else lo if lo in b.clipped else f"tl.maximum({lo}, 0)"))
        lines.append(f"{hi_name} = " + (size if hi is None else hi if hi in b.clipped else f"tl.minimum({hi}, {size})"))
    return lines


def eval_bounds(lines: Sequence[str], env: dict) -> dict:
    """Run :func:`render_bounds` code on Python ints (``env``: the row bounds, the size and the
    constants by name); returns the namespace. ``tl.*`` and ``_floordiv`` are substituted with
    Python equivalents (``_floordiv`` emulates Triton's truncating ``//`` and the correction of
    :data:`FLOORDIV_HELPER`, so the test covers the helper too)."""

    class _TL:
        minimum = staticmethod(min)
        maximum = staticmethod(max)

        @staticmethod
        def where(c, x, y):
            return x if c else y

    def trunc_div(x: int, d: int) -> int:
        q = abs(x) // abs(d)
        return q if (x >= 0) == (d > 0) else -q

    def floordiv(x: int, d: int) -> int:
        q = trunc_div(x, d)
        return q - 1 if q * d > x else q

    ns = dict(env, tl=_TL, _floordiv=floordiv)
    exec("\n".join(lines), ns)  # noqa: S102 - our own rendered code, in tests
    return ns
