"""A canonical view of FX graphs: one op name per computation, whatever its spelling.

Graphs reach fuser from Dynamo (torch functions, ``Tensor`` methods, ``operator`` functions,
in-place variants), from ``torch.fx.symbolic_trace`` (the same, without shape metadata until
propagated) and from ``make_fx`` / AOT (ATen overloads). :class:`GraphView` maps every node
to a :class:`COp` — a canonical op name, its operands in a fixed order and normalised
attributes (non-negative dims, dtypes) — without changing the graph: the rewrite later
replaces matched regions of the *original* graph, and everything unmatched stays exactly as
Dynamo produced it.

The view also resolves in-place ops: after ``s.masked_fill_(m, -inf)`` Dynamo's graph keeps
feeding ``s`` to later users; :meth:`GraphView.operand` returns the mutating node instead, so
patterns see the value a user actually reads.

The module also holds the helpers on single nodes that the pass and the patterns share:
:func:`val` reads a node's value metadata (seen through :func:`values_viewed` while the pass
plans: per-rank shapes of DTensors, ``fuser/distributed.py``), :func:`annotate` sets it on a
node a rewrite inserted, :func:`location` names the user code behind a node.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import logging
import math
import operator
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten
log = logging.getLogger("fuser")


@dataclasses.dataclass(frozen=True)
class COp:
    """A node seen canonically.

    Attributes:
        op: canonical name (``"matmul"``, ``"softmax"``, ``"mul"``, ``"cast"``, ...).
        args: operands in canonical order: ``fx.Node`` or Python values.
        attrs: normalised attributes (e.g. ``dim`` non-negative, ``dtype``).
        node: the FX node.
        parts: other nodes this op consists of (``torch.max(x, d)[0]`` is one ``amax`` made
            of the ``max`` node and the ``getitem``); a match that takes the op takes them too.
    """

    op: str
    args: tuple
    attrs: Mapping[str, Any]
    node: fx.Node
    parts: tuple = ()


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _varargs(node: fx.Node, start: int, name: str) -> tuple:
    """Sizes/dims given as varargs (``x.view(a, b)``) or one sequence (``x.view((a, b))``)."""
    rest = node.args[start:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return tuple(rest[0])
    if not rest and name in node.kwargs:
        return tuple(node.kwargs[name])
    return tuple(rest)


#: The function :func:`val` passes each value through, or None (see :func:`values_viewed`).
_value_view: contextvars.ContextVar[Optional[Callable[[Any], Any]]] = contextvars.ContextVar(
    "fuser_value_view", default=None)


@contextlib.contextmanager
def values_viewed(view: Callable[[Any], Any]) -> Iterator[None]:
    """Inside the block, :func:`val` (and so :func:`shape`, :func:`ndim`, :func:`dtype`,
    :func:`is_tensor`) returns ``view(value)`` instead of a node's value metadata.

    The pass plans inside such a block: ``fuser.distributed.planning_view`` shows every DTensor
    as a tensor of its local shard's shape, so that the patterns' cost models, plan choices and
    the kernels they render for reports see the shapes each rank's kernels run on, while matching
    and emitting (outside the block) see the graph's own values. The graph's metadata is never
    written. Blocks nest (the innermost view applies) and are per thread and per task
    (a :class:`contextvars.ContextVar`).

    Args:
        view: value -> value; called with every non-None value :func:`val` would return
            (tensors, SymInts, tuples of them, Python values) and must return the others as given.
    """
    token = _value_view.set(view)
    try:
        yield
    finally:
        _value_view.reset(token)


def _meta_val(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return node
    for key in ("example_value", "val"):
        v = node.meta.get(key)
        if v is not None:
            return v
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    return None


def val(node: Any) -> Any:
    """A node's value metadata: a (fake) tensor, SymInt or Python value; None if unknown.
    Inside :func:`values_viewed`, that value as the block's view shows it."""
    v = _meta_val(node)
    view = _value_view.get()
    return view(v) if view is not None and v is not None else v


def is_tensor(x: Any) -> bool:
    return isinstance(val(x), torch.Tensor)


