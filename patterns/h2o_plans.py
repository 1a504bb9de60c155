"""Plans for an H2O match — their symbolic costs — and the graph code each emits.

Candidates (``codegen/h2o.py`` has the kernels, ``docs/math.md`` "H2O column sums" the math):

``fuser[two_kernel]``
    the attention forward (O, LSE), then a column-parallel pass recomputing P: per visible
    (query, key) pair ``4D + 2Dv`` FLOPs (Q Kᵀ twice, P V once) and two exps; deterministic.
``fuser[one_kernel]``
    one row-parallel kernel, two passes over the keys (statistics, then P, P V and the column
    sums by float32 atomics): the same FLOPs and exps, one launch, no statistics through HBM,
    ``Nk · ⌈Nq / BLOCK_M⌉`` atomic adds per head; **not deterministic** (the atomics' order).
``fuser[diag_cache K=<K> <layout>]``
    two_kernel where kernel 0 also writes the float32 scores of the cached tiles (``|C|`` tiles of
    ``T × T``, from :func:`fuser.codegen.h2o.cached_tiles`'s layout at the example shapes) and the
    column pass reads them: ``2·D·T²`` FLOPs fewer per cached tile, ``2·4·T²`` bytes more (written
    once, read once). Offered at a few K (an eighth, a quarter and half of the block diagonals),
    the ``balanced`` layout always and the ``causal`` layout under causal masking.
``fuser[plan=autotune]``
    under ``fuser.autotune``: the three best-estimated plans above timed on the first call of a
    shape (``patterns/h2o_ops.py``), the fastest kept.
``inductor``
    on CUDA: leave the region to Inductor (scores and P materialised).
"""

from __future__ import annotations

import sympy
import torch

from fuser import costmodel as cm
from fuser.codegen import h2o as kernels
from fuser.codegen import launch
from fuser.graph import permuted, shape
from fuser.pattern import Candidate, Match, MatchContext
from fuser.static import symint_value
from . import planning


#: the nominal query-block height for tile and atomic counts (the GPU tables' usual BLOCK_M)
BLOCK_M = 128

# Fraction of the matrix-unit peak each H2O kernel reaches, by head-dim bucket (<=64, <=128,
# <=256), counted on that kernel's own FLOPs over the (query, key) pairs of the tiles it visits
# (cost_terms). The <=128 entries are MEASURED on the H100 (B=1, H=32, D=128, fp16, N 1024..16384,
# causal and not; benchmarks/results/h2o.md of 2026-11-24, forced plans timed as CUDA-graph
# replays, and the attention forward alone from scratch/att_tma.py's run of the same day):
#   - kernel 0 of two_kernel is the attention forward (Q Kᵀ and P V): 0.49 (N=1024) to 0.60
#     (N=4096) of the 790 TFLOP/s model peak -> 0.55;
#   - kernel 1, the column pass (Q Kᵀ again), is two_kernel's time minus kernel 0's: 0.44-0.46
#     with its 128-wide tiles (N >= 4096), but 0.23-0.28 with the 64 x 64 tiles it takes for
#     N <= codegen.h2o.SHORT_N (more programs, each too short to keep its pipeline full) -> a
#     table per column tile width, read from codegen.h2o.column_pass_config;
#   - one_kernel (two passes, Q Kᵀ twice and P V once): 0.40-0.47 unmasked -> 0.45.
# Under a causal mask one_kernel measured a further ~19 us per program on top of its tiles at
# every N (6-11 tile passes of 2.3 us each, fitted on N = 1024..16384; its cause is not found):
# ONE_KERNEL_CAUSAL_PROGRAM_US. With these the planner's choice is the faster measured plan at
# every one of the ten shapes (tests/patterns/test_h2o_costmodel.py replays them). The <=64 and
# <=256 entries are NOT MEASURED: the <=128 entry scaled by the attention forward's ratios
# (patterns/attention_plans.py: 0.50 / 0.60 and 0.38 / 0.60).
ROW_EFFICIENCY = (0.46, 0.55, 0.35)
COLUMN_EFFICIENCY = {"wide": (0.38, 0.46, 0.29), "narrow": (0.21, 0.25, 0.16)}
ONE_KERNEL_EFFICIENCY = (0.375, 0.45, 0.285)
#: the column pass's tiles counted as "wide" (COLUMN_EFFICIENCY) from this many keys per program
WIDE_COLUMN_TILE = 128
#: one_kernel under a causal mask: measured time per program (us) on top of its tiles (above)
ONE_KERNEL_CAUSAL_PROGRAM_US = 19.0

