"""The fused KDA op: ``torch.ops.fuser.kda``.

A ``torch.library.custom_op`` with a fake implementation and an autograd formula; it neither
mutates nor aliases its inputs. It takes the tensors the user's loop selects time steps from, in
the user's layout, and returns the assembled outputs in the layout the loop built them:

``torch.ops.fuser.kda(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim,
out_dtype, want_state, state_dtype, plan) -> (o, state)``
    q, k ``[*L, K]`` and v ``[*L, V]`` with a time axis inserted at ``time_dims[0..2]``; g the
    same as k (``[*L]`` plus time when ``scalar_gate``), beta ``[*L]`` (or ``[*L, 1]``) plus time
    (``time_dims[3], time_dims[4]``); ``L`` the batch and head dims, equal for all; h0 ``[*L, K,
    V]`` or None (zeros). The loop runs over time indices ``t0 .. t0 + steps − 1``. Returns ``o``
    ``[*L, V]`` with the time axis inserted at ``out_dim`` (``steps`` long), contiguous, in
    ``out_dtype``, and the final state ``[*L, K, V]`` in ``state_dtype`` (an empty tensor unless
    ``want_state``). ``plan``: ``"plan=recurrent"``, ``"plan=chunk;chunk=64"`` (optionally
    ``;dots=bfloat16`` and ``;output_precision=tf32|tf32x3|ieee``, the chunked kernels' dots:
    ``codegen/kda_chunk.forward``) or ``"plan=parallel"`` (:func:`parse_plan`).

Inside, the time axis of every input is moved next to the features: ``[*L, T, *]``, a view
(:func:`as_rows`), whose rows (the ``L`` dims, flattened row-major into ``N``) the kernels of
``codegen/kda_recurrent.py``, ``codegen/kda_chunk.py`` and ``codegen/kda_bwd.py`` address as at
most two stride groups, as do those of ``codegen/kda_parallel.py``: no input is copied for the
op's layouts (``[B, T, H, K]``, ``[B, H, T, K]``, ``[T, B, H, K]``, time windows of them).
``o`` is allocated in its final layout and the kernels
write it in place (the launchers' ``out=``, its rows addressed as two stride groups): no copy
follows them. The chunk and parallel kernels floor the gates at :data:`GATE_FLOOR` as they load
them: no kernel runs before them either.

Backward: the chunked backward kernels (``codegen/kda_bwd.py``) for K, V ≤
:data:`KERNEL_BACKWARD_MAX_DIM`, reading the inputs and dO in place as the forward's kernels do
and writing dq, dk, dv, dg, dβ in place too: each allocated once like its input (its strides
and dtype; zeros when the loop's window leaves part of the time axis out), the kernels writing
the window's ``[*L, T, *]`` view (``kda_bwd.backward``'s ``out=``), no copy after them; larger heads by autograd through the float64 chunked reference
(``patterns/kda_reference.chunked``) — exact, slow (PyTorch ops per chunk, float64).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..codegen import launch
from ..codegen import kda_chunk as _kda_chunk

PLANS = ("recurrent", "chunk", "parallel")


#: What the chunk plan keeps for the backward (plan key ``save``): ``"inputs"`` (the backward
#: recomputes the chunk quantities from q, k, v, g, beta) or ``"workspaces"`` (the forward's
#: workspaces, :data:`SAVED`: op ``fuser::kda_save``; faster backward, ~2.5-3.6x the activation
#: memory of the inputs; ``benchmarks/results/kda.md``).
SAVES = ("inputs", "workspaces")


def plan_string(plan: str, chunk: int = 64, dots: Optional[str] = None, output_precision: Optional[str] = None,
                save: Optional[str] = None) -> str:
    """The op's ``plan`` argument for ``plan`` (:data:`PLANS`); for the chunk plan also ``dots``
    and ``output_precision`` of ``codegen/kda_chunk.forward`` where given (None: its defaults,
    ``dots="float32"`` and the output-path rule of ``kda_chunk.resolve_output_precision``, applied
    when the op runs), and ``save`` (:data:`SAVES`; None: ``"inputs"``)."""
    if plan != "chunk":
        return f"plan={plan}"
    return (f"plan=chunk;chunk={int(chunk)}" + (f";dots={dots}" if dots is not None else "")
            + (f";output_precision={output_precision}" if output_precision is not None else "")
            + (f";save={save}" if save is not None else ""))


def parse_plan(plan: str) -> dict:
    """``"plan=chunk;chunk=64;output_precision=tf32"`` -> ``{"plan": "chunk", "chunk": 64, "dots":
    "float32", "output_precision": "tf32"}`` (defaults: recurrent, 64, ``"float32"``, None).

    Raises:
        ValueError: an entry that is not ``key=value``, an unknown key or plan, a ``dots`` or
            ``output_precision`` the chunked kernels do not take (the messages name the valid
            values).
    """
    from ..codegen.kda_chunk import DOTS, OUTPUT_PRECISIONS

    out = {"plan": "recurrent", "chunk": 64, "dots": "float32", "output_precision": None, "save": "inputs"}
    for part in plan.split(";"):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or key not in out:
            raise ValueError(f"fuser::kda plan entry {part!r}: expected one of {', '.join(k + '=' for k in out)}")
        out[key] = int(value) if key == "chunk" else value
    if out["plan"] not in PLANS:
        raise ValueError(f"fuser::kda plan {out['plan']!r}: expected one of {PLANS}")
    if out["dots"] not in DOTS:
        raise ValueError(f"fuser::kda plan dots={out['dots']!r}: expected one of {DOTS}")
    if out["save"] not in SAVES:
        raise ValueError(f"fuser::kda plan save={out['save']!r}: expected one of {SAVES}")
    if out["save"] == "workspaces" and out["plan"] != "chunk":
        raise ValueError("fuser::kda plan save=workspaces: only the chunk plan has workspaces to keep")
    if out["output_precision"] is not None and out["output_precision"] not in OUTPUT_PRECISIONS:
        raise ValueError(f"fuser::kda plan output_precision={out['output_precision']!r}: expected one of "
                         f"{OUTPUT_PRECISIONS}")
    return out


@functools.lru_cache(maxsize=256)
def _parsed_plan(plan: str) -> dict:
    """:func:`parse_plan`, parsed once per plan string (the op's calls repeat a few strings);
    the dict is shared: read it, never change it."""
    return parse_plan(plan)


def _lead(q: torch.Tensor, time_dim: int) -> list:
    dims = list(q.shape)
    del dims[time_dim]
    return dims[:-1]


def flatten(x: torch.Tensor, time_dim: int, t0: int, steps: int, features: bool) -> torch.Tensor:
    """``x`` with its time axis ``time_dim`` cut to ``[t0, t0 + steps)`` as ``[N, T, F]``
    (``features``) or ``[N, T]``; a view when the layout allows one."""
    if t0 or x.shape[time_dim] != steps:
        x = x.narrow(time_dim, t0, steps)
    if features:
        x = x.movedim(time_dim, -2)
        return x.reshape(-1, steps, x.shape[-1])
    x = x.movedim(time_dim, -1)
    return x.reshape(-1, steps)


def _inputs(q, k, v, g, beta, time_dims, t0, steps, scalar_gate, flat: bool = True):
    """``(lead, (q, k, v, g, beta))``: the inputs cut to ``[t0, t0 + steps)``, either flattened
    (``flat``: ``[N, T, *]`` by :func:`flatten`, a copy when the lead dims do not merge into one
    stride) or as the views :func:`as_rows` gives (``[*L, T, *]``, never a copy: the launchers
    that address rows as two stride groups take them)."""
    tq, tk, tv, tg, tb = time_dims
    lead = _lead(q, tq)
    beta_rank = len(lead) + 1
    if beta.dim() == beta_rank + 1:  # [*L, 1] per step
        beta = beta.squeeze(-1)
    cut = flatten if flat else as_rows
    return lead, (cut(q, tq, t0, steps, True), cut(k, tk, t0, steps, True),
                  cut(v, tv, t0, steps, True), cut(g, tg, t0, steps, not scalar_gate),
                  cut(beta, tb if tb < beta.dim() else beta.dim() - 1, t0, steps, False))


def as_rows(x: torch.Tensor, time_dim: int, t0: int, steps: int, features: bool) -> torch.Tensor:
    """``x`` with its time axis ``time_dim`` cut to ``[t0, t0 + steps)`` as the view ``[*L, T, F]``
    (``features``) or ``[*L, T]`` (``L`` the other dims; ``[1, T, *]`` without any), never a copy.

    The launchers of ``codegen/kda_recurrent.py``, ``kda_chunk.py`` and ``kda_bwd.py`` address
    the rows (the row-major index over ``L``) as at most two stride groups
    (``kda_recurrent.input_rows``): moving the time axis of a tensor contiguous in any layout
    leaves the ``L`` dims before it and those after it, each group contiguous with itself, so the
    kernels read every input of the op's usual layouts in place (``[B, T, H, K]``: rows ``b·H +
    h`` at ``b·T·H·K + h·K``). Only lead dims in three groups that do not merge (a permuted
    tensor) make the launchers copy."""
    if t0 or x.shape[time_dim] != steps:
        x = x.narrow(time_dim, t0, steps)
    x = x.movedim(time_dim, -2 if features else -1)
    return x if x.dim() > (2 if features else 1) else x.unsqueeze(0)


def _assemble(o_flat: torch.Tensor, lead: list, steps: int, out_dim: int) -> torch.Tensor:
    o = o_flat.reshape(*lead, steps, o_flat.shape[-1])
    return o.movedim(len(lead), out_dim).contiguous()


def _output(lead: list, steps: int, v_dim: int, out_dim: int, dtype: torch.dtype, device):
    """The op's o, allocated in its final layout (``[*L, V]`` with the time axis inserted at
    ``out_dim``, contiguous: what the fake implementation promises), and the view of it the
    kernels write (``out=`` of the launchers): ``[*L, T, V]`` (``[1, T, V]`` without lead dims),
    whose lead dims are at most two stride groups (those before ``out_dim`` and those after), so
    the kernels address it directly: no copy after them."""
    shape = list(lead) + [v_dim]
    shape.insert(out_dim, steps)
    o = launch.empty(shape, dtype, device)
    view = o.movedim(out_dim, len(lead))
    return o, (view if lead else view.unsqueeze(0))


#: Gates below this are raised to it by the chunked and parallel kernels where they load them (no
#: kernel runs before them): exp of either is exactly 0 in float32 (below about −104), so a step's
#: decay is unchanged, while a gate of −inf (a hard reset, e.g. ``log(0)``) would make those
#: kernels' differences of cumulative sums ``−inf − (−inf) = NaN``; a NaN gate stays NaN, as with
#: ``clamp_min``. The recurrent kernel multiplies step by step and needs no floor. Defined in
#: ``codegen/kda_chunk.py`` (the kernels render it in); the backward kernels (``codegen/kda_bwd.py``,
#: :func:`backward_kernels`) floor with it too, as they load the gates.
GATE_FLOOR = _kda_chunk.GATE_FLOOR


def run_forward(q, k, v, g, beta, h0, scale: float, scalar_gate: bool, want_state: bool, out_dtype, plan: dict,
                out: Optional[torch.Tensor] = None, save: bool = False):
    """The kernels of ``plan`` on flattened inputs (``[N, T, *]``) or the ``[*L, T, *]`` views of
    :func:`as_rows` (every plan's launchers take both): ``(o, state [N, K, V] float32 or
    None)``, o ``[N, T, V]``, or ``out`` written in place (``[*lead, T, V]``, the launchers'
    ``out=``); with ``save`` (chunk plan only) also the forward's ``saved`` dict
    (``kda_chunk.forward(save_for_backward=True)``; its chunk states only where
    :func:`keeps_states`). The chunk and parallel kernels floor the gates at :data:`GATE_FLOOR`
    themselves."""
    if plan["plan"] == "chunk":
        from ..codegen import kda_chunk as kernels

        return kernels.forward(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=want_state,
                               scalar_gate=scalar_gate, out_dtype=out_dtype, chunk=plan["chunk"],
                               dots=plan.get("dots", "float32"), output_precision=plan.get("output_precision"),
                               out=out, save_for_backward=save,
                               save_states=keeps_states(q.shape[-1], plan.get("dots", "float32")))
    if plan["plan"] == "parallel":
        from ..codegen import kda_parallel as kernels
    else:
        from ..codegen import kda_recurrent as kernels
    return kernels.forward(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=want_state,
                           scalar_gate=scalar_gate, out_dtype=out_dtype, out=out)


def _symbolic_sizes(q, v, time_dims, t0, steps) -> Optional[str]:
    """Why a KDA op's call with symbolic sizes keeps the opaque op, or None: symbolic lead dims
    (batch, heads) are traced into the kernels' grids, strides and workspaces without a guard;
    K, V and the length must be static (a symbolic length specialised a size in the saved
    workspaces' shapes when tried; a matched loop unrolls its steps, so its length is static).

    The rows (value rows, ``N = B·HV``) are one grid axis of every kernel, and a launch holds at
    most ``launch.MAX_GRID_ROWS``: the traced kernels launch once, so the rows must be at most that
    for every size the graph serves (``launch.at_most``: from the dims' bounds, or for a dim
    unbounded above with a guard, the one such a trace adds; past it Dynamo compiles again and that
    graph keeps the opaque op, which launches the rows in slices through ``launch.jit_call``)."""
    return launch.symbolic_launch_fits((q.shape[-1], v.shape[-1], q.shape[time_dims[0]], t0, steps),
                                       math.prod(_lead(v, time_dims[2])), "a symbolic K, V or length")


def _symbolic_forward(args, kwargs) -> Optional[str]:
    """The ``symbolic`` rule (``launch.fused_op``) of :func:`kda` and :func:`kda_save`: the chunk
    plan's body and the recurrent kernel, with symbolic lead dims (:func:`_symbolic_sizes`; their
    configs depend on K, V and the dtype; the recurrent table orders its candidates by the row
    count only when that is an int), and the parallel plan without an initial state (its config
    from K, V and T; with a symbolic N, the table's choices made from N keep their general values,
    ``codegen/kda_parallel._short_config``). With an initial state the parallel plan's split
    kernels choose the h0 projection's key split from N and keep the opaque op
    (``kda_parallel.serves_symbolic_rows``: the one-launch kernel does not). All checked by
    tests/patterns/test_inline_ops.py (no guard while traced)."""
    q, v, h0, time_dims, t0, steps = args[0], args[2], args[5], args[6], args[7], args[8]
    plan = _parsed_plan(args[15])["plan"]
    if plan not in ("chunk", "recurrent", "parallel"):
        return f"plan {plan} chooses its kernels from the sizes"
    why = _symbolic_sizes(q, v, time_dims, t0, steps)  # None: K, V and the length are ints
    if why is None and plan == "parallel" and h0 is not None:
        from ..codegen import kda_parallel

        if not kda_parallel.serves_symbolic_rows(k_dim=q.shape[-1], v_dim=v.shape[-1], t_len=steps,
                                                 device=q.device, initial_state=True):
            return "plan parallel with an initial state chooses its key split from the row count"
    return why


def _symbolic_backward(args, kwargs, at: int = 8) -> Optional[str]:
    """The ``symbolic`` rule of :func:`kda_backward` and :func:`kda_backward_saved` (the chunked
    backward, configs from K and V): :func:`_symbolic_sizes`; ``at``: where ``time_dims`` is
    among the op's arguments."""
    return _symbolic_sizes(args[0], args[2], *args[at:at + 3])