def shape(x: Any) -> Optional[tuple]:
    v = val(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def ndim(x: Any) -> Optional[int]:
    s = shape(x)
    return None if s is None else len(s)


def dtype(x: Any) -> Optional[torch.dtype]:
    v = val(x)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _norm_dim(dim: Any, rank: Optional[int]) -> Any:
    if isinstance(dim, int) and rank is not None and dim < 0:
        return dim + rank
    return dim


# ---------------------------------------------------------------------------------------------
# Spelling tables. Each canonical op lists the callables (call_function targets) and method
# names (call_method targets) that spell it; ATen overloads are listed by packet.
# ---------------------------------------------------------------------------------------------

def _fns(*names: str) -> set:
    out = set()
    for n in names:
        mod, _, attr = n.rpartition(".")
        obj = {"torch": torch, "torch.special": torch.special, "F": F, "operator": operator, "Tensor": torch.Tensor}[mod]
        if hasattr(obj, attr):
            out.add(getattr(obj, attr))
    return out


def _aten(*names: str) -> set:
    out = set()
    for n in names:
        if hasattr(aten, n):
            packet = getattr(aten, n)
            out.add(packet)
            for ov in packet.overloads():
                out.add(getattr(packet, ov))
    return out


_BINARY = {
    "mul": (_fns("operator.mul", "operator.imul", "torch.mul", "torch.multiply") | _aten("mul"), {"mul", "mul_", "multiply", "__mul__", "__rmul__"}),
    "div": (_fns("operator.truediv", "operator.itruediv", "torch.div", "torch.true_divide", "torch.divide") | _aten("div"), {"div", "div_", "true_divide", "divide", "__truediv__"}),
    "add": (_fns("operator.add", "operator.iadd", "torch.add") | _aten("add"), {"add", "add_", "__add__", "__radd__"}),
    "sub": (_fns("operator.sub", "operator.isub", "torch.sub", "torch.subtract") | _aten("sub"), {"sub", "sub_", "subtract", "__sub__"}),
}
_UNARY = {
    "exp": (_fns("torch.exp") | _aten("exp"), {"exp", "exp_"}),
    "log": (_fns("torch.log") | _aten("log"), {"log", "log_"}),
    "neg": (_fns("operator.neg", "torch.neg") | _aten("neg"), {"neg", "neg_", "__neg__"}),
    "identity": (_fns("torch.clone") | _aten("clone", "alias", "contiguous"), {"contiguous", "clone"}),
    "detach": (_fns("torch.detach") | _aten("detach"), {"detach"}),
}
_MATMUL = _fns("operator.matmul", "torch.matmul", "torch.bmm") | _aten("matmul", "bmm", "mm")
_MATMUL_M = {"matmul", "bmm", "mm", "__matmul__"}
_SOFTMAX = _fns("F.softmax", "torch.softmax", "torch.special.softmax") | _aten("softmax", "_softmax")
_LOG_SOFTMAX = _fns("F.log_softmax", "torch.log_softmax", "torch.special.log_softmax") | _aten("log_softmax", "_log_softmax")
_AMAX = _fns("torch.amax") | _aten("amax")
_MAX = _fns("torch.max") | _aten("max")
_SUM = _fns("torch.sum") | _aten("sum")
_MEAN = _fns("torch.mean") | _aten("mean")
_KL_DIV = _fns("F.kl_div", "torch.kl_div") | _aten("kl_div")
_SDPA = _fns("F.scaled_dot_product_attention") | _aten("scaled_dot_product_attention")
_MASKED_FILL = _fns("torch.masked_fill") | _aten("masked_fill")
_WHERE = _fns("torch.where") | _aten("where")
_DROPOUT = _fns("F.dropout", "torch.dropout") | _aten("dropout")
_NATIVE_DROPOUT = _aten("native_dropout")  # (built once: _aten lists overloads, ~0.1 ms a call)
_TRANSPOSE = _fns("torch.transpose", "torch.swapaxes", "torch.swapdims") | _aten("transpose")
_PERMUTE = _fns("torch.permute") | _aten("permute")
_T = _fns("torch.t") | _aten("t")
_EXPAND = _aten("expand")
_RESHAPE = _fns("torch.reshape", "torch.flatten", "torch.unsqueeze", "torch.squeeze") | _aten(
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten"
)
_RESHAPE_M = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as"}
_REPEAT_INTERLEAVE = _fns("torch.repeat_interleave") | _aten("repeat_interleave")
_EINSUM = _fns("torch.einsum") | {torch.functional.einsum}
_BADDBMM = _fns("torch.baddbmm") | _aten("baddbmm")
_TO_COPY = _aten("_to_copy", "to")
_CONVERT = set()
if hasattr(torch.ops, "prims") and hasattr(torch.ops.prims, "convert_element_type"):
    _CONVERT = {torch.ops.prims.convert_element_type, torch.ops.prims.convert_element_type.default}
_SELECT = _fns("torch.select") | _aten("select")
_STACK = _fns("torch.stack") | _aten("stack")
# fresh allocations: (fill value; None for empty) by spelling
_ALLOC = {fn: fill for names, fill in ((("torch.zeros",), 0.0), (("torch.ones",), 1.0), (("torch.empty",), None))
          for fn in _fns(*names)}
_ALLOC_LIKE = {fn: fill for names, fill in ((("torch.zeros_like",), 0.0), (("torch.ones_like",), 1.0),
                                            (("torch.empty_like",), None)) for fn in _fns(*names)}
_ALLOC_M = {"new_zeros": 0.0, "new_ones": 1.0, "new_empty": None}
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _einsum_as_matmul(eq: str, a_rank: int, b_rank: int) -> Optional[dict]:
    """``einsum(eq, A, B)`` as ``matmul(A.permute(pa), B.permute(pb)).permute(po)`` when it
    is a batched matrix product in any layout (``"bhqd,bhkd->bhqk"``, ``"bnhd,bmhd->bhnm"``,
    ``"bhnm,bmhd->bnhd"``, ``...`` for leading dims).

    Returns ``{"pa", "pb", "po"}``: permutations (tuples, None for the identity), or None when
    the equation is not one contraction between two operands whose other letters are batch
    letters (in both operands and the output) and one free letter each.
    """
    eq = eq.replace(" ", "")
    if "->" not in eq or eq.count(",") != 1:
        return None
    ins, out = eq.split("->")
    a, b = ins.split(",")

    def expand(s: str, rank: int) -> Optional[list]:
        if "..." in s:
            pre, post = s.split("...")
            n = rank - len(pre) - len(post)
            if n < 0:
                return None
            return list(pre) + [f"_{i}" for i in range(n)] + list(post)
        return list(s) if len(s) == rank else None

    la, lb = expand(a, a_rank), expand(b, b_rank)
    if la is None or lb is None:
        return None
    lo = expand(out, max(a_rank, b_rank) if "..." in out else len(out))
    if lo is None or len(la) < 2 or len(lb) < 2 or len(lo) < 2:
        return None
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(lo)) != len(lo):
        return None  # a repeated letter is a diagonal or a trace, not a matmul
    contract = [c for c in la if c in lb and c not in lo]
    if len(contract) != 1:
        return None
    c = contract[0]
    batch = [x for x in lo if x in la and x in lb]
    fa = [x for x in la if x not in lb]
    fb = [x for x in lb if x not in la]
    if len(fa) != 1 or len(fb) != 1 or sorted(batch + fa + fb) != sorted(lo):
        return None
    if sorted(batch + fa + [c]) != sorted(la) or sorted(batch + fb + [c]) != sorted(lb):
        return None
    pa = tuple(la.index(x) for x in batch) + (la.index(fa[0]), la.index(c))
    pb = tuple(lb.index(x) for x in batch) + (lb.index(c), lb.index(fb[0]))
    mat = batch + fa + fb
    po = tuple(mat.index(x) for x in lo)

    def norm(p):
        return None if p == tuple(range(len(p))) else p

    return {"pa": norm(pa), "pb": norm(pb), "po": norm(po)}


