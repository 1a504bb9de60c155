"""``fuser.export`` (this module is ``fuser.exporting``): ``torch.export`` with fuser's rewrites in the exported program.

``torch.export`` does not go through a ``torch.compile`` backend, so ``backend="fuser"`` never
sees an exported model. :func:`export` exports the model, applies fuser's pass to the exported
graph (the same matching, planning and emission as the backend, on ATen ops), and exports the
rewritten module again, so the :class:`torch.export.ExportedProgram` holds fuser's ops
(``torch.ops.fuser.attention`` ...) where the patterns were found. From there:

- ``ep.module()(...)`` runs it in Python (any device; CPU tensors in Triton's interpreter);
  ``torch.export.save``/``load`` round-trip it (fuser must be importable where it is loaded:
  the ops are registered by ``import fuser``).
- ``torch._inductor.aoti_compile_and_package(ep)`` builds an AOTInductor package. On CUDA with
  static sizes, AOTInductor traces fuser's ops into their Triton kernels
  (:func:`fuser.codegen.launch.inline_into_inductor`): the package holds the compiled kernels
  and runs without Python. With symbolic sizes (``dynamic_shapes``) or on CPU the ops stay
  opaque and the package would have to call back into Python; torch's package loader cannot
  read such a call's ``-inf`` float arguments (its JSON reader refuses ``"-Infinity"``,
  torch 2.13), so :func:`export` refuses ``for_aoti=True`` in those cases instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from . import passes
from .options import FuserOptionError, resolve
from .report import next_graph_index, record

__all__ = ["export"]


def export(
    mod: torch.nn.Module,
    args: tuple,
    kwargs: Optional[dict] = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
    options: Optional[dict] = None,
    training: bool = False,
    for_aoti: bool = False,
) -> "torch.export.ExportedProgram":
    """Export ``mod`` with ``torch.export.export`` and put fuser's fused ops into the program.

    Args:
        mod: the model (``torch.nn.Module``).
        args, kwargs, dynamic_shapes, strict: as for ``torch.export.export``.
        options: fuser's options (the ``fuser.*`` keys of ``torch.compile(options=...)``).
        training: whether the exported program is for training (fused ops save what their
            backward needs) or inference (the default: nothing is saved for backward).
        for_aoti: the program is meant for ``torch._inductor.aoti_compile_and_package``: raise
            if a fused op would stay opaque in the package (CPU tensors, or symbolic sizes from
            ``dynamic_shapes``), which the package could not run.

    Returns:
        The ``torch.export.ExportedProgram`` of the rewritten model (the first export itself
        when nothing was fused). What was fused and why: ``with fuser.report.collecting() as
        rep: ep = fuser.export(...)``, then ``print(rep)`` (a :class:`fuser.Report`).

    Raises:
        fuser.FuserOptionError: an unknown or bad ``fuser.*`` option; ``for_aoti=True`` with a
            fused op that would stay opaque (the message says why and what to change).
        Anything ``torch.export.export`` raises for ``mod``.
    """
    kwargs = dict(kwargs or {})
    opts, rest = resolve(options)
    if rest:
        raise FuserOptionError(
            f"fuser.export takes only fuser.* options; got {sorted(rest)} (Inductor options go to "
            f"torch._inductor.aoti_compile_and_package's inductor_configs)")
    first = torch.export.export(mod, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    gm = first.module()
    example_inputs = pytree.tree_leaves((tuple(args), kwargs))
    result = passes.apply(gm, example_inputs, opts, grad_enabled=training, graph_index=next_graph_index())
    record(result, opts)
    fused = [m for m in result.matches if m.fused]
    if not fused:
        return first
    if for_aoti:
        _check_inlinable(gm)
    return torch.export.export(gm, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=False)


def _check_inlinable(gm: torch.fx.GraphModule) -> None:
    """Raise when a fused op in ``gm`` would stay opaque under AOTInductor (the rule Inductor's
    tracing applies, :func:`fuser.codegen.launch.stays_opaque`, on the values the graph carries)."""
    from .codegen import launch

    fixes = {
        "device": (f"runs on tensors of another device; only ops on "
                   f"{'/'.join(sorted(launch.INLINE_DEVICE_TYPES))} tensors become kernels in an AOTInductor "
                   f"package (on the CPU they need Python and Triton's interpreter). Export on CUDA tensors"),
        "symbolic sizes": ("has symbolic sizes (dynamic_shapes) its kernels or launch configs are chosen from "
                           "(KDA's chunk and recurrent plans, and its parallel plan without an initial state, serve a "
                           "symbolic batch and heads, with static length, K and V, "
                           f"and a batch bounded so that batch × value heads ≤ {launch.MAX_GRID_ROWS}, one "
                           "launch grid's rows: Dim(..., max=...)); export without dynamic_shapes, one package "
                           "per shape"),
        "opaque ops": "is kept opaque by FUSER_OPAQUE_OPS=1, which an AOTInductor package cannot run. Unset it",
    }
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "fuser":
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        with launch.without_size_guards():
            why = launch.stays_opaque(args, kwargs, n.target)
        if why is not None:
            raise FuserOptionError(f"fuser.export(for_aoti=True): {n.target} {fixes[why]}, or keep the program "
                                   f"in Python (for_aoti=False, ep.module()).")
