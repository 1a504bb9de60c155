"""KDA forward for short sequences: the whole sequence as one chunk of the WY form, parallel over K and V.

KDA (Kimi Delta Attention, Kimi Linear, Moonshot AI 2025) is the gated delta rule of Gated DeltaNet
(Yang et al., ICLR 2025) with one decay per key channel. Per value row ``n`` (a flattened (batch,
value head) pair) a float32 state ``S [K, V]`` evolves every token ``t`` as
``S ← diag(e^{g_t}) S;  S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ;  o_t = Sᵀ(scale · q_t)``
(``patterns/kda_reference.py``; the scalar-gate variant decays the whole state by one ``e^{g_t}``).

For a sequence of at most :data:`MAX_T` tokens the chunked (WY) form of ``docs/math.md`` ("KDA")
needs a single chunk. With ``G`` the inclusive cumulative sum of ``g`` over the tokens (per key
channel) and ``S0`` the initial state::

    A_kk[r, s] = Σ_d k_rd k_sd e^{G_rd − G_sd}  (s < r)      A_qk[r, s] = Σ_d q_rd k_sd e^{G_rd − G_sd}  (s ≤ r)
    Tm = (I + diag(β) A_kk)⁻¹ diag(β)          Δ = Tm (V − (K∘e^G) S0)
    O  = scale · ((Q∘e^G) S0 + A_qk Δ)         S_T = diag(e^{G_T}) S0 + (K∘e^{G_T − G})ᵀ Δ

Nothing here walks the tokens through the state, so very large key dimensions (8192, 16384: the
recurrent kernel must stream its state through memory every token there) cost about one write of
the final state (``N·K·V·4`` bytes) plus, with ``h0``, two reads of it. The kernels
(``templates/kda_parallel.py.jinja``, our own implementation of this algebra; FLA's chunked KDA
kernels evaluate the same WY form chunk by chunk):

1. **prep**, split over the key channels (split-K): ``SPLIT_G`` programs per row sum the two
   ``[T, T]`` Gram matrices over their channel range, as pairwise ``[TG, TG, BLOCK_KG]`` tiles
   ``e^{G_r − G_s}``, and store partial sums. The exponent is summed directly over the gates in
   ``(s, r]`` (a scan of the masked gates along the tokens), ``−∞`` above the diagonal: never
   ``e^{G}·e^{−G}``, and never the difference of two large cumulative sums (after a gate near
   −30 that difference would lose about five digits in float32). With ``h0`` more programs of
   the same launch project the state: ``P_k = (K∘e^G) S0``, ``P_q = (Q∘e^G) S0`` (``tl.dot``;
   split over key ranges and value blocks; partial sums).
2. **reduce** (only when the Gram partials are too many for every solve program to sum them):
   sums them in a fixed order.
3. **solve**, one program per (value block, row): sums the partials in a fixed order
   (deterministic: no atomics anywhere), inverts the unit lower-triangular ``I + diag(β) A_kk``
   by forward substitution (``T`` steps on a ``[T_PAD, T_PAD]`` tile, redone by every program:
   tiny), then ``Δ = Tm (V − P_k)`` and ``O`` by two ``tl.dot``; stores ``O`` and, when the final
   state is wanted, ``Δ`` (float32 ``[N, T, V]`` workspace).
4. **state** (only with ``output_final_state``): one ``[BLOCK_K, BLOCK_V]`` tile of ``S_T`` per
   program, ``Σ_t (k_t∘e^{G_T − G_t}) δ_tᵀ`` by ``T`` rank-1 updates, last token first, carrying the
   suffix sum ``G_T − G_t`` (default; few registers), or by one ``tl.dot`` (``STATE_DOT``), plus
   ``e^{G_T} S0``; stores float32 rows coalesced along V. The bandwidth-bound part.

**One launch** (config ``FUSED``; only where the call allows it: ``T ≤ 16`` tokens, one ``[16, 16]``
block; else the kernels above run): ``kda_parallel_fused_kernel``, grid
``(⌈V / BLOCK_VF⌉, N)``, each program the whole forward of its ``BLOCK_VF`` value columns. It redoes
the row's Gram matrices as two ``tl.dot`` per ``BLOCK_KF`` key channels, the decay split through
token 0 as a reference, ``e^{G_r − G_s} = e^{H_r}·e^{−H_s}`` with ``H_t = Σ_{0<j≤t} g_j`` scanned as a
float32 pair and each factor by a correctly rounded exp (``docs/math.md``, "One chunk in one
launch": as precise as the pairwise form whatever ``|H|``; exact while ``|H| ≤`` :data:`EXACT_H`, a row
past it recomputes its Gram matrices pairwise), inverts ``I + diag(β) A_kk`` by the product of
Neumann factors (``_unit_lower_inverse``, six ``[16, 16]`` IEEE dots), forms ``Δ = Tm V`` and ``O``,
and writes its columns of the final state ``[BLOCK_KF, BLOCK_VF]`` a step. With ``h0`` the same key
loop projects the program's columns of ``S0`` (``P_k``, ``P_q``: ``[16, BLOCK_VF]``, two more
``tl.dot`` a key block; ``Δ = Tm (V − P_k)``, ``O = scale·(P_q + A_qk Δ)``) and the state loop adds
``e^{G_T} S0`` (each ``S0`` column block read by its own program: no key split to choose, so a
symbolic batch is served as well, :func:`serves_symbolic_rows`). No workspace, no second launch.

Measured (H100, 2026-12-08, ``benchmarks/results/kda_parallel_fused.md``): the one launch wins only
where the whole call is small — N=16, K=64, V=128, T=8: 7.0 µs against the split kernels' 10.1 —
and is the default there (K ≤ 64, V ≤ 128, T ≤ 16: :func:`_short_config`). At the blog shapes it
is 1.6-20× slower (256×8192: 26-51 µs by value block against 17.0; 8192×1024: 595-837 against
43.7). Its time grows with the key steps a program walks, not with T (T=1: 30.6 µs at 256×8192),
and with the programs a row has (BLOCK_VF 128 / 64 / 32: 27 / 31 / 51 µs): every program redoes the
row's Gram loop and walks its state loop, a dependent chain of about 3 µs a 64-channel step, that
the split kernels spread over many short programs. One launch at large K would need the Gram
matrices from other programs (a second launch, which is the split form).

Tried and not kept (H100, 2026-12-06, ``benchmarks/results/kda_parallel_one_launch.md``): all four
kernels fused into one launch, each program summing the Gram matrices over all K itself (commit
346eccc): 27.8 against 22.9 µs at 256×8192, T=8, and 2-9× slower at K ≥ 1024 or T ≥ 16 — every
program's dependent chain of Gram steps precedes its first store. Cheaper Gram steps (many short
prep programs, or the channel-major tiles of ``GRAM_DK``) took 1.1-1.3× off instead
(:func:`_short_config`).

Sizes: ``T`` is a runtime argument (``do_not_specialize``); the kernels are compiled per padded
length (``TG = max(4, next_pow2(T))`` for the Gram tiles, ``T_PAD = max(16, next_pow2(T))`` for
the dots: at most five specialisations for T = 1..64), and per K, V and config. Any T in
``0..MAX_T``, K, V ≥ 1 (masked, no power of two needed). Inputs of any strides, their rows as lead
dims in up to two stride groups (never copied, but for three groups that do not merge),
float32 / float16 / bfloat16 each; arithmetic and the state in float32. A scalar gate is passed
to the kernels as a stride-0 view over the channels (no copy; the same kernels).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import launch
from .kda_recurrent import check_inputs, finish_out, inputs_rows, out_buffer
from .render import RenderedKernel, render

__all__ = [
    "forward", "kernel", "kernels_for", "serves_symbolic_rows", "runs_fused", "candidate_configs", "choose_config",
    "hbm_bytes", "workspace_elements", "MAX_T", "TEMPLATE",
]

TEMPLATE = "kda_parallel.py.jinja"

#: The longest sequence the single-chunk form takes (the ``[TG, TG, BLOCK_KG]`` Gram tiles and the
#: ``[T_PAD, T_PAD]`` solve grow as T²); longer ones: the recurrent or chunked kernels.
MAX_T = 64

#: Programs wanted on the GPU: about two per SM of an H100 (132 SMs).
_WANT_PROGRAMS = 2 * 132

#: The largest register tile (float32 elements per program) a config may ask for.
TILE_MAX = 16384

_PRECISIONS = ("ieee", "tf32x3")

#: The fused kernel's Gram matrices go through token 0 as a reference (module docstring, "One
#: launch"): exact while every ``|H_t| = |sum_{0 < j <= t} g_j|`` of a row stays within this, so
#: that both factors ``e^{±H}`` are normal float32 numbers (``e^{-60}`` ≈ 8.8e-27, ``e^{60}`` ≈
#: 1.1e26, with room for ``|q|·|k|·K`` below float32's 3.4e38); a row past it recomputes its Gram
#: matrices pairwise (exact, slower).
EXACT_H = 60.0


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def kernel(*, has_h0: bool, store_final: bool, interpret: bool) -> RenderedKernel:
    """Render the kernel module of one static variant (``templates/kda_parallel.py.jinja``).

    Args:
        has_h0: an initial state is read (else the state starts at zero and is never read).
        store_final: the final state is computed and stored (adds the state kernel).
        interpret: rendered for Triton's interpreter (CPU tensors).
    """
    name = ("kda_parallel" + ("_h0" if has_h0 else "") + ("_ht" if store_final else "")
            + ("_interp" if interpret else ""))
    from .kda_chunk import GATE_FLOOR

    return render(TEMPLATE, name, has_h0=bool(has_h0), store_final=bool(store_final), interpret=bool(interpret),
                  gate_floor=GATE_FLOOR, exact_h=EXACT_H)


@functools.lru_cache(maxsize=None)
def _module(has_h0: bool, store_final: bool, interpret: bool):
    """The imported module of one static variant (rendered once per process)."""
    k = kernel(has_h0=has_h0, store_final=store_final, interpret=interpret)
    return k, launch.kernel_module(k, interpret)


def kernels_for(*, k_dim: int, v_dim: int, dtype: torch.dtype, device, scalar_gate: bool = False,
                initial_state: bool = False, output_final_state: bool = False, config: Optional[dict] = None,
                n_rows: Optional[int] = None) -> list[RenderedKernel]:
    """The kernel modules :func:`forward` runs for these flags (one module; its prep, reduce, solve
    and, with ``output_final_state``, state kernels), for reports. ``k_dim``, ``v_dim``, ``dtype``,
    ``scalar_gate``, ``config`` and ``n_rows`` do not change the module (sizes are compile-time
    constants inside it; a scalar gate is a stride-0 view)."""
    return [kernel(has_h0=initial_state, store_final=output_final_state, interpret=launch.interpreted(device))]


# --------------------------------------------------------------------------------------------
# Configs and the launch plan
# --------------------------------------------------------------------------------------------


def _pads(t_len: int) -> tuple[int, int]:
    """(TG, T_PAD): the Gram tiles' padded length and the dots' (at least 16, tl.dot's minimum)."""
    p = launch.next_power_of_2(max(1, t_len))
    return max(4, p), max(16, p)


def _cfg(*, gram_tile=2048, gram_steps=4, reduce_over=8192, block_kp=16, block_vp=64, block_vs=64, block_k=32,
         block_v=128, v_tiles=1, state_dot=False, warps_prep=4, warps_solve=4, warps=4, stages=2,
         precision="tf32x3", gram_dk=False, fused=False, block_kf=64, block_vf=64, warps_fused=4) -> dict:
    return {"GRAM_DK": gram_dk, "GRAM_TILE": gram_tile, "GRAM_STEPS": gram_steps, "REDUCE_OVER": reduce_over,
            "BLOCK_KP": block_kp, "BLOCK_VP": block_vp, "BLOCK_VS": block_vs, "BLOCK_K": block_k, "BLOCK_V": block_v,
            "V_TILES": v_tiles, "STATE_DOT": state_dot, "WARPS_PREP": warps_prep, "WARPS_SOLVE": warps_solve,
            "num_warps": warps, "num_stages": stages, "DOT_PRECISION": precision,
            "FUSED": fused, "BLOCK_KF": block_kf, "BLOCK_VF": block_vf, "WARPS_FUSED": warps_fused}


def _pick_block_vs(v_pad: int, t_pad: int, n_rows: Optional[int], top: int) -> int:
    """The solve's value block: the largest power of two in [16, top] with a ``[T_PAD, BLOCK_VS]``
    tile of ≤ 4096 elements and, when N is known, about two programs per SM."""
    best = 16
    bv = 16
    while bv <= min(top, max(16, v_pad)):
        if t_pad * bv > 4096:
            break
        if n_rows is not None and n_rows * launch.cdiv(v_pad, bv) < _WANT_PROGRAMS:
            break
        best = bv
        bv *= 2
    return best


def candidate_configs(*, k_dim: int, v_dim: int, dtype: torch.dtype, device, n_rows: Optional[int] = None,
                      t_len: Optional[int] = None) -> list[dict]:
    """Launch configs, best first (the first is the default).

    Keys:
        ``GRAM_TILE``: elements of the prep kernel's pairwise ``[TG, TG, BLOCK_KG]`` Gram tile
        (``BLOCK_KG = GRAM_TILE / TG²`` key channels a step, at least 2); ``GRAM_STEPS``: steps a
        Gram program takes (``SPLIT_G = cdiv(K, BLOCK_KG · GRAM_STEPS)`` programs per row);
        ``GRAM_DK``: the Gram tile held channel-major (``[BLOCK_KG, TG, TG]``, the token scan
        along the middle axis, the channels summed once per program instead of every step);
        ``REDUCE_OVER``: a separate reduce launch sums the Gram partials when ``SPLIT_G · TG²``
        exceeds it (else every solve program sums them); ``BLOCK_KP``, ``BLOCK_VP``: the h0
        projection's ``[BLOCK_KP, BLOCK_VP]`` state tile (key splits chosen to fill the GPU);
        ``BLOCK_VS``: value columns per solve program; ``BLOCK_K``, ``BLOCK_V``: the final-state
        tile per state program, ``V_TILES`` such tiles side by side along V per state program
        (the keys' decays formed once for all of them); ``WARPS_PREP``, ``WARPS_SOLVE``, ``num_warps`` (state kernel):
        warps; ``num_stages`` (prep and state kernels); ``DOT_PRECISION``: ``"ieee"`` (float32
        FMA dots) or ``"tf32x3"``.

    Args:
        k_dim, v_dim: K and V.
        dtype: the inputs' dtype (unused by the current tables: the arithmetic is float32).
        device: the tensors' device (``launch.device_kind``: interpreter, sm90, cuda).
        n_rows: N (batch × value heads), if known: the solve's value block is then chosen so
            that its grid reaches about two programs per SM.
        t_len: the sequence length, if known (default: 16, the short-sequence target).

    GPU rows (sm90 measured on the H100, torch 2.11 / Triton 3.6, at the kernel blogs' shapes
    B=1, T=8, H=2, K×V = 256×8192, 512×16384, 8192×1024, 16384×1024, bf16; device time per kernel
    from ``torch.profiler``; ``benchmarks/results/kda_parallel_tuning.md``): the final state by
    one 3xTF32 ``tl.dot`` per ``32 × 128`` tile at 4 warps (``STATE_DOT``): 8.7 / 26.8 / 24.8 /
    47.6 µs, within 1.1-1.5x of writing the state at 3 TB/s, where the token loop of rank-1
    updates took 33.7 / 104 / 109 / 210 µs (alternatives: the loop, 64-row tiles, several value
    tiles per program: no faster); the Gram partials summed by the reduce launch as soon as there
    are more than two (``REDUCE_OVER`` 128 elements: reduce + solve 8.4 / 8.7 / 11.3 µs at the
    last three shapes where every solve program summing the partials took 12.1 / 25.7 / 46.6 µs);
    ``[TG, TG, BLOCK_KG]`` Gram tiles of 2048 elements, four steps a program (GRAM_STEPS 1, 2,
    16, 64 and tiles of 1024, 4096: slower or no faster); the h0 projection in ``[16, 64]`` state
    tiles, two stages (NOT MEASURED: the blog shapes have no h0).
    """
    if k_dim < 1 or v_dim < 1:
        raise ValueError(f"K and V must be >= 1, got K={k_dim}, V={v_dim}")
    return [dict(c) for c in _candidates(launch.device_kind(device), k_dim, v_dim, n_rows, t_len)]


@functools.lru_cache(maxsize=256)
def _candidates(dev: str, k_dim: int, v_dim: int, n_rows: Optional[int], t_len: Optional[int]) -> tuple:
    """:func:`candidate_configs` by device kind (cached; callers copy the rows)."""
    tg, t_pad = _pads(16 if t_len is None else min(max(1, t_len), MAX_T))
    v_pad = max(16, launch.next_power_of_2(v_dim))
    k_pad = max(16, launch.next_power_of_2(k_dim))
    if dev == "interpreter":
        # small tiles: several (ragged) key and value blocks, split-K partials at test sizes
        bv = min(32, v_pad)
        return (_cfg(gram_tile=4096, gram_steps=2, block_kp=min(64, k_pad), block_vp=bv, block_vs=bv,
                     block_k=min(64, k_pad), block_v=bv, warps=4, precision="ieee"),)
    bvs = _pick_block_vs(v_pad, t_pad, n_rows, 128)
    bk, bv = min(32, k_pad), min(128, v_pad)
    base = dict(block_vs=bvs, block_kp=16, block_vp=min(64, v_pad))
    base = dict(base, reduce_over=128)
    cands = [
        # the final state by one tl.dot (3xTF32 mma) per [32, 128] tile at 4 warps; the Gram
        # partials summed by the reduce launch when there are more than two (T=8)
        _cfg(**base, block_k=bk, block_v=bv, warps=4, state_dot=True),
        # four value tiles a program, deeper prefetch (within 5% of the first)
        _cfg(**base, block_k=bk, block_v=bv, v_tiles=4, warps=4, state_dot=True, stages=3),
        # the final state by the token loop of rank-1 updates (3-4x slower at T=8; no tensor cores)
        _cfg(**base, block_k=bk, block_v=bv, warps=4),
        # the partials summed in every solve program (no reduce launch; slower past two partials)
        _cfg(**dict(base, reduce_over=8192), block_k=bk, block_v=bv, warps=4, state_dot=True),
        # wider h0 projection tiles, deeper prefetch
        _cfg(**dict(base, block_kp=32, block_vp=min(128, v_pad)), block_k=bk, block_v=bv, warps=4, warps_prep=8,
             stages=3, state_dot=True),
        # float32 FMA dots (exact products; more registers, more FMA work in the h0 projection)
        _cfg(**base, block_k=bk, block_v=bv, warps=4, state_dot=True, precision="ieee"),
    ]
    first = _short_config(cands[0], k_pad, v_pad, n_rows, tg)
    if first is not None:
        cands.insert(0, first)
    if dev == "cuda":  # pre-Hopper: less shared memory for prefetched tiles
        for c in cands:
            c["num_stages"] = min(c["num_stages"], 2)
    # dedupe (small K or V collapse rows)
    out: list[dict] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return tuple(out)


def _short_config(base: dict, k_pad: int, v_pad: int, n_rows: Optional[int], tg: int) -> Optional[dict]:
    """The default at T ≤ 16 (``tg``: the Gram tiles' padded length, :func:`_pads`) where it
    differs from ``base`` (the table's general first row), else None. Measured on the H100
    (``benchmarks/kda_parallel_configs.py``, ``benchmarks/results/kda_parallel_configs.md``,
    2026-12-06; device µs at N=2, T=8 unless said):

    - K ≤ 512: one Gram step a program (``GRAM_STEPS`` 1: many short prep programs, their partials
      summed by the reduce launch), 64 value columns a solve program when that still gives one
      program per SM, four value tiles a state program with three stages when the state grid keeps
      one per SM: 256×8192 22.9 → 18.2, 512×16384 48.8 → 41.0, N=16 256×1024 23.4 → 19.5, T=16
      256×8192 28.0 → 21.5. At K = 1024 (N=16, T=16) the same was slower (52.8 → 55.3): not used.
    - K ≥ 8192: the Gram tiles channel-major (``GRAM_DK``), 4096 pairwise terms a step, two steps a
      program at T ≤ 8: 8192×1024 48.6 → 44.9, 16384×1024 77.6 → 71.2; at T=16 (8192×1024) two
      steps were slower (57.5 → 61.6) and the default four 55.9: kept there.

    - K ≤ 64 and V ≤ 128: the one-launch kernel (``FUSED``, ``BLOCK_KF`` 64, ``BLOCK_VF`` 32): N=16,
      64×128 10.1 → 7.0 µs (with h0 11.7 → 9.8), where the four launches of the split kernels are
      most of the time (2026-12-08, ``benchmarks/results/kda_parallel_fused.md``,
      ``kda_parallel_fused_h0.md``). Everywhere else measured it was slower, 1.6-20× (256×8192
      31.5 against 17.0 µs; 8192×1024 672 against 43.7): each program walks all K in a dependent
      chain of key steps (about 3 µs a step measured: the Gram loop, then the state loop), which
      the split kernels spread over many programs (module docstring, "One launch").
    Longer sequences (``TG`` > 16: the Gram tile grows as ``TG²`` a channel) and 1024 < K < 8192
    keep ``base`` (NOT MEASURED with these rows). With ``n_rows`` None (unknown: a symbolic batch)
    the choices made from N keep ``base``'s values (BLOCK_VS as :func:`_pick_block_vs` gives it
    without N, one value tile a state program)."""
    if tg > 16:
        return None
    if k_pad <= 64 and v_pad <= 128:
        return dict(base, GRAM_STEPS=1, FUSED=True, BLOCK_KF=64, BLOCK_VF=32)
    if k_pad <= 512:
        out = dict(base, GRAM_STEPS=1)
        if n_rows is None:
            return out
        if n_rows * launch.cdiv(v_pad, 64) >= _WANT_PROGRAMS // 2:
            out["BLOCK_VS"] = max(out["BLOCK_VS"], 64)
        state_programs = launch.cdiv(k_pad, out["BLOCK_K"]) * launch.cdiv(launch.cdiv(v_pad, out["BLOCK_V"]), 4)
        if n_rows * state_programs >= _WANT_PROGRAMS // 2:
            out.update(V_TILES=4, num_stages=3)
        return out
    if k_pad >= 8192:
        return dict(base, GRAM_DK=True, GRAM_TILE=4096, GRAM_STEPS=2 if tg <= 8 else base["GRAM_STEPS"])
    return None


def _pow2(cfg: dict, key: str, lo: int) -> int:
    val = cfg.get(key)
    if not isinstance(val, int) or isinstance(val, bool) or val < lo or val & (val - 1):
        raise ValueError(f"config {key} must be a power of two >= {lo}, got {val!r}")
    return val


def _normalise(cfg: dict) -> dict:
    """Check a merged config; raise ValueError naming the fix."""
    _pow2(cfg, "GRAM_TILE", 32)
    for key in ("BLOCK_KP", "BLOCK_VP", "BLOCK_VS", "BLOCK_K", "BLOCK_V", "BLOCK_KF", "BLOCK_VF"):
        _pow2(cfg, key, 16)  # tl.dot operands: every dimension >= 16
    for key in ("GRAM_STEPS", "REDUCE_OVER", "V_TILES"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
            raise ValueError(f"config {key} must be an int >= 1, got {cfg.get(key)!r}")
    for key in ("WARPS_PREP", "WARPS_SOLVE", "WARPS_FUSED", "num_warps"):
        if cfg.get(key) not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"config {key} must be a power of two in 1..32, got {cfg.get(key)!r}")
    if not isinstance(cfg.get("num_stages"), int) or cfg["num_stages"] < 1:
        raise ValueError(f"config num_stages must be an int >= 1, got {cfg.get('num_stages')!r}")
    for key in ("STATE_DOT", "GRAM_DK", "FUSED"):
        if not isinstance(cfg.get(key), bool):
            raise ValueError(f"config {key} must be a bool, got {cfg.get(key)!r}")
    if cfg.get("DOT_PRECISION") not in _PRECISIONS:
        raise ValueError(f"config DOT_PRECISION must be one of {_PRECISIONS}, got {cfg.get('DOT_PRECISION')!r}")
    for a, b in (("BLOCK_K", "BLOCK_V"), ("BLOCK_KP", "BLOCK_VP"), ("BLOCK_KF", "BLOCK_VF")):
        if cfg[a] * cfg[b] > TILE_MAX:
            raise ValueError(f"config tile {a} x {b} = {cfg[a]} x {cfg[b]} exceeds {TILE_MAX} float32 elements: "
                             f"use smaller blocks")
    unknown = set(cfg) - set(_cfg())
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(_cfg())}")
    return cfg


