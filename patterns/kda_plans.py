"""Plans for a KDA match and their costs.

Candidates (kernels in ``codegen/kda_recurrent.py`` and ``codegen/kda_chunk.py``; the math in
``docs/math.md``, "KDA"):

``fuser[recurrent]``
    token by token; each program owns a ``[K, BLOCK_V]`` column block of one head's state for the
    whole sequence — in registers for small K, streamed through a float32 workspace for large K
    (two reads and a write of the block per token, mostly from L2). Reads every input once,
    writes o once; the T steps are a dependency chain. In registers its time is the larger of
    its traffic and ``T`` token steps per wave of programs (``codegen/kda_recurrent.REGISTERS_MODEL``,
    measured per launch config, the config chosen for the shape): a few resident programs per SM,
    so ``N · cdiv(V, BLOCK_V)`` programs past that run
    in waves (at T=8 and V=16384 there are thousands: the wave term, not the state write, is
    its time).
``fuser[chunk C=<C>]``
    the chunked WY form on tensor cores: an intra-chunk kernel parallel over chunks (decays,
    ``A_kk``, ``A_qk``, the triangular solve, ``U``, ``W`` into float32 workspaces), then a pass
    sequential over the chunks carrying the state in registers (K ≤ 256). The dependency chain
    is ``T / C`` long; at short T (a chunk or two) its first kernel has only ``N · cdiv(T, C)``
    programs, each solving then streaming all V columns (:data:`CHUNK_PREP_US`: a measured floor
    under the estimate). Its dots take float32 operands also for 16-bit inputs (as accurate as the
    float32 loop): the state path's as ``tf32x3`` on the GPU (three TF32 products a dot, counted
    so), the output path's (``A_qk``, ``Qg S``, ``A_qk Δ``) as single-pass TF32 when o is
    bfloat16, else as the state path's (``codegen/kda_chunk.resolve_output_precision``; one
    product, counted so). ``fuser.plan`` forces ``kda.output_precision=tf32|tf32x3|ieee`` and
    ``kda.dots=bfloat16`` (FLA's precision class: faster, the state ~2e-3 off; never chosen
    otherwise). The note says which precisions run.
``fuser[parallel]``
    the single-chunk parallel form for T ≤ 64 (``codegen/kda_parallel.py``): the ``T × T`` Gram
    matrices split over K across programs, a per-head solve, and the final state written tile by
    tile — without an initial state the state is never read, so the floor is writing it. Any K.
    Its time (:data:`PARALLEL_FIXED_US` and the constants after it, measured) is a fixed part,
    the Gram sums (``N · K · T²``), the solve programs in waves of one per SM (each redoes the
    ``T``-row forward substitution: 0.4 / 14 / 75 µs a wave at ``T_PAD`` = 16 / 32 / 64) and the
    traffic; it wins where the recurrent kernel must stream a large state
    (the blog's K = 8192, 16384 with V = 1024, T = 8: 45 / 75 µs of kernels against 548 / 1923 µs on
    the H100) and at short T with many value columns (512 × 16384, T = 8: 47 against 98 µs).
``inductor``
    the unrolled loop as written: Inductor round-trips the state through HBM every token.

The rates below are estimates until measured on the H100 (``benchmarks/kda.py``); where a number
is NOT MEASURED it says so. The recurrent, parallel and short-T chunk terms are fitted to one
sweep of the three kernels' device times (H100, torch 2.11 / Triton 3.6, 2026-11-24, CUDA-graph
replay, bf16 inputs, the final state returned, no h0: N ∈ {2, 16}, T ∈ {8, 16, 32, 64}, K ∈
{64 … 1024} (chunk: ≤ 256), V ∈ {128, 1024, 8192, 16384}, 164 shapes;
``benchmarks/kda_plan_sweep.py``, ``benchmarks/results/kda_plan_sweep.md``): median errors
4-5%; the recurrent kernel in registers within −17…+21% (measured again at its per-shape launch
configs, ``codegen/kda_recurrent.REGISTERS_MODEL``: 1.09x faster than BLOCK_V 8 at the median
shape of the sweep, up to 1.74x), its streamed variant (K > 1024) up to 2x over (part of its state
stays in L2; the parallel form is 7-13x faster there anyway), the parallel form within −19…+23%,
the chunked one within −16…+11%. Over the sweep the pick is the measured fastest or within 6% of
it at every shape. The rates before (0.5 µs a token for the
recurrent kernel) picked the recurrent kernel over the parallel form at short T with many value
columns, up to 2.4x slower (K × V = 1024 × 1024, T = 8, N = 16: 150 against 47 µs; the blog's
512 × 16384: 98 against 47 µs).
"""