def einsum_letters(eq: str, ranks: tuple) -> Optional[tuple]:
    """The letters of ``eq`` per operand and for the output, ``...`` expanded to the ranks
    given (``("_0", "_1", ...)``; an implicit output, written without ``->``, is the letters
    that appear once, sorted, as torch defines it): ``((letters of operand 0), ...,
    (output letters))``, or None when ``eq`` does not fit the ranks."""
    eq = eq.replace(" ", "")
    ins, arrow, out = eq.partition("->")
    parts = ins.split(",")
    if len(parts) != len(ranks):
        return None
    longest = 0
    expanded = []
    for s, rank in zip(parts, ranks):
        if rank is None:
            return None
        if "..." in s:
            pre, post = s.split("...")
            k = rank - len(pre) - len(post)
            if k < 0:
                return None
            longest = max(longest, k)
            expanded.append(tuple(pre) + tuple(f"_{i + (longest - k)}" for i in range(k)) + tuple(post))
        elif len(s) != rank:
            return None
        else:
            expanded.append(tuple(s))
    if not arrow:
        counts = {c: sum(p.count(c) for p in parts) for c in set(ins) - {",", "."}}
        lo = tuple(f"_{i}" for i in range(longest)) + tuple(sorted(c for c, k in counts.items() if k == 1))
    elif "..." in out:
        pre, post = out.split("...")
        lo = tuple(pre) + tuple(f"_{i}" for i in range(longest)) + tuple(post)
    else:
        lo = tuple(out)
    return tuple(expanded) + (lo,)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def single_int_index(idx: tuple, rank: Optional[int]) -> Optional[int]:
    """The dim an index tuple selects with its one integer, when every other entry is ``:``
    or one ``...`` (no ``None``, tensor or strided slice); else None."""
    ints = [i for i, e in enumerate(idx) if _is_int(e)]
    if len(ints) != 1 or rank is None:
        return None
    if not all(_is_int(e) or e == slice(None) or e is Ellipsis for e in idx) or sum(e is Ellipsis for e in idx) > 1:
        return None
    pos = ints[0]
    if Ellipsis in idx[:pos]:
        return rank - (len(idx) - pos)
    return pos


def compose(first: Optional[tuple], then: Optional[tuple]) -> Optional[tuple]:
    """The permutation ``x.permute(first).permute(then)`` as one (None: the identity)."""
    if first is None:
        p = then
    elif then is None:
        p = first
    else:
        p = tuple(first[i] for i in then)
    return None if p is None or p == tuple(range(len(p))) else p


