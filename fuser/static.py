"""Evaluate the parts of a graph that depend only on shapes and constants.

Masks and scales are often computed inside the traced graph from sizes alone: ``torch.tril``
of ``torch.ones(N, N)``, ``arange`` comparisons (transformers' mask utilities), a slice of a
registered causal buffer, ``torch.full([], sqrt(D))``. Such a value is the same function of
the sizes on every call, so fuser can compute it at compile time and look at it: a mask is
causal because its values are, not because of how it was written.

:class:`StaticEvaluator` finds the backward slice of a node, decides whether it is static
(leaves: constants, factory calls, sizes, symbolic-size placeholders, module buffers) and
evaluates it at the example sizes. A value that depends on dynamic sizes is the same
function of the sizes on every call but not the same tensor: evaluating it at a few sizes
proves nothing, so such values are analysed symbolically instead (``fuser/indexmask.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import sympy
import torch
import torch.fx as fx

from .graph import GraphView, flat_args, val
from .names import is_module_buffer

_RANDOM = {
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "multinomial", "randperm", "dropout", "native_dropout",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
}
_SIZE_METHODS = {"size", "dim", "ndimension", "numel", "stride"}
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}
#: Factories whose first argument is read for its metadata alone (shape, dtype, device), with
#: the value each entry gets (None: the ``fill_value`` argument). ``empty_like`` is not one:
#: its values are whatever the memory held.
LIKE_FACTORIES = {"ones_like": 1, "zeros_like": 0, "full_like": None, "new_ones": 1, "new_zeros": 0,
                  "new_full": None}


def reads_metadata_of_first_arg(n: fx.Node) -> bool:
    """True for ``torch.ones_like(x)`` / ``zeros_like`` / ``full_like`` and the methods
    ``x.new_ones(...)`` / ``new_zeros`` / ``new_full``: the result depends on ``x``'s shape,
    dtype and device, never on its values (kvpress builds a mask as ``ones_like(scores) *
    -inf``), so ``x`` is not part of the value's static slice."""
    if n.op == "call_function":
        return n.target in (torch.ones_like, torch.zeros_like, torch.full_like)
    return n.op == "call_method" and n.target in ("new_ones", "new_zeros", "new_full")


def is_metadata_query(n: fx.Node) -> bool:
    """True for a node that reads only a tensor's sizes or metadata, never its values:
    ``x.size(1)``, ``x.dim()``, ``x.numel()``, ``x.stride()``, ``aten.sym_size`` and the like,
    ``getattr(x, "shape")`` / ``dtype`` / ``device`` / ... (its value is the graph's recorded one)."""
    name = _target_name(n)
    return (n.op == "call_method" and name in _SIZE_METHODS) or (
        n.op == "call_function" and (name in ("sym_size", "sym_stride", "sym_numel") or
                                     (n.target is getattr and n.args[1] in _META_ATTRS)))


class NotStatic(Exception):
    """The value depends on data (an input tensor, randomness), not only on sizes."""


def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", str(t)).split(".")[-1]


def symint_value(x: Any, assignment: Optional[Mapping] = None) -> Any:
    """Concrete value of an int/float/SymInt/SymFloat under ``assignment`` (sympy symbol ->
    int); with no assignment, its hint (the value at the example inputs)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = x.node
        if assignment:
            expr = sympy.sympify(node.expr.xreplace(dict(assignment)))
            if expr.free_symbols:
                expr = expr.xreplace(_var_to_val(node.shape_env))
            if isinstance(x, torch.SymInt):
                return int(expr)
            if isinstance(x, torch.SymBool):
                return bool(expr)
            return float(expr)
        hint = node.hint if getattr(node, "hint", None) is not None else None
        if hint is None:
            hint = node.shape_env.size_hint(node.expr)
        return type({torch.SymInt: 1, torch.SymFloat: 1.0, torch.SymBool: True}[type(x)])(hint)
    if isinstance(x, (list, tuple, torch.Size)):
        return type(x)(symint_value(v, assignment) for v in x) if not isinstance(x, torch.Size) else torch.Size(
            [symint_value(v, assignment) for v in x]
        )
    return x


def free_symbols(x: Any) -> set:
    """sympy symbols of the SymInts/SymFloats in ``x`` (nested in tuples)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(x.node.expr.free_symbols)
    if isinstance(x, (list, tuple, torch.Size)):
        out: set = set()
        for v in x:
            out |= free_symbols(v)
        return out
    return set()


@dataclasses.dataclass
class StaticSlice:
    """The static backward slice of one node.

    Attributes:
        nodes: the slice's nodes in graph order (the target node last).
        buffers: names of module-buffer placeholders the value depends on (assumed constant).
        symbols: sympy symbols of dynamic sizes the value depends on.
    """

    nodes: list[fx.Node]
    buffers: list[str]
    symbols: set


