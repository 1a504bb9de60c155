"""fuser's ops on DTensors: sharding rules, and which sharded regions must not be fused.

Tensor parallelism with ``use_local_output=False`` (and anything else that keeps activations as
:class:`torch.distributed.tensor.DTensor`) hands DTensors to fuser's custom ops. DTensor runs an
op on the local shards only when a *sharding strategy* is registered for it; without one it
raises ``Operator fuser.attention.default does not have a sharding strategy registered``.

Each fused op declares its **layout**: a letter per dim of every tensor argument and output, in
the einsum style (attention's ``q`` is ``"bhid"``, its output ``"bhie"``), and which letters are
**parallel** — dims along which the op is a loop of independent problems (batch and heads for
the attention family, every lead dim for KDA). :func:`register_op_sharding` turns that into
DTensor strategies with :func:`torch.distributed.tensor.experimental.register_sharding`
(public since torch 2.5; the same call in 2.11 and 2.13):

- everything replicated (the op runs whole on every rank);
- for each parallel letter, every tensor that has it sharded along it (``Shard(dim)``), the
  tensors that broadcast it (size 1: a ``[B, 1, 1, N]`` padding mask under head sharding)
  replicated, every non-empty output sharded along the same letter. A letter whose sizes differ
  between tensors (query heads ``Hq`` and key heads ``Hkv`` under GQA) is offered only when every
  such size divides by the mesh size: then the local query heads ``[r·Hq/t, (r+1)·Hq/t)`` read
  exactly the local key heads ``[r·Hkv/t, (r+1)·Hkv/t)``.

DTensor then runs the op's own implementation on the local shards (local shapes: the kernels
choose their tiles from what they are given) and redistributes any other input placement to the
cheapest of these first (e.g. a sequence-sharded input is all-gathered: correct, but see below).

Context parallelism shards the *sequence* dim, and ring attention (torch's
``context_parallel``) hooks PyTorch's own SDPA to attend across the shards without gathering
them. A fused op there would either fail or all-gather q, k and v and lose the memory saving.
:func:`sharding_decline` says, for a match on DTensor inputs, whether the matched region can be
computed on each rank's shards without communication — it runs the region's own ops on the
graph's fake DTensors under :class:`torch.distributed.tensor.debug.CommDebugMode` — and gives the
reason to decline it when it cannot (any input sharded along a dim the region reduces over: the
sequence dim of context parallelism, a feature dim, a ``Partial`` input).

**Planning on each rank's shapes.** A graph's fake values are DTensors with *global* shapes
(``H`` heads where each rank runs ``H/tp``). The pass plans every match inside
:func:`planning_view`, in which :func:`fuser.graph.val` — and so every shape a pattern reads for
its cost model, plan choices and the kernels it names — shows a DTensor as a tensor of its
:func:`local_shape`: the largest shard any rank holds (``ceil(size / mesh size)`` per ``Shard``;
an uneven split is planned on its larger piece, so that resource checks hold on every rank and
every rank plans alike). Symbolic sizes stay symbolic (``(s + n - 1) // n``). The estimates
``explain()`` shows are then per rank, and it says on which local shapes (:func:`planning_note`).
Where DTensor would redistribute the emitted fused op's inputs (a dim sharded that the op's rule
does not keep sharded, e.g. the value feature dim, which the region computes locally), fusing
would gather what the program keeps sharded: the pass sees DTensor communicate for the
replacement (:func:`communication`), undoes it and leaves the region as written, saying why
(:func:`gather_reason`), as it does for a region that itself needs communication. Matching and
emitting always see the global values.

Sources: DTensor's ``register_sharding`` documentation and ``expand_to_full_mesh_op_strategy``
(torch/distributed/tensor/_ops/utils.py); ring attention in
torch/distributed/tensor/experimental/_context_parallel/_attention.py; the shard sizes of
``Shard.local_shard_size_and_offset`` (torch/distributed/tensor/placement_types.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .graph import flat_args, val

log = logging.getLogger("fuser")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The dims of one call of a fused op.

    Attributes:
        inputs: argument name -> one letter per dim of that tensor argument (``None`` for an
            argument that is not a tensor, or is None); arguments left out count as None.
        outputs: one string of letters per output, ``None`` for an output that is an empty
            placeholder tensor (``lse`` of an inference forward, a gradient nobody needs).
        parallel: the letters along which the op is independent problems (may be sharded).
    """

    inputs: dict
    outputs: tuple
    parallel: str