def swap_last2(rank: int) -> tuple:
    """The permutation that transposes the last two dims."""
    p = list(range(rank))
    p[-1], p[-2] = p[-2], p[-1]
    return tuple(p)


def permuted(sizes: Any, perm: Optional[tuple]) -> tuple:
    """``sizes`` reordered by ``perm`` (as ``x.permute(perm).shape``)."""
    sizes = tuple(sizes)
    return sizes if perm is None else tuple(sizes[i] for i in perm)


_INPLACE_OPERATORS = {
    getattr(operator, name) for name in (
        "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior",
        "ixor", "ilshift", "irshift",
    )
}
# canonical ops whose result may share memory with their first operand
_VIEW_OPS = {"permute", "reshape", "expand", "identity", "detach", "cast", "select"}
_VIEW_METHODS = {"view", "view_as", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
                 "expand_as", "narrow", "select", "unflatten", "flatten", "as_strided", "detach", "contiguous",
                 "__getitem__", "swapaxes", "swapdims", "movedim", "unfold", "split", "chunk", "unbind"}


def written_args(n: fx.Node) -> list[fx.Node]:
    """The nodes whose memory ``n`` writes in place: the tensor of a method ending in ``_``
    (``x.mul_(2)``) or of ``operator.i*``/``setitem``, ``out=`` tensors, the input of an
    ``inplace=True`` call, and the arguments an ATen overload's schema marks as written."""
    out: list = []
    t = n.target
    if n.op == "call_method" and isinstance(t, str) and t.endswith("_") and not t.startswith("_"):
        out.append(n.args[0] if n.args else None)
    elif n.op == "call_function":
        if t in _INPLACE_OPERATORS or t is operator.setitem:
            out.append(n.args[0])
        elif isinstance(t, torch._ops.OpOverload):
            for i, a in enumerate(t._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    out.append(n.args[i] if i < len(n.args) else n.kwargs.get(a.name))
        elif getattr(t, "__module__", None) not in ("_operator", "operator"):  # operator.and_ is not in place
            name = getattr(t, "__name__", "")
            if name.endswith("_") and not name.startswith("_") and n.args:
                out.append(n.args[0])
        if n.kwargs.get("inplace") is True and n.args and not isinstance(t, torch._ops.OpOverload):
            out.append(n.args[0])
        o = n.kwargs.get("out")
        out.extend(o if isinstance(o, (list, tuple)) else [o])
    return [x for x in out if isinstance(x, fx.Node)]


def _grad_mode_after(n: fx.Node, mode: bool, stack: list) -> bool:
    """The grad mode after node ``n`` has run, given the mode before it."""
    if n.op != "call_function":
        return mode
    name = getattr(n.target, "__name__", "")
    if name in ("_set_grad_enabled", "set_grad_enabled") and n.args and isinstance(n.args[0], bool):
        return n.args[0]
    if name == "_enter_inference_mode":
        stack.append(mode)
        return False if (not n.args or n.args[0]) else mode
    if name == "_exit_inference_mode":
        return stack.pop() if stack else mode
    return mode


class GraphView:
    """Canonical, read-only view of an ``fx.Graph`` (see the module docstring).

    Args:
        graph: the graph; nodes should carry ``meta["example_value"]`` (Dynamo) or
            ``meta["val"]`` (make_fx/AOT) so shapes and dtypes are known.
    """

    def __init__(self, graph: fx.Graph, grad_enabled: bool = True):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self._canon: dict[fx.Node, Optional[COp]] = {}
        # base node -> nodes that mutate it in place and whose value carries on (x.add_(1),
        # x += 1, x[i] = v), in graph order: what `operand` resolves reads through
        self.mutations: dict[fx.Node, list[fx.Node]] = {}
        # every in-place write in the graph, as (writing node, written node), in graph order:
        # methods ending in "_", operator.i*, setitem, out= and inplace=True arguments, and
        # ATen overloads whose schema marks an argument as written
        self.writes: list[tuple[fx.Node, fx.Node]] = []
        # the grad mode each node runs under (Dynamo keeps `with torch.no_grad()` as
        # torch._C._set_grad_enabled calls in the graph)
        self.grad_enabled: dict[fx.Node, bool] = {}
        mode, stack = grad_enabled, []
        for n in self.nodes:
            self.grad_enabled[n] = mode
            mode = _grad_mode_after(n, mode, stack)
            base = self._mutated_base(n)
            if base is not None:
                self.mutations.setdefault(base, []).append(n)
            for w in written_args(n):
                self.writes.append((n, w))
        self._alias: dict[fx.Node, Any] = {}
        self._groups: Optional[dict] = None
        self._mutation_pos: dict[fx.Node, list] = {}
        self._users_by_pos: dict[fx.Node, list] = {}
        self._writes_by_key: Optional[dict] = None  # writes_between's index (built once)

    # -- in-place resolution -------------------------------------------------------------------
    @staticmethod
    def _mutated_base(n: fx.Node) -> Optional[fx.Node]:
        if n.op == "call_method" and isinstance(n.target, str) and n.target.endswith("_") and not n.target.startswith("_"):
            base = n.args[0] if n.args else None
        elif n.op == "call_function" and n.target in _INPLACE_OPERATORS:
            # Dynamo's graph names the result of `x /= c` as a new node and feeds it onwards;
            # the in-place op on a tensor also mutates x itself.
            base = n.args[0]
        elif n.op == "call_function" and n.target is operator.setitem:
            base = n.args[0]
        else:
            return None
        return base if isinstance(base, fx.Node) and is_tensor(base) else None

    # -- aliasing ---------------------------------------------------------------------------
    def alias_key(self, x: Any) -> Any:
        """A key shared by every node whose tensor value may share memory with ``x``'s: the
        storage of its fake value (views of one tensor share it; Dynamo gives aliased inputs
        one fake storage), else the node reached by walking back through view-like ops. None
        for non-tensors."""
        if not isinstance(x, fx.Node):
            return None
        hit = self._alias.get(x)
        if hit is None:
            hit = self._alias[x] = self._alias_key(x)
        return hit

    def _alias_key(self, x: fx.Node) -> Any:
        v = val(x)
        if isinstance(v, torch.Tensor):
            try:
                return ("storage", StorageWeakRef(v.untyped_storage()).cdata)
            except Exception:  # noqa: BLE001 - e.g. a tensor subclass without a storage
                pass
        elif v is not None:
            return None
        seen = set()
        while isinstance(x, fx.Node) and x not in seen:
            seen.add(x)
            c = self.canon(x) if x in self.order else None
            if c is not None and c.op in _VIEW_OPS and isinstance(c.args[0], fx.Node):
                x = c.args[0]
            elif x.op == "call_function" and x.target is operator.getitem and isinstance(x.args[0], fx.Node) \
                    and is_tensor(x.args[0]):
                x = x.args[0]
            elif x.op == "call_method" and x.target in _VIEW_METHODS and x.args and isinstance(x.args[0], fx.Node):
                x = x.args[0]
            else:
                break
        return ("node", x)

    def aliases(self, key: Any) -> list[fx.Node]:
        """The nodes whose alias key (:meth:`alias_key`) is ``key``, in graph order (grouped once
        per view: a region of an unrolled loop asks for every write it holds)."""
        if key is None:
            return []
        if self._groups is None:
            groups: dict = {}
            for n in self.nodes:
                groups.setdefault(self.alias_key(n), []).append(n)
            self._groups = groups
        return self._groups.get(key, [])

    def writes_between(self, key: Any, lo: int, hi: int, exclude: Any = ()) -> list[fx.Node]:
        """The in-place writes at graph positions strictly between ``lo`` and ``hi`` to memory
        with alias key ``key`` (see :meth:`alias_key`), except those in ``exclude``."""
        if key is None:
            return []
        if self._writes_by_key is None:
            # alias key -> (positions, writers) in graph order, so that each call bisects its
            # span: the pass asks once per input of a region, and an unrolled loop has T of both
            index: dict = {}
            for w, target in self.writes:
                pos_w = index.setdefault(self.alias_key(target), ([], []))
                pos_w[0].append(self.order[w])
                pos_w[1].append(w)
            self._writes_by_key = index
        positions, writers = self._writes_by_key.get(key, ((), ()))
        lo_i, hi_i = bisect.bisect_right(positions, lo), bisect.bisect_left(positions, hi)
        return [w for w in writers[lo_i:hi_i] if w not in exclude]

    def operand(self, x: Any, user: fx.Node) -> Any:
        """The value ``user`` reads through operand ``x``: the latest in-place mutation of
        ``x`` that precedes ``user`` (itself if none)."""
        if not isinstance(x, fx.Node):
            return x
        muts = self.mutations.get(x)
        if not muts:
            return x
        pos = self.order.get(user, math.inf)
        # the mutations are in graph order: the last one before `user` (bisected: an unrolled
        # loop writes one buffer T times)
        keys = self._mutation_pos.get(x)
        if keys is None:
            keys = self._mutation_pos[x] = [self.order[m] for m in muts]
        i = bisect.bisect_left(keys, pos) - 1
        latest = muts[i] if i >= 0 else x
        if latest is not x and latest.op == "call_function" and latest.target is operator.setitem:
            return x  # partial writes are not resolved; patterns treat x as opaque
        return latest

    def readers(self, x: fx.Node) -> list[fx.Node]:
        """Every node that reads the value of ``x`` (including through in-place resolution:
        users of the base that come after ``x`` when ``x`` mutates it)."""
        out = []
        for u in x.users:
            if any(self.operand(a, u) is x for a in flat_args(u)):
                out.append(u)
        base = self._mutated_base(x)
        if base is not None:
            # only users between x and the next write of base can read x's value (a loop writes
            # one buffer T times: bisect rather than scan its users)
            by_pos = self._users_by_pos.get(base)
            if by_pos is None:
                users = sorted((u for u in base.users if u in self.order), key=self.order.__getitem__)
                by_pos = self._users_by_pos[base] = ([self.order[u] for u in users], users)
            keys = self._mutation_pos.get(base)
            if keys is None:
                keys = self._mutation_pos[base] = [self.order[m] for m in self.mutations[base]]
            pos = self.order[x]
            i = bisect.bisect_right(keys, pos)
            nxt = keys[i] if i < len(keys) else math.inf
            positions, users = by_pos
            for j in range(bisect.bisect_right(positions, pos), len(users)):
                u = users[j]
                if positions[j] > nxt:
                    break
                if u is not x and any(self.operand(a, u) is x for a in flat_args(u)):
                    out.append(u)
        return out

    # -- canonicalisation ------------------------------------------------------------------
    def canon(self, node: Any) -> Optional[COp]:
        """The :class:`COp` of ``node``, or None for ops fuser has no name for."""
        if not isinstance(node, fx.Node):
            return None
        if node not in self._canon:
            c = self._canonicalize(node)
            if c is not None:
                c = dataclasses.replace(c, args=tuple(self.operand(a, node) for a in c.args))
            self._canon[node] = c
        return self._canon[node]

    def op(self, node: Any) -> Optional[str]:
        c = self.canon(node)
        return c.op if c else None

    def _canonicalize(self, n: fx.Node) -> Optional[COp]:  # noqa: C901 - a table, not logic
        t = n.target
        fn = n.op == "call_function"
        meth = n.op == "call_method"
        if not (fn or meth):
            return None
        x0 = n.args[0] if n.args else None
        rank0 = ndim(x0)

        def mk(op: str, args: tuple, **attrs: Any) -> COp:
            return COp(op, args, attrs, n)

        for name, (fset, mset) in _BINARY.items():
            if (fn and t in fset) or (meth and t in mset):
                if len(n.args) < 2:
                    return None
                a, b = n.args[0], n.args[1]
                if t in ("__rmul__", "__radd__"):
                    a, b = b, a
                if name == "div" and _arg(n, 2, "rounding_mode") is not None:
                    return None
                if name in ("add", "sub"):
                    alpha = n.kwargs.get("alpha", 1)
                    if alpha != 1:
                        return None
                return mk(name, (a, b))
        for name, (fset, mset) in _UNARY.items():
            if (fn and t in fset) or (meth and t in mset):
                if name == "identity" and n.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
                    return None
                return mk(name, (x0,))
        if (fn and t in _MATMUL) or (meth and t in _MATMUL_M):
            return mk("matmul", (n.args[0], n.args[1]), pa=None, pb=None, po=None)
        if fn and t in _EINSUM:
            eq = n.args[0]
            ops = n.args[1:]
            if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
                ops = tuple(ops[0])
            if not isinstance(eq, str) or len(ops) != 2:
                return None
            ra, rb = ndim(ops[0]), ndim(ops[1])
            if ra is None or rb is None:
                return None
            letters = einsum_letters(eq, (ra, rb))
            form = _einsum_as_matmul(eq, ra, rb)
            if form is None:
                # any other two-operand einsum (an outer product 'bhk,bhv->bhkv', a contraction
                # with a free letter on one side only 'bhk,bhkv->bhv'): its letters, expanded
                return mk("einsum", (ops[0], ops[1]), equation=letters) if letters is not None else None
            return mk("matmul", (ops[0], ops[1]), equation=letters, **form)
        if (fn and t in _BADDBMM) or (meth and t == "baddbmm"):
            beta = n.kwargs.get("beta", 1)
            alpha = n.kwargs.get("alpha", 1)
            return mk("baddbmm", (n.args[0], n.args[1], n.args[2]), alpha=alpha, beta=beta)
        if (fn and t in _SOFTMAX) or (meth and t == "softmax"):
            return self._softmax_like(n, "softmax")
        if (fn and t in _LOG_SOFTMAX) or (meth and t == "log_softmax"):
            return self._softmax_like(n, "log_softmax")
        if (fn and t in _AMAX) or (meth and t == "amax"):
            dims = _arg(n, 1, "dim", ())
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            return mk("amax", (x0,), dim=tuple(_norm_dim(d, rank0) for d in dims), keepdim=bool(_arg(n, 2, "keepdim", False)))
        if fn and t is operator.getitem and n.args[1] == 0 and isinstance(x0, fx.Node):
            # torch.max(x, dim, keepdim)[0] / .values
            if (x0.op == "call_function" and x0.target in _MAX) or (x0.op == "call_method" and x0.target == "max"):
                dim = _arg(x0, 1, "dim", None)
                if isinstance(dim, int):
                    inner = x0.args[0]
                    return COp("amax", (inner,), {"dim": (_norm_dim(dim, ndim(inner)),),
                               "keepdim": bool(_arg(x0, 2, "keepdim", False))}, n, parts=(x0,))
            return None
        if (fn and t in _SUM) or (meth and t == "sum"):
            dims = _arg(n, 1, "dim", None)
            if dims is None:
                return mk("sum", (x0,), dim=None, keepdim=False, dtype=n.kwargs.get("dtype"))
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            return mk("sum", (x0,), dim=tuple(_norm_dim(d, rank0) for d in dims), keepdim=bool(_arg(n, 2, "keepdim", False)), dtype=n.kwargs.get("dtype"))
        if (fn and t in _MEAN) or (meth and t == "mean"):
            dims = _arg(n, 1, "dim", None)
            if dims is None:
                return mk("mean", (x0,), dim=None, keepdim=False)
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            return mk("mean", (x0,), dim=tuple(_norm_dim(d, rank0) for d in dims), keepdim=bool(_arg(n, 2, "keepdim", False)))
        if fn and t in _KL_DIV:
            if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
                # aten.kl_div(self, target, reduction: int = 1, log_target=False)
                reduction, log_target = _arg(n, 2, "reduction", 1), _arg(n, 3, "log_target", False)
                reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction)
                return mk("kl_div", (x0, _arg(n, 1, "target")), reduction=reduction, log_target=bool(log_target))
            # F.kl_div(input, target, size_average, reduce, reduction, log_target)
            if _arg(n, 2, "size_average") is not None or _arg(n, 3, "reduce") is not None:
                return None  # legacy arguments: not worth the semantics table
            reduction = _arg(n, 4, "reduction", "mean")
            return mk("kl_div", (x0, _arg(n, 1, "target")), reduction=reduction, log_target=bool(_arg(n, 5, "log_target", False)))
        if fn and t in _SDPA:
            # F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
            # is_causal=False, scale=None, enable_gqa=False)
            return mk("sdpa", (x0, _arg(n, 1, "key"), _arg(n, 2, "value"), _arg(n, 3, "attn_mask")),
                      dropout_p=_arg(n, 4, "dropout_p", 0.0), is_causal=_arg(n, 5, "is_causal", False),
                      scale=_arg(n, 6, "scale"), enable_gqa=_arg(n, 7, "enable_gqa", False))
        if (fn and t in _MASKED_FILL) or (meth and t in ("masked_fill", "masked_fill_")):
            return mk("masked_fill", (x0, _arg(n, 1, "mask"), _arg(n, 2, "value")))
        if fn and t in _WHERE and len(n.args) + len(n.kwargs) >= 3:
            return mk("where", (_arg(n, 0, "condition"), _arg(n, 1, "input", _arg(n, 1, "self")), _arg(n, 2, "other")))
        if (fn and t in _DROPOUT) or (meth and t == "dropout"):
            p = _arg(n, 1, "p", 0.5)
            training = _arg(n, 2, "training", _arg(n, 2, "train", True))
            return mk("dropout", (x0,), p=p, training=training)
        if fn and t in _NATIVE_DROPOUT:
            return None
        if (fn and t in _TRANSPOSE) or (meth and t in ("transpose", "swapaxes", "swapdims")):
            d0, d1 = _norm_dim(_arg(n, 1, "dim0"), rank0), _norm_dim(_arg(n, 2, "dim1"), rank0)
            if rank0 is None or not isinstance(d0, int) or not isinstance(d1, int):
                return None
            perm = list(range(rank0))
            perm[d0], perm[d1] = perm[d1], perm[d0]
            return mk("permute", (x0,), dims=tuple(perm))
        if (fn and t in _T) or (meth and t == "t") or (fn and t is getattr and n.args[1] in ("mT", "T") and rank0 is not None):
            if rank0 is None or (n.args[-1] == "T" and rank0 != 2):
                return None
            perm = list(range(rank0))
            if rank0 >= 2:
                perm[-1], perm[-2] = perm[-2], perm[-1]
            return mk("permute", (x0,), dims=tuple(perm))
        if (fn and t in _PERMUTE) or (meth and t == "permute"):
            dims = _varargs(n, 1, "dims")
            return mk("permute", (x0,), dims=tuple(_norm_dim(d, rank0) for d in dims))
        if (fn and t in _EXPAND) or (meth and t in ("expand", "expand_as")):
            return mk("expand", (x0,), shape=shape(n))
        if (fn and t in _RESHAPE) or (meth and t in _RESHAPE_M):
            return mk("reshape", (x0,), shape=shape(n))
        if fn and t is operator.getitem and isinstance(x0, fx.Node) and is_tensor(x0):
            idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
            if all(i is None or i == slice(None) or i is Ellipsis for i in idx):
                return mk("reshape", (x0,), shape=shape(n))  # only inserts unit dims
            dim = single_int_index(idx, rank0)
            if dim is not None:  # x[:, t]: one integer index, every other dim whole
                return mk("select", (x0,), dim=dim, index=idx[[i for i, e in enumerate(idx) if _is_int(e)][0]])
            return None
        if (fn and t in _SELECT) or (meth and t == "select"):
            d, i = _arg(n, 1, "dim"), _arg(n, 2, "index")
            if not isinstance(_norm_dim(d, rank0), int) or not _is_int(i):
                return None
            return mk("select", (x0,), dim=_norm_dim(d, rank0), index=i)
        if fn and t is operator.setitem and isinstance(x0, fx.Node) and is_tensor(x0):
            # x[idx] = value, in place: the buffer written and the value; `index` as written
            idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
            return mk("setitem", (x0, n.args[2]), index=idx)
        if fn and t in _STACK:
            tensors = _arg(n, 0, "tensors")
            if not isinstance(tensors, (list, tuple)):
                return None
            d = _arg(n, 1, "dim", 0)
            return mk("stack", tuple(tensors), dim=_norm_dim(d, (ndim(tensors[0]) + 1) if tensors else None))
        if (fn and (t in _ALLOC or t in _ALLOC_LIKE)) or (meth and t in _ALLOC_M):
            fill = _ALLOC.get(t, _ALLOC_LIKE.get(t)) if fn else _ALLOC_M[t]
            return mk("alloc", (), fill=fill, shape=shape(n), dtype=dtype(n))
        if (fn and t in _REPEAT_INTERLEAVE) or (meth and t == "repeat_interleave"):
            reps = _arg(n, 1, "repeats")
            dim = _norm_dim(_arg(n, 2, "dim"), rank0)
            return mk("repeat_interleave", (x0,), repeats=reps, dim=dim)
        # casts
        if meth and t in _CAST_METHODS:
            return mk("cast", (x0,), dtype=_CAST_METHODS[t])
        if meth and t in ("to", "type"):
            dt = n.kwargs.get("dtype")
            for a in n.args[1:]:
                if isinstance(a, torch.dtype):
                    dt = a
            if dt is None and t == "to":
                # a device move or a no-op .to(): identity when the value keeps its dtype
                if dtype(n) is not None and dtype(n) == dtype(x0):
                    return mk("identity", (x0,))
                return None
            if not isinstance(dt, torch.dtype):
                return None
            return mk("cast", (x0,), dtype=dt)
        if meth and t == "type_as":
            dt = dtype(n.args[1])
            return mk("cast", (x0,), dtype=dt) if dt is not None else None
        if fn and (t in _TO_COPY or t in _CONVERT):
            dt = n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 and isinstance(n.args[1], torch.dtype) else None)
            if dt is None:
                return mk("identity", (x0,)) if dtype(n) == dtype(x0) else None
            return mk("cast", (x0,), dtype=dt)
        return None

    def _softmax_like(self, n: fx.Node, op: str) -> Optional[COp]:
        x0 = n.args[0]
        rank0 = ndim(x0)
        if n.op == "call_function" and n.target in (aten._softmax.default, aten._log_softmax.default):
            dim = n.args[1]
            half_to_float = n.args[2]
            dt = torch.float32 if half_to_float else None
        else:
            dim = _arg(n, 1, "dim", None)
            dt = n.kwargs.get("dtype")
            if dt is None:
                for a in n.args[2:]:
                    if isinstance(a, torch.dtype):
                        dt = a
        if not isinstance(dim, int):
            return None
        return COp(op, (x0,), {"dim": _norm_dim(dim, rank0), "dtype": dt}, n)