def choose_config(*, k_dim: int, v_dim: int, dtype: torch.dtype, device, n_rows: Optional[int] = None,
                  t_len: Optional[int] = None, config: Optional[dict] = None) -> dict:
    """The config :func:`forward` runs: ``config``'s keys over the table's first candidate, checked.

    Raises:
        ValueError: blocks that are not powers of two (≥ 16 for the dot operands, ≥ 32 for
            ``GRAM_TILE``), tiles over :data:`TILE_MAX` elements, bad warps, stages, precision,
            or unknown keys.
    """
    base = candidate_configs(k_dim=k_dim, v_dim=v_dim, dtype=dtype, device=device, n_rows=n_rows, t_len=t_len)[0]
    return _normalise({**base, **(config or {})})


def runs_fused(cfg: dict, t_len: int) -> bool:
    """Whether a call of ``t_len`` tokens under the checked config ``cfg`` runs the one-launch
    kernel: ``FUSED`` asked for and the sequence one ``[16, 16]`` block (``T ≤ 16``)."""
    return bool(cfg["FUSED"]) and _pads(t_len)[1] == 16


def _plan(cfg: dict, n: int, t: int, kd: int, vd: int, has_h0: bool, final: bool) -> dict:
    """The launch sizes of one call: pads, Gram and projection splits, workspace layout (float32
    elements)."""
    tg, t_pad = _pads(t)
    if t_pad * cfg["BLOCK_VS"] > TILE_MAX:
        raise ValueError(f"the solve tile T_PAD x BLOCK_VS = {t_pad} x {cfg['BLOCK_VS']} exceeds {TILE_MAX} float32 "
                         f"elements at T={t}: use a smaller BLOCK_VS")
    block_kg = max(1, min(cfg["GRAM_TILE"] // (tg * tg), launch.next_power_of_2(kd)))
    k_per_g = block_kg * cfg["GRAM_STEPS"]
    split_g = launch.cdiv(kd, k_per_g)
    plan = dict(cfg, TG=tg, T_PAD=t_pad, BLOCK_KG=block_kg, K_PER_G=k_per_g, SPLIT_G=split_g,
                REDUCE=split_g > 1 and split_g * tg * tg > cfg["REDUCE_OVER"])
    # tiles that grow with T get more warps (up to 8): the Gram tile past GRAM_TILE elements (at
    # T = 64 one key channel a step is already 4096), the solve's [T_PAD, T_PAD] and
    # [T_PAD, BLOCK_VS] tiles past T_PAD = 16
    plan["WARPS_PREP"] = max(cfg["WARPS_PREP"], min(8, cfg["WARPS_PREP"] * (tg * tg * block_kg // cfg["GRAM_TILE"])))
    plan["WARPS_SOLVE"] = max(cfg["WARPS_SOLVE"], min(8, cfg["WARPS_SOLVE"] * (t_pad // 16)))
    # the solve sums [SPLIT_B, T_PAD, T_PAD] Gram and [SPLIT_BP, T_PAD, BLOCK_VS] projection partials
    # a step (about 2048 elements: 16 a thread at 4 warps); the reduce [SPLIT_BR, BLOCK_R]
    plan["SPLIT_B"] = max(2, min(launch.next_power_of_2(split_g), 2048 // (t_pad * t_pad)))
    plan["BLOCK_R"] = min(256, 2 * tg * tg)
    plan["SPLIT_BR"] = max(2, min(launch.next_power_of_2(split_g), 8192 // plan["BLOCK_R"]))
    plan["APART"] = n * split_g * 2 * tg * tg
    plan["PPART"] = 0
    # the fused kernel where the call allows it (T <= 16: one [16, 16] block): no workspace; its
    # pairwise fallback takes [16, 16, BLOCK_KG_F] tiles of GRAM_TILE elements
    plan["FUSED"] = runs_fused(cfg, t)
    plan["BLOCK_KG_F"] = max(1, min(cfg["GRAM_TILE"] // 256, launch.next_power_of_2(kd)))
    if has_h0 and not plan["FUSED"]:
        bkp, bvp = cfg["BLOCK_KP"], cfg["BLOCK_VP"]
        nvb = launch.cdiv(vd, bvp)
        split_p = max(1, min(launch.cdiv(_WANT_PROGRAMS, max(1, n * nvb)), launch.cdiv(kd, bkp)))
        k_per_p = launch.cdiv(launch.cdiv(kd, split_p), bkp) * bkp
        split_p = launch.cdiv(kd, k_per_p)
        plan.update(NVB_P=nvb, SPLIT_P=split_p, K_PER_P=k_per_p,
                    SPLIT_BP=max(2, min(launch.next_power_of_2(split_p), 2048 // (t_pad * cfg["BLOCK_VS"]))))
        plan["PPART"] = n * split_p * 2 * t_pad * vd
    plan["DELTA"] = n * t * vd if final else 0
    if plan["FUSED"]:
        plan["APART"] = plan["DELTA"] = 0
    plan["WORK"] = plan["APART"] + plan["PPART"] + plan["DELTA"]
    return plan


def workspace_elements(n: int, t: int, kd: int, vd: int, *, initial_state: bool, output_final_state: bool,
                       config: dict) -> int:
    """Float32 elements of the scratch buffers one :func:`forward` call allocates (Gram partials,
    projection partials with h0, Δ with the final state) under ``config`` (a checked config,
    :func:`choose_config`)."""
    return _plan(config, n, t, kd, vd, initial_state, output_final_state)["WORK"]


# --------------------------------------------------------------------------------------------
# Traffic model
# --------------------------------------------------------------------------------------------


def hbm_bytes(N: int, NQ: int, T: int, K: int, V: int, in_bytes: int, initial_state: bool, final_state: bool, *,
              scalar_gate: bool = False, out_bytes: Optional[int] = None, state_bytes: int = 4,
              fused: bool = False) -> int:
    """Bytes one :func:`forward` call moves through HBM (for a roofline estimate).

    Inputs counted once each (the prep and state kernels each load k and g, and every value block
    of the state kernel loads them again: assumed to hit L2): q and k ``2 · NQ · T · K · in_bytes``; v
    ``N · T · V · in_bytes``; g ``N · T · K · in_bytes`` (``N · T`` with ``scalar_gate``); beta
    ``N · T · in_bytes``; o ``N · T · V · out_bytes`` (default ``in_bytes``). The state: h0 is read
    by the projection and, with the final state, again by the state kernel (``N · K · V ·
    state_bytes`` each); the final state ``N · K · V · 4`` is written once. Workspace: Δ
    (``N · T · V · 4``) written and read once with the final state; the projection's partials
    (``2 · N · T · V · 4`` per key split, counted for one split) written and read once with h0.
    The Gram partials (``O(N · T²)`` per split) are not counted. ``fused`` (the one-launch kernel,
    ``T ≤ 16``): no workspace, and h0 read once (each program reads its ``[K, BLOCK_VF]`` columns in
    its key loop and again in its state loop: assumed to hit L2).
    """
    out_bytes = in_bytes if out_bytes is None else out_bytes
    total = 2 * NQ * T * K * in_bytes
    total += N * T * V * in_bytes + N * T * (1 if scalar_gate else K) * in_bytes + N * T * in_bytes
    total += N * T * V * out_bytes
    state = N * K * V
    if initial_state:
        total += state * state_bytes * (2 if final_state and not fused else 1)
        total += 0 if fused else 2 * (2 * N * T * V * 4)
    if final_state:
        total += state * 4 + (0 if fused else 2 * N * T * V * 4)
    return int(total)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _cached_plan(dev: str, kd: int, vd: int, n: int, t: int, has_h0: bool, final: bool, items: tuple) -> dict:
    base = _candidates(dev, kd, vd, n, t)[0]
    return _plan(_normalise({**base, **dict(items)}), n, t, kd, vd, has_h0, final)


def _resolve(dev: str, kd: int, vd: int, n: int, t: int, has_h0: bool, final: bool, config: Optional[dict]) -> dict:
    """The checked config's launch plan (:func:`choose_config`, :func:`_plan`), cached per sizes and
    config: a call with the same shapes spends no Python time on tables."""
    if not isinstance(n, int):
        # a symbolic row count (dynamic shapes, traced for Inductor): the config from K, V and T
        # alone, the workspaces sized by expressions in N; no branch on N (the split kernels'
        # h0 projection chooses its key split from N: those calls keep the opaque op,
        # patterns/kda_ops._symbolic_forward through serves_symbolic_rows)
        cfg = _normalise({**_candidates(dev, kd, vd, None, t)[0], **dict(config or {})})
        if has_h0 and not runs_fused(cfg, t):
            raise ValueError("the split parallel KDA kernels with an initial state choose their key split from the "
                             "row count, which must be an int (not a symbolic size)")
        return _plan(cfg, n, t, kd, vd, has_h0, final)
    items = tuple(sorted((config or {}).items()))
    try:
        return _cached_plan(dev, kd, vd, n, t, has_h0, final, items)
    except TypeError:  # an unhashable config value: not cached (and checked by _normalise)
        base = _candidates(dev, kd, vd, n, t)[0]
        return _plan(_normalise({**base, **dict(config or {})}), n, t, kd, vd, has_h0, final)


def serves_symbolic_rows(*, k_dim: int, v_dim: int, t_len: int, device, initial_state: bool) -> bool:
    """Whether :func:`forward`'s default kernels for these sizes serve a symbolic row count N
    (dynamic shapes: traced once for every batch size) without choosing anything from N: always
    without an initial state, and with one where the call runs the one-launch kernel (the split
    kernels' h0 projection chooses its key split from N)."""
    if not initial_state:
        return True
    return runs_fused(_candidates(launch.device_kind(device), k_dim, v_dim, None, t_len)[0], t_len)


def _check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype):
    """The launchers' common checks (:func:`fuser.codegen.kda_recurrent.check_inputs`) and
    T ≤ :data:`MAX_T`; returns (NQ, N, T, K, V)."""
    dims = check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype, lead_dims=True)
    if dims[2] > MAX_T:
        raise ValueError(f"the single-chunk parallel KDA kernels take at most MAX_T={MAX_T} tokens, got T={dims[2]}: "
                         f"use the recurrent or chunked kernels (codegen/kda_recurrent.py, the chunked form)")
    return dims


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            scale: float, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
            scalar_gate: bool = False, out_dtype: Optional[torch.dtype] = None,
            config: Optional[dict] = None,
            out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA forward of a short sequence (at most :data:`MAX_T` tokens) as one chunk of the WY form
    (module docstring): 1 to 4 kernel launches, no pass over the tokens through the state.

    Args:
        q, k: ``[NQ, T, K]``. v: ``[N, T, V]``, ``N = NQ · group``: value row n reads q/k row
            ``n // group`` (grouped value heads; batch and heads flattened batch-major). Every
            input may also carry its rows as lead dims, e.g. FLA's ``[B, T, H, *]`` inputs as the
            views ``x.movedim(1, -2)`` (``fuser.codegen.kda_recurrent.check_inputs`` with
            ``lead_dims``): read in place when the lead dims merge into at most two stride
            groups, else copied once (``kda_recurrent.input_rows``).
        g: log-space decay, ``[N, T, K]`` (``[N, T]`` with ``scalar_gate``); ``g ≤ 0`` in practice
            (the decays are formed so that none overflows when ``g ≤ 0``); gates below
            ``kda_chunk.GATE_FLOOR`` are raised to it in the kernels (−inf: a hard reset; NaN
            stays NaN).
        beta: ``[N, T]``, the delta-rule step size.
        scale: multiplies q (float; typically ``K ** -0.5``).
        initial_state: ``[N, K, V]`` or None (zeros: then the state is never read).
        output_final_state: also return the state after the last token.
        scalar_gate: one decay per (row, token) instead of one per key channel.
        out_dtype: o's dtype (default v's).
        config: a launch config (keys of :func:`candidate_configs`, missing keys from the table's
            first row, see :func:`choose_config`); None: the table's default for this device.
        out: o preallocated, written in place, or None (a new contiguous ``[N, T, V]``), as
            :func:`fuser.codegen.kda_recurrent.forward`'s ``out`` (its shapes, strides, dtype and
            checks, :func:`fuser.codegen.kda_recurrent.check_out`).
        Every tensor: float32, float16 or bfloat16 (they may differ), any strides (never copied,
        but for lead dims of three or more stride groups), one device; CPU tensors run in
        Triton's interpreter. Arithmetic in float32.

    Returns:
        ``(o, final_state)``: o ``[N, T, V]`` in ``out_dtype``, contiguous (``out`` itself when given,
        in its own shape); final_state ``[N, K, V]`` float32 contiguous when ``output_final_state``,
        else None.

    Raises:
        ValueError: ``T > MAX_T`` (use the recurrent or chunked kernels), wrong ranks or shapes
            (q/k ``[NQ, T, K]``, v ``[N, T, V]`` with ``N % NQ == 0``, g, beta, initial_state), an
            unsupported dtype, tensors on different devices, a non-finite scale, a config that
            cannot work (:func:`choose_config`), or an ``out`` of the wrong shape, dtype or device,
            or overlapping itself.
    """
    nq, n, t, kd, vd = _check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale}")
    device = q.device
    has_h0 = initial_state is not None
    plan = _resolve(launch.device_kind(device), kd, vd, n, t, has_h0, bool(output_final_state), config)
    o, o_arg, o_rows = out_buffer(out, n, t, vd, out_dtype or v.dtype, device)
    final = launch.empty((n, kd, vd), torch.float32, device) if output_final_state else None
    if n == 0:  # no rows: nothing to launch
        return o, final
    if t == 0:  # no tokens: o is empty, the state is h0 (or zeros)
        if final is not None and has_h0:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final
    if scalar_gate:  # one decay per token: a stride-0 view over the channels, no copy
        g = g.unsqueeze(-1).expand(*g.shape, kd)
    interpret = launch.interpreted(device)
    ins, rows = inputs_rows(q, k, v, g, beta, False)
    _, module = _module(has_h0, bool(output_final_state), interpret)
    # one tensor per workspace, not slices of one buffer: when Inductor launches the kernels, a kernel
    # writing a slice makes its functionalisation copy the slice out and back (six small copy kernels)
    spaces = [torch.empty(plan[key], dtype=torch.float32, device=device)
              for key, used in (("APART", True), ("PPART", has_h0), ("DELTA", final is not None)) if used]
    args = [*ins, o_arg, *spaces] + ([initial_state] if has_h0 else []) + ([final] if final is not None else [])
    with launch.launching(interpret):
        module.launch_kda_parallel(*args, scale=scale, plan=plan, o_rows=o_rows, rows=rows)
    return finish_out(o, o_arg), final
