"""KDA (Kimi Delta Attention) forward in chunks (the WY form) on tensor cores: launchers,
workspaces, config tables and cost helpers.

KDA (Kimi Linear, Moonshot AI 2025) is the gated delta rule (Yang, Kautz and Hatamizadeh, "Gated
Delta Networks", ICLR 2025) with one decay per key channel. Per value head a float32 state
``S ∈ ℝ^{K×V}`` is updated every token ``t``::

    S ← diag(e^{g_t}) S;   v̂_t = Sᵀ k_t;   S ← S + β_t k_t (v_t − v̂_t)ᵀ;   o_t = Sᵀ (scale · q_t)

(scalar gate: one ``g_t`` per head and token decays all of ``S``). ``docs/math.md`` ("KDA: the
chunked (WY) form") derives the chunked form used here; the float64 oracles are
``patterns/kda_reference.py``. In a chunk of ``C`` tokens with ``S0`` the state before it and
``G`` the inclusive cumulative sum of ``g`` inside the chunk (float32)::

    A_kk[r, s] = Σ_d k_rd k_sd e^{G_rd − G_sd}  (s < r)      A_qk[r, s] = Σ_d q_rd k_sd e^{G_rd − G_sd}  (s ≤ r)
    T = (I + diag(β) A_kk)⁻¹ diag(β),   U = T V,   W = T (K ∘ e^G)
    Δ = U − W S0,   O = scale · ((Q ∘ e^G) S0 + A_qk Δ),   S_C = diag(e^{G_C}) S0 + (K ∘ e^{G_C − G})ᵀ Δ

Everything but the last line is independent of ``S0``, hence two kernels:

Kernel 1, grid ``(chunks, N)``, in two variants (config key ``"prep"``, :data:`PREP_TEMPLATES`;
the table picks per device, K and dots' dtype). ``"pairs"``, ``templates/kda_chunk_prep.py.jinja``:
    per chunk and value head, over K in blocks of ``BLOCK_K1``, sub-block by sub-block (16
    rows; only the right factors of the earlier sub-blocks stay live): ``G``; ``A_kk`` and
    ``A_qk`` as ``[16, 16]`` tiles (``DT`` dots, float32 accumulators; the decays below);
    ``Qg``, ``Kd``, ``G_C`` stored. Then the inverse ``X = (I + diag(β) A_kk)⁻¹`` block by block:
    each diagonal tile ``X_ii = (I + L_ii)⁻¹ = (I − L)(I + L²)(I + L⁴)(I + L⁸)`` (``L = diag(β)
    A_kk`` strictly lower, so ``L¹⁶ = 0``: six ``[16, 16]`` IEEE float32 dots instead of 15
    sequential row steps, each a cross-warp reduction — measured 0.44 ms of 1.7 ms at K=128
    before), then ``X_ij = −X_ii Σ_{m=j}^{i−1} L_im X_mj`` (IEEE float32 dots). ``T = X diag(β)``
    is stored to the ``t_mat`` workspace and read back whole (after a CTA barrier), so that
    ``U = T V`` and ``W = T (K ∘ e^G)`` are ``[C, C] × [C, BLOCK]`` tensor-core dots (as ``[16,
    16]`` tile dots they spilled and cost 0.9 ms at K=128).
``"strips"``, ``templates/kda_chunk_prep_strips.py.jinja`` (the float32-dots default on the H100)
    first ``G`` per K block to a float32 scratch (``Gcum``, with ``G_C``, ``Qg``, ``Kd``); then per
    16-row strip ``b`` (a runtime loop: two ``[16, C]`` accumulators live, no spills) ``A_kk`` and
    ``A_qk`` of its rows against every column through the reference row ``16 b`` — two ``[16,
    BLOCK_K1] × [BLOCK_K1, C]`` dots per K block, the decays as kda_bwd's prep has them (below) —
    and its rows of ``X`` by block forward substitution against the rows already in a float32
    scratch ``Xm``; then ``T``, ``W``, ``U`` as above. Measured (H100, Triton 3.6, B·H=16,
    T=4096, bf16 inputs, kernel 1 alone at each variant's best config): float32 dots K=64 / 128 /
    256 215 / 392 / 699 µs against the pairs' ~265 / 443 / 821; bfloat16 dots K=128 279 against
    227 (the pairs variant's unrolled sub-blocks keep more independent work in flight, which the
    strips' serial K loop per strip lacks), so bf16 keeps the pairs.
Kernel 2, ``templates/kda_chunk_scan.py.jinja``, grid ``(⌈V / BLOCK_V⌉, N)``
    Sequential over the chunks, the state tile ``[K, BLOCK_V]`` in float32 registers (as
    ``⌈K / BLOCK_K⌉`` tiles): ``Δ = U − W S``, ``O = Qg S + Aqk Δ``,
    ``S ← diag(e^{G_C}) S + Kdᵀ Δ``; loads the initial state, stores the final state and (with
    ``save_for_backward``) the state before every chunk. The chunk loop's loads do not depend on
    the state, so Triton's pipelining (``num_stages`` ≥ 2) prefetches them.

Kernel 1 does all the exponentials (about ``4·C·K`` per chunk), so kernel 2 is dots and loads
only (one ``e^{G_C}`` vector per chunk).

Tried and not kept (H100, torch 2.11 / Triton 3.6, 2026-11-24, B=1, T=4096, H=16, K=V, bf16
inputs): the output path split off kernel 2 into a third kernel parallel over the chunks (kernel
2 storing ``Δ`` and the states, carrying only ``W S → Δ → Kdᵀ Δ``; kernel 3 ``O = Qg S_c + A_qk
Δ``). Nsight Compute had kernel 2 latency-bound (K=128: 4 warps per SM, 17% issue slots busy,
stalls on global loads and CTA barriers), which made the output path's two dots and two loads
per chunk look like a third of its chain. Measured, the split was slower everywhere but K=64:
float32 dots K=64 0.479 → 0.443 ms, K=128 0.788 → 0.809-0.904 (best of 8 configs), K=256 1.66 →
1.75-2.16 (2 stages now fit; still slower); bfloat16 dots K=128 0.408 → 0.410-0.612, K=256 0.638
→ 0.681-0.837. The chain's own dots (``W S`` and ``Kdᵀ Δ``, three TF32 products each with
float32 dots) set kernel 2's time, and the split adds the states' and ``Δ``'s round trip.

Numerics of the decays (why nothing overflows):

- ``e^{G_r − G_s}`` is never formed as ``e^{G_r} · e^{−G_s}`` over the chunk (``−G`` reaches
  hundreds with strong gates; ``e^{88}`` overflows float32, and ``∞ · 0 = NaN``).
- Off-diagonal sub-block pairs ``(i, j)``, ``j < i``: with ``c_i`` the value of ``G`` at the
  row before sub-block ``i`` (0 for ``i = 0``) and ``c_{j+1}`` the value at the last row of
  sub-block ``j``, ``e^{G_r − G_s} = e^{G_r − c_i} · e^{c_i − c_{j+1}} · e^{c_{j+1} − G_s}``:
  for ``g ≤ 0`` every factor is ``≤ 1`` (``r`` is at or after the reference ``c_i``, ``s`` at
  or before ``c_{j+1}`` and ``c_{j+1}`` before ``c_i``), so a factor can only underflow, to a
  value whose true product is below ``~1e-38`` anyway. The first and last factors are per row
  ``[16, K]`` (computed once per sub-block and shared by all pairs and by ``Qg``, ``Kd``), the
  middle one a ``[K]`` vector per pair.
- Diagonal pairs ``(i, i)``: ``e^{G_r − c_i} · e^{c_i − G_s}`` with the second factor clamped at
  ``e^{30}`` (so every product is finite: at most ``e^{30}·|q||k|`` above the diagonal, where the
  mask drops it). This is exact while every ``|G_r − c_i|`` of the sub-block is ``≤ 30``, which
  the kernel tracks over all K blocks; a sub-block that spans more (strong gates: mean gate
  below about −2 per token) gets its diagonal tile recomputed afterwards, pairwise from the
  differences ``[16, 16, 16]`` per K slice with exponent ``−∞`` above the diagonal before the
  exponential (16× the exponentials, only for such sub-blocks; the pairwise differences inside a
  sub-block need only its own cumulative sum).
- The strips variant: strip ``b``'s rows ``r`` and the columns ``s`` go through the reference
  row ``ref = 16 b``, ``e^{G_r − G_s} = e^{G_r − G_ref} · e^{G_ref − G_s}``: both ``≤ 1`` for the
  columns before the strip (``g ≤ 0``); on the strip's own diagonal sub-block the second factor is
  clamped at ``e^{30}`` with the same exactness condition and the same pairwise recomputation
  (one column per step on ``[16, BLOCK_K1]`` tiles) as above; columns after the strip are 0
  (exponent ``−∞``). Scalar gates take the same path, their ``G`` one number per row.
- Scalar gate (pairs variant): the decay is a ``[16, 16]`` matrix per tile pair, pairwise (``e^{G_r − G_s}``,
  ``−∞`` above the diagonal), multiplying ``K Kᵀ`` and ``Q Kᵀ`` computed without decay.
- Positive gates: the same formulas; the factors then exceed 1 but stay finite while every
  partial sum of ``g`` inside a chunk stays below ~80 (the float32 exponent range with margin);
  slightly positive gates (e.g. up to 0.1) match the reference. Larger positive sums overflow
  (``inf``/``NaN``), as the decays themselves would.
- ``Qg = scale · q e^G`` and ``Kd = k e^{G_C − G}`` (``≤ 1`` factors for ``g ≤ 0``), the
  state decay ``e^{G_C}`` from the stored ``G_C``.

Workspaces (allocated per call, contiguous; ``T_pad = ⌈T / C⌉ · C``, rows past ``T`` are
written as zeros; "dots' dtype" ``DT`` = float32 whatever the inputs' dtypes, bfloat16 only when
asked, ``dots="bfloat16"``: :func:`workspace_dtype`):

=========  ======================  =====  =========================================================
name       shape                   dtype  content
=========  ======================  =====  =========================================================
``qg``     ``[N, T_pad, K]``       DT     ``scale · q ∘ e^G``
``kd``     ``[N, T_pad, K]``       DT     ``k ∘ e^{G_C − G}``
``w``      ``[N, T_pad, K]``       DT     ``W = T (K ∘ e^G)`` per chunk
``u``      ``[N, T_pad, V]``       DT     ``U = T V`` per chunk
``a_qk``   ``[N, T_pad, C]``       DT     ``scale · A_qk`` per chunk (row r of chunk c at ``c·C + r``;
                                          zero above the diagonal)
``t_mat``  ``[N, T_pad, C]``       DT     ``T = (I + diag(β) A_kk)⁻¹ diag(β)`` per chunk (same
                                          layout; zero above the diagonal)
``g_last`` ``[N, n_chunks, K]``    fp32   ``G_C``, the chunk's summed gate per key channel
``states`` ``[N, n_chunks, K, V]`` fp32   the state before each chunk (``save_for_backward`` only)
``gcum``   ``[N, T_pad, K]``       fp32   ``G`` (``[N, T_pad]`` with a scalar gate; strips variant, or
                                          ``save_for_backward``)
``xm``     ``[N, T_pad, C]``       fp32   ``X = (I + diag(β) A_kk)⁻¹`` (strips variant, or
                                          ``save_for_backward``)
``a_kk``   ``[N, T_pad, C]``       fp32   ``A_kk`` (zero on and above the diagonal;
                                          ``save_for_backward`` only)
=========  ======================  =====  =========================================================

Precision: decays, ``A``, the solve and the state are float32; the dots of kernel 1's ``A``,
``U``, ``W`` and of kernel 2 take ``DT`` operands (``T``, the decayed ``q``/``k`` factors, and in
kernel 2 the state and ``Δ``) and accumulate in float32. With the default float32 ``DT`` the
16-bit inputs are upcast exactly, as the user's loop upcasts them, and the result is as close to
the float64 recurrence as the eager float32 loop's (:func:`workspace_dtype` has the
measurements). With ``dots="bfloat16"`` (FLA's class, an explicit opt-in): measured on the H100
with bf16 inputs (T up to 2000, K up to 256), relative error of o 0.3-0.4% against the float64
recurrence, of which bf16 output rounding alone is ~0.17%, and of the final state ~2e-3.

Precision of the dots: the state path and the output path. The float32 dots split in two classes
by where their rounding errors go:

- **State path**: kernel 1's ``A_kk`` (into the solve, ``T``), ``W = T (K ∘ e^G)``, ``U = T V``;
  kernel 2's ``Δ = U − W S`` and ``S ← diag(e^{G_C}) S + Kdᵀ Δ``. An error here is an error of
  ``S``, which every later chunk carries on: it compounds over the ``T / C`` chunks, into the final
  state and into every later chunk's o. These run as :func:`input_precision` says: TF32 where
  torch's float32 matmul precision allows it, else ``tf32x3`` on a GPU
  (:data:`GPU_FP32_PRECISION`), IEEE float32 in the interpreter.
- **Output path**: kernel 1's ``A_qk``; kernel 2's ``Qg S`` and ``A_qk Δ``. Their results make
  one chunk's o and nothing else (``Δ`` and ``S`` come from the state path's own dots, which round
  their operands themselves), so each error enters o once and nothing downstream. These run at
  ``output_precision`` (:data:`OUTPUT_PRECISIONS`; the rule is :func:`resolve_output_precision`).

Error of one dot (a derivation; the H100's numbers below it): ``tl.dot``
rounds both operands to its ``input_precision`` and accumulates in float32 (``2^-24`` per add,
``~2^-24·√K`` relative over K terms, negligible below). TF32 keeps 10 explicit mantissa bits:
unit roundoff ``u = 2^-11 ≈ 4.9e-4`` (round-to-nearest conversion; ``2^-10`` where the operands
are truncated instead). One product ``a·b`` of rounded operands is off by ``≤ 2u`` relative, rms
``√(2/3)·u ≈ 0.8u`` for rounding errors spread evenly. ``tf32x3`` splits ``a = a_hi + a_lo``
(both TF32) and sums ``a_hi b_hi + a_hi b_lo + a_lo b_hi``: the dropped ``a_lo b_lo`` and the
rounding of the low parts are ``~u² = 2^-22 ≈ 2.4e-7`` relative, float32's class (``2^-24``);
``"ieee"`` is float32 FMA (``2^-24``). A dot ``Σ_k a_k b_k`` of products with independent
errors is off by ``≈ 0.8u‖a ∘ b‖₂`` (rms), relative to the result ``0.8u · ‖a ∘ b‖₂ / |Σ_k a_k
b_k|``; the ratio is ~1 for terms of mixed signs (q, k, S, Δ here: the sum of K such terms is
~√K times one, as is ``‖a ∘ b‖₂``), larger where terms cancel.

Into o, once: ``O = Qg S + A_qk Δ`` with ``A_qk`` itself from a TF32 dot, so single-pass TF32 on
the output path adds ``e_tf ≈ (0.8-1.2)·u ≈ 4-6e-4`` relative (rms) to o, independent of the
rounding of the stored o and not growing with T: the errors of different chunks land in
different rows of o. Rounding o to its dtype costs the measured eager errors (H100, FLA's loop,
``workspace_dtype``): bfloat16 o ``~1.6e-3`` (unit roundoff ``2^-9``), float16 o ``~2.1e-4``
(``2^-11``: the same 10 mantissa bits as TF32), float32 o ``~6e-8``. The two add in quadrature:

- bfloat16 o: ``√(1.6² + 0.6²)·1e-3 ≈ 1.7e-3``, predicted ~1.05-1.1x eager's o error (a 1.5x
  bound leaves room for ``e_tf`` 3x the estimate, e.g. from cancellation or truncation);
- float16 o: ``√(2.1² + 5²)·1e-4 ≈ 5.4e-4``, ~2.6x eager's: TF32 is not below float16's rounding;
- float32 o: TF32 would be ~1e4x eager's error.

A float64 model of the output path (the operands the kernels pass, ``q e^{G−c}``, ``k e^{c−G}``,
``Qg``, ``S``, ``A_qk``, ``Δ``, rounded to TF32 to nearest; the state path exact; N=4, T=1024,
K=V=64 and 128, softplus and mild gates, bfloat16/float16 inputs) agrees: TF32 alone
4.1-4.2e-4 relative on o (0.85u); then rounded to bfloat16 1.70-1.71e-3 against 1.65-1.66e-3
for the exact o rounded (1.03x), to float16 4.5-4.7e-4 against 2.1e-4 (2.2x). On the GPU it
is a prediction; measured on the H100 (torch 2.11, Triton 3.6; B=1, T=4096, H=16, bfloat16
inputs and o, K=V = 64/128/256; ``benchmarks/results/kda_chunk_output_tf32*.md``): o off by
2.2e-3 with TF32 on the output path against 1.7e-3 with ``tf32x3`` on both, 1.3x rather than the
predicted 1.03-1.1x (Triton's TF32 conversion may truncate; not checked), within the GPU tests'
1.5x of eager's; the final state unchanged (1.4e-6: the state path is the same).

Into S, compounding (why the state path keeps ``tf32x3``): an error ``δ`` of ``S`` at one chunk
stays in ``S`` (decayed by ``e^{G_C}``, which forgets it only under strong gates), so the errors
of ``T / C`` chunks add up (``√(T/C)·δ`` for independent ones, ``(T/C)·δ`` at worst) and reach the
final state and every later chunk's o. A float64 model of the kernels put plain TF32 everywhere
at 2.5-3.4e-4 on the state (1000x eager's); with ``tf32x3`` the H100 measured 2.0-2.2x eager's
(:data:`GPU_FP32_PRECISION`).

Hence the default (:func:`resolve_output_precision`): single-pass ``"tf32"`` on the output path
when o is bfloat16 (its own rounding, ``2^-9``, dominates ``2^-11``), the state path's
precision when o is float16 or float32 (whose rounding does not hide TF32's error: a float32 o
deserves float32-class dots). In the interpreter every default is the state path's (IEEE: the
interpreter does not emulate TF32 anyway, and computes plain float32 products whatever the
precision). Speed: the output path is ``A_qk`` (``2·256·K`` per tile pair), ``Qg S`` (``2·C·K·V``)
and ``A_qk Δ`` (``2·C²·V``) per chunk (:func:`flops` with ``path="output"``): at K=V=128, C=64
3.8 of 11.1 MFLOP per chunk and head, so TF32 there cuts the TF32 products of ``tf32x3``
everywhere by ~23% (:func:`dot_flops`); on the H100 (same runs) the forward took 0.551 / 0.854 /
1.73 ms at K=V = 64/128/256 against 0.617 / 1.04 / 2.35 ms with ``tf32x3`` everywhere.

Gates and shapes: ``q, k [NQ, T, K]``, ``v [N, T, V]``, ``g [N, T, K]`` (``[N, T]`` with
``scalar_gate``), ``beta [N, T]``, ``N = NQ · group``; any strides, never copied; or each with
its rows as lead dims (``[*lead, T, *]``, e.g. ``[B, H, T, K]`` views of FLA's ``[B, T, H, K]``),
read in place when they merge into at most two stride groups
(``kda_recurrent.input_rows``; a contiguous copy only for three); ``T`` a run-time
argument (a new length does not recompile), ``K`` and ``V`` compile-time (any positive values,
masked to the blocks).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import launch
from .kda_recurrent import check_inputs, finish_out, inputs_rows, out_buffer
from .render import RenderedKernel, render

__all__ = [
    "forward", "prep_kernel", "scan_kernel", "kernels_for", "candidate_configs", "workspace_dtype",
    "input_precision", "resolve_output_precision", "dot_rate", "dot_flops", "DOTS", "OUTPUT_PRECISIONS",
    "GPU_FP32_PRECISION", "workspace_bytes", "hbm_bytes", "flops", "exps", "CHUNKS", "MAX_K",
]

#: Kernel 1's two variants (config key ``"prep"``; module docstring): ``[16, 16]`` tile pairs of the
#: unrolled sub-blocks, or 16-row strips through a reference row.
PREP_TEMPLATES = {"pairs": "kda_chunk_prep.py.jinja", "strips": "kda_chunk_prep_strips.py.jinja"}
PREP_VARIANTS = tuple(PREP_TEMPLATES)
SCAN_TEMPLATE = "kda_chunk_scan.py.jinja"

#: The chunk lengths the kernels take (multiples of the 16-row sub-block).
CHUNKS = (16, 32, 64)
#: The largest key dimension: kernel 2 keeps the state [K, BLOCK_V] in registers.
MAX_K = 256


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


#: The chunked and parallel kernels (this module's and ``codegen/kda_parallel.py``'s) raise every
#: gate below this to it where they load it (``tl.where(g < GATE_FLOOR, GATE_FLOOR, g)``, no extra
#: kernel before them): ``e^g`` of either is exactly 0 in float32 (below about −104), so a step's
#: decay is unchanged, while a gate of −inf (a hard reset, e.g. ``log(0)``) would make their
#: differences of cumulative sums ``−inf − (−inf) = NaN``. A NaN gate stays NaN (as torch's
#: ``clamp_min`` keeps it; ``tl.maximum`` on the GPU would return the floor). The recurrent kernel
#: multiplies step by step and needs no floor. ``patterns/kda_ops.GATE_FLOOR`` is this value.
GATE_FLOOR = -200.0


def _check_chunk(chunk) -> int:
    if isinstance(chunk, bool) or chunk not in CHUNKS:
        raise ValueError(f"chunk must be one of {CHUNKS}, got {chunk!r}")
    return int(chunk)


def prep_kernel(*, chunk: int, scalar_gate: bool, interpret: bool, output_precision: str,
                variant: str = "pairs") -> RenderedKernel:
    """Render kernel 1 (:data:`PREP_TEMPLATES`: ``templates/kda_chunk_prep.py.jinja`` for
    ``variant="pairs"``, ``templates/kda_chunk_prep_strips.py.jinja`` for ``"strips"``) for a
    chunk length, gate kind and the ``input_precision`` of its output-path dot (``A_qk``;
    :data:`OUTPUT_PRECISIONS`, rendered in: the name ends in ``_o<precision>``, so the variants
    coexist; the strips variant's names start ``kda_chunk_prep_strips``).

    Raises:
        ValueError: ``chunk`` not in :data:`CHUNKS`, ``output_precision`` not in
            :data:`OUTPUT_PRECISIONS`, ``variant`` not in :data:`PREP_VARIANTS`.
    """
    chunk = _check_chunk(chunk)
    output_precision = _check_output_precision(output_precision)
    variant = _check_prep(variant)
    name = (f"kda_chunk_prep{'_strips' if variant == 'strips' else ''}_c{chunk}" + ("_scalar" if scalar_gate else "")
            + f"_o{output_precision}" + ("_interp" if interpret else ""))
    return render(PREP_TEMPLATES[variant], name, chunk=chunk, scalar_gate=bool(scalar_gate), interpret=bool(interpret),
                  output_precision=output_precision, gate_floor=GATE_FLOOR)


def scan_kernel(*, chunk: int, k_blocks: int, interpret: bool, output_precision: str) -> RenderedKernel:
    """Render kernel 2 (``templates/kda_chunk_scan.py.jinja``): the state as ``k_blocks`` tiles,
    its output-path dots (``Qg S``, ``A_qk Δ``) at ``output_precision`` (rendered in; the name
    ends in ``_o<precision>``).

    Raises:
        ValueError: ``chunk`` not in :data:`CHUNKS`, ``k_blocks`` not in 1..16,
            ``output_precision`` not in :data:`OUTPUT_PRECISIONS`.
    """
    chunk = _check_chunk(chunk)
    output_precision = _check_output_precision(output_precision)
    if isinstance(k_blocks, bool) or not isinstance(k_blocks, int) or not 1 <= k_blocks <= 16:
        raise ValueError(f"k_blocks must be an int in 1..16, got {k_blocks!r}")
    name = f"kda_chunk_scan_c{chunk}_kb{k_blocks}_o{output_precision}" + ("_interp" if interpret else "")
    return render(SCAN_TEMPLATE, name, chunk=chunk, k_blocks=k_blocks, interpret=bool(interpret),
                  output_precision=output_precision)


@functools.lru_cache(maxsize=None)
def _prep_module(chunk: int, scalar_gate: bool, interpret: bool, output_precision: str, variant: str = "pairs"):
    kernel = prep_kernel(chunk=chunk, scalar_gate=scalar_gate, interpret=interpret, output_precision=output_precision,
                         variant=variant)
    return kernel, launch.kernel_module(kernel, interpret)


@functools.lru_cache(maxsize=None)
def _scan_module(chunk: int, k_blocks: int, interpret: bool, output_precision: str):
    kernel = scan_kernel(chunk=chunk, k_blocks=k_blocks, interpret=interpret, output_precision=output_precision)
    return kernel, launch.kernel_module(kernel, interpret)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def _cfg(bk, bv, w, s, bk1, bv1, w1, s1, prep="pairs"):
    return {"BLOCK_K": bk, "BLOCK_V": bv, "num_warps": w, "num_stages": s,
            "BLOCK_K1": bk1, "BLOCK_V1": bv1, "num_warps1": w1, "num_stages1": s1, "prep": prep}


def _check_prep(variant) -> str:
    if variant not in PREP_VARIANTS:
        raise ValueError(f"prep (kernel 1's variant) must be one of {PREP_VARIANTS}, got {variant!r}")
    return variant


# Keys: BLOCK_K, BLOCK_V, num_warps, num_stages: kernel 2 (the state tile is K x BLOCK_V, held as
# ceil(K / BLOCK_K) tiles [BLOCK_K, BLOCK_V]; the grid is N x ceil(V / BLOCK_V) programs, each
# sequential over T); BLOCK_K1, BLOCK_V1, num_warps1, num_stages1: kernel 1 (K and V are looped
# in blocks of BLOCK_K1 / BLOCK_V1; the pairwise diagonal tiles are [16, 16, BLOCK_K1]); prep: kernel
# 1's variant (PREP_TEMPLATES).
#
# Interpreter: small blocks (several K blocks at test sizes); the GPU's float32 default variant first
# (tests that cover both pass the config).
_INTERP = [_cfg(16, 32, 4, 1, 16, 32, 4, 1, "strips"), _cfg(32, 16, 4, 1, 32, 16, 4, 1)]

# GPUs. sm90 bf16, MEASURED on the H100 (2026-11-23, N=32, T=8192, K=V, chunk 64, Triton 3.6, softplus
# gates). Kernel 2 (BLOCK_K 64) over BLOCK_V {64, 32, 16} x warps {4, 8} x stages {1, 2, 3}:
#   K=128: (64, 32, 4, 3) 0.250 ms best, (64, 64, 4, 3) 0.289, (64, 32, 4, 2) 0.345, 8 warps always
#          slower, 1 stage 2-3x slower (the chunk loop's loads must be pipelined);
#   K=64:  (64, 16, 4, 3) 0.165 ms best, (64, 32, 4, 3) 0.186, (64, 64, 4, 3) 0.222;
#   K=256: 3 stages run out of shared memory; (64, 32, 4, 2) 0.948 ms best, (64, 32, 8, 2) 1.19,
#          (64, 16, 4, 2) 1.58.
# Kernel 1, BLOCK_K1 {16, 32, 64} x warps {4, 8} at K=128: (32, 4 warps) 0.83 ms best (16: 0.96,
# 64: 0.98, 8 warps: 1.22; it spills at 255 registers); K=64 0.49 ms, K=256 1.51 ms; 1 stage a
# little slower at K=64/256.
# sm90 float32 dots (the default), MEASURED on the H100 (2026-11-24, B=1, T=4096, H=16, K=V, bf16
# inputs, Triton 3.6; one kernel's keys varied at a time, device time of both kernels under
# CUDA-graph replay; benchmarks/kda_chunk_configs.py, benchmarks/results/kda_chunk_configs.md):
#   K=128: the previous first row (64, 32, 4, 2 | 32, 32, 4, 2) 852-861 µs; now (64, 16, 4, 2 |
#          16, 32, 4, 2) 789 (kernel 1 BLOCK_K1 32: 829; kernel 2 BLOCK_V 32: 817, 1 stage 961,
#          BLOCK_K 128: 796);
#   K=64:  previous (64, 16, 4, 3 | 32, 32, 4, 2) 548 µs; now (64, 16, 4, 3 | 16, 32, 4, 2) 437;
#   K=256: kernel 2 at two stages does not fit in shared memory (the previous first two rows were
#          compiled and skipped at every first call); (128, 16, 4, 1 | 32, 32, 4, 1) 1674 µs, (64, 16,
#          4, 1 | ...) 1727. Kernel 1's BLOCK_K1 16 at K=256: NOT MEASURED.
# Kernel 1's strips variant (2026-11-25, same shapes but kernel 1 alone under do_bench; the sweep's
# numbers are in benchmarks/results/kda.md, "Kernel 1 in strips"; the pairs variant's default in brackets): float32 dots
# K=128 (64, 32, 4, 2) 392 µs [443], (32, 32, 4, 1) 402, (16, 32, 4, 1) 439 (139 registers, no
# spills: the pairs variant's 255 registers and spills were not what cost it); K=64 (64, 64, 4, 1)
# 215 [~265]; K=256 (64, 64, 4, 2) 699 [821]. bfloat16 dots: K=128 best (32, 64, 4, 1) 279 [227],
# K=256 (64, 32, 4, 2) 477: the pairs variant stays the bf16 default.
# Faults (illegal memory access; such configs are refused when given, :func:`faulting_config`):
# kernel 1 at 8 warps, kernel 2 at 8 warps with BLOCK_V 16 (every 8-warp kernel 2 is refused: 20-30%
# slower where it ran), kernel 2 at 3 stages with K=128.
# Every other row (other GPUs): NOT MEASURED (guesses): kernel 2
# keeps K x BLOCK_V float32 state (<= 8K elements per program at 4 warps) plus [C, BLOCK_V]
# U/D/O tiles; a small BLOCK_V gives more programs (N * V / BLOCK_V), each sequential over T.
# Key: (device kind, K bucket <= 64 / <= 128 / <= 256, size of the dots' dtype).
_TABLE = {
    ("sm90", 64, 2): [_cfg(64, 16, 4, 3, 32, 64, 4, 2), _cfg(64, 32, 4, 3, 32, 64, 4, 2),
                      _cfg(64, 64, 4, 3, 32, 64, 4, 2)],
    ("sm90", 128, 2): [_cfg(64, 32, 4, 3, 32, 64, 4, 2), _cfg(64, 64, 4, 3, 32, 64, 4, 2),
                       _cfg(64, 32, 4, 2, 32, 64, 4, 2), _cfg(64, 16, 4, 3, 32, 64, 4, 2)],
    ("sm90", 256, 2): [_cfg(64, 32, 4, 2, 32, 64, 4, 2), _cfg(64, 32, 8, 2, 32, 64, 4, 2),
                       _cfg(64, 16, 4, 2, 32, 64, 4, 2)],
    ("sm90", 64, 4): [_cfg(64, 16, 4, 3, 64, 64, 4, 1, "strips"), _cfg(64, 16, 4, 3, 16, 32, 4, 2), _cfg(64, 16, 4, 3, 32, 32, 4, 2),
                      _cfg(64, 32, 4, 2, 32, 32, 4, 1)],
    ("sm90", 128, 4): [_cfg(64, 16, 4, 2, 64, 32, 4, 2, "strips"), _cfg(64, 16, 4, 2, 16, 32, 4, 2), _cfg(64, 32, 4, 2, 32, 32, 4, 2),
                       _cfg(64, 16, 4, 2, 32, 32, 4, 1)],
    # one stage first: with single-pass TF32 output-path dots the scan kernel stages its state
    # blocks in shared memory per pipeline stage, 317-352 KB at two stages for K=256 (compiled
    # for sm90; the H100 has 227 KB), 32 KB at one; launch.launch_first_fitting skips the last
    # row's two stages if they do not fit either
    ("sm90", 256, 4): [_cfg(128, 16, 4, 1, 64, 64, 4, 2, "strips"), _cfg(128, 16, 4, 1, 32, 32, 4, 1), _cfg(64, 16, 4, 1, 32, 32, 4, 1),
                       _cfg(32, 16, 4, 2, 16, 32, 4, 1)],
    ("cuda", 64, 2): [_cfg(64, 32, 4, 3, 32, 64, 4, 2), _cfg(32, 32, 4, 2, 32, 32, 4, 1)],
    ("cuda", 128, 2): [_cfg(64, 32, 4, 2, 32, 32, 4, 2), _cfg(32, 16, 4, 2, 16, 32, 4, 1)],
    ("cuda", 256, 2): [_cfg(64, 16, 4, 2, 32, 32, 4, 1), _cfg(32, 16, 4, 2, 16, 32, 4, 1)],
    ("cuda", 64, 4): [_cfg(32, 32, 4, 2, 32, 32, 4, 1), _cfg(32, 16, 4, 1, 16, 32, 4, 1)],
    ("cuda", 128, 4): [_cfg(32, 16, 4, 2, 32, 32, 4, 1), _cfg(16, 16, 4, 1, 16, 16, 4, 1)],
    ("cuda", 256, 4): [_cfg(32, 16, 4, 2, 16, 32, 4, 1), _cfg(16, 16, 4, 1, 16, 16, 4, 1)],
}


def _bucket(k_dim: int) -> int:
    return 64 if k_dim <= 64 else 128 if k_dim <= 128 else 256


def _fit(cfg: dict, k_dim: int, v_dim: int) -> dict:
    """A config's blocks shrunk to the problem (no block wider than the next power of two of
    its dimension, none below 16)."""
    kp, vp = max(16, launch.next_power_of_2(k_dim)), max(16, launch.next_power_of_2(v_dim))
    out = dict(cfg)
    for key, lim in (("BLOCK_K", kp), ("BLOCK_V", vp), ("BLOCK_K1", kp), ("BLOCK_V1", vp)):
        out[key] = min(out[key], lim)
    return out


#: The ``dots`` the chunked forward takes: the dtype of its workspaces, which is the dtype of
#: every tensor-core dot operand (:func:`workspace_dtype`).
DOTS = ("float32", "bfloat16")

#: ``input_precision`` of the float32 state-path dots (and by default of the output-path ones but
#: for a bfloat16 o: :func:`resolve_output_precision`) on a GPU where torch's float32 matmul precision is
#: ``"highest"`` (no TF32): three TF32 products per dot (Triton splits each operand into a TF32
#: high part and a TF32 remainder and drops the remainder × remainder product), about 22 bits of
#: the 24 of float32, on the tensor cores. A float64 model of the kernels' dataflow with Triton's
#: split (B=1, H=4, K=V=64, T 64-300, float16 and bfloat16 inputs, strong and mild gates)
#: predicted the final state at 0.6-1.5x the error of the eager float32 loop and ``o`` at eager's
#: (plain TF32: the state at 2.5-3.4e-4, 1000x eager's); measured on the H100 (torch 2.11, Triton
#: 3.6; ``tests/patterns/test_kda.py``, K=V=32, T 64-200): ``o`` as eager's, the state 2.0-2.2x
#: (1.2e-7 against 5.8e-8). ``tests/codegen/test_kda_chunk.py``'s GPU test
#: ``test_half_inputs_as_close_as_eager_on_gpu`` checks it on the device. IEEE float32 dots
#: would run on the FMA units (about 15x below the bf16 tensor-core rate on the H100).
#: Triton also lists ``"bf16x3"`` / ``"bf16x6"`` (three / six bfloat16 products); tried here on the
#: state path (H200, torch 2.11, Triton 3.6, B·H=16, T=4096, K=V=128, bfloat16 inputs; 2026-12-03):
#: both gave NaN outputs (bf16x3 also an illegal memory access at K=V=64), at 0.652 / 0.802 ms
#: against tf32x3's 0.726 ms (o 2.2e-3, state 1.1e-7: 1.33x / 1.94x eager's), so not offered.
GPU_FP32_PRECISION = "tf32x3"


#: The ``input_precision`` values the output-path dots take (``output_precision`` of
#: :func:`forward`; module docstring, "Precision of the dots"): ``"tf32"`` one TF32 product
#: (``2^-11`` per operand), ``"tf32x3"`` three (``~2^-22``), ``"ieee"`` float32 FMA (``2^-24``, off
#: the tensor cores on a GPU).
OUTPUT_PRECISIONS = ("tf32", "tf32x3", "ieee")


def _check_dots(dots) -> str:
    if dots not in DOTS:
        raise ValueError(f"dots must be one of {DOTS}, got {dots!r}")
    return dots


def _check_output_precision(precision) -> str:
    if precision not in OUTPUT_PRECISIONS:
        raise ValueError(f"output_precision must be one of {OUTPUT_PRECISIONS} (or None: the default rule), "
                         f"got {precision!r}")
    return precision


def workspace_dtype(dots: str = "float32") -> torch.dtype:
    """The workspaces' dtype ``DT``, which every tensor-core dot takes its operands in:
    ``dots="float32"`` (the default, whatever the inputs' dtypes) or ``"bfloat16"``.

    Why float32 also for float16/bfloat16 inputs: the kernels carry the state in float32, as
    the loops they replace do (a float32 state with the inputs upcast every step), and every
    product on the state's path (``A_kk``, ``T``, ``U``, ``W``, ``Kd``, ``Δ``) rounded to 16 bits
    costs the state ~1e-3 relative (the eager float32 loop: ~6e-8). Measured on the H100 with
    bfloat16 workspaces (B=1, H=4, K=V=64, T=64, FLA's naive loop; o / final state against
    float64, eager's in brackets): float16 inputs 4.4e-3 (2.1e-4) / 3.6e-3 (5.7e-8), bfloat16
    inputs 3.9e-3 (1.6e-3) / 2.0e-3 (6e-8). With float32 workspaces the interpreter gives
    eager's own errors (float16, T = 64, 100, 200: o 2.1e-4 as eager's, state 5-8e-8 against
    eager's 5.4e-8). Float16 workspaces are not offered: the diagonal tiles' decay factor is
    clamped at e^30, beyond float16's range (NaN), and the state would overflow at 65504.
    ``"bfloat16"`` is FLA's ``chunk_kda`` precision class (its state, ``W``, ``U`` and ``Δ``
    operands are 16-bit too): an explicit opt-in that trades the state's accuracy (~2e-3 against
    float32's ~1e-7 on the H100) for speed (B=1, T=4096, H=16, bf16 inputs, H100, K=V = 64 / 128:
    0.210 / 0.341 ms against 0.551 / 0.854 ms with float32 dots and the default TF32 output path,
    0.617 / 1.04 ms with ``tf32x3`` everywhere); the
    planner never picks it, ``fuser.plan`` ``kda.dots=bfloat16`` forces it.

    Raises:
        ValueError: ``dots`` not in :data:`DOTS`.
    """
    return torch.float32 if _check_dots(dots) == "float32" else torch.bfloat16


def input_precision(dots: str = "float32", *, interpret: bool = False) -> str:
    """``tl.dot``'s ``input_precision`` of the state-path dots (module docstring, "Precision of
    the dots") for the workspaces of ``dots``: ``"tf32"`` where torch's float32 matmul precision
    allows TF32 (``launch.dot_precision``), else ``"ieee"`` in Triton's interpreter
    (``interpret``) and :data:`GPU_FP32_PRECISION` on a GPU; ``"ieee"`` (moot) for bfloat16
    operands.

    Raises:
        ValueError: ``dots`` not in :data:`DOTS`.
    """
    if _check_dots(dots) == "bfloat16":
        return "ieee"
    if launch.dot_precision(torch.float32) == "tf32":
        return "tf32"
    return "ieee" if interpret else GPU_FP32_PRECISION


def resolve_output_precision(output_precision: Optional[str] = None, *, dots: str = "float32",
                             out_dtype: torch.dtype = torch.float32, interpret: bool = False) -> str:
    """``tl.dot``'s ``input_precision`` of the output-path dots (``A_qk``, ``Qg S``, ``A_qk Δ``;
    module docstring, "Precision of the dots", has the error argument).

    Args:
        output_precision: one of :data:`OUTPUT_PRECISIONS`, returned as it is (also in the
            interpreter, which computes plain float32 products whatever it says), or None: the
            default rule: ``"tf32"`` when ``out_dtype`` is bfloat16 on a GPU (its rounding,
            ``2^-9``, dominates TF32's ``2^-11``), else the state path's
            (:func:`input_precision`: ``tf32x3`` on a GPU under torch's default float32 matmul
            precision, ``"tf32"`` where torch allows TF32, ``"ieee"`` in the interpreter). A
            float16 o keeps the state path's: float16 has TF32's 10 mantissa bits, so TF32 would
            not hide below its rounding (predicted 2.6x eager's o error).
        dots: :data:`DOTS`. With ``"bfloat16"`` every dot takes bfloat16 operands and the
            precision is moot: ``"ieee"``.
        out_dtype: o's dtype (float32, float16 or bfloat16).
        interpret: the kernels run in Triton's interpreter.

    Raises:
        ValueError: ``output_precision`` not in :data:`OUTPUT_PRECISIONS` or None (the message
            names the valid values), ``"tf32"``/``"tf32x3"`` with ``dots="bfloat16"``, ``dots``
            not in :data:`DOTS`.
    """
    if _check_dots(dots) == "bfloat16":
        if output_precision not in (None, "ieee"):
            _check_output_precision(output_precision)
            raise ValueError(f"output_precision={output_precision!r} applies to float32 dots; with dots='bfloat16' "
                             "every dot takes bfloat16 operands (leave output_precision None, or pass dots='float32')")
        return "ieee"
    if output_precision is not None:
        return _check_output_precision(output_precision)
    state = input_precision(dots, interpret=interpret)
    if not interpret and out_dtype == torch.bfloat16:
        return "tf32"
    return state


def dot_rate(precision: str, dots: str = "float32") -> tuple[str, int]:
    """``(key of the cost model's tflops, products per dot)`` of dots with this
    ``input_precision`` on ``dots`` operands: ``tf32x3`` runs three TF32 products, ``tf32`` one,
    ``ieee`` float32 runs on the FMA units (``"fp32"``)."""
    if _check_dots(dots) == "bfloat16":
        return "bf16", 1
    return {"tf32": ("tf32", 1), "tf32x3": ("tf32", 3)}.get(precision, ("fp32", 1))


def candidate_configs(*, k_dim: int, v_dim: int, dtype: torch.dtype, device) -> list[dict]:
    """Launch configs, best first (the first is the default): the interpreter's table on CPU
    tensors, else by device kind (``launch.device_kind``), K bucket (≤ 64, ≤ 128, ≤ 256) and the
    size of the dots' dtype (:func:`workspace_dtype`; ``dtype`` is that or an input dtype).
    Blocks are shrunk to the problem's K and V. Keys: ``BLOCK_K``, ``BLOCK_V``, ``num_warps``,
    ``num_stages`` (kernel 2), ``BLOCK_K1``, ``BLOCK_V1``, ``num_warps1``, ``num_stages1``
    (kernel 1), ``prep`` (kernel 1's variant, :data:`PREP_VARIANTS`).

    Raises:
        ValueError: ``k_dim`` outside 1..:data:`MAX_K` or ``v_dim < 1``.
    """
    _check_dims(k_dim, v_dim)
    dev = launch.device_kind(device)
    if dev == "interpreter":
        cands = _INTERP
    else:
        cands = _TABLE[(dev, _bucket(k_dim), 4 if dtype == torch.float32 else 2)]
    out = []
    for c in cands:
        c = _fit(c, k_dim, v_dim)
        if c not in out:
            out.append(c)
    return out


def _check_dims(k_dim: int, v_dim: int) -> None:
    if not 1 <= k_dim <= MAX_K:
        raise ValueError(f"KDA chunked forward: the key dimension K must be in 1..{MAX_K} (the state [K, BLOCK_V] "
                         f"lives in registers), got K={k_dim}; split the heads' key dimension or use the "
                         "recurrent kernel")
    if v_dim < 1:
        raise ValueError(f"KDA chunked forward: the value dimension V must be >= 1, got V={v_dim}")


def _check_config(cfg: dict) -> dict:
    launch.check_config(cfg)
    for key in ("num_warps", "num_warps1"):
        if cfg[key] not in (1, 2, 4, 8, 16):
            raise ValueError(f"{key} must be 1, 2, 4, 8 or 16, got {cfg[key]!r}")
    for key in ("num_stages", "num_stages1"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an int >= 1, got {cfg[key]!r}")
    _check_prep(cfg["prep"])
    return cfg


def faulting_config(cfg: dict, k_dim: int, dtype: torch.dtype, device) -> Optional[str]:
    """Why ``cfg`` is refused on this device, or None: launch configs of the kinds that made an
    illegal memory access (the CUDA context lost, every later call in the process failing) with
    float32 dots (``dtype``: the dots' dtype), MEASURED on the H100 with Triton 3.6 (2026-11-24,
    B=1, T=4096, H=16, bf16 inputs; ``benchmarks/kda_chunk_configs.py``,
    ``benchmarks/results/kda_chunk_configs.md``): kernel 1 at 8 warps (K = 64 and 128); kernel 2
    at 8 warps with BLOCK_V 16 (K = 64, 128, 256; at 8 warps it was 20-30% slower wherever it
    ran); kernel 2 at 3 pipeline stages with K = 128 (at K ≤ 64 the table's default runs 3). The
    same configs with bfloat16 dots ran. With bfloat16 dots (2026-11-25, the same shape): kernel 1's
    strips variant at BLOCK_K1 64 (K = 128, one stage; K = 256 ran). Not root-caused: our masks
    and workspace bounds do not depend on warps, stages or blocks."""
    if launch.device_kind(device) == "interpreter":
        return None
    if dtype != torch.float32:
        if cfg["prep"] == "strips" and cfg["BLOCK_K1"] >= 64:
            return "kernel 1's strips variant at BLOCK_K1 64 or more with bfloat16 dots"
        return None
    if cfg["num_warps1"] >= 8:
        return "kernel 1 at 8 or more warps (num_warps1)"
    if cfg["num_warps"] >= 8:
        return "kernel 2 at 8 or more warps (num_warps)"
    if cfg["num_stages"] >= 3 and k_dim > 64:
        return "kernel 2 at 3 or more num_stages with K > 64"
    return None


def _configs(config: Optional[dict], k_dim: int, v_dim: int, dtype: torch.dtype, device) -> list[dict]:
    """The given config alone (missing keys from the default), or every candidate (default first).

    Raises:
        ValueError: unknown keys, a bad value (``_check_config``), or a config measured to fault
            (:func:`faulting_config`).
    """
    cands = candidate_configs(k_dim=k_dim, v_dim=v_dim, dtype=dtype, device=device)
    if config:
        unknown = set(config) - set(cands[0])
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(cands[0])}")
        cfg = _check_config({**cands[0], **config})
        why = faulting_config(cfg, k_dim, dtype, device)
        if why:
            raise ValueError(f"KDA chunked forward: config {cfg} is refused: {why} made an illegal memory "
                             "access on the H100 (Triton 3.6); with float32 dots use num_warps and num_warps1 <= 4 "
                             "and, for K > 64, num_stages <= 2; with bfloat16 dots a strips kernel 1 needs "
                             "BLOCK_K1 <= 32")
        return [cfg]
    return [_check_config(c) for c in cands]


def _k_blocks(k_dim: int, cfg: dict) -> int:
    return launch.cdiv(k_dim, cfg["BLOCK_K"])


def kernels_for(*, k_dim: int, v_dim: int, device, chunk: int = 64, scalar_gate: bool = False,
                config: Optional[dict] = None, dots: str = "float32", output_precision: Optional[str] = None,
                out_dtype: torch.dtype = torch.float32) -> list[RenderedKernel]:
    """The kernel modules :func:`forward` runs for these sizes (for reports), in launch order:
    kernel 1 (prep) and kernel 2 (scan, whose unrolling depends on ``⌈K / BLOCK_K⌉`` of the
    config: ``config`` or the default of :func:`candidate_configs` for the workspaces of
    ``dots``, whatever the inputs' dtypes), both with the output-path precision
    :func:`resolve_output_precision` gives for ``output_precision``, ``dots``, ``out_dtype``
    (o's dtype) and the device.

    Raises:
        ValueError: a bad chunk, K, V, dots, output_precision or config.
    """
    cfg = _configs(config, k_dim, v_dim, workspace_dtype(dots), device)[0]
    interpret = launch.interpreted(device)
    out_prec = resolve_output_precision(output_precision, dots=dots, out_dtype=out_dtype, interpret=interpret)
    return [prep_kernel(chunk=chunk, scalar_gate=scalar_gate, interpret=interpret, output_precision=out_prec,
                        variant=cfg["prep"]),
            scan_kernel(chunk=chunk, k_blocks=_k_blocks(k_dim, cfg), interpret=interpret, output_precision=out_prec)]


# --------------------------------------------------------------------------------------------
# Cost helpers (plain ints for ints; they also take sympy expressions for the planner)
# --------------------------------------------------------------------------------------------


def _chunks(t, chunk):
    if isinstance(t, int):
        return launch.cdiv(t, chunk)
    import sympy

    return sympy.ceiling(sympy.sympify(t) / chunk)


def workspace_bytes(*, n, t, k_dim, v_dim, chunk: int = 64, ws_bytes: int = 4, save_for_backward: bool = False,
                    prep: str = "pairs", scalar_gate: bool = False):
    """Extra HBM :func:`forward` allocates beyond ``o`` and the final state, in bytes: the
    workspaces of the module docstring (``ws_bytes`` the size of the dots' dtype: 4, or 2 with
    ``dots="bfloat16"``; ``gcum`` and ``xm`` with ``prep="strips"`` or ``save_for_backward``;
    ``states`` and ``a_kk`` only with ``save_for_backward``). With ``save_for_backward`` these
    are what a backward keeps alive from the forward to the backward."""
    nc = _chunks(t, chunk)
    tp = nc * chunk
    total = n * tp * (3 * k_dim + v_dim + 2 * chunk) * ws_bytes + n * nc * k_dim * 4
    gk = 1 if scalar_gate else k_dim
    if save_for_backward:
        total += n * nc * k_dim * v_dim * 4 + n * tp * (gk + 2 * chunk) * 4
    elif _check_prep(prep) == "strips":
        total += n * tp * (gk + chunk) * 4
    return total


def hbm_bytes(*, n, nq, t, k_dim, v_dim, chunk: int = 64, in_bytes: int = 2, g_bytes=None, out_bytes=None,
              ws_bytes: int = 4, scalar_gate: bool = False, initial_state: bool = False, final_state: bool = False,
              save_for_backward: bool = False):
    """Bytes through HBM of one :func:`forward` (a model: every operand read once per kernel
    that reads it, L2 reuse ignored).

    Kernel 1 reads q, k (per value head: ``N`` rows; with grouped heads L2 usually serves the
    repeats — counted as ``N``), v, g, beta; reads k and g again (pass 2: W); writes qg, kd, w,
    u, a_qk, t_mat (``ws_bytes`` each; t_mat is read back once) and ``G_C``. Strong-gate
    sub-blocks' diagonal recomputation (another read of their q, k, g) is not counted; nor are
    the strips variant's float32 scratch (``G`` written once and read twice, ``X`` written and
    read once per strip: a few percent, mostly served by L2). Kernel 2 reads the workspaces once per V block
    (counted once: the V blocks of a head run concurrently and share them in L2), writes o,
    reads/writes the states asked for. ``g_bytes``/``out_bytes`` default to ``in_bytes``.
    """
    g_bytes = in_bytes if g_bytes is None else g_bytes
    out_bytes = in_bytes if out_bytes is None else out_bytes
    nc = _chunks(t, chunk)
    tp = nc * chunk
    gk = 1 if scalar_gate else k_dim
    k1 = (n * t * (3 * k_dim * in_bytes + v_dim * in_bytes + 2 * gk * g_bytes + in_bytes)
          + n * tp * (3 * k_dim + v_dim + 3 * chunk) * ws_bytes + n * nc * k_dim * 4)
    k2 = n * tp * (3 * k_dim + v_dim + chunk) * ws_bytes + n * nc * k_dim * 4 + n * t * v_dim * out_bytes
    states = n * k_dim * v_dim * 4 * ((1 if initial_state else 0) + (1 if final_state else 0))
    if save_for_backward:
        states += n * nc * k_dim * v_dim * 4
    return k1 + k2 + states


def flops(*, n, t, k_dim, v_dim, chunk: int = 64, path: str = "all"):
    """Matrix-unit FLOPs of one :func:`forward` (2 per multiply-add, the tiles as the kernels
    compute them: the ``[16, 16]`` tile pairs of ``A`` on and below the diagonal, the full
    ``[C, C]`` ``T`` in ``U``, ``W``, all of ``W S``, ``Qg S``, ``Kdᵀ Δ`` and the full ``[C, C]``
    ``Aqk Δ``), of the dots of ``path``: ``"all"``, ``"state"`` or ``"output"`` (module
    docstring, "Precision of the dots").

    These are the pairs variant's; the strips variant computes each strip's ``[16, C]`` of
    ``A_kk`` and ``A_qk`` whole (``2·C²·K`` each per chunk: 1.6× the pairs' at ``C = 64``), not
    modelled: the cost model's estimate of kernel 1 stays the pairs'.
    Per chunk and head, with ``p = s(s+1)/2`` tile pairs (``s = C / 16``): the output path
    ``A_qk`` ``2·256·K·p``, ``Qg S`` ``2·C·K·V``, ``A_qk Δ`` ``2·C²·V``; the state path ``A_kk``
    ``2·256·K·p``, the solve ``2·16³`` per ``[16, 16]`` dot: 6 per diagonal tile and ``Σ_{j<i}
    (i − j + 1)`` off the diagonal (IEEE float32, on the FMA units; counted with the state path,
    whatever its precision: a few percent), ``U`` and ``W`` ``2·C²·(V + K)``, ``W S`` and ``Kdᵀ Δ``
    ``2·C·K·V`` each.

    Raises:
        ValueError: ``path`` not ``"all"``, ``"state"`` or ``"output"``.
    """
    if path not in ("all", "state", "output"):
        raise ValueError(f"path must be 'all', 'state' or 'output', got {path!r}")
    nc = _chunks(t, chunk)
    s = chunk // 16
    p = s * (s + 1) // 2
    solve_dots = 6 * s + sum(i - j + 1 for i in range(s) for j in range(i))
    output = 2 * 256 * k_dim * p + 2 * chunk * k_dim * v_dim + 2 * chunk * chunk * v_dim
    state = (2 * 256 * k_dim * p + 2 * 4096 * solve_dots + 2 * chunk * chunk * (v_dim + k_dim)
             + 2 * 2 * chunk * k_dim * v_dim)
    per_chunk = {"all": output + state, "state": state, "output": output}[path]
    return n * nc * per_chunk


def dot_flops(*, n, t, k_dim, v_dim, chunk: int = 64, dots: str = "float32", state_precision: str,
              output_precision: str) -> dict:
    """The cost model's matrix-unit work of one :func:`forward`: ``{tflops key: FLOPs at that
    rate}`` (keys of :func:`dot_rate`), every dot counted with its products: the state path's
    :func:`flops` times the products of ``state_precision`` (3 for ``tf32x3``), the output path's
    times those of ``output_precision`` (1 for ``tf32``). Ints, or sympy expressions for symbolic
    sizes.

    Raises:
        ValueError: ``dots`` not in :data:`DOTS`.
    """
    out: dict = {}
    for path, precision in (("state", state_precision), ("output", output_precision)):
        kind, products = dot_rate(precision, dots)
        work = products * flops(n=n, t=t, k_dim=k_dim, v_dim=v_dim, chunk=chunk, path=path)
        out[kind] = out[kind] + work if kind in out else work
    return out


def exps(*, n, t, k_dim, chunk: int = 64, scalar_gate: bool = False, pairwise_diagonal: bool = False):
    """Exponentials of one :func:`forward`: per token and key channel 4 in kernel 1 (the two
    sub-block factors, the diagonal tile's clamped factor and pass 2's ``e^G``), plus 16 per token
    and channel where the diagonal tiles are recomputed pairwise (``pairwise_diagonal``: strong
    gates, every sub-block spanning ``|ΔG| > 30``). Scalar gate: per token the pairwise
    ``[16, 16]`` decays (``8·(s + 1)``, ``s = C / 16``) plus 2, and pass 2's ``e^G`` per
    channel."""
    nc = _chunks(t, chunk)
    tp = nc * chunk
    if scalar_gate:
        return n * tp * (8 * (chunk // 16 + 1) + 2 + k_dim) + n * nc * k_dim
    return n * tp * k_dim * (4 + (16 if pairwise_diagonal else 0)) + n * nc * k_dim


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype):
    """:func:`fuser.codegen.kda_recurrent.check_inputs` with lead dims (q, k ``[*lead_q, T, K]``,
    v ``[*lead, T, V]``, g, beta likewise, or the plain ``[N, T, *]``), ``NQ ≥ 1``, and K within
    this module's limits: ``(N, NQ, T, K, V)``. Raises ValueError naming the input."""
    nq, n, t, k_dim, v_dim = check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype, lead_dims=True)
    if nq == 0:
        raise ValueError(f"v's N={n} must be a positive multiple of q's NQ={nq} (grouped value heads)")
    _check_dims(k_dim, v_dim)
    return n, nq, t, k_dim, v_dim


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    scalar_gate: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[dict] = None,
    chunk: int = 64,
    save_for_backward: bool = False,
    save_states: bool = True,
    dots: str = "float32",
    output_precision: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
):
    """KDA forward in chunks of ``chunk`` tokens (the WY form; module docstring).

    Args:
        q, k: ``[NQ, T, K]``. v: ``[N, T, V]``, ``N = NQ · group``: value head ``n`` reads q/k
            row ``n // group``. g: log-space decay ``[N, T, K]`` (``[N, T]`` with
            ``scalar_gate``); ``g ≤ 0`` in practice (positive values: module docstring); gates
            below :data:`GATE_FLOOR` are raised to it in the kernels (−inf: a hard reset; NaN
            stays NaN).
            beta: ``[N, T]``. Any of float32 / float16 / bfloat16 each (they may differ), any
            strides (never copied). Each may instead carry its rows as lead dims (at least one):
            q, k ``[*lead_q, T, K]``, v ``[*lead, T, V]``, g ``[*lead, T(, K)]``, beta ``[*lead,
            T]`` (``kda_recurrent.check_inputs`` with ``lead_dims``), read in place when the lead
            dims merge into at most two stride groups, else copied once
            (``kda_recurrent.input_rows``). ``1 ≤ K ≤ 256``, ``V ≥ 1``, any ``T ≥ 0``.
        scale: multiplies q (e.g. ``K ** -0.5``).
        initial_state: ``[N, K, V]`` (any float dtype and strides) or None (zeros).
        output_final_state: also return the state after the last token.
        scalar_gate: g is ``[N, T]``, one decay for the whole state per token (gated delta rule).
        out_dtype: o's dtype (default v's).
        config: launch config (keys of :func:`candidate_configs`; missing keys from the
            default); None: the table's candidates, the first that fits the device.
        chunk: tokens per chunk, one of :data:`CHUNKS`.
        save_for_backward: also return what a backward can reuse (below).
        save_states: with ``save_for_backward``, also store the state before every chunk
            (``"states"``; else None there: the backward recomputes them in its sequential pass).
        dots: the workspaces' dtype, which the tensor-core dots take their operands in
            (:data:`DOTS`): ``"float32"`` (default; the accuracy of a float32 loop also for
            16-bit inputs, :func:`workspace_dtype`) or ``"bfloat16"``: FLA's precision class, an
            explicit opt-in that trades the state's accuracy for speed (H100, bf16 inputs: final
            state ~2e-3 relative against ~1.2e-7 with float32 dots; B=1, T=4096, H=16, K=V=128
            0.341 against 0.854 ms with float32 dots and the default output path). The state-path dots'
            ``input_precision``: :func:`input_precision`.
        output_precision: ``input_precision`` of the output-path dots (``A_qk``, ``Qg S``,
            ``A_qk Δ``: each error enters o once), one of :data:`OUTPUT_PRECISIONS`, or None
            (default): the rule of :func:`resolve_output_precision` (single-pass ``"tf32"`` for a
            bfloat16 o on a GPU, else the state path's precision). Module docstring, "Precision
            of the dots", has the error argument.
        out: o preallocated, written in place, or None (a new contiguous ``[N, T, V]``), as
            :func:`fuser.codegen.kda_recurrent.forward`'s ``out`` (its shapes, strides, dtype and
            checks, :func:`fuser.codegen.kda_recurrent.check_out`).

    Returns:
        ``(o, final_state)``: o ``[N, T, V]`` in ``out_dtype``, contiguous (``out`` itself when
        given, in its own shape); final_state
        ``[N, K, V]`` float32 contiguous, or None unless ``output_final_state``.
        With ``save_for_backward``: ``(o, final_state, saved)``, ``saved`` a dict of
        contiguous tensors: ``"states"`` ``[N, n_chunks, K, V]`` float32, the state before
        each chunk (``states[:, 0]`` is the initial state); ``"g_last"`` ``[N, n_chunks, K]``
        float32, ``G_C`` (the chunk's summed gate; broadcast over K with a scalar gate);
        ``"qg"``, ``"kd"``, ``"w"`` ``[N, T_pad, K]``, ``"u"`` ``[N, T_pad, V]``, ``"a_qk"``,
        ``"t_mat"`` ``[N, T_pad, chunk]`` in the dots' dtype (:func:`workspace_dtype`), the workspaces of
        the module docstring (``T_pad = n_chunks · chunk``, rows past T zero); float32 ``"gcum"``
        (``G``, ``[N, T_pad, K]``, ``[N, T_pad]`` with a scalar gate), ``"xm"`` (``X = (I +
        diag(β) A_kk)⁻¹``) and ``"a_kk"`` (``A_kk``, zero on and above the diagonal) ``[N, T_pad,
        chunk]``; ``"chunk"``. :func:`fuser.codegen.kda_bwd.backward` takes this dict as its
        ``saved`` and then recomputes none of it.

    Raises:
        ValueError: wrong ranks or shapes (messages name the expected shape), an unsupported
            dtype, inputs on several devices, K outside 1..256, a chunk not in
            :data:`CHUNKS`, ``dots`` not in :data:`DOTS`, ``output_precision`` not in
            :data:`OUTPUT_PRECISIONS` (or ``"tf32"``/``"tf32x3"`` with ``dots="bfloat16"``), a bad
            config, an ``out`` of the wrong shape, dtype or device, or overlapping itself.
    """
    chunk = _check_chunk(chunk)
    dt = workspace_dtype(dots)
    n, nq, t, k_dim, v_dim = _check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype)
    device = v.device
    out_dtype = v.dtype if out_dtype is None else out_dtype
    interpret = launch.interpreted(device)
    out_prec = resolve_output_precision(output_precision, dots=dots, out_dtype=out_dtype, interpret=interpret)
    configs = _configs(config, k_dim, v_dim, dt, device)
    nc = launch.cdiv(t, chunk)
    tp = nc * chunk
    o, o_arg, o_rows = out_buffer(out, n, t, v_dim, out_dtype, device)
    final = launch.empty((n, k_dim, v_dim), torch.float32, device) if output_final_state else None
    states = launch.empty((n, nc, k_dim, v_dim), torch.float32, device) if save_for_backward and save_states else None
    ws = {
        "qg": launch.empty((n, tp, k_dim), dt, device),
        "kd": launch.empty((n, tp, k_dim), dt, device),
        "w": launch.empty((n, tp, k_dim), dt, device),
        "u": launch.empty((n, tp, v_dim), dt, device),
        "a_qk": launch.empty((n, tp, chunk), dt, device),
        "t_mat": launch.empty((n, tp, chunk), dt, device),
        "g_last": launch.empty((n, nc, k_dim), torch.float32, device),
    }
    if save_for_backward:
        # what a backward reads instead of recomputing (codegen/kda_bwd.backward's saved=): G, X, A_kk
        ws.update(gcum=launch.empty((n, tp) if scalar_gate else (n, tp, k_dim), torch.float32, device),
                  xm=launch.empty((n, tp, chunk), torch.float32, device),
                  a_kk=launch.empty((n, tp, chunk), torch.float32, device))
    if t == 0 or n == 0:
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return _result(o, final, save_for_backward, states, ws, chunk)
    precision = input_precision(dots, interpret=interpret)
    group = n // nq
    # the inputs' rows as at most two stride groups each: no copy ([B, H, T, *] views of FLA's layout included)
    ins, rows = inputs_rows(q, k, v, g, beta, bool(scalar_gate))

    def run(cfg):
        _, prep = _prep_module(chunk, bool(scalar_gate), interpret, out_prec, cfg["prep"])
        _, scan = _scan_module(chunk, _k_blocks(k_dim, cfg), interpret, out_prec)
        # the strips variant's own float32 scratch: G (the cumulative gate), X = (I + diag(beta) A_kk)^-1;
        # with save_for_backward both variants write G, X and A_kk to the saved workspaces
        if save_for_backward:
            keep = (ws["gcum"], ws["xm"], ws["a_kk"])
            scratch, extra = ((), {"save": keep}) if cfg["prep"] == "pairs" else (keep[:2], {"akk": keep[2]})
        else:
            extra = {}
            scratch = () if cfg["prep"] == "pairs" else (
                launch.empty((n, tp) if scalar_gate else (n, tp, k_dim), torch.float32, device),
                launch.empty((n, tp, chunk), torch.float32, device))
        with launch.launching(interpret):
            prep.launch_prep(*ins, ws["qg"], ws["kd"], ws["w"], ws["u"], ws["a_qk"], ws["g_last"],
                             ws["t_mat"], *scratch, group=group, scale=float(scale), config=cfg, input_precision=precision,
                             rows=rows, **extra)
            scan.launch_scan(ws["qg"], ws["kd"], ws["w"], ws["u"], ws["a_qk"], ws["g_last"], o_arg, initial_state,
                             final, states, config=cfg, input_precision=precision, o_rows=o_rows)

    key = ("kda_chunk", chunk, bool(scalar_gate), k_dim, v_dim, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
           out_dtype, initial_state is not None, precision, out_prec, str(device))
    launch.launch_first_fitting(key, configs, run)
    return _result(finish_out(o, o_arg), final, save_for_backward, states, ws, chunk)


def _result(o, final, save_for_backward, states, ws, chunk):
    if not save_for_backward:
        return o, final
    return o, final, dict(ws, states=states, chunk=chunk)