@launch.fused_op("fuser::kda", symbolic=_symbolic_forward)
def kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], time_dims: list[int], t0: int, steps: int, scale: float, scalar_gate: bool,
    out_dim: int, out_dtype: torch.dtype, want_state: bool, state_dtype: torch.dtype, plan: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _op_forward(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype, want_state,
                       state_dtype, plan, save=False)


def _op_forward(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype, want_state,
                state_dtype, plan, *, save: bool) -> tuple:
    """The body of :func:`kda` (``(o, state)``) and, with ``save``, of :func:`kda_save` (``(o,
    state, *saved)``, :data:`SAVED` as ``[*L, ...]`` views of the forward's workspaces)."""
    parsed = _parsed_plan(plan)
    # every plan's kernels read the inputs' rows in place ([*L, T, *] views, two stride groups)
    lead, (qf, kf, vf, gf, bf) = _inputs(q, k, v, g, beta, time_dims, t0, steps, scalar_gate, flat=False)
    kd, vd = q.shape[-1], v.shape[-1]
    h0f = h0.reshape(-1, kd, vd) if h0 is not None else None
    # o in its final layout, written by the kernels through a view: no copy after them
    o, o_view = _output(lead, steps, vd, out_dim, out_dtype, q.device)
    _, state, *saved = run_forward(qf, kf, vf, gf, bf, h0f, scale, scalar_gate, want_state, out_dtype, parsed,
                                   out=o_view, save=save)
    state = (state.reshape(*lead, kd, vd).to(state_dtype) if want_state
             else torch.empty(0, dtype=state_dtype, device=q.device))
    if not save:
        return o, state
    kept = [saved[0][key].view(shape) if saved[0][key] is not None else q.new_empty(0, dtype=dt)
            for key, (shape, dt) in zip(SAVED, _saved_shapes(lead, steps, kd, vd, parsed, scalar_gate))]
    return (o, state, *kept)