from __future__ import annotations

import math
from typing import Optional

import sympy
import torch

from fuser import costmodel as cm
from fuser.codegen import launch
from fuser.graph import shape, val
from fuser.pattern import Candidate, Match, MatchContext
from fuser.static import symint_value

from .kda_ops import plan_string
from . import planning

#: Shape symbols: N value heads (batch × heads), T steps, K key dim, V value dim.
N, T, KD, VD = sympy.symbols("N T K V", positive=True, integer=True)

#: Latency of one chunk of the chunked form's sequential pass (three [C, K] x [K, BLOCK_V] dots
#: and the state update), in microseconds: NOT MEASURED.
CHUNK_US = 2.0
#: The chunked form at short T as a floor under its estimate: its first kernel (grid ``(chunks,
#: N)``) runs one program per SM, each ``CHUNK_PREP_US[K_pad]`` µs plus ``CHUNK_US_PER_COLUMN +
#: CHUNK_US_PER_ROW_COLUMN · N`` µs per value column (its solve, then ``U = T V`` over V in
#: blocks, one after the other; the ``N`` part: the scan kernel's ``N · cdiv(V, BLOCK_V)``
#: programs), so ``N · cdiv(T, C)`` programs run in waves of one per SM. MEASURED on the H100
#: (torch 2.11 / Triton 3.6, 2026-11-24, ``codegen/kda_chunk.forward`` device time, N = 2 and 16,
#: T = 8 … 64 (one chunk), K = 64 / 128 / 256, V = 128 … 16384, bf16;
#: ``benchmarks/results/kda_plan_sweep.md``; least squares on the relative error: median 5%,
#: worst 16%). At short T this floor is the estimate (T=64, K=256, V=8192, N=2: 563 µs measured
#: where the traffic model says 98; without the floor the planner would pick this plan there, 4x
#: slower than the recurrent kernel's 140 µs); at the training shapes (1024 programs) the
#: calibrated model above it stays the estimate.
CHUNK_PREP_US = {64: 45.0, 128: 72.0, 256: 128.0}
CHUNK_US_PER_COLUMN = 0.046
CHUNK_US_PER_ROW_COLUMN = 0.0026
#: The parallel form besides its traffic (which counts at 1/:data:`PARALLEL_TRAFFIC_EFFICIENCY` of
#: the HBM time): ``PARALLEL_FIXED_US + PARALLEL_GRAM_US · N · K · T² + PARALLEL_SOLVE_WAVE_US[T_PAD]
#: · cdiv(solve programs, SMs)`` µs, ``T_PAD = max(16, next_pow2(T))``, solve programs ``N ·
#: cdiv(V, BLOCK_VS)`` (``codegen/kda_parallel``'s solve grid): each solve program redoes the
#: ``T``-row forward substitution and takes an SM to itself. MEASURED on the H100 (module
#: docstring's sweep; least squares on the relative error: median 6%, worst 37%).
PARALLEL_FIXED_US = 14.0
PARALLEL_GRAM_US = 3.3e-6
PARALLEL_SOLVE_WAVE_US = {16: 0.4, 32: 14.0, 64: 75.0}
PARALLEL_TRAFFIC_EFFICIENCY = 1 / 1.3
#: The parallel form at its ``"gram_steps_1"`` config (K ≤ 512, T ≤ 16: one Gram step a program,
#: four value tiles a state program): ``PARALLEL_STEPS_1_CALIBRATION · (traffic + Gram + solve waves)
#: + PARALLEL_STEPS_1_FIXED_US + PARALLEL_STEPS_1_ROW_US · T`` µs, in place of
#: :data:`PARALLEL_FIXED_US` and one calibration factor: the solve's forward substitution runs its
#: ``T`` rows one after another, which the general model (fitted at T ≥ 32, where the solve waves
#: dominate) does not count; with one factor the estimates ran 20% high at T = 8 and 8-18% low at
#: T = 16, and at the blog shape (N=2, T=8, K=256, V=8192) ranked the parallel form (17.1 µs) behind
#: the recurrent kernel (19.8 µs). Least squares on the relative error over the 64 such shapes of
#: the T ≤ 16 sweep (H100, torch 2.11 / Triton 3.6, 2026-12-07,
#: ``benchmarks/results/kda_plan_sweep_t16.json``, device time of CUDA-graph replays): median
#: |error| 5.4%, from -16% to +16% (one factor 0.865 and the 14 µs fixed term: 7.9%, -20% to +27%).
PARALLEL_STEPS_1_CALIBRATION = 0.91
PARALLEL_STEPS_1_FIXED_US = 7.7
PARALLEL_STEPS_1_ROW_US = 0.33
#: Measured over modelled time of the parallel form at the short-sequence configs of
#: ``codegen/kda_parallel._short_config`` (the model above was fitted to the general config):
#: ``"gram_dk"`` (K ≥ 8192, T ≤ 16, channel-major Gram tiles) 0.92 / 0.92 at T ≤ 8, 0.97 at T = 16
#: (0.93; the T ≤ 16 sweep's two such shapes: 0.90, 0.95). MEASURED on the H100 (2026-12-06,
#: ``benchmarks/results/kda_parallel_configs.md``). ``"gram_steps_1"``: see
#: :data:`PARALLEL_STEPS_1_CALIBRATION` and the two terms beside it.
PARALLEL_SHORT_CALIBRATION = {"gram_steps_1": PARALLEL_STEPS_1_CALIBRATION, "gram_dk": 0.93}
#: The one-launch kernel (``codegen/kda_parallel`` ``FUSED``, its default at K ≤ 64, V ≤ 128,
#: T ≤ 16) against the split kernels it replaces, device time: N=16, T=8, K=64, V=128 7.0 against
#: 10.1 µs (0.69; with h0 9.8 against 11.7: 0.84). Applied to the ``"gram_steps_1"`` estimate, with one
#: launch instead of four. MEASURED on the H100 at that one shape only (2026-12-08,
#: ``benchmarks/results/kda_parallel_fused.md``, ``kda_parallel_fused_h0.md``).
PARALLEL_FUSED_FACTOR = 0.69
#: Largest K the chunked kernels take (``codegen/kda_chunk.MAX_K``: the state tiles live
#: in registers).
CHUNK_MAX_K = 256
#: Fraction of the fp32 FMA peak the unrolled loop's elementwise kernels reach (Inductor's plan;
#: its traffic bounds it): NOT MEASURED.
INDUCTOR_FP32_EFFICIENCY = 0.5
#: Device µs of each of the unrolled loop's kernels at least (Inductor's plan: ``3 T`` small
#: kernels, each waiting on the one before): the estimate is at least ``3 T`` times this, whatever
#: the traffic. With no host time a launch (CUDA graphs) this is what the loop costs at small
#: states. MEASURED on the H100 (``benchmarks/results/overhead.md``: B=1, T=8, H=2, K=V=16 bf16
#: under ``mode="reduce-overhead"``, Inductor 47.3 device µs a call, less the 4.6 of an empty
#: function's replay, over its 24 kernels: 1.8).
INDUCTOR_KERNEL_US = 1.8
#: Fraction of the matrix-unit peak the chunked kernels reach: NOT MEASURED on its own.
CHUNK_EFFICIENCY = 0.3
#: Measured over modelled time of the chunked forward, by the dots' dtype, applied to the chunk
#: plan's estimate (the model counts each dot with its products, ``kda_chunk.dot_flops``: three a
#: dot under tf32x3, one under TF32). MEASURED on the H100 (torch 2.11, Triton 3.6; B=1, T=4096,
#: H=16, bf16): float32 dots at the launch configs of 2026-11-24, later
#: (benchmarks/results/kda_chunk_configs.md), K=V = 64/128/256, output path TF32 (the default for
#: a bf16 o): 0.437/0.789/1.674 ms against 0.229/0.357/0.824 modelled (1.91, 2.21, 2.03):
#: geometric mean 2.05 (at the configs before: 0.551/0.854/1.73, 2.35; tf32x3 everywhere
#: 0.617/1.04/2.35 against 0.243/0.423/1.03, benchmarks/results/kda_chunk_output_tf32*.md);
#: bfloat16 dots, K=V = 64/128: 0.210/0.341 against 0.195/0.243 (1.08, 1.40): 1.25. (Kernel 1
#: spills registers; the float32 tiles double its shared-memory traffic.)
CHUNK_CALIBRATION = {"float32": 2.05, "bfloat16": 1.25}
#: State passes (float32 reads + writes of the whole state) Inductor's unrolled loop makes per
#: token, fitted to the issue's three measurements on the H100 (B=1, T=8, H=2; bf16): K×V =
#: 256×8192 0.247 ms, 8192×1024 0.798 ms, 16384×1024 1.497 ms (model: 0.28, 0.82, 1.53 ms with
#: 3 launches a token); kernels per token ~3.
INDUCTOR_STATE_PASSES = 4.0
#: The recurrent kernel's streamed variant (large K): the fraction of HBM bandwidth its state
#: traffic reaches, MEASURED on the H100 (benchmarks/results/kda.md, T=8, H=2, V=1024): a 64 MiB
#: state (K=8192) streamed at ~2.9 TB/s (0.552 ms), a 128 MiB state (K=16384) at ~1.65 TB/s
#: (1.95 ms): full speed up to :data:`STREAMED_FAST_BYTES` of state, 0.55 above.
STREAMED_FAST_BYTES = 64 * 2**20
STREAMED_SLOW_EFFICIENCY = 0.55