#: op -> its layout function (see :func:`register_op_sharding`).
LAYOUTS: dict = {}


def available() -> bool:
    """Whether this torch has DTensor (``torch.distributed`` built in)."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor.experimental import register_sharding  # noqa: F401
    except ImportError:  # pragma: no cover - a torch without DTensor
        return False
    return True


def _overload(op: Any) -> Any:
    """The ``OpOverload`` of a ``torch.library.custom_op`` object, an ``OpOverloadPacket`` or an
    overload."""
    if hasattr(op, "_opoverload"):  # torch.library.custom_op's CustomOpDef
        return op._opoverload
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    return op


def register_op_sharding(op: Any, layout: Callable[..., Layout]) -> None:
    """Register DTensor sharding strategies for the fused op ``op`` from its layout.

    Args:
        op: the op (a ``torch.library.custom_op``, e.g. ``fuser::attention``, or its overload).
        layout: called with the op's arguments by name — tensors as DTensor's specs, which have
            ``.shape`` (global) and ``.ndim``; other arguments as given — returns the call's
            :class:`Layout`.

    The strategies are listed in this module's docstring. Every non-tensor argument is part of
    DTensor's propagation cache key (``register_sharding`` alone keys on them only from the
    first ``int`` argument on, and e.g. ``need_lse`` changes which outputs are empty). Does
    nothing on a torch without DTensor.
    """
    if not available():
        return
    from torch.distributed.tensor.experimental import register_sharding

    overload = _overload(op)
    LAYOUTS[overload] = layout
    schema = overload._schema
    names = [a.name for a in schema.arguments]

    def rule(*args: Any, **kwargs: Any) -> list:
        named = dict(zip(names, args))
        named.update(kwargs)
        for a in schema.arguments:  # defaults of arguments left out
            if a.name not in named and a.has_default_value():
                named[a.name] = a.default_value
        return strategies(overload, layout(**named), [named.get(n) for n in names], len(schema.returns))

    register_sharding(overload)(rule)
    _key_on_every_argument(overload, schema)


def _key_on_every_argument(overload: Any, schema: Any) -> None:
    """Make every non-tensor argument part of DTensor's sharding-propagation cache key (the
    ``static_argnum`` of its ``RuntimeSchemaInfo``: the index from which arguments are hashed)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    first = next((i for i, a in enumerate(schema.arguments) if not _is_tensor_type(a.type)), len(schema.arguments))
    prop = DTensor._op_dispatcher.sharding_propagator
    info = prop.op_to_schema_info.get(overload)
    kwargs = [a.name for a in schema.arguments if a.kwarg_only and not _is_tensor_type(a.type)]
    prop.op_to_schema_info[overload] = RuntimeSchemaInfo(
        static_argnum=first, static_kwargkey=kwargs or (info.static_kwargkey if info else None), needs_pytree=True)