@kda.register_fake
def _kda_fake(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype, want_state,
              state_dtype, plan):
    lead = _lead(q, time_dims[0])
    shape_o = list(lead) + [v.shape[-1]]
    shape_o.insert(out_dim, steps)
    o = q.new_empty(shape_o, dtype=out_dtype)
    state = q.new_empty((*lead, q.shape[-1], v.shape[-1]) if want_state else (0,), dtype=state_dtype)
    return o, state


#: The chunked forward's workspaces the plan ``save=workspaces`` keeps for the backward: the extra
#: outputs of ``fuser::kda_save`` and inputs of ``fuser::kda_backward_saved``, in this order, each
#: ``[*L, ...]`` (the op's lead dims, then the per-head shape of ``kda_chunk.forward``'s
#: ``saved`` dict: ``[T_pad, K]``, ..., ``states`` ``[n_chunks, K, V]`` or an empty placeholder
#: where :func:`keeps_states` says no).
SAVED = ("qg", "kd", "w", "u", "a_qk", "a_kk", "xm", "gcum", "g_last", "states")


def keeps_states(k_dim: int, dots: str) -> bool:
    """Whether ``save=workspaces`` also keeps the state before every chunk (read by the backward
    instead of its sequential recompute). MEASURED (H100, torch 2.11 / Triton 3.6, B=1, T=4096,
    H=16, bf16 inputs, forward + backward device µs, the kernels called directly, 2026-11-25): with the
    states 999 / 1938 / 4773 (float32 dots, K = V = 64 / 128 / 256) and 812 / 1493 / 3581
    (bfloat16 dots), without 972 / 2057 / 5084 and 792 / 1456 / 3630: kept for K > 128, and for
    K > 64 with float32 dots (whose float32 W and Kd slow the fused recompute pass)."""
    return k_dim > 128 or (k_dim > 64 and dots == "float32")