def _int(x) -> int:
    return int(symint_value(x))


def shapes(m: Match) -> dict:
    """Shape symbol -> value at the example shapes, read from q and v (``[*lead, K]`` and
    ``[*lead, V]`` a step, their time dims left out) through ``fuser.graph.shape``: while the pass
    plans, a DTensor's local shard shape (``fuser.distributed.planning_view``; N is then the
    value heads of one rank)."""
    b = m.bindings
    tq, tv = b["time_dims"][0], b["time_dims"][2]  # INPUTS order: q, k, v, g, beta
    q, v = list(shape(b["q"])), list(shape(b["v"]))
    del q[tq], v[tv]
    n = 1
    for d in q[:-1]:
        n *= _int(d)
    return {N: n, T: int(b["steps"]), KD: _int(q[-1]), VD: _int(v[-1])}


def _dtype(node) -> torch.dtype:
    from fuser.graph import dtype

    return dtype(node)


def _device(b: dict) -> torch.device:
    return torch.device(b["device"]) if b.get("device") is not None else torch.device("cpu")


def _elt(node) -> int:
    from fuser.graph import dtype

    return torch.finfo(dtype(node)).bits // 8


def cost_terms(m: Match, plan: str, chunk: int = 64, dots: str = "float32",
               output_precision: Optional[str] = None) -> dict:
    """Symbolic cost terms of one plan: ``bytes`` (HBM), ``flops`` (and ``kind``: the units
    they run on), ``chain_us`` (the sequential dependency chain), ``launches``. The chunk plan
    also: ``flops_by_kind`` (``{tflops key: FLOPs}``, each path's dots counted with their
    products, ``kda_chunk.dot_flops``) for its ``dots`` and ``output_precision`` (None: the rule
    of ``kda_chunk.resolve_output_precision``) as they run on a GPU. The recurrent kernel in
    registers and the parallel form: ``waves`` (``programs``, ``per_sm`` resident, ``fixed_us``,
    ``wave_us``, ``whole_waves``, ``overlaps_traffic``: their measured time, see :func:`estimate`),
    the parallel form also ``traffic_efficiency``; the chunk plan ``floor_waves`` (its first
    kernel's programs in waves, a floor under its estimate)."""
    b = m.bindings
    eq, ev, eg, eb = _elt(b["q"]), _elt(b["v"]), _elt(b["g"]), _elt(b["beta"])
    eo = torch.finfo(b["out_dtype"]).bits // 8
    gate = 1 if b["scalar_gate"] else KD
    io = N * T * (2 * KD * eq + VD * ev + gate * eg + eb) + N * T * VD * eo
    state = N * KD * VD * 4 * ((1 if b["h0"] is not None else 0) + (1 if b["want_state"] else 0))
    x = shapes(m)  # the example shapes, for choices made on numbers (configs, measured tables)
    if plan == "inductor":
        return {"bytes": io + INDUCTOR_STATE_PASSES * 4 * N * KD * VD * T, "flops": 8 * N * T * KD * VD,
                "kind": "fp32", "launches": 3 * T, "chain_us": 0, "floor_us": INDUCTOR_KERNEL_US * 3 * T}
    if plan == "recurrent":
        from fuser.codegen import kda_recurrent

        cfg = kda_recurrent.choose_config(k_dim=x[KD], v_dim=x[VD], dtype=_dtype(b["q"]), device=_device(b),
                                          n_rows=x[N])
        variant = cfg["VARIANT"]
        # the streamed variant (large K) reads the state block twice and writes it once a token
        streamed = 3 * 4 * N * KD * VD * T if variant == "streamed" else 0
        resident, fixed_us, token_us = kda_recurrent.registers_model_row(cfg["BLOCK_K"], cfg["BLOCK_V"],
                                                                         cfg["num_warps"], cfg["STATE_LAYOUT"])
        terms = {"bytes": io + state + streamed, "flops": 8 * N * T * KD * VD, "kind": "fp32", "launches": 1,
                 "variant": variant, "chain_us": 0}
        if variant == "streamed":
            # bound by its state traffic; the token chain on top (the registers rate, NOT MEASURED
            # for this variant on its own)
            terms["state_bytes"] = 4 * N * KD * VD
            terms["chain_us"] = token_us * T
        else:
            terms["waves"] = {"programs": N * sympy.ceiling(VD / cfg["BLOCK_V"]), "per_sm": resident,
                              "fixed_us": fixed_us, "wave_us": token_us * T, "whole_waves": False,
                              "overlaps_traffic": True}
        return terms
    if plan == "parallel":
        from fuser.codegen import kda_parallel

        nbytes = kda_parallel.hbm_bytes(x[N], x[N], x[T], x[KD], x[VD], eq, b["h0"] is not None, b["want_state"],
                                        scalar_gate=b["scalar_gate"], out_bytes=eo)
        # the Gram matrices (T² K twice), the h0 projections (2 T K V), the state tiles (T K V)
        flops = 4 * N * T * T * KD + (4 * N * T * KD * VD if b["h0"] is not None else 0) + 2 * N * T * KD * VD
        cfg = kda_parallel.choose_config(k_dim=x[KD], v_dim=x[VD], dtype=_dtype(b["q"]), device=_device(b),
                                         n_rows=x[N], t_len=x[T])
        t_pad = max(16, launch.next_power_of_2(max(1, x[T])))
        short = "gram_dk" if cfg["GRAM_DK"] else "gram_steps_1" if cfg["GRAM_STEPS"] == 1 else None
        steps_1 = short == "gram_steps_1"
        fused = kda_parallel.runs_fused(cfg, x[T])
        factor = PARALLEL_FUSED_FACTOR if fused else 1.0
        return {"bytes": nbytes, "flops": flops, "kind": "mma", "launches": 1 if fused else 4, "chain_us": 0,
                "traffic_efficiency": PARALLEL_TRAFFIC_EFFICIENCY,
                "calibration": PARALLEL_SHORT_CALIBRATION.get(short, 1.0) * factor,
                "calibrated_us": (PARALLEL_STEPS_1_FIXED_US + PARALLEL_STEPS_1_ROW_US * T) * factor if steps_1 else 0,
                "waves": {"programs": N * sympy.ceiling(VD / cfg["BLOCK_VS"]), "per_sm": 1,
                          "fixed_us": (0 if steps_1 else PARALLEL_FIXED_US) + PARALLEL_GRAM_US * N * KD * T ** 2,
                          "wave_us": PARALLEL_SOLVE_WAVE_US[min(t_pad, 64)], "whole_waves": True,
                          "overlaps_traffic": False}}
    from fuser.codegen import kda_chunk

    # float32 workspaces whatever the inputs' dtypes (the float32 loop's accuracy: kda_chunk.workspace_dtype),
    # bfloat16 only when forced; the dots as they run on a GPU: the state path's at kda_chunk.input_precision
    # (tf32x3: three TF32 products a dot), the output path's at kda_chunk.resolve_output_precision (TF32 for a
    # bfloat16 o: one)
    ws = torch.finfo(kda_chunk.workspace_dtype(dots)).bits // 8
    state_precision = kda_chunk.input_precision(dots, interpret=False)
    out_precision = kda_chunk.resolve_output_precision(output_precision, dots=dots, out_dtype=b["out_dtype"],
                                                       interpret=False)
    by_kind = kda_chunk.dot_flops(n=N, t=T, k_dim=KD, v_dim=VD, chunk=chunk, dots=dots,
                                  state_precision=state_precision, output_precision=out_precision)
    nbytes = kda_chunk.hbm_bytes(n=N, nq=N, t=T, k_dim=KD, v_dim=VD, chunk=chunk, in_bytes=eq, g_bytes=eg,
                                 out_bytes=eo, ws_bytes=ws, scalar_gate=b["scalar_gate"],
                                 initial_state=b["h0"] is not None, final_state=b["want_state"])
    return {"bytes": nbytes, "flops": sum(by_kind.values()), "flops_by_kind": by_kind,
            "kind": "mma", "state_precision": state_precision, "output_precision": out_precision,
            "launches": 2, "chain_us": CHUNK_US * sympy.ceiling(T / chunk), "calibration": CHUNK_CALIBRATION[dots],
            "floor_waves": {"programs": N * sympy.ceiling(T / chunk), "per_sm": 1, "fixed_us": 0,
                            "wave_us": by_k_pad(CHUNK_PREP_US, x[KD])
                            + (CHUNK_US_PER_COLUMN + CHUNK_US_PER_ROW_COLUMN * N) * VD, "whole_waves": True}}