def _is_tensor_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def strategies(op: Any, lay: Layout, args: Sequence[Any], n_outputs: int) -> list:
    """``register_sharding``'s list of ``(output placements, input placements)`` for one call:
    all replicated, then one strategy per parallel letter that can be sharded (see the module
    docstring). ``args`` in schema order, tensors as specs (objects with ``.shape`` and
    ``.mesh``)."""
    from torch.distributed.tensor import Replicate, Shard

    names = [a.name for a in op._schema.arguments]
    specs = [(n, a) for n, a in zip(names, args) if _is_spec(a)]
    out = [([Replicate()] * n_outputs, [Replicate() if _is_spec(a) else None for a in args])]
    if not specs:
        return out
    mesh_size = specs[0][1].mesh.size()
    for letter in lay.parallel:
        inputs: list = []
        sizes = []
        for n, a in zip(names, args):
            if not _is_spec(a):
                inputs.append(None)
                continue
            letters = lay.inputs.get(n)
            if letters is not None and len(letters) != len(a.shape):
                raise RuntimeError(f"fuser: the layout of {op} gives {n} the dims {letters!r}, "
                                   f"but it has {len(a.shape)}")
            if letters and letter in letters and a.shape[letters.index(letter)] != 1:
                d = letters.index(letter)
                inputs.append(Shard(d))
                sizes.append(a.shape[d])
            else:
                inputs.append(Replicate())
        if not sizes:
            continue  # nothing is sharded along it
        if len(set(sizes)) > 1 and any(s % mesh_size for s in sizes):
            continue  # e.g. GQA heads that do not split evenly: local q and kv heads would not pair
        outputs = []
        for letters in lay.outputs:
            if letters is None:
                outputs.append(Replicate())  # an empty placeholder
            elif letter in letters:
                outputs.append(Shard(letters.index(letter)))
            else:
                break  # an output that mixes every problem: this letter cannot be sharded
        if len(outputs) != n_outputs:
            continue
        out.append((outputs, inputs))
    return out


def broadcast_dims(x: Any, full: str) -> Optional[str]:
    """The letters of a tensor ``x`` broadcast against ``full`` (right-aligned, as broadcasting
    aligns dims; a mask ``[N, N]`` against ``"bhij"`` is ``"ij"``); None when ``x`` is None."""
    if x is None:
        return None
    rank = len(x.shape)
    return full[len(full) - rank:] if rank <= len(full) else None


def _is_spec(x: Any) -> bool:
    return hasattr(x, "placements") and hasattr(x, "mesh") and hasattr(x, "shape")


# --------------------------------------------------------------------------------------------
# Which regions on DTensors may be fused at all
# --------------------------------------------------------------------------------------------

def _dtensor_type():
    if not available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def sharding_decline(match: Any, view: Any = None) -> Optional[str]:
    """Why ``match`` (a :class:`fuser.pattern.Match`) must not be fused because of how its
    DTensor inputs are sharded, or None (no DTensor input, or every rank can compute the region
    from its own shards).

    The test is the program's own: the region's nodes are run, in graph order, on the fake
    values the graph carries for its inputs (fresh clones: the graph's metadata is never
    written), under :class:`torch.distributed.tensor.debug.CommDebugMode`. If DTensor needs
    any collective for them — a sequence-sharded q or k (context parallelism), a sharded feature
    dim, a ``Partial`` input — the region is not local to the shards: fusing it would gather
    the inputs (or fail), so it is declined with the inputs' placements in the reason. A region
    that cannot be run that way is declined too (nothing proves it local).

    Args:
        match: the match (its ``region`` and ``pattern`` are read).
        view: unused; accepted so that the pass can call it beside its other region checks.

    Returns:
        None or the reason, for ``explain()``.
    """
    DTensor = _dtensor_type()
    if DTensor is None:
        return None
    region = match.region
    nodes = _in_graph_order(region)
    values = {a: val(a) for a in _read_from_outside(nodes)}
    sharded = {a: v for a, v in values.items() if isinstance(v, DTensor)}
    if not sharded and not any(isinstance(val(n), DTensor) for n in nodes):
        return None
    described = ", ".join(f"'{a.name}' {_placements(v)}" for a, v in sharded.items()) or "DTensor values"
    try:
        comms = _collectives(nodes, values, region)
    except Exception as exc:  # noqa: BLE001 - nothing proves the region local: decline
        log.debug("fuser: could not run the %s region on its DTensor values: %r", match.pattern, exc)
        return (f"its inputs are DTensors ({described}) and running the region on them to check that each "
                f"rank can compute it from its own shards failed ({_first_line(exc)}); not fused")
    if comms:
        what = ", ".join(f"{k} x{v}" for k, v in sorted(comms.items()))
        return (f"its inputs are DTensors sharded so that computing the region needs communication ({described}; "
                f"DTensor would run {what}): a dim the region reduces over is sharded — the sequence dim under "
                "context parallelism, whose ring attention must stay PyTorch's own — and the fused op would "
                "gather the shards; left as written")
    return None