def _saved_shapes(lead: list, steps, k_dim: int, v_dim: int, plan: dict, scalar_gate: bool) -> list:
    """``(shape, dtype)`` of each of :data:`SAVED` (``states``: ``(0,)`` when not kept)."""
    from ..codegen.kda_chunk import workspace_dtype

    chunk = plan["chunk"]
    nc = launch.cdiv(steps, chunk)
    tp = nc * chunk
    dt, f32 = workspace_dtype(plan["dots"]), torch.float32
    lead = list(lead)
    states = (lead + [nc, k_dim, v_dim], f32) if keeps_states(k_dim, plan["dots"]) else ([0], f32)
    return [(lead + [tp, k_dim], dt), (lead + [tp, k_dim], dt), (lead + [tp, k_dim], dt), (lead + [tp, v_dim], dt),
            (lead + [tp, chunk], dt), (lead + [tp, chunk], f32), (lead + [tp, chunk], f32),
            (lead + ([tp] if scalar_gate else [tp, k_dim]), f32), (lead + [nc, k_dim], f32), states]


@launch.fused_op("fuser::kda_save", symbolic=_symbolic_forward)
def kda_save(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], time_dims: list[int], t0: int, steps: int, scale: float, scalar_gate: bool,
    out_dim: int, out_dtype: torch.dtype, want_state: bool, state_dtype: torch.dtype, plan: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kda` with the chunk plan's ``save=workspaces``: ``(o, state, *saved)``, ``saved``
    the forward's workspaces (:data:`SAVED`, ``[*L, ...]``), which its autograd formula hands to
    ``fuser::kda_backward_saved`` instead of recomputing them. Used by the rewrite only when
    gradients are recorded (the workspaces live until the backward)."""
    return _op_forward(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype, want_state,
                       state_dtype, plan, save=True)


@kda_save.register_fake
def _kda_save_fake(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype, want_state,
                   state_dtype, plan):
    o, state = _kda_fake(q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype,
                         want_state, state_dtype, plan)
    shapes = _saved_shapes(_lead(q, time_dims[0]), steps, q.shape[-1], v.shape[-1], _parsed_plan(plan), scalar_gate)
    return (o, state, *(q.new_empty(shape, dtype=dt) for shape, dt in shapes))


def _setup(ctx, inputs, output):
    """Autograd context of :func:`kda` and :func:`kda_save`: the inputs, and kda_save's workspaces
    (its outputs after o and the state; none for kda)."""
    q, k, v, g, beta, h0, time_dims, t0, steps, scale, scalar_gate, out_dim, out_dtype, want_state, state_dtype, \
        plan = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, *output[2:])
    ctx.args = (list(time_dims), t0, steps, scale, scalar_gate, out_dim, want_state, _parsed_plan(plan)["chunk"])
    # the final state never depends on q: with only q needing a gradient it needs none, as in eager
    # (autograd.grad of it then raises instead of giving zeros); kda_save's workspaces never do
    state_free = not any(t is not None and t.requires_grad for t in (k, v, g, beta, h0))
    ctx.mark_non_differentiable(*([output[1]] if state_free else []), *output[2:])


#: Largest K (and V) the backward kernels (codegen/kda_bwd.py) take: their state tiles live in
#: registers. Larger heads fall back to :func:`backward_reference`.
KERNEL_BACKWARD_MAX_DIM = 256


def _backward(ctx, d_o, d_state, *_):
    """Gradients of :func:`kda` and :func:`kda_save` (``*_``: kda_save's workspace outputs, never
    differentiated): kda_backward, or kda_backward_saved on the workspaces :func:`_setup` kept;
    heads above :data:`KERNEL_BACKWARD_MAX_DIM` by the float64 reference."""
    q, k, v, g, beta, h0, *saved = ctx.saved_tensors
    time_dims, t0, steps, scale, scalar_gate, out_dim, want_state, chunk = ctx.args
    args = dict(time_dims=time_dims, t0=t0, steps=steps, scale=scale, scalar_gate=scalar_gate, out_dim=out_dim)
    d_state = d_state if want_state and d_state is not None and d_state.numel() else None
    if max(q.shape[-1], v.shape[-1]) <= KERNEL_BACKWARD_MAX_DIM:
        # dO read in place too (its rows as two stride groups; any strides, a broadcast one included)
        if saved:
            dq, dk, dv, dg, db, dh0 = kda_backward_saved(q, k, v, g, beta, h0, d_o, d_state, *saved, time_dims, t0,
                                                         steps, scale, scalar_gate, out_dim, chunk)
        else:
            dq, dk, dv, dg, db, dh0 = kda_backward(q, k, v, g, beta, h0, d_o, d_state, time_dims, t0, steps, scale,
                                                   scalar_gate, out_dim)
        grads = (dq, dk, dv, dg, db, dh0 if h0 is not None else None)
    else:
        grads = backward_reference(q, k, v, g, beta, h0, d_o, d_state, **args)
    return (*grads, None, None, None, None, None, None, None, None, None, None)


def _grad_buffers(q, k, v, g, beta, time_dims, t0, steps, scalar_gate):
    """The gradients of q, k, v, g, beta, allocated once each in its input's layout and dtype
    (``empty_like``: the strides the fake implementation promises), and the ``[*L, T, *]`` views of
    their written window the backward kernels take as ``out=`` (cut as :func:`_inputs` cuts the
    inputs, beta's trailing size-1 dim included): ``(full, views)``. A window that leaves part of
    the time axis out (``t0 > 0`` or ``steps`` short of it) zero-fills the buffers (the gradient
    there is 0); the kernels write the rest."""
    full = [launch.empty_like(x) for x in (q, k, v, g, beta)]
    _, views = _inputs(*full, time_dims, t0, steps, scalar_gate, flat=False)
    for x, view in zip(full, views):
        if view.numel() != x.numel():  # a window of the time axis: 0 outside it
            x.zero_()
    return full, views


def backward_kernels(q, k, v, g, beta, h0, d_o, d_state, *, time_dims, t0, steps, scale, scalar_gate, out_dim,
                     saved: Optional[dict] = None, chunk: int = 64):
    """Gradients of :func:`kda` with respect to ``q, k, v, g, beta, h0`` by the chunked backward
    kernels (:func:`fuser.codegen.kda_bwd.backward`), in the inputs' dtypes and layouts: the
    kernels write dq, dk, dv, dg, dbeta where they are returned (``out=``, views of tensors
    allocated like the inputs), no copy after them; dh0 (``[N, K, V]`` float32 from the
    kernels) is copied into ``h0``'s layout and dtype. ``saved``: the forward's workspaces
    (:data:`SAVED` -> ``[*L, ...]`` tensors of :func:`kda_save`; ``states`` may be empty) of a
    forward with chunks of ``chunk``, read instead of recomputed."""
    from ..codegen import kda_bwd

    # the inputs and dO as [*L, T, *] views: the kernels read their rows in place (two stride groups)
    lead, (qf, kf, vf, gf, bf) = _inputs(q, k, v, g, beta, time_dims, t0, steps, scalar_gate, flat=False)
    kd, vd = q.shape[-1], v.shape[-1]
    do = as_rows(d_o, out_dim, 0, steps, True)
    h0f = h0.reshape(-1, kd, vd) if h0 is not None else None
    dsf = d_state.reshape(-1, kd, vd) if d_state is not None else None
    grads, views = _grad_buffers(q, k, v, g, beta, time_dims, t0, steps, scalar_gate)
    # the kernels floor the gates at GATE_FLOOR as they load them, as in the forward (a −inf gate:
    # dg there is 0, as eager's)
    flat = None
    if saved is not None:
        n = math.prod(lead)
        flat = {key: x.reshape(n, *x.shape[len(lead):]) for key, x in saved.items() if key != "states" or x.dim() > 1}
    *_, dh0 = kda_bwd.backward(qf, kf, vf, gf, bf, do, scale=scale, initial_state=h0f, d_final_state=dsf,
                               scalar_gate=scalar_gate, out=views, saved=flat, chunk=chunk)
    if h0 is not None and dh0 is not None:
        return (*grads, torch.empty_like(h0).copy_(dh0.view(h0.shape)))
    return (*grads, None)


def backward_reference(q, k, v, g, beta, h0, d_o, d_state, *, time_dims, t0, steps, scale, scalar_gate, out_dim):
    """Gradients of :func:`kda` with respect to ``q, k, v, g, beta, h0`` (None where an input
    needs none), by autograd through the float64 chunked reference
    (:func:`fuser.patterns.kda_reference.chunked`), in the inputs' dtypes and layouts."""
    from .kda_reference import chunked

    originals = (q, k, v, g, beta, h0)
    with torch.enable_grad():
        leaves = [x.detach().double().requires_grad_(True) if x is not None else None for x in originals]
        lq, lk, lv, lg, lb, lh = leaves
        lead, (qf, kf, vf, gf, bf) = _inputs(lq, lk, lv, lg, lb, time_dims, t0, steps, scalar_gate)
        kd, vd = q.shape[-1], v.shape[-1]
        if scalar_gate:
            gf = gf[..., None].expand(*gf.shape, kd)
        as_heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [N, T, *] -> [1, T, N, *]
        h0f = lh.reshape(1, -1, kd, vd) if lh is not None else None
        o, state = chunked(as_heads(qf), as_heads(kf), as_heads(vf), as_heads(gf), as_heads(bf), scale=scale,
                           initial_state=h0f, output_final_state=d_state is not None)
        o = _assemble(o[0].transpose(0, 1), lead, steps, out_dim)
        outs, grads_out = [o], [d_o.double()]
        if d_state is not None:
            outs.append(state.reshape(*lead, kd, vd))
            grads_out.append(d_state.double())
        wanted = [x for x in leaves if x is not None]
        got = torch.autograd.grad(outs, wanted, grads_out, allow_unused=True)
    it = iter(got)
    result = []
    for x, leaf in zip(originals, leaves):
        if leaf is None:
            result.append(None)
            continue
        gr = next(it)
        result.append(torch.zeros_like(x) if gr is None else gr.to(x.dtype))
    return tuple(result)


@launch.fused_op("fuser::kda_backward", symbolic=_symbolic_backward)
def kda_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], d_o: torch.Tensor, d_state: Optional[torch.Tensor], time_dims: list[int], t0: int,
    steps: int, scale: float, scalar_gate: bool, out_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`kda` by the kernels (an op of its own, so that AOTAutograd traces
    the backward graph without running them): ``(dq, dk, dv, dg, dbeta, dh0)`` shaped like the
    inputs (``dh0`` empty without ``h0``)."""
    # allocated in the inputs' own strides (empty_like), as the fake implementation says
    *grads, dh0 = backward_kernels(q, k, v, g, beta, h0, d_o, d_state, time_dims=time_dims, t0=t0, steps=steps,
                                   scale=scale, scalar_gate=scalar_gate, out_dim=out_dim)
    return (*grads, dh0 if dh0 is not None else q.new_empty(0))


@kda_backward.register_fake
def _kda_backward_fake(q, k, v, g, beta, h0, d_o, d_state, time_dims, t0, steps, scale, scalar_gate, out_dim):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), torch.empty_like(h0) if h0 is not None else q.new_empty(0))


@launch.fused_op("fuser::kda_backward_saved", symbolic=functools.partial(_symbolic_backward, at=8 + len(SAVED)))
def kda_backward_saved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], d_o: torch.Tensor, d_state: Optional[torch.Tensor],
    qg: torch.Tensor, kd: torch.Tensor, w: torch.Tensor, u: torch.Tensor, a_qk: torch.Tensor, a_kk: torch.Tensor,
    xm: torch.Tensor, gcum: torch.Tensor, g_last: torch.Tensor, states: torch.Tensor,
    time_dims: list[int], t0: int, steps: int, scale: float, scalar_gate: bool, out_dim: int, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kda_backward` on the forward's workspaces (the outputs :data:`SAVED` of
    :func:`kda_save`): kda_bwd_prep's recomputation is skipped."""
    saved = dict(zip(SAVED, (qg, kd, w, u, a_qk, a_kk, xm, gcum, g_last, states)))
    *grads, dh0 = backward_kernels(q, k, v, g, beta, h0, d_o, d_state, time_dims=time_dims, t0=t0, steps=steps,
                                   scale=scale, scalar_gate=scalar_gate, out_dim=out_dim, saved=saved, chunk=chunk)
    return (*grads, dh0 if dh0 is not None else q.new_empty(0))