class StaticEvaluator:
    """Evaluates static slices of one graph.

    Args:
        view: the graph's :class:`GraphView`.
        inputs: placeholder node -> its concrete example value (real tensors for buffers,
            ints/SymInts for sizes). Missing placeholders are treated as data.
        owner: the ``GraphModule`` holding ``get_attr`` constants, if any.

    Constant leaves: ``get_attr`` tensors that are not parameters (constants of the graph
    module), and placeholders that Dynamo's source information proves to be registered module
    buffers (:func:`fuser.names.is_module_buffer`; assumed constant, and reported as such). Parameters and
    inputs are data.
    """

    def __init__(self, view: GraphView, inputs: Mapping[fx.Node, Any], owner: Optional[torch.nn.Module] = None):
        self.view = view
        self.inputs = dict(inputs)
        self.owner = owner
        # a declined slice is cached as its reason, never as the exception: a raised exception
        # holds its traceback, the traceback every frame up to the compiler's caller, and this
        # cache would keep them alive (see :meth:`slice`)
        self._slices: dict[tuple, StaticSlice | str] = {}

    # ----------------------------------------------------------------------------------
    def slice(self, node: fx.Node, at: Optional[fx.Node] = None) -> StaticSlice:
        """The static slice of ``node`` as the node ``at`` reads it (default: as ``node`` is
        produced): in-place writes to the slice's tensors that come before ``at`` are part of
        it (``m = zeros(...); m[:, :8] = True``). Raises :class:`NotStatic` (with the reason)
        if any of its leaves is data, or a tensor of the slice is written through an alias."""
        key = (node, at)
        hit = self._slices.get(key)
        if isinstance(hit, str):
            raise NotStatic(hit)  # a fresh exception each time: the cache holds no traceback
        if hit is not None:
            return hit
        try:
            result = self._collect(node, at if at is not None else node)
        except NotStatic as exc:
            # The reason, not ``exc``: ``exc.__traceback__`` reaches this frame and, through
            # f_back, every caller up to Dynamo's, and ``self`` -> the cache -> ``exc`` would
            # make that a reference cycle. Frames kept alive until a later collection broke
            # DDPOptimizer, which frees a guard in its per-piece frame by reference counting
            # (tests/fuser/test_backend.py::test_the_backend_leaves_its_callers_frames_...).
            self._slices[key] = str(exc)
            raise
        self._slices[key] = result
        return result

    def _collect(self, node: fx.Node, at: fx.Node) -> StaticSlice:
        seen: dict[fx.Node, None] = {}
        buffers: list[str] = []
        symbols: set = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen[n] = None
            if n.op == "placeholder":
                v = val(n)
                ex = self.inputs.get(n, v)
                if isinstance(v, torch.Tensor) or isinstance(ex, torch.Tensor):
                    name = is_module_buffer(n)
                    if name is None or isinstance(ex, torch.nn.Parameter):
                        raise NotStatic(f"depends on the input tensor '{n.target}'")
                    if ex is None or not isinstance(ex, torch.Tensor) or _is_fake(ex):
                        raise NotStatic(f"the value of buffer '{name}' is not known at compile time")
                    buffers.append(name)
                    continue
                if isinstance(ex, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(
                    v, (torch.SymInt, torch.SymFloat, torch.SymBool)
                ):
                    symbols |= free_symbols(v if v is not None else ex)
                    continue
                if isinstance(ex, (int, float, bool)) or isinstance(v, (int, float, bool)):
                    continue
                raise NotStatic(f"depends on the input '{n.target}'")
            if n.op == "get_attr":
                obj = self._attr(n)
                if isinstance(obj, torch.nn.Parameter):
                    raise NotStatic(f"depends on the parameter '{n.target}'")
                if isinstance(obj, torch.Tensor):
                    buffers.append(str(n.target))
                continue
            if n.op == "output":
                raise NotStatic("output node")
            name = _target_name(n)
            if name in _RANDOM:
                raise NotStatic(f"uses random op '{name}'")
            # sizes and metadata of any tensor are static even when its data is not
            if is_metadata_query(n):
                v = val(n)
                symbols |= free_symbols(v)
                if v is None and isinstance(n.args[0], fx.Node):
                    symbols |= free_symbols(val(n.args[0]).shape) if isinstance(val(n.args[0]), torch.Tensor) else set()
                continue
            skip = None
            if reads_metadata_of_first_arg(n):
                # the shape (and so the symbols) of the result; the tensor read for it is not followed
                v = val(n)
                if not isinstance(v, torch.Tensor):
                    raise NotStatic(f"'{n.name}' has no recorded value")
                symbols |= free_symbols(tuple(v.shape))
                skip = n.args[0] if n.args else n.kwargs.get("input", n.kwargs.get("self"))
            for a in flat_args(n):
                if a is skip:
                    continue
                if isinstance(a, fx.Node):
                    stack.append(self.view.operand(a, n))
            # in-place updates of a node in the slice that precede the reader are part of it
            for m in self.view.mutations.get(n, ()):
                if self.view.order[m] < self.view.order[at]:
                    stack.append(m)
        ordered = sorted(seen, key=lambda x: self.view.order[x])
        # a write through another view of a slice tensor (``m[:, :8].fill_(1)``) before the
        # reader changes the value too: not evaluated, the value is then data
        included = set(ordered)
        for n in ordered:
            key = self.view.alias_key(n) if isinstance(val(n), torch.Tensor) else None
            if key is None:
                continue
            for w in self.view.writes_between(key, self.view.order[n], self.view.order[at]):
                if w not in included:
                    raise NotStatic(f"'{n.name}' is written in place through another view by '{w.name}'")
        return StaticSlice(ordered, buffers, symbols)

    # ----------------------------------------------------------------------------------
    def evaluate(self, node: fx.Node, assignment: Optional[Mapping] = None, at: Optional[fx.Node] = None) -> Any:
        """Concrete value of static ``node`` as ``at`` reads it (see :meth:`slice`), at the
        example sizes or under ``assignment`` (sympy symbol -> int). Raises :class:`NotStatic`."""
        sl = self.slice(node, at)
        env: dict[fx.Node, Any] = {}

        def load(a: Any) -> Any:
            return fx.node.map_arg(a, lambda x: env[x])

        for n in sl.nodes:
            if n.op == "placeholder":
                ex = self.inputs.get(n, val(n))
                if isinstance(ex, torch.Tensor):
                    ex = ex.clone()
                env[n] = symint_value(ex, assignment)
                continue
            if n.op == "get_attr":
                env[n] = self._attr(n)
                continue
            if is_metadata_query(n):
                v = val(n)
                if v is None or isinstance(v, torch.Tensor):
                    # e.g. getattr(x, "shape") with no recorded value: take it from x
                    src = val(n.args[0])
                    v = _size_like(n, src)
                env[n] = symint_value(v, assignment)
                continue
            if reads_metadata_of_first_arg(n):
                v = val(n)
                fill = LIKE_FACTORIES[n.target if isinstance(n.target, str) else n.target.__name__]
                if fill is None:
                    rest = load(n.args[1:])
                    fill = load(n.kwargs).get("fill_value", rest[0] if n.op == "call_function" else rest[-1])
                env[n] = torch.full(tuple(symint_value(tuple(v.shape), assignment)), symint_value(fill, assignment),
                                    dtype=v.dtype, device=v.device)
                continue
            args, kwargs = load(n.args), load(n.kwargs)
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                self_, *rest = args
                env[n] = getattr(self_, n.target)(*rest, **kwargs)
            else:
                raise NotStatic(f"cannot evaluate {n.op} node {n.name}")
        return env[node]

    def constant(self, n: fx.Node) -> Optional[torch.Tensor]:
        """The value of a constant leaf (a registered buffer placeholder or a non-parameter
        ``get_attr`` tensor), None for anything else."""
        if n.op == "get_attr":
            obj = self._attr(n)
            return obj if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter) else None
        if n.op == "placeholder" and is_module_buffer(n) is not None:
            ex = self.inputs.get(n)
            if isinstance(ex, torch.Tensor) and not isinstance(ex, torch.nn.Parameter) and not _is_fake(ex):
                return ex
        return None

    def _attr(self, n: fx.Node) -> Any:
        obj = self.owner
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return obj

    def max_numel(self, node: fx.Node, assignment: Optional[Mapping] = None, at: Optional[fx.Node] = None) -> int:
        """The largest tensor the evaluation of ``node`` would create (elements), from the
        shapes Dynamo recorded, under ``assignment`` for dynamic sizes."""
        most = 0
        for n in self.slice(node, at).nodes:
            v = val(n)
            if isinstance(v, torch.Tensor):
                most = max(most, int(symint_value(v.numel(), assignment or None)))
        return most


def _var_to_val(shape_env: Any) -> Mapping:
    """Symbol -> example value (``backed_var_to_val`` in newer torch, ``var_to_val`` before)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return values if values is not None else shape_env.var_to_val


def _symints_in(v: Any) -> list:
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return [v]
    if isinstance(v, torch.Tensor):
        return [s for s in v.shape if isinstance(s, torch.SymInt)]
    if isinstance(v, (list, tuple)):
        out = []
        for x in v:
            out += _symints_in(x)
        return out
    return []


def _size_like(n: fx.Node, src: Any) -> Any:
    name = _target_name(n)
    if name in ("size", "sym_size"):
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        return src.shape if dim is None else src.shape[dim]
    if name == "dim" or name == "ndimension":
        return src.dim()
    if name == "numel":
        return src.numel()
    if n.target is getattr:
        return getattr(src, n.args[1])
    raise NotStatic(f"cannot evaluate {name}")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"