def _first_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message`` of ``exc``, cut at ``limit`` characters."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _placements(v: Any) -> str:
    return "(" + ", ".join(str(p) for p in v.placements) + ")"


def _collectives(nodes: list, values: dict, region: frozenset) -> dict:
    """Run ``nodes`` on ``values`` (their inputs from outside, tensors cloned first) under
    DTensor's communication counter; returns ``{collective: count}``."""
    from torch.distributed.tensor.debug import CommDebugMode

    env: dict = {}
    # the values' own fake mode (a DTensor's local tensor carries it), not the tracing
    # context's: inside the backend, after the pass re-propagated values, the two differ
    fake_mode = next((m for m in (getattr(getattr(v, "_local_tensor", v), "fake_mode", None)
                                  for v in values.values() if isinstance(v, torch.Tensor)) if m is not None), None)

    def load(a: Any) -> Any:
        return env[a] if a in env else values.get(a, val(a))

    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        for a, v in list(values.items()):
            if isinstance(v, torch.Tensor):
                values[a] = v.clone()  # in-place ops of the region must not touch the graph's metadata
        with CommDebugMode() as comm:
            for n in nodes:
                if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
                    env[n] = None
                    continue
                args = fx.node.map_arg(n.args, load)
                kwargs = fx.node.map_arg(n.kwargs, load)
                if n.op == "call_function":
                    env[n] = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    raise NotImplementedError(f"node {n.name} ({n.op})")
    counts = comm.get_comm_counts()
    return {str(k): int(v) for k, v in counts.items() if v}


# --------------------------------------------------------------------------------------------
# Planning on each rank's shapes
# --------------------------------------------------------------------------------------------

def _ceil_div(size: Any, n: int) -> Any:
    """``ceil(size / n)`` for an int or a SymInt (``(size + n - 1) // n``: ``torch.chunk``'s
    chunk size, and DTensor's ``Shard.local_shard_size_and_offset`` ``full_chunk_size``; on a
    SymInt a new symbolic size, no guard)."""
    return (size + n - 1) // n


def local_shape(value: Any) -> tuple:
    """The shape of the largest local shard of ``value`` over the ranks of its mesh; a plain
    tensor's own shape.

    Args:
        value: a DTensor (or a spec: anything with ``shape``, ``placements`` and ``device_mesh``
            or ``mesh``), or a tensor.

    Returns:
        A tuple of ints or SymInts (dynamic shapes: symbolic sizes stay symbolic). For each mesh
        dim ``i`` in order, a ``Shard(d)`` placement splits dim ``d`` as ``torch.chunk`` does into
        ``mesh.size(i)`` pieces, the first ones of ``ceil(size / mesh.size(i))`` elements
        (DTensor's ``Shard.local_shard_size_and_offset``; several mesh dims sharding one dim
        split it in turn, ``ceil(ceil(s / a) / b) = ceil(s / (a·b))``); ``Replicate`` and
        ``Partial`` keep the size. A ``_StridedShard`` (FSDP2 + TP parameters) divides the size
        only when it splits evenly into ``split_factor · mesh.size(i)`` pieces (then every rank
        holds ``size / mesh.size(i)``), else keeps it.

    This is the size of rank 0's shard (the ranks with mesh coordinate 0), which no other rank's
    exceeds: an uneven split (5 heads on 2 ranks: 3 and 2) plans every rank on the larger, so that
    checks of a kernel's resources (tiles, shared memory, registers) hold on every rank, and
    every rank plans the same way (the same kernels and graph on each). ``torch.distributed.tensor
    ._utils.compute_local_shape_and_global_offset`` gives the calling rank's own shape instead
    (and is private); the tests compare the two on rank 0.
    """
    placements = getattr(value, "placements", None)
    mesh = getattr(value, "device_mesh", None) or getattr(value, "mesh", None)
    sizes = list(value.shape)
    if placements is None or mesh is None:
        return tuple(sizes)
    for i, p in enumerate(placements):
        factor = getattr(p, "split_factor", None)  # _StridedShard (not is_shard() in torch 2.13)
        if factor is None and not (hasattr(p, "is_shard") and p.is_shard()):
            continue  # Replicate, Partial
        d = p.dim if p.dim >= 0 else p.dim + len(sizes)
        n = mesh.size(i)
        if factor is not None:
            if isinstance(sizes[d], int) and isinstance(factor, int) and sizes[d] % (factor * n) == 0:
                sizes[d] = sizes[d] // n
            continue
        sizes[d] = _ceil_div(sizes[d], n)
    return tuple(sizes)