@kda_backward_saved.register_fake
def _kda_backward_saved_fake(q, k, v, g, beta, h0, d_o, d_state, *rest):
    return _kda_backward_fake(q, k, v, g, beta, h0, d_o, d_state, *rest[len(SAVED):-1])


kda.register_autograd(_backward, setup_context=_setup)
kda_save.register_autograd(_backward, setup_context=_setup)


# DTensor sharding rules (fuser/distributed.py): every lead (batch, head) dim is independent problems.
from fuser import distributed  # noqa: E402


def _with_time(dims: str, at: int) -> str:
    return dims[:at] + "t" + dims[at:]


def _sharding_dims(q, k, v, g, beta, h0, time_dims, scalar_gate) -> tuple[dict, str]:
    tq, tk, tv, tg, tb = time_dims
    lead = "ABCDEFGH"[:len(q.shape) - 2]
    beta_dims = lead + "x" * (len(beta.shape) - 1 - len(lead))  # [*L] or [*L, 1], plus time
    ins = {"q": _with_time(lead + "k", tq), "k": _with_time(lead + "k", tk), "v": _with_time(lead + "v", tv),
           "g": _with_time(lead if scalar_gate else lead + "k", tg),
           "beta": _with_time(beta_dims, tb if tb < len(beta.shape) else len(beta.shape) - 1),
           "h0": None if h0 is None else lead + "kv"}
    return ins, lead