#: diag_cache with K >= 1, measured against two_kernel on the H100 (same run): kernel 0 is then
#: the H2O row kernel (templates/h2o_fwd.py.jinja, which writes the cached tiles) instead of the
#: tuned attention forward, and the column pass splits its loops; the cost is flat in K:
#: balanced 1.33-1.42x (K = 1..16, N 4096/8192, causal and not), causal layout 1.23-1.25x. The
#: workspace traffic (written by kernel 0, read by kernel 1) comes on top, not overlapped (K = n/2
#: at N=4096: 1 GiB each way, 1.58 ms against 0.96 ms).
DIAG_CACHE_OVERHEAD = {"balanced": 1.40, "causal": 1.25}

def _int(x) -> int:
    return int(symint_value(x))


def _shapes(m: Match) -> tuple[dict, int]:
    """Shape symbol -> value at the example shapes, and Dv (0 without P V)."""
    b = m.bindings
    lead = (1,) * (4 - b["rank"])  # [B·H, N, D] operands: B = 1
    sq = lead + tuple(permuted(shape(b["q"]), b["q_p"]))
    sk = lead + tuple(permuted(shape(b["k"]), b["k_p"]))
    subs = {cm.B: _int(sq[0]), cm.H: _int(sq[1]), cm.NQ: _int(sq[2]), cm.NK: _int(sk[2]), cm.D: _int(sq[3])}
    dv = _int(shape(b["v"])[-1]) if b["v"] is not None else 0
    return subs, dv