def _same_sizes(a: Sequence, b: Sequence) -> bool:
    from .codegen import launch

    return launch.same_sizes(a, b)


def local_value(value: Any) -> Any:
    """``value`` with every DTensor in it (a tensor, or a tuple or list of values) replaced by a
    tensor of its :func:`local_shape`, with its dtype, device and ``requires_grad``; anything
    else as given.

    The replacement is the DTensor's own local tensor (a fake tensor in a graph's metadata: this
    rank's shard) when that has the local shape; otherwise (an uneven split, this rank holding a
    smaller shard) a new empty tensor of the local shape — made by the local tensor's fake mode,
    or on the ``meta`` device for a real DTensor (nothing allocated). ``value`` itself is never
    changed.
    """
    if isinstance(value, (tuple, list)):
        return type(value)(local_value(v) for v in value)
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(value, DTensor):
        return value
    shape = local_shape(value)
    local = value._local_tensor
    if not _same_sizes(tuple(local.shape), shape):
        if getattr(local, "fake_mode", None) is not None:
            with local.fake_mode:
                local = torch.empty(shape, dtype=local.dtype, device=local.device)
        else:
            local = torch.empty(shape, dtype=local.dtype, device="meta")
    if local.requires_grad != value.requires_grad:
        local = local.detach().requires_grad_(value.requires_grad)
    return local


def planning_view() -> contextlib.AbstractContextManager:
    """A block in which :func:`fuser.graph.val` shows each DTensor as a tensor of its
    :func:`local_shape` (:func:`local_value`): the pass plans a match inside it, so that every
    shape a pattern reads for its cost model, its plan choices and the kernels it names (through
    ``val``, ``shape``, ``ndim``...) is one rank's — the shapes DTensor runs the fused op's
    kernels on when every input is sharded along the op's parallel dims (its sharding rules);
    the costs ``explain()`` shows are then per rank. Matching and emitting see the global values.
    """
    from .graph import values_viewed

    return values_viewed(local_value)


def sharded_inputs(match: Any) -> list:
    """``[(node, value)]`` of the DTensor values the replacement of ``match`` reads (its
    ``inputs``; where it names none, what its region reads from outside it, in graph order) whose
    local shard is smaller than the whole (a ``Shard`` placement on a mesh dim of size > 1); empty
    on a torch without DTensor."""
    DTensor = _dtensor_type()
    if DTensor is None:
        return []
    out = []
    nodes = ([a for a in getattr(match, "inputs", ()) if isinstance(a, fx.Node)]
             or _read_from_outside(_in_graph_order(match.region)))
    for a in dict.fromkeys(nodes):
        v = _meta_value(a)
        if isinstance(v, DTensor) and not _same_sizes(tuple(v.shape), local_shape(v)):
            out.append((a, v))
    return out