def chunk_precisions(m: Match, ctx: MatchContext) -> tuple:
    """``(dots, requested, state precision, output precision)`` of the chunk plan on the match's
    device: ``dots`` forced by ``fuser.plan`` ``kda.dots`` (else ``"float32"``), the output-path
    precision ``kda.output_precision`` forces (``requested``; None where not forced, or moot:
    bfloat16 dots), and the ``input_precision`` both paths' dots run at
    (``kda_chunk.input_precision``, ``kda_chunk.resolve_output_precision``; IEEE in the
    interpreter unless forced)."""
    from fuser.codegen import kda_chunk

    b = m.bindings
    dots = ctx.options.forced("kda", "dots") or "float32"
    requested = ctx.options.forced("kda", "output_precision") if dots == "float32" else None
    interpret = launch.interpreted(_device(b))
    return (dots, requested, kda_chunk.input_precision(dots, interpret=interpret),
            kda_chunk.resolve_output_precision(requested, dots=dots, out_dtype=b["out_dtype"], interpret=interpret))


def chunk_save(m: Match, ctx: MatchContext, dots: str, chunk: int) -> tuple:
    """``(save, note)``: what the chunk plan keeps for its backward (``kda_ops.SAVES``) —
    ``"workspaces"`` where ``fuser.plan`` forces ``kda.save=workspaces`` and the region records
    gradients, ``"inputs"`` (the default) where it records them otherwise, None where it records
    none (the candidate then has no ``save`` choice, as an inference-only match has no backward
    choices) — and its words for ``explain()`` (with workspaces, the memory kept from the forward to
    the backward at the example sizes: ``kda_ops``' :data:`~fuser.patterns.kda_ops.SAVED` shapes)."""
    from .kda_ops import _saved_shapes

    b = m.bindings
    records = getattr(ctx, "grad_enabled", False) and any(getattr(val(b[name]), "requires_grad", False)
                                                          for name in ("q", "k", "v", "g", "beta", "h0")
                                                          if b.get(name) is not None)
    if not records:
        return None, ""
    if ctx.options.forced("kda", "save") != "workspaces":
        return "inputs", ("; the backward recomputes the chunk quantities from the inputs (kda.save=workspaces keeps "
                          "the forward's instead: a faster backward for more activation memory)")
    x = shapes(m)
    kept = sum(math.prod(shape) * dt.itemsize for shape, dt in _saved_shapes(
        [x[N]], x[T], x[KD], x[VD], {"chunk": chunk, "dots": dots}, b["scalar_gate"]))
    return "workspaces", (f"; keeps the forward's workspaces for the backward (forced kda.save=workspaces: "
                          f"{kept / 2**20:.0f} MiB at the example sizes, read instead of recomputed)")