def _sharding_fwd(q, k, v, g, beta, h0, time_dims, scalar_gate, out_dim, want_state, **_):
    ins, lead = _sharding_dims(q, k, v, g, beta, h0, time_dims, scalar_gate)
    return distributed.Layout(ins, (_with_time(lead + "v", out_dim), lead + "kv" if want_state else None), lead)


def _sharding_bwd(q, k, v, g, beta, h0, d_o, d_state, time_dims, scalar_gate, out_dim, **_):
    ins, lead = _sharding_dims(q, k, v, g, beta, h0, time_dims, scalar_gate)
    ins.update(d_o=_with_time(lead + "v", out_dim), d_state=None if d_state is None else lead + "kv")
    outs = (ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], ins["h0"])
    return distributed.Layout(ins, outs, lead)


def _saved_dims(lead: str, scalar_gate: bool, states_kept: bool) -> dict:
    """The dims of the workspaces :data:`SAVED`: the lead dims (independent problems), then their own."""
    return {"qg": lead + "tk", "kd": lead + "tk", "w": lead + "tk", "u": lead + "tv", "a_qk": lead + "tc",
            "a_kk": lead + "tc", "xm": lead + "tc", "gcum": lead + ("t" if scalar_gate else "tk"),
            "g_last": lead + "nk", "states": lead + "nkv" if states_kept else None}