def planning_note(match: Any) -> str:
    """What ``explain()`` says of a match planned on local shapes (see :func:`planning_view`):
    ``""`` when none of its inputs is a sharded DTensor (:func:`sharded_inputs`), else e.g.
    ``planned on the local shard shapes 'q' [2, 2, 16, 8] of the global [2, 4, 16, 8]
    (Shard(dim=1) over 2 ranks), ...; the estimates are per rank``."""
    groups: dict = {}  # the text after the names -> the names (q, k, v alike: said once)
    uneven = False
    for a, v in sharded_inputs(match):
        mesh = v.device_mesh
        local = local_shape(v)
        over = " x ".join(str(mesh.size(i)) for i in range(mesh.ndim))
        text = (f"{_sizes(local)} of the global {_sizes(v.shape)} "
                f"({', '.join(repr(p) for p in v.placements)} over {over} ranks)")
        groups.setdefault(text, []).append(f"'{a.name}'")
        n = math.prod(mesh.size(i) for i, p in enumerate(v.placements) if p.is_shard())
        uneven |= not _same_sizes((math.prod(local) * n,), (math.prod(v.shape),))
    if not groups:
        return ""
    parts = [f"{', '.join(names)} {text}" for text, names in groups.items()]
    return ("planned on the local shard shapes " + "; ".join(parts) + "; the estimates are per rank"
            + ("; an uneven split is planned on its largest shard" if uneven else ""))


def gather_reason(communication: str) -> str:
    """Why a match is left as written when its fused op, emitted, would make DTensor
    communicate (``communication``, from :func:`communication`) where the region's own ops run
    on each rank's shards without it."""
    return (f"its fused op would make DTensor redistribute the inputs ({communication}) to the placements the op's "
            "sharding rule takes (batch and head dims sharded, nothing else), where the code as written runs on "
            "each rank's shards without communication: fusing would gather the sharded inputs (more memory and "
            "traffic than the program); left as written")


def communication(nodes: Sequence[fx.Node]) -> Optional[str]:
    """The collectives DTensor runs for ``nodes`` (a replacement just emitted, in graph order) on
    the graph's fake values of what they read from outside (e.g. ``"all_gather_into_tensor x1"``),
    or None when none (or no DTensor is involved). Run as :func:`sharding_decline` runs a region
    (fresh clones of the values, under ``CommDebugMode``); a replacement that cannot be run that
    way is reported as communicating (``"unknown: <exception type>"``: nothing proves it local).
    """
    DTensor = _dtensor_type()
    if DTensor is None or not nodes:
        return None
    values = {a: _meta_value(a) for a in _read_from_outside(nodes)}
    if not any(isinstance(v, DTensor) for v in values.values()):
        return None
    try:
        comms = _collectives(list(nodes), values, frozenset(nodes))
    except Exception as exc:  # noqa: BLE001 - nothing proves it local
        log.debug("fuser: could not run the replacement on its DTensor values: %r", exc)
        return f"unknown: running it on its DTensor values failed ({_first_line(exc)})"
    return ", ".join(f"{k} x{v}" for k, v in sorted(comms.items())) or None


def _sizes(shape: Sequence) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _meta_value(node: Any) -> Any:
    """A node's value metadata as the graph holds it (never through a planning view)."""
    from .graph import _meta_val

    return _meta_val(node)


def _in_graph_order(nodes) -> list:
    """``nodes`` (of one graph) sorted in graph order."""
    if not nodes:
        return []
    order = {n: i for i, n in enumerate(next(iter(nodes)).graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def _read_from_outside(nodes: Sequence[fx.Node]) -> list:
    """The nodes that ``nodes`` (in the order given) read and that are not among them, each once,
    in the order they are first read."""
    inside = set(nodes)
    return list(dict.fromkeys(a for n in nodes for a in flat_args(n) if a not in inside))


# --------------------------------------------------------------------------------------------
# Elementwise core ops
# --------------------------------------------------------------------------------------------

def _register_core() -> None:
    """Rules for fuser's own elementwise op, ``fuser::saved_copy`` (its output is laid out as
    its input: every dim is parallel)."""
    from . import copies  # noqa: F401  (registers the op)

    letters = "abcdefghijklmnopqrstuvwxyz"

    def layout(x: Any) -> Layout:
        dims = letters[:len(x.shape)]
        return Layout(inputs={"x": dims}, outputs=(dims,), parallel=dims)

    register_op_sharding(torch.ops.fuser.saved_copy.default, layout)


_register_core()