def precision_note(m: Match, dots: str, requested: Optional[str], state_precision: str, out_precision: str) -> str:
    """The chunk plan's dots in words, for its note (``explain()`` shows it)."""
    if dots == "bfloat16":
        return ("bfloat16 dots (forced: FLA's precision class, faster; the state ~2e-3 off where float32 dots keep "
                "it ~1e-7)")
    out = str(m.bindings["out_dtype"]).replace("torch.", "")
    if requested is not None:
        why = "forced"
    elif launch.interpreted(_device(m.bindings)):
        why = "Triton's interpreter: plain float32 products"
    elif out_precision == "tf32" and state_precision != "tf32":
        why = f"o is {out}: its rounding (2^-9) hides TF32's 2^-11, each error enters o once"
    else:
        why = f"o is {out}: as the state path"
    return f"float32 dots: state path {state_precision}, output path {out_precision} ({why})"


def by_k_pad(table: dict, k_dim: int):
    """The row of a measured table keyed by padded K (powers of two: :data:`CHUNK_PREP_US`) for
    key dim ``k_dim``: ``next_power_of_2(k_dim)`` clamped to the table's smallest and largest keys."""
    return table[min(max(min(table), launch.next_power_of_2(int(k_dim))), max(table))]


def _waves_seconds(w: dict, subs: dict, model: cm.DeviceModel) -> float:
    """Seconds of a plan's programs run in waves: ``fixed_us + wave_us · waves``, ``waves =
    programs / (per_sm · SMs)`` (at least 1; rounded up to whole waves where ``whole_waves``)."""
    slots = w["per_sm"] * model.sm_count
    ratio = cm.evaluate(w["programs"], subs) / slots
    waves = math.ceil(ratio) if w["whole_waves"] else max(1.0, ratio)
    return (cm.evaluate(w["fixed_us"], subs) + cm.evaluate(w["wave_us"], subs) * waves) * 1e-6