def flat_args(n: fx.Node) -> list:
    """Every argument of ``n`` (nested in lists/dicts too), in order."""
    out: list = []
    fx.node.map_arg((n.args, n.kwargs), out.append)
    return out


def location(node: fx.Node) -> str:
    """``file:line`` of the user code that produced ``node`` (from Dynamo's stack trace)."""
    st = node.meta.get("stack_trace")
    if not st:
        return node.name
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return node.name
    last = lines[-1]
    try:
        fname = last.split('"')[1]
        lineno = last.split("line ")[1].split(",")[0]
        return f"{fname.rsplit('/', 1)[-1]}:{lineno}"
    except IndexError:
        return node.name


def annotate(node: fx.Node) -> fx.Node:
    """Set ``node.meta['example_value']`` (and ``val``) by running its target on the fake
    values of its inputs, so later passes see shapes of inserted nodes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    args = fx.node.map_arg(node.args, val)
    kwargs = fx.node.map_arg(node.kwargs, val)
    tensors = _tensors_in((args, kwargs))
    # The mode the operands' fake values belong to. Under torch.compile the active tracing
    # context may carry another fake mode than the one Dynamo recorded the graph's values
    # with (mixing them fails), so the operands' own mode comes first.
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    if len(modes) > 1:
        log.debug("fuser: not annotating %s: its operands come from %d fake modes", node.name, len(modes))
        return node
    fake_mode = next(iter(modes.values())) if modes else detect_fake_mode(tuple(tensors))
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