def _sharding_fwd_saved(q, k, v, g, beta, h0, time_dims, scalar_gate, out_dim, want_state, plan, **_):
    lay = _sharding_fwd(q, k, v, g, beta, h0, time_dims, scalar_gate, out_dim, want_state)
    parsed = _parsed_plan(plan)
    dims = _saved_dims(lay.parallel, scalar_gate, keeps_states(q.shape[-1], parsed["dots"]))
    return distributed.Layout(lay.inputs, lay.outputs + tuple(dims[key] for key in SAVED), lay.parallel)


def _sharding_bwd_saved(q, k, v, g, beta, h0, d_o, d_state, time_dims, scalar_gate, out_dim, states, **_):
    lay = _sharding_bwd(q, k, v, g, beta, h0, d_o, d_state, time_dims, scalar_gate, out_dim)
    ins = dict(lay.inputs, **_saved_dims(lay.parallel, scalar_gate, len(states.shape) > 1))
    return distributed.Layout(ins, lay.outputs, lay.parallel)


distributed.register_op_sharding(kda, _sharding_fwd)
distributed.register_op_sharding(kda_backward, _sharding_bwd)
distributed.register_op_sharding(kda_save, _sharding_fwd_saved)
distributed.register_op_sharding(kda_backward_saved, _sharding_bwd_saved)