def estimate(terms: dict, subs: dict, model: cm.DeviceModel, in_kind: str) -> float:
    """Milliseconds, plus launches. A plan with measured ``waves`` (the recurrent kernel in
    registers, the parallel form): their time (:func:`_waves_seconds`) and the traffic at
    ``traffic_efficiency`` of the HBM rate, the larger of the two where the waves overlap the
    traffic, else their sum. Otherwise the larger of traffic and arithmetic, plus the dependency
    chain: matrix-unit FLOPs run at the rate of their kind in ``terms["flops_by_kind"]`` where the
    plan splits them (the chunk plan: its state and output paths' dots), else at the inputs'
    ``in_kind``. ``calibration`` multiplies that sum; ``calibrated_us`` (terms fitted together with
    the factor: the parallel form's short config) is added after it. ``floor_waves`` (the chunk
    plan's first kernel) puts its programs' waves under the result, ``floor_us`` a time in µs
    (Inductor's: its kernels' least device time, :data:`INDUCTOR_KERNEL_US`)."""
    nbytes = cm.evaluate(terms["bytes"], subs)
    bandwidth = model.bandwidth_gbs * 1e9 * terms.get("traffic_efficiency", 1.0)
    if "state_bytes" in terms and cm.evaluate(terms["state_bytes"], subs) > STREAMED_FAST_BYTES:
        bandwidth *= STREAMED_SLOW_EFFICIENCY
    if "waves" in terms:
        w = terms["waves"]
        t_waves = _waves_seconds(w, subs, model)
        t = max(nbytes / bandwidth, t_waves) if w["overlaps_traffic"] else nbytes / bandwidth + t_waves
    else:
        flops = cm.evaluate(terms["flops"], subs)
        if terms["kind"] == "fp32":
            t_math = flops / (model.tflops["fp32"] * 1e12 * INDUCTOR_FP32_EFFICIENCY)
        elif "flops_by_kind" in terms:
            t_math = sum(cm.evaluate(f, subs) / (model.tflops[kind] * 1e12 * CHUNK_EFFICIENCY)
                         for kind, f in terms["flops_by_kind"].items())
        else:
            t_math = flops / (model.tflops[in_kind] * 1e12 * CHUNK_EFFICIENCY)
        t = max(nbytes / bandwidth, t_math)
    t += cm.evaluate(terms["chain_us"], subs) * 1e-6
    t *= terms.get("calibration", 1.0)
    t += cm.evaluate(terms.get("calibrated_us", 0), subs) * 1e-6
    if "floor_waves" in terms:
        t = max(t, _waves_seconds(terms["floor_waves"], subs, model))
    t = max(t, cm.evaluate(terms.get("floor_us", 0), subs) * 1e-6)
    t += cm.evaluate(terms["launches"], subs) * model.launch_us * 1e-6
    return t * 1e3