def diag_options(m: Match, subs: dict) -> list[tuple[int, str, int, int]]:
    """diag_cache's offered ``(K, layout, cached tiles |C| per head, tile T)`` at the example
    shapes: K in {n/8, n/4, n/2} (n the block diagonals), the balanced layout, and the causal
    layout under causal masking."""
    b = m.bindings
    dev = b["device"]
    t = kernels.candidate_configs(head_dim=subs[cm.D], dtype=b["in_dtype"], device=dev, plan="diag_cache")[0]["BLOCK_M"]
    n_q, n_k = subs[cm.NQ], subs[cm.NK]
    if n_q == 0 or n_k == 0:
        return []
    n = max(launch.cdiv(n_q, t), launch.cdiv(n_k, t))
    ks = sorted({kk for kk in (n // 8, n // 4, n // 2) if kk >= 1})
    layouts = ("balanced", "causal") if b["causal"] != "none" else ("balanced",)
    out = []
    for cache in layouts:
        for kk in ks:
            tiles = len(kernels._tables(n_q, n_k, t, b["causal"], kk, cache)[3])
            out.append((kk, cache, tiles, t))
    return out


def cost_terms(m: Match, plan: str, subs: dict, dv: int, cached: int = 0, tile: int = 0,
               cache: str = "balanced", col_tile: int = BLOCK_M) -> dict:
    """Symbolic cost terms of one plan (see the module docstring); ``cached`` tiles of ``tile²``
    per head for diag_cache (a number at the example shapes); ``col_tile`` the keys per program
    of two_kernel's column pass (:func:`fuser.codegen.h2o.column_pass_config`).

    Totals in ``flops``, ``exps``, ``bytes`` (what explain shows); for the plans with a column
    pass its share also in ``col_flops``, ``col_exps``, ``col_bytes``, ``col_tiles`` and its tile
    in ``col_tile``, so that :func:`estimate` times the two kernels at their own efficiencies.
    Under a causal mask a kernel visits whole tiles: the pairs it computes are the visible ones
    plus the hidden part of each tile on the diagonal (``N · (tile − 1) / 2`` per head: exact
    for a square top-left mask with tile dividing N)."""
    b = m.bindings
    dense = cm.NQ * cm.NK
    # a finite causal fill with a data mask visits every tile (no bound proves the entries above
    # the diagonal weigh 0); without one the run-time bound usually lets the kernels skip them
    visits_all = b.get("causal_fill", float("-inf")) != float("-inf") and b["mask_kind"] != "none"
    causal = b["causal"] != "none" and not visits_all

    def visited(n_edge, t):  # pairs of the tiles a kernel with t-wide blocks along n_edge visits
        if not causal:
            return dense
        offset = 0 if b["causal"] == "top_left" else cm.NK - cm.NQ
        return sympy.Min(cm.pairs_causal(cm.NQ, cm.NK, offset) + n_edge * (t - 1) / 2, dense)

    pairs = visited(cm.NQ, BLOCK_M)
    bh = cm.B * cm.H
    elt = torch.finfo(b["in_dtype"]).bits // 8
    if plan == "inductor":
        return {
            "flops": bh * visited(cm.NQ, 1) * (2 * cm.D + 2 * dv),  # the visible pairs
            "exps": bh * cm.NQ * cm.NK,
            # scores written, read by the softmax, P written, read by the sum and by P V
            "bytes": bh * cm.NQ * cm.NK * (4 + 4 + 4 + 4 + elt),
            "launches": 5,
        }
    io = elt * bh * (cm.NQ * cm.D + cm.NK * cm.D + cm.NQ * dv + cm.NK * dv) + 4 * bh * cm.NK
    tiles = sympy.ceiling(cm.NQ / BLOCK_M) * bh
    if plan == "one_kernel":
        return {
            # Q Kᵀ in both passes, P V once
            "flops": bh * pairs * (4 * cm.D + 2 * dv),
            "exps": 2 * bh * pairs,
            "tiles": tiles,
            "bytes": io + elt * bh * cm.NK * cm.D,  # k streamed twice; no statistics
            "atomics": bh * cm.NK * sympy.ceiling(cm.NQ / BLOCK_M),
            "launches": 1,
            # under a causal mask: the programs that pay ONE_KERNEL_CAUSAL_PROGRAM_US (estimate)
            **({"causal_programs": tiles} if causal else {}),
        }
    # two kernels: kernel 0 (Q Kᵀ, P V) writes the statistics; the column pass reads q and k
    # again and the statistics, recomputes Q Kᵀ and writes the score
    col_pairs = visited(cm.NK, col_tile)
    terms = {
        "col_flops": bh * col_pairs * 2 * cm.D,
        "col_exps": bh * col_pairs,
        "col_bytes": elt * bh * (cm.NQ * cm.D + cm.NK * cm.D) + 4 * bh * cm.NQ + 4 * bh * cm.NK,
        "col_tiles": sympy.ceiling(cm.NK / col_tile) * bh,
        "col_tile": col_tile,
        "tiles": tiles,
        "launches": 2,
    }
    terms["flops"] = bh * pairs * (2 * cm.D + 2 * dv) + terms["col_flops"]
    terms["exps"] = bh * pairs + terms["col_exps"]
    terms["bytes"] = io + 4 * bh * cm.NQ + terms["col_bytes"] - 4 * bh * cm.NK
    if plan == "diag_cache" and cached:
        area = tile * tile
        saved = bh * cached * 2 * area * cm.D
        terms["flops"] = terms["flops"] - saved
        terms["col_flops"] = terms["col_flops"] - saved
        terms["workspace"] = bh * cached * area * 4
        terms["overhead"] = DIAG_CACHE_OVERHEAD[cache]  # measured factor over two_kernel
        terms["bytes"] = terms["bytes"] + 2 * terms["workspace"]  # written by kernel 0, read by kernel 1
    return terms


def estimate(terms: dict, subs: dict, model: cm.DeviceModel, kind: str, plan: str) -> float:
    """Milliseconds of one plan: :func:`fuser.costmodel.estimate_ms` per kernel at its own
    efficiency (:data:`ROW_EFFICIENCY` and :data:`COLUMN_EFFICIENCY` by the column pass's tile,
    :data:`ONE_KERNEL_EFFICIENCY` plus :data:`ONE_KERNEL_CAUSAL_PROGRAM_US` per program and SM
    under a causal mask), plus the atomics; for diag_cache with cached tiles, times
    :data:`DIAG_CACHE_OVERHEAD` plus the workspace traffic."""
    d = subs[cm.D]
    keys = ("flops", "bytes", "exps", "tiles", "launches")
    if plan == "inductor":
        return cm.estimate_ms({k: v for k, v in terms.items() if k in keys}, subs, model, kind,
                              cm.efficiency(cm.EAGER_MATMUL, d))
    if plan == "one_kernel":
        t = cm.estimate_ms({k: v for k, v in terms.items() if k in keys}, subs, model, kind,
                           cm.efficiency(ONE_KERNEL_EFFICIENCY, d))
        if terms.get("causal_programs"):
            t += cm.evaluate(terms["causal_programs"], subs) * ONE_KERNEL_CAUSAL_PROGRAM_US * 1e-3 / model.sm_count
        return t + cm.atomics_ms(terms, subs, model)
    workspace = cm.evaluate(terms.get("workspace", 0), subs)
    col = {"flops": terms["col_flops"], "bytes": terms["col_bytes"], "exps": terms["col_exps"],
           "tiles": terms["col_tiles"], "launches": 1}
    row = {"flops": terms["flops"] - terms["col_flops"], "bytes": terms["bytes"] - terms["col_bytes"]
           - 2 * terms.get("workspace", 0), "exps": terms["exps"] - terms["col_exps"], "tiles": terms["tiles"],
           "launches": 1}
    width = "wide" if terms["col_tile"] >= WIDE_COLUMN_TILE else "narrow"
    t = (cm.estimate_ms(row, subs, model, kind, cm.efficiency(ROW_EFFICIENCY, d))
         + cm.estimate_ms(col, subs, model, kind, cm.efficiency(COLUMN_EFFICIENCY[width], d)))
    if workspace:
        t = t * terms["overhead"] + 2 * workspace / (model.bandwidth_gbs * 1e9) * 1e3
    return t


def candidates(m: Match, ctx: MatchContext) -> list[Candidate]:
    """Every plan this match can run with, each with its estimate at the example shapes."""
    b = m.bindings
    dev = b["device"]
    subs, dv = _shapes(m)
    model = planning.device_model(dev, ctx)
    kind = cm.operand_kind(str(b["in_dtype"]), launch.dot_precision(b["in_dtype"]) == "tf32")
    out: list[Candidate] = []

    def add(name, params, terms, plan, note, deterministic=True):
        out.append(Candidate(name, {"impl": "fuser", **params}, terms, estimate(terms, subs, model, kind, plan), note,
                             deterministic=deterministic))

    base = {"diagonals": 0, "cache": "balanced"}
    col_tile = kernels.column_pass_config(head_dim=subs[cm.D], dtype=b["in_dtype"], device=dev,
                                          n=max(subs[cm.NQ], subs[cm.NK]))["BLOCK_N"]
    add("fuser[two_kernel]", {"plan": "two_kernel", **base}, cost_terms(m, "two_kernel", subs, dv, col_tile=col_tile),
        "two_kernel",
        "attention forward (O, LSE), then a column-parallel pass recomputing P from the LSE")
    if b.get("causal_fill", float("-inf")) != float("-inf"):
        # a finite causal fill: only two_kernel's kernels take it (codegen/h2o.py)
        if dev.type != "cpu":
            terms = cost_terms(m, "inductor", subs, dv)
            out.append(Candidate("inductor", {"impl": "inductor"}, terms, estimate(terms, subs, model, kind, "inductor"),
                                 "left to Inductor: scores and P materialised"))
        return out
    add("fuser[one_kernel]", {"plan": "one_kernel", **base}, cost_terms(m, "one_kernel", subs, dv), "one_kernel",
        "one row-parallel kernel: statistics pass, then P V and the column sums by float32 atomics "
        "(score not bitwise deterministic)", deterministic=False)
    for kk, cache, tiles, t in diag_options(m, subs):
        add(f"fuser[diag_cache K={kk} {cache}]", {"plan": "diag_cache", "diagonals": kk, "cache": cache},
            cost_terms(m, "diag_cache", subs, dv, tiles, t, cache, col_tile=t), "diag_cache",
            f"two kernels; kernel 0 caches the float32 scores of {tiles} tiles of {t}x{t} per head "
            f"({cache} layout, K={kk}) for the column pass")
    if ctx.options.autotune:
        ranked = sorted(out, key=lambda c: c.estimate_ms)
        strict = torch.are_deterministic_algorithms_enabled()
        tries = tuple((c.params["plan"], c.params["diagonals"], c.params["cache"]) for c in ranked
                      if c.deterministic or not strict)[:3]
        best = ranked[0]
        out.append(Candidate("fuser[plan=autotune]", {"impl": "fuser", "plan": "autotune", "diagonals": 0,
                                                      "cache": "balanced", "tries": tries},
                             dict(best.cost), best.estimate_ms * 0.999,
                             "times " + ", ".join(f"{p}" + (f" K={kk} {c}" if p == "diag_cache" else "")
                                                  for p, kk, c in tries) + " on the first call of a shape",
                             deterministic=all(p != "one_kernel" for p, _, _ in tries)))
    if dev.type != "cpu":
        terms = cost_terms(m, "inductor", subs, dv)
        out.append(Candidate("inductor", {"impl": "inductor"}, terms, estimate(terms, subs, model, kind, "inductor"),
                             "left to Inductor: scores and P materialised"))
    return out


def why_not_offered(m: Match, choice: str, value: str) -> str:
    """Why ``h2o.<choice>=<value>`` is not among :func:`candidates` for ``m`` (see
    :meth:`fuser.pattern.Pattern.why_not_offered`)."""
    if choice != "plan":
        return ""
    if m.bindings.get("causal_fill", float("-inf")) != float("-inf"):
        return ("with a finite causal fill (torch.where(causal, 0, finfo.min) or masked_fill with a number) only "
                "two_kernel's kernels take it; drop h2o.plan from fuser.plan, or hide with -inf")
    if value == "autotune":
        return "h2o.plan=autotune is offered only under fuser.autotune=True (or mode=\"max-autotune\")"
    if value == "diag_cache":
        subs, _ = _shapes(m)
        t = kernels.candidate_configs(head_dim=subs[cm.D], dtype=m.bindings["in_dtype"], device=m.bindings["device"],
                                      plan="diag_cache")[0]["BLOCK_M"]
        return (f"diag_cache keeps the scores of diagonal {t}x{t} tiles for the column pass, and at N_q={subs[cm.NQ]}, "
                f"N_k={subs[cm.NK]} (this compile's sizes; a recompile for new sizes plans again) the scores span "
                f"fewer than 2 tiles of {t}: nothing to keep. Force it only where N_q or N_k is above {t} "
                "(compile that call on its own), or drop h2o.plan from fuser.plan and let the planner choose")
    return ""


def kernels_for(m: Match, plan: Candidate) -> list:
    """The kernel modules a fuser plan runs (for reports); all tried plans for autotune."""
    if plan.params.get("impl") != "fuser":
        return []
    b = m.bindings
    ms = b["mask_shape"]
    row = bool(ms is not None and (len(ms) < 2 or ms[-2] == 1))
    p = plan.params
    tries = (p.get("tries") or ()) if p["plan"] == "autotune" else ((p["plan"], p["diagonals"], p["cache"]),)
    out = []
    for name, kk, cache in tries:
        for k in kernels.kernels_for(plan=name, causal=b["causal"], mask_kind=b["mask_kind"], mask_row_broadcast=row,
                                     need_out=b["v"] is not None, interpret=b["device"].type == "cpu", diagonals=kk,
                                     cache=cache, causal_fill=b.get("causal_fill", float("-inf")),
                                     causal_fill_mode=b.get("causal_fill_mode", "replace"),
                                     mask_fill=b.get("mask_fill", float("-inf")), nan_rows=True):
            if k not in out:
                out.append(k)
    return out
