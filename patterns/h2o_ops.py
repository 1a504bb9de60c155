"""The fused H2O op: ``torch.ops.fuser.h2o``.

A ``torch.library.custom_op`` with a fake (meta) implementation, so Dynamo and AOTAutograd
treat it as one op with known output shapes; it neither mutates nor aliases its inputs. It is a
:func:`fuser.codegen.launch.fused_op`: on CUDA tensors with static sizes AOTAutograd traces its
body and Inductor launches the H2O kernels itself (their launches recorded with
``torch.library.wrap_triton``; diag_cache's workspace and layout tables, one_kernel's zeroed
score, allocated in the compiled graph per call); on CPU tensors (Triton's interpreter) and
with dynamic shapes where its rule (:func:`_symbolic_sizes`) says so it stays an opaque op that
launches its kernels from Python. It has no autograd formula: the pattern declines regions whose outputs need
gradients (H2O scores keys during inference). The kernels are in ``codegen/h2o.py``.

``torch.ops.fuser.h2o(q, k, v, mask, scale, causal, mask_kind, need_out, plan, causal_fill,
causal_fill_mode, mask_fill) -> (out, score)``
    q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` or None (any strides;
    GQA when ``Hkv < Hq``); ``mask`` broadcastable to ``[B, Hq, Nq, Nk]`` or None; ``causal`` in
    ``{"none", "top_left", "bottom_right"}``; ``mask_kind`` in ``{"none", "bool_keep",
    "bool_drop", "additive"}``; ``plan`` a ``"key=value;..."`` string (:func:`plan_string`):
    ``plan=two_kernel|one_kernel|diag_cache|autotune``, ``diagonals=<K>``,
    ``cache=balanced|causal`` and, for ``autotune``, ``try=<plan>/<K>/<cache>,...`` (the plans
    to time; "" is two_kernel); ``causal_fill`` (``-inf``, or a finite score for the entries above
    the diagonal: ``causal_fill_mode`` ``"replace"`` or ``"add"``, then two_kernel runs whatever
    ``plan`` says, see :func:`fuser.codegen.h2o.forward`); ``mask_fill`` (``-inf``, or the finite
    score of an entry a boolean mask hides: every plan). Returns ``out = softmax(scale·q kᵀ + mask) v``
    ``[B, Hq, Nq, Dv]`` in q's dtype (an empty tensor when ``need_out`` is False or v is None)
    and the column sums ``score[b, h, j] = Σ_i P[b, h, i, j]`` ``[B, Hq, Nk]`` float32. A query row
    with no visible key (every score ``-inf``) is NaN in eager's softmax: its (b, h)'s scores are
    NaN for every key, as in eager (``nan_rows`` of :func:`fuser.codegen.h2o.forward`); its out row
    is 0 (eager: NaN; README, Limits).

With dynamic shapes a K chosen at compile time can exceed the block diagonals of a later,
shorter call: it is clamped to :func:`fuser.codegen.h2o.diagonal_count` (and the causal layout
without causal masking, impossible from the planner, falls back to ``balanced``).

``plan=autotune`` times the listed plans on the first call of each shape bucket (sequence
lengths rounded up to powers of two) with :func:`fuser.codegen.launch.autotune` — on the GPU with
Triton's ``do_bench`` (while Inductor compiles the call: on random stand-ins of the inputs, at
compile time), in the interpreter with the wall clock — and remembers the fastest in
memory and in the autotune cache file; ``one_kernel`` is left out under
``torch.use_deterministic_algorithms(True)`` (its atomics are not deterministic).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codegen import attention as attention_kernels
from ..codegen import h2o as kernels
from ..codegen import launch

NEG_INF = float("-inf")


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


def plan_string(plan: str = "two_kernel", diagonals: int = 0, cache: str = "balanced",
                tries: tuple = ()) -> str:
    """The op's ``plan`` argument: ``"plan=diag_cache;diagonals=4;cache=causal"``; ``tries``
    (``plan="autotune"``) a sequence of ``(plan, diagonals, cache)`` to time."""
    text = f"plan={plan};diagonals={int(diagonals)};cache={cache}"
    if tries:
        text += ";try=" + ",".join(f"{p}/{int(kk)}/{c}" for p, kk, c in tries)
    return text


def parse_plan(plan: str) -> dict:
    """``"plan=diag_cache;diagonals=4;cache=causal"`` -> ``{"plan": "diag_cache", "diagonals": 4,
    "cache": "causal", "tries": []}`` (defaults: two_kernel, 0, balanced).

    Raises:
        ValueError: an entry that is not ``key=value`` or an unknown key.
    """
    out = {"plan": "two_kernel", "diagonals": 0, "cache": "balanced", "tries": []}
    for part in plan.split(";"):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or key not in ("plan", "diagonals", "cache", "try"):
            raise ValueError(f"fuser::h2o plan entry {part!r}: expected plan=, diagonals=, cache= or try=")
        if key == "diagonals":
            out[key] = int(value)
        elif key == "try":
            for item in value.split(","):
                p, kk, c = item.split("/")
                out["tries"].append((p, int(kk), c))
        else:
            out[key] = value
    return out


def _fit(q, k, causal: str, plan: str, diagonals: int, cache: str) -> dict:
    """The plan's keyword arguments for :func:`fuser.codegen.h2o.forward` at this call's shape
    (K clamped to the block diagonals; the causal layout only with causal masking)."""
    if plan != "diag_cache":
        return {"plan": plan}
    if cache == "causal" and causal == "none":
        cache = "balanced"
    count = kernels.diagonal_count(q, k, causal) if q.shape[2] and k.shape[2] else 0
    return {"plan": plan, "diagonals": min(int(diagonals), count), "cache": cache}


def _tune_key(q, k, v, mask, causal: str, mask_kind: str, need_out: bool, tries, mask_fill: float = NEG_INF) -> str:
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dv = v.shape[-1] if v is not None else 0
    fill = "fill" if mask_fill != NEG_INF and mask_kind in ("bool_keep", "bool_drop") else ""
    return (f"h2o.plan|{launch.gpu_name(q.device)}|{q.dtype}|B{b}|H{hq}/{hkv}|Nq{launch.next_power_of_2(nq)}|"
            f"Nk{launch.next_power_of_2(nk)}|D{d}/{dv}|{causal}|{mask_kind}{fill}|"
            f"{None if mask is None else mask.dtype}|out{int(need_out)}|"
            + ",".join(f"{p}/{kk}/{c}" for p, kk, c in tries))


def tuned_plan(q, k, v, mask, scale: float, causal: str, mask_kind: str, need_out: bool, tries,
               mask_fill: float = NEG_INF) -> dict:
    """The fastest of ``tries`` (``(plan, diagonals, cache)`` triples; two_kernel when empty) for
    this problem, timed on first use (see :func:`fuser.codegen.launch.autotune`): the keyword
    arguments of :func:`fuser.codegen.h2o.forward` for it."""
    tries = [t for t in tries if not (t[0] == "one_kernel" and torch.are_deterministic_algorithms_enabled())]
    if not tries:
        tries = [("two_kernel", 0, "balanced")]
    cands = [{"plan": p, "diagonals": kk, "cache": c} for p, kk, c in tries]
    if len(cands) == 1:
        best = cands[0]
    else:
        def run(cfg, q, k, v, mask):
            return kernels.forward(q, k, v, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
                                   need_out=need_out, mask_fill=mask_fill, nan_rows=True,
                                   **_fit(q, k, causal, cfg["plan"], cfg["diagonals"], cfg["cache"]))

        timer = launch.wall_clock_ms if launch.interpreted(q.device) else None
        best = launch.autotune(_tune_key(q, k, v, mask, causal, mask_kind, need_out, tries, mask_fill), cands, run,
                               timer=timer, inputs=(q, k, v, mask))
    return _fit(q, k, causal, best["plan"], best["diagonals"], best["cache"])


def _symbolic_sizes(args, kwargs) -> Optional[str]:
    """The ``symbolic`` rule (``launch.fused_op``) of :func:`h2o`: why a call with symbolic sizes
    (dynamic shapes: a KV cache that grows between decode steps, a changed batch) keeps the opaque
    op, or None. two_kernel and one_kernel choose their kernels and configs from the dtype, the
    head dims and the variant (a symbolic length takes the long-sequence configs,
    ``codegen.h2o._short_first``; where ``Nk >= Nq`` is not proven the empty-row pass runs), so
    launches traced once serve every batch and length; a finite causal fill runs two_kernel.
    Not so for diag_cache (its tables and workspace sized from the block diagonals), autotuning
    (timed per length bucket), symbolic head dims or head counts, or rows (B·Hq) that may exceed
    one launch grid (``launch.at_most``). Checked by tests/patterns/test_inline_h2o.py."""
    q, k, causal, plan, causal_fill = args[0], args[1], args[5], args[8], args[9]
    kind = parse_plan(plan)["plan"]
    if not (causal != "none" and causal_fill != NEG_INF):  # else two_kernel, whatever the plan
        if kind == "autotune":
            return "autotuning, timed per length"
        if kind == "diag_cache":
            return "diag_cache's tables, sized from the lengths"
    dv = args[2].shape[-1] if args[2] is not None else 0
    return launch.symbolic_launch_fits((q.shape[1], k.shape[1], q.shape[-1], dv), q.shape[0] * q.shape[1])


@launch.fused_op("fuser::h2o", symbolic=_symbolic_sizes)
def h2o(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    scale: float,
    causal: str,
    mask_kind: str,
    need_out: bool,
    plan: str,
    causal_fill: float,
    causal_fill_mode: str,
    mask_fill: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    want_out = need_out and v is not None
    p = parse_plan(plan)
    if causal != "none" and causal_fill != float("-inf"):
        # a finite causal fill runs with two_kernel only (the planner offers nothing else)
        kw = {"plan": "two_kernel"}
    elif p["plan"] == "autotune":
        kw = tuned_plan(q, k, v if want_out else None, mask, scale, causal, mask_kind, want_out, p["tries"], mask_fill)
    else:
        kw = _fit(q, k, causal, p["plan"], p["diagonals"], p["cache"])
    out, score = kernels.forward(q, k, v if want_out else None, scale=scale, causal=causal, mask=mask,
                                 mask_kind=mask_kind, need_out=want_out, causal_fill=causal_fill,
                                 causal_fill_mode=causal_fill_mode, mask_fill=mask_fill, nan_rows=True, **kw)
    return (out if out is not None else _empty(q)), score


@h2o.register_fake
def _h2o_fake(q, k, v, mask, scale, causal, mask_kind, need_out, plan, causal_fill, causal_fill_mode, mask_fill):
    b, hq, n_q, _ = q.shape
    n_k = k.shape[2]
    score = q.new_empty((b, hq, n_k), dtype=torch.float32)
    if not (need_out and v is not None):
        return _empty(q), score
    return attention_kernels.alloc_out(q, v), score  # the attention forward's output layout


# DTensor sharding rule (fuser/distributed.py): batch and heads are independent problems.
from fuser import distributed  # noqa: E402

distributed.register_op_sharding(h2o, lambda q, k, v, mask, need_out, **_: distributed.Layout(
    {"q": "bhid", "k": "bhjd", "v": "bhje", "mask": distributed.broadcast_dims(mask, "bhij")},
    ("bhie" if need_out and v is not None else None, "bhj"), "bh"))