def stand_in_match(n: int, t: int, k_dim: int, v_dim: int, *, dtype: torch.dtype = torch.bfloat16,
                   gate_dtype: torch.dtype = torch.float32, out_dtype: Optional[torch.dtype] = None,
                   device="cuda", want_state: bool = True, lead: Optional[tuple] = None):
    """A stand-in for the match ``patterns/kda.py`` finds in the blog loop on ``[B, T, H, *]``
    inputs (``lead = (B, H)``, default ``(1, n)``): q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` in
    ``dtype``, g ``[B, T, H, K]`` in ``gate_dtype``, beta ``[B, T, H]``, no initial state, the final
    state returned when ``want_state``, o in ``out_dtype`` (default ``dtype``). Its nodes carry meta
    tensors: nothing is traced or run. For estimating plans at given sizes (:func:`candidates`)
    from benchmarks and tests."""
    import types

    import torch.fx as fx

    lead = tuple(lead) if lead is not None else (1, n)
    graph = fx.Graph()

    def node(name, shape, dt):
        x = graph.placeholder(name)
        x.meta["val"] = torch.empty(shape, dtype=dt, device="meta")
        return x

    b0, h = lead[0], lead[-1]
    b = dict(q=node("q", (b0, t, h, k_dim), dtype), k=node("k", (b0, t, h, k_dim), dtype),
             v=node("v", (b0, t, h, v_dim), dtype), g=node("g", (b0, t, h, k_dim), gate_dtype),
             beta=node("beta", (b0, t, h), dtype), h0=None, time_dims=(1,) * 5, t0=0, steps=t,
             scale=k_dim ** -0.5, scalar_gate=False, out_dim=1, out_dtype=out_dtype or dtype, want_state=want_state,
             state_dtype=torch.float32, lead=lead, key_dim=k_dim, value_dim=v_dim, device=torch.device(device))
    return types.SimpleNamespace(bindings=b, pattern="kda", location="stand-in")


def candidates(m: Match, ctx: MatchContext) -> list[Candidate]:
    """Every plan this match can run with, each with its estimate at the example shapes."""
    b = m.bindings
    dev = b["device"]
    subs = shapes(m)
    model = planning.device_model(dev, ctx)
    from fuser.graph import dtype

    kind = cm.operand_kind(str(dtype(b["q"])), launch.dot_precision(dtype(b["q"])) == "tf32")
    out: list[Candidate] = []

    def add(name, plan, terms, note, chunk=64, **extra):
        params = {"impl": "fuser", "plan": plan, "chunk": chunk, "plan_string": plan_string(plan, chunk)}
        params.update(extra)
        out.append(Candidate(name, params, terms, estimate(terms, subs, model, kind), note))

    add("fuser[recurrent]", "recurrent", cost_terms(m, "recurrent"),
        "token by token, each program keeping a [K, BLOCK_V] block of the state for the whole sequence")
    from fuser.codegen import kda_parallel

    if subs[T] <= kda_parallel.MAX_T:
        add("fuser[parallel]", "parallel", cost_terms(m, "parallel"),
            "single-chunk parallel form: T x T Gram matrices split over K, a per-head solve, the final state "
            "written tile by tile")
    if subs[KD] <= CHUNK_MAX_K:
        dots, requested, state_precision, out_precision = chunk_precisions(m, ctx)
        for c in (64,):
            save, save_note = chunk_save(m, ctx, dots, c)
            add(f"fuser[chunk C={c}]", "chunk", cost_terms(m, "chunk", c, dots, requested),
                f"chunked WY form (chunks of {c}): intra-chunk kernel, then the state across chunks; "
                + precision_note(m, dots, requested, state_precision, out_precision) + save_note, chunk=c,
                dots=dots, output_precision=out_precision, **({"save": save} if save else {}),
                plan_string=plan_string("chunk", c, ctx.options.forced("kda", "dots"), requested,
                                        "workspaces" if save == "workspaces" else None))
    if dev is not None and torch.device(dev).type != "cpu":
        terms = cost_terms(m, "inductor")
        out.append(Candidate("inductor", {"impl": "inductor"}, terms, estimate(terms, subs, model, kind),
                             "left to Inductor: the unrolled loop, the state through HBM every token"))
    return out


def why_not_offered(m: Match, choice: str, value: str) -> str:
    """Why ``kda.<choice>=<value>`` is not among :func:`candidates` for ``m`` because of its
    sizes or device (see :meth:`fuser.pattern.Pattern.why_not_offered`); "" otherwise."""
    from fuser.codegen import kda_parallel

    x = shapes(m)
    if choice == "plan" and value == "parallel" and x[T] > kda_parallel.MAX_T:
        return (f"the parallel form runs the whole loop as one chunk of at most {kda_parallel.MAX_T} steps; this loop "
                f"has {x[T]} (drop kda.plan from fuser.plan, or force it only for loops of ≤ {kda_parallel.MAX_T} steps)")
    if choice == "plan" and value == "chunk" and x[KD] > CHUNK_MAX_K:
        return (f"the chunked kernels take a key dim K ≤ {CHUNK_MAX_K}; this state has K = {x[KD]} (drop kda.plan "
                "from fuser.plan: the recurrent and parallel plans take any K)")
    return ""


def kernels_for(m: Match, plan: Candidate) -> list:
    """The rendered kernels a fuser plan runs (for reports)."""
    if plan.params.get("impl") != "fuser":
        return []
    b = m.bindings
    x = shapes(m)
    kw = dict(k_dim=x[KD], v_dim=x[VD], dtype=_dtype(b["q"]), device=_device(b),
              scalar_gate=b["scalar_gate"], initial_state=b["h0"] is not None, output_final_state=b["want_state"])
    if plan.params["plan"] == "parallel":
        from fuser.codegen import kda_parallel

        return list(kda_parallel.kernels_for(**kw))
    if plan.params["plan"] == "chunk":
        from fuser.codegen import kda_chunk

        return list(kda_chunk.kernels_for(k_dim=kw["k_dim"], v_dim=kw["v_dim"], device=kw["device"],
                                          chunk=plan.params["chunk"], scalar_gate=kw["scalar_gate"],
                                          dots=plan.params.get("dots", "float32"),
                                          output_precision=plan.params.get("output_precision"),
                                          out_dtype=b["out_dtype"]))
    from fuser.codegen import kda_recurrent

    return list(kda_recurrent.kernels_for(**kw, n_rows=x[N]))
