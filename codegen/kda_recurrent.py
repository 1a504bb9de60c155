"""KDA forward, token by token: the recurrent kernels, their configs and their traffic model.

KDA (Kimi Delta Attention, Kimi Linear, Moonshot AI 2025) is the gated delta rule of Gated DeltaNet
(Yang et al., ICLR 2025) with one decay per key channel instead of one per head. Per value row
``n`` (a flattened (batch, value head) pair) it keeps a float32 state ``S [K, V]`` and, for every
token ``t``::

    S ← diag(exp g_t) S;   v̂ = Sᵀ k_t;   S ← S + β_t k_t (v_t − v̂)ᵀ;   o_t = Sᵀ (scale · q_t)

(the float64 oracle is ``patterns/kda_reference.py``; the scalar-gate variant, Gated DeltaNet's,
multiplies the whole state by one ``exp g_t``). The kernels here walk the tokens in order, one
program per (block of ``BLOCK_V`` value columns, value row): a column block of the state evolves
independently of the others (every operation above mixes rows of S, never columns), so the
programs never communicate. FLA's fused recurrent kernels use the same decomposition; this is our
own implementation (``templates/kda_recurrent.py.jinja``).

Variants (:data:`VARIANTS`, the ``VARIANT`` key of a config):

``"registers"``
    the program's state tile ``[K_pad, BLOCK_V]`` (``K_pad`` = next power of two ≥ K, the
    config's ``BLOCK_K``) stays in registers for the whole sequence. The state touches HBM only
    when ``h0`` is read and the final state written: per token the program reads ``q_t, k_t,
    g_t`` (K each), ``v_t`` (BLOCK_V), ``β_t`` and writes ``o_t``. The loop is software-pipelined
    by hand: token t+1's vectors are loaded while token t is computed (on the H100 this halved
    the time per token, to about 0.5 µs at K=128). Needs ``K_pad · BLOCK_V`` ≤
    :data:`REGISTER_TILE_MAX` elements (the tables' first choices ≤ 8192); the default up to
    K_pad = :data:`REGISTERS_MAX_K`. The tile is held ``[K_pad, BLOCK_V]`` or transposed
    (``STATE_LAYOUT``, :data:`STATE_LAYOUTS`), whichever :data:`REGISTERS_MODEL` says is faster
    at this N and V. Where its time goes at the kernel-blog shape (N=2, K=256, V=8192, T=8: 19 µs
    on the H100): ~4 µs a one-token launch, ~4 µs the final state, 1.6-1.8 µs each further token,
    3.3× a token's FMA floor. Tried and not kept (``benchmarks/results/kda_recurrent_reductions.md``):
    lanes split over keys and values (24 shuffles a token instead of 160; 1.6-5.5× slower: each
    lane then loads and exponentiates its keys' vectors), and the sums over the keys as chains of
    multiply-adds over 32-key tiles (0.74-1.02×).
``"streamed"``
    for K too large for registers (8192, 16384, ...): the column block ``S[:, v-block]`` lives in
    a float32 global workspace, the final-state buffer itself (or a scratch ``[N, K, V]`` buffer
    when the final state is not wanted), and every token walks it in ``[BLOCK_K, BLOCK_V]`` tiles
    twice: pass 1 accumulates ``v̂ = Σ_tiles (k ∘ e^g)ᵀ S`` (reads only), pass 2 updates each tile
    ``S ← e^g S + k δᵀ`` (``δ = β (v − v̂)``), writes it back and accumulates ``o_t`` (both
    passes load tile i+1 while computing tile i; a barrier orders one token's writes before the
    next token's reads). Correct for any K. Traffic: **the whole state is read twice and
    written once per token** (``3 · T · N · K · V · 4`` bytes on top of the inputs;
    :func:`hbm_bytes`), against the registers variant's none and a chunked form's ``O(T / C)``
    state passes; part of it may hit L2 when ``N · K · V · 4`` bytes fit there. Measured on the
    H100: K=8192, V=128, N=8 at about 28 µs per token (96 MB of state traffic per token, 3.4
    TB/s counting L2 hits); the grid has only ``N · cdiv(V, BLOCK_V)`` programs, one value
    block each, so small N leaves SMs idle.

Sizes: ``T`` is a runtime argument (``do_not_specialize``: a new sequence length does not
recompile); ``K``, ``V`` and the blocks are compile-time constants. Any T ≥ 0, K, V ≥ 1 (masked
to the blocks, no power of two needed). Inputs of any strides, their rows as lead dims in up to two
stride groups (``[B, H, T, K]`` views of FLA's ``[B, T, H, K]``: :func:`input_rows`; never copied,
but for three groups that do not merge), float32 / float16 /
bfloat16 each (they may differ); arithmetic in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import launch
from .render import RenderedKernel, render

__all__ = [
    "forward", "kernel", "kernels_for", "candidate_configs", "choose_config", "registers_model_row", "registers_token_us",
    "REGISTERS_MODEL", "STATE_LAYOUTS", "hbm_bytes", "check_out", "check_inputs",
    "check_shapes",
    "input_rows", "inputs_rows", "row_groups",
    "TEMPLATE", "VARIANTS", "REGISTER_TILE_MAX",
]

TEMPLATE = "kda_recurrent.py.jinja"

#: The kernel variants (module docstring).
VARIANTS = ("registers", "streamed")
#: The registers variant's state-tile layouts (config key ``STATE_LAYOUT``): ``"kv"`` holds the
#: tile ``[K_pad, BLOCK_V]`` (Triton spreads the keys over warps: the two reductions over the keys a
#: token needs, ``v̂ = Sᵀ k`` and ``o = Sᵀ q``, cross warps through shared memory); ``"vk"`` holds it
#: transposed, ``[BLOCK_V, K_pad]``: the keys run along a warp's lanes and at one warp each reduction
#: is a few shuffles. Measured on the H100 (``benchmarks/results/kda_recurrent_layout.md``): vk at one
#: warp 1.14-1.31× faster than the best kv config at few rows with large V (the kernel-blog shapes),
#: 0.67× at many small heads; more warps split the keys over warps again. Chosen per shape by
#: :data:`REGISTERS_MODEL`.
STATE_LAYOUTS = ("kv", "vk")

#: The largest register state tile ``K_pad · BLOCK_V`` (float32 elements per program) a config may
#: ask for; the tables' first choices stay at or under 8192.
REGISTER_TILE_MAX = 16384

#: Largest ``K_pad`` the registers variant is the default for; above it the streamed variant comes
#: first (registers stays the second candidate while ``K_pad · 8 <= REGISTER_TILE_MAX``). H100,
#: 2026-11-23, bf16, K=1024, V=128, N=8, T=128: registers (BLOCK_V 8, 8 warps) 0.12 ms, the best
#: streamed config 0.49 ms.
REGISTERS_MAX_K = 1024


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def kernel(*, variant: str, scalar_gate: bool, has_h0: bool, store_final: bool, interpret: bool,
           state_layout: str = "kv") -> RenderedKernel:
    """Render the kernel module of one static variant (``templates/kda_recurrent.py.jinja``).

    Args:
        variant: ``"registers"`` or ``"streamed"``.
        state_layout: the registers tile's layout (:data:`STATE_LAYOUTS`): ``"kv"`` ``[K_pad,
            BLOCK_V]`` or ``"vk"`` transposed; the streamed variant takes ``"kv"`` only.
        scalar_gate: g is ``[N, T]`` (one decay per row and token) instead of ``[N, T, K]``.
        has_h0: an initial state is read (else the state starts at zero).
        store_final: the final state is written (the streamed variant always writes its
            workspace; the flag only changes the module's name there).
        interpret: rendered for Triton's interpreter (CPU tensors).

    Raises:
        ValueError: unknown variant or layout, or ``"vk"`` with the streamed variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    streamed = variant == "streamed"
    if streamed and state_layout != "kv":
        raise ValueError("the streamed variant walks its state in [BLOCK_K, BLOCK_V] tiles: STATE_LAYOUT must be 'kv'")
    store_final = bool(store_final) or streamed
    name = ("kda_recurrent_" + variant + ("_vk" if state_layout == "vk" else "") + ("_scalar" if scalar_gate else "")
            + ("_h0" if has_h0 else "") + ("_ht" if store_final and not streamed else "") + ("_interp" if interpret else ""))
    return render(TEMPLATE, name, variant=variant, scalar_gate=bool(scalar_gate), has_h0=bool(has_h0),
                  store_final=store_final, interpret=bool(interpret), state_layout=state_layout)


@functools.lru_cache(maxsize=None)
def _module(variant: str, scalar_gate: bool, has_h0: bool, store_final: bool, interpret: bool,
            state_layout: str = "kv"):
    """The imported module of one static variant (rendered once per process)."""
    k = kernel(variant=variant, scalar_gate=scalar_gate, has_h0=has_h0, store_final=store_final, interpret=interpret,
               state_layout=state_layout)
    return k, launch.kernel_module(k, interpret)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def _cfg(variant: str, block_k: int, block_v: int, warps: int, stages: int, layout: str = "kv") -> dict:
    return {"VARIANT": variant, "BLOCK_K": block_k, "BLOCK_V": block_v, "num_warps": warps, "num_stages": stages,
            "STATE_LAYOUT": layout}


# GPU tables. Measured on the H100 (sm90) on 2026-11-23, bf16 inputs, g float32, compiled with
# Triton 3.6, the hand-pipelined kernels of this template (ms per call, best first):
#   registers K=128,  V=128, N=32, T=1024: BV 8 / 2 warps 0.534, BV 8 / 1 warp 0.545, BV 16 / 4 0.628,
#             BV 8 / 8 1.01, BV 32 / 4 0.777 (before the hand pipelining: 1.09 at best, ~1.3 typical)
#   registers K=256,  V=256, N=32, T=512:  BV 16 / 2 0.511, BV 8 / 1 0.516, BV 16 / 4 0.552, BV 8 / 2 0.625
#   registers K=512,  V=128, N=8,  T=256:  BV 8 / 4 0.162, BV 8 / 8 0.198, BV 16 / 4 0.206, BV 8 / 2 0.278
#   registers K=1024, V=128, N=8,  T=128:  BV 8 / 8 0.120, BV 8 / 4 0.163 (streamed at best 0.487)
#   streamed  K=8192, V=128, N=8,  T=32:   (BK 1024, BV 8, 8 warps) 0.908, (512, 8, 8) 1.07,
#             (512, 16, 8) 1.22, (256, 8, 4) 1.47; 16384-element tiles at 4 warps spill (20-30 ms)
#   streamed  K=16384, V=128, N=4, T=16:   (1024, 8, 8) 0.817, (1024, 8, 4) 0.949, (512, 8, 8) 1.04
# num_stages made no difference (the loads are pipelined by hand). BLOCK_V 8 was best or within
# 3% at these shapes (few programs); past one wave of programs wider blocks win (REGISTERS_MODEL,
# which orders the configs when N is known; this table is the order without it).
# The "cuda" rows (other GPUs) take the same configs, NOT MEASURED. K <= 64: NOT MEASURED.
_REGS_TABLE = {  # K_pad -> registers configs (BLOCK_V, num_warps), best first
    4: [(8, 1), (16, 1)], 8: [(8, 1), (16, 1)], 16: [(8, 1), (16, 1)], 32: [(8, 1), (16, 1)],
    64: [(8, 1), (16, 1), (8, 2)],
    128: [(8, 2), (8, 1), (16, 4)],
    256: [(8, 1), (16, 2), (16, 4)],
    512: [(8, 4), (8, 8), (16, 4)],
    1024: [(8, 8), (8, 4)],
    2048: [(8, 8)],  # 16384 elements: a second candidate only, NOT MEASURED
}
_STREAMED = [(1024, 8, 8), (512, 8, 8), (512, 16, 8)]  # (BLOCK_K, BLOCK_V, num_warps), best first

#: The registers variant's device time per launch config, for the shape at hand: ``K_pad ->
#: {(BLOCK_V, num_warps, STATE_LAYOUT): (resident programs per SM, fixed µs, µs per token)}``, the time being
#: ``fixed + T · per_token · max(1, N · cdiv(V, BLOCK_V) / (resident · SMs))`` (``patterns/kda_plans``' estimate):
#: the programs run in waves of a few per SM, each walking the T tokens. MEASURED on the H100
#: (torch 2.11 / Triton 3.6, 2026-11-24; bf16 inputs, g float32, the final state returned;
#: ``benchmarks/kda_recurrent_configs.py``, ``benchmarks/results/kda_recurrent_configs.md``):
#: 1218 device times at N ∈ {2, 16}, T ∈ {8, 64, 256}, V ∈ {128 … 16384}, K ∈ {64 … 1024}, the
#: fit within 2-9% (median) and 8-19% (worst) per config. Configs with more than 128 state elements
#: a thread were not tried (they spill: K=256, BLOCK_V 32, 1 warp ran 1055 µs where 4 warps took 47);
#: K=512, BLOCK_V 16, 2 warps spills and is left out. :func:`candidate_configs` orders the registers
#: configs by this model when N is known: against BLOCK_V 8 everywhere (the table above) the
#: pick is 1.10x faster at the median, up to 1.77x (K=64, V=8192, N=16, T=64: 296 -> 167 µs, BLOCK_V 64,
#: 1 warp), never more than 8% slower than the measured fastest. The "cuda" kind (other GPUs) uses
#: it with its own SM count, NOT MEASURED; K_pad below 64 keeps :data:`_REGS_TABLE`'s order, NOT MEASURED.
#: The ``"vk"`` rows (the state tile transposed, one warp; :data:`STATE_LAYOUTS`): MEASURED on the H100
#: 2026-12-06 at the same shapes and inputs (``benchmarks/results/kda_recurrent_configs_vk.json``, 210
#: device times; the kv rows re-measured at K=256 the same day ran 0.99× their committed times, median),
#: fit within 1-9% (median) and 7-21% (worst). With them the pick is never slower than the kv rows'
#: pick and 1.06-1.29× faster at K_pad 256, 1.23-1.50× at 512, where N · V ≥ 16384 value columns
#: (geometric mean 1.06 over the 105 shapes; ``benchmarks/results/kda_recurrent_configs_vk.md``); at
#: fewer columns, and at K_pad ≤ 128, a kv config stays first.
REGISTERS_MODEL = {
    64: {
        (8, 1, "kv"): (7.03, 2.42, 0.282),
        (8, 2, "kv"): (5.81, 2.4, 0.361),
        (8, 4, "kv"): (3.28, 2.55, 0.367),
        (8, 8, "kv"): (2.46, 2.35, 0.426),
        (16, 1, "kv"): (5.81, 2.57, 0.379),
        (16, 2, "kv"): (4.8, 2.39, 0.407),
        (16, 4, "kv"): (2.71, 2.64, 0.488),
        (16, 8, "kv"): (1.85, 2.46, 0.473),
        (32, 1, "kv"): (4.8, 3.01, 0.568),
        (32, 2, "kv"): (3.28, 2.83, 0.481),
        (32, 4, "kv"): (1.85, 2.53, 0.534),
        (32, 8, "kv"): (1.39, 2.6, 0.603),
        (64, 1, "kv"): (3.97, 3.29, 0.721),
        (64, 2, "kv"): (2.46, 3, 0.579),
        (64, 4, "kv"): (1.39, 2.9, 0.87),
        (64, 8, "kv"): (1.26, 2.94, 0.846),
        (8, 1, "vk"): (7.73, 3.65, 0.557),
        (16, 1, "vk"): (10.3, 3.84, 1.41),
        (32, 1, "vk"): (5.28, 3.95, 1.29),
        (64, 1, "vk"): (4.36, 5.62, 2.25),
    },
    128: {
        (8, 1, "kv"): (4.8, 2.84, 0.373),
        (8, 2, "kv"): (4.8, 2.71, 0.431),
        (8, 4, "kv"): (3.6, 2.71, 0.448),
        (8, 8, "kv"): (2.24, 2.54, 0.531),
        (16, 1, "kv"): (4.8, 2.92, 0.622),
        (16, 2, "kv"): (3.28, 2.64, 0.459),
        (16, 4, "kv"): (2.71, 2.59, 0.468),
        (16, 8, "kv"): (1.68, 2.61, 0.67),
        (32, 1, "kv"): (5.28, 3.06, 1.53),
        (32, 2, "kv"): (2.46, 3.17, 0.659),
        (32, 4, "kv"): (2.04, 2.64, 0.568),
        (32, 8, "kv"): (1.39, 2.93, 0.96),
        (64, 2, "kv"): (2.46, 4.06, 1.5),
        (64, 4, "kv"): (1.39, 3.28, 0.757),
        (64, 8, "kv"): (0.949, 3.52, 1.48),
        (8, 1, "vk"): (5.28, 4.57, 0.517),
        (16, 1, "vk"): (4.8, 4.52, 0.836),
        (32, 1, "vk"): (4.8, 5.22, 1.49),
    },
    256: {
        (8, 1, "kv"): (4.36, 4.62, 0.625),
        (8, 2, "kv"): (3.6, 4.52, 0.571),
        (8, 4, "kv"): (2.98, 4.4, 0.539),
        (8, 8, "kv"): (2.24, 4.43, 0.667),
        (16, 1, "kv"): (2.98, 5.49, 1.81),
        (16, 2, "kv"): (2.24, 5.37, 0.664),
        (16, 4, "kv"): (2.04, 4.67, 0.57),
        (16, 8, "kv"): (1.53, 4.68, 0.611),
        (32, 2, "kv"): (2.71, 5.67, 2.1),
        (32, 4, "kv"): (1.26, 4.73, 0.736),
        (32, 8, "kv"): (1.26, 5, 0.864),
        (64, 4, "kv"): (1.15, 6.34, 1.54),
        (64, 8, "kv"): (0.863, 6.31, 1.1),
        (8, 1, "vk"): (4.8, 4.71, 0.643),
        (16, 1, "vk"): (4.36, 5.09, 1.0),
    },
    512: {
        (8, 1, "kv"): (3.6, 5, 1.93),
        (8, 2, "kv"): (2.46, 5.74, 0.809),
        (8, 4, "kv"): (1.53, 5.71, 0.537),
        (8, 8, "kv"): (1.53, 5.45, 0.641),
        (16, 4, "kv"): (1.26, 5.06, 0.783),
        (16, 8, "kv"): (1.15, 5.08, 0.768),
        (32, 4, "kv"): (1.26, 6.53, 1.77),
        (32, 8, "kv"): (0.863, 6.27, 1.24),
        (8, 1, "vk"): (4.36, 5.3, 0.944),
    },
    1024: {
        (8, 2, "kv"): (2.24, 7.25, 2.1),
        (8, 4, "kv"): (1.15, 6.02, 0.875),
        (8, 8, "kv"): (0.863, 6.21, 0.854),
        (16, 4, "kv"): (1.26, 6.83, 2.09),
        (16, 8, "kv"): (0.863, 6.45, 1.2),
    },
}


def registers_model_row(k_pad: int, block_v: int, num_warps: int, layout: str = "kv") -> tuple[float, float, float]:
    """``(resident programs per SM, fixed µs, µs per token)`` of a registers config
    (:data:`REGISTERS_MODEL`): K_pad clamped into the measured 64 … 1024; a config not measured
    takes the measured row at that K_pad of its layout (else of ``"kv"``) with the nearest BLOCK_V,
    then the nearest warps (an estimate, NOT MEASURED for that config)."""
    table = REGISTERS_MODEL[min(max(k_pad, 64), 1024)]
    if (block_v, num_warps, layout) in table:
        return table[(block_v, num_warps, layout)]
    same = [c for c in table if c[2] == layout] or [c for c in table if c[2] == "kv"]
    near = min(same, key=lambda c: (abs(math.log2(c[0] / block_v)), abs(math.log2(c[1] / num_warps))))
    return table[near]


def registers_token_us(row: tuple[float, float, float], *, block_v: int, n_rows: int, v_dim: int,
                       sm_count: int) -> float:
    """Modelled µs of one token step of a registers config whose :data:`REGISTERS_MODEL` row is
    ``row`` (resident programs per SM, fixed µs, µs per token): ``per_token · max(1, N · cdiv(V,
    BLOCK_V) / (resident · SMs))``, the programs running in waves. A call takes ``fixed + T ·``
    this; the configs are ordered by it (``benchmarks/kda_recurrent_configs.py`` fits and checks
    the rows with the same formula)."""
    resident, _, token = row
    return token * max(1.0, n_rows * -(-v_dim // block_v) / (resident * sm_count))


@functools.lru_cache(maxsize=4096)
def _registers_order(k_pad: int, v_dim: int, n_rows: int, sm_count: int) -> tuple:
    """:data:`REGISTERS_MODEL`'s configs at ``k_pad`` (``BLOCK_V`` no wider than V's padded
    size), fastest first by the time of a token (``per_token · waves``), then the fixed part.
    Independent of T, so a new sequence length never changes the config (nor compiles a kernel);
    over the measured shapes ordering by the whole time at the real T picked no better (regret
    1.005 against 1.004)."""
    v_pad = max(4, launch.next_power_of_2(v_dim))
    table = REGISTERS_MODEL[k_pad]
    cfgs = [c for c in table if c[0] <= max(8, v_pad)]
    return tuple(sorted(cfgs, key=lambda c: (registers_token_us(table[c], block_v=c[0], n_rows=n_rows, v_dim=v_dim,
                                                                sm_count=sm_count), table[c][1])))


def candidate_configs(*, k_dim: int, v_dim: int, dtype: torch.dtype, device,
                      n_rows: Optional[int] = None) -> list[dict]:
    """Launch configs, best first (the first is the default).

    Keys: ``VARIANT`` (``"registers"`` / ``"streamed"``), ``BLOCK_K`` (registers: the whole key
    dimension, ``max(4, next_power_of_2(k_dim))``; streamed: the key tile), ``BLOCK_V`` (value
    columns per program), ``num_warps``, ``num_stages``, ``STATE_LAYOUT`` (:data:`STATE_LAYOUTS`;
    ``"kv"`` for the streamed variant). Blocks are powers of two >= 4: BLOCK_V is
    8 in most rows, below ``launch.check_config``'s 16 (these kernels have no ``tl.dot``).

    Args:
        k_dim, v_dim: K and V.
        dtype: the inputs' dtype (unused by the current tables: the state is float32 either way).
        device: the tensors' device (``launch.device_kind``: interpreter, sm90, cuda).
        n_rows: N, the value rows (batch × value heads), if known. Then, on a GPU, at K_pad
            64 … 1024, the registers configs are those of :data:`REGISTERS_MODEL` ordered by
            their modelled time of a token at this N and V (how many programs ``N · cdiv(V,
            BLOCK_V)`` run in how many waves decides BLOCK_V and the warps; not T: a new length
            keeps the config); otherwise :data:`_REGS_TABLE`'s order (BLOCK_V 8: the most
            programs). A new N may pick another config: one more kernel compiled, once.

    The registers variant comes first up to ``K_pad = REGISTERS_MAX_K`` (1024), the streamed one
    above. sm90 rows measured on the H100 (see the tables' comments); "cuda" rows are the same,
    not measured.
    """
    if k_dim < 1 or v_dim < 1:
        raise ValueError(f"K and V must be >= 1, got K={k_dim}, V={v_dim}")
    dev = launch.device_kind(device)
    k_pad = max(4, launch.next_power_of_2(k_dim))
    v_pad = max(4, launch.next_power_of_2(v_dim))
    if dev == "interpreter":
        # small tiles: several (ragged) value blocks and, streamed, several key tiles at test sizes
        bv = min(16, max(8, v_pad))
        cands = []
        if k_pad * bv <= REGISTER_TILE_MAX:
            cands.append(_cfg("registers", k_pad, bv, 4, 1))
        cands.append(_cfg("streamed", min(k_pad, max(16, k_pad // 4)), bv, 4, 1))
        if k_pad > REGISTERS_MAX_K:
            cands.reverse()
        return cands

    regs: list[dict] = []
    if isinstance(n_rows, int) and n_rows > 0 and k_pad in REGISTERS_MODEL:  # a SymInt: no guard on N
        order = _registers_order(k_pad, int(v_dim), n_rows, launch.sm_count(device))
    else:
        order = _REGS_TABLE.get(k_pad, [])
    for bv, warps, *layout in order:
        bv = min(bv, v_pad)
        cfg = _cfg("registers", k_pad, bv, warps, 1, *layout)
        if k_pad * bv <= REGISTER_TILE_MAX and cfg not in regs:
            regs.append(cfg)
    streamed: list[dict] = []
    for bk, bv, warps in _STREAMED:
        cfg = _cfg("streamed", min(bk, k_pad), min(bv, v_pad), warps, 2)
        if cfg not in streamed:
            streamed.append(cfg)
    return regs + streamed if (regs and k_pad <= REGISTERS_MAX_K) else streamed + regs


def _normalise(cfg: dict, k_dim: int) -> dict:
    """Check a merged config; raise ValueError naming the fix."""
    variant = cfg.get("VARIANT")
    if variant not in VARIANTS:
        raise ValueError(f"config VARIANT must be one of {VARIANTS}, got {variant!r}")
    for key in ("BLOCK_K", "BLOCK_V"):
        val = cfg.get(key)
        if not isinstance(val, int) or isinstance(val, bool) or val < 4 or val & (val - 1):
            raise ValueError(f"config {key} must be a power of two >= 4, got {val!r}")
    if cfg.get("STATE_LAYOUT") not in STATE_LAYOUTS:
        raise ValueError(f"config STATE_LAYOUT must be one of {STATE_LAYOUTS}, got {cfg.get('STATE_LAYOUT')!r}")
    if variant == "streamed" and cfg["STATE_LAYOUT"] != "kv":
        raise ValueError("the streamed variant walks its state in [BLOCK_K, BLOCK_V] tiles: STATE_LAYOUT must be "
                         "'kv' (or VARIANT='registers' for the transposed tile)")
    if cfg.get("num_warps") not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"config num_warps must be a power of two in 1..32, got {cfg.get('num_warps')!r}")
    if not isinstance(cfg.get("num_stages"), int) or cfg["num_stages"] < 1:
        raise ValueError(f"config num_stages must be an int >= 1, got {cfg.get('num_stages')!r}")
    if variant == "registers":
        k_pad = max(4, launch.next_power_of_2(k_dim))
        if cfg["BLOCK_K"] != k_pad:
            raise ValueError(f"the registers variant holds the whole key dimension: BLOCK_K must be "
                             f"next_power_of_2(K) = {k_pad} for K={k_dim} (or leave BLOCK_K out), got {cfg['BLOCK_K']}")
        if k_pad * cfg["BLOCK_V"] > REGISTER_TILE_MAX:
            raise ValueError(f"the registers variant's state tile K_pad x BLOCK_V = {k_pad} x {cfg['BLOCK_V']} exceeds "
                             f"{REGISTER_TILE_MAX} float32 elements: use a smaller BLOCK_V or VARIANT='streamed'")
    return cfg


def choose_config(*, k_dim: int, v_dim: int, dtype: torch.dtype, device, n_rows: Optional[int] = None,
                  config: Optional[dict] = None) -> dict:
    """The config :func:`forward` runs: ``config``'s keys over the candidate of its variant that
    agrees with most of them (the first such in the table's order; ``config=None``: the default
    candidate; without ``VARIANT``: the default's variant), checked.

    For the registers variant ``BLOCK_K`` is always ``next_power_of_2(k_dim)`` (≥ 4); a config
    naming only ``{"VARIANT": "streamed", "BLOCK_K": 16}`` takes BLOCK_V, warps and stages from
    the table's first streamed row. A partial config takes its missing keys from a measured row
    like it: ``{"BLOCK_V": 16, "num_warps": 4}`` at K = 256 gets the layout of the table's 16 / 4
    row (``"kv"``), not that of the first row (which may hold the tile transposed, fast at one
    warp only).

    Raises:
        ValueError: unknown variant, blocks that are not powers of two ≥ 4, a registers
            ``BLOCK_K`` other than K's padded size, a registers tile over
            :data:`REGISTER_TILE_MAX` elements, bad warps or stages.
    """
    cands = candidate_configs(k_dim=k_dim, v_dim=v_dim, dtype=dtype, device=device, n_rows=n_rows)
    if not config:
        return _normalise(dict(cands[0]), k_dim)
    variant = config.get("VARIANT", cands[0]["VARIANT"])
    same = [c for c in cands if c["VARIANT"] == variant]
    # max() keeps the first of equals: the table's order decides among rows agreeing alike
    base = max(same, key=lambda c: sum(c.get(key) == val for key, val in config.items()), default=None)
    if base is None:
        k_pad = max(4, launch.next_power_of_2(k_dim))
        bv = min(16, max(4, launch.next_power_of_2(v_dim)))
        base = _cfg(str(variant), k_pad if variant == "registers" else min(64, k_pad), bv, 4, 2)
    if variant == "registers":
        base = dict(base, BLOCK_K=max(4, launch.next_power_of_2(k_dim)))
    return _normalise({**base, **config}, k_dim)


def kernels_for(*, k_dim: int, v_dim: int, dtype: torch.dtype, device, scalar_gate: bool = False,
                initial_state: bool = False, output_final_state: bool = False, config: Optional[dict] = None,
                n_rows: Optional[int] = None) -> list[RenderedKernel]:
    """The kernel modules :func:`forward` runs for these sizes and flags (one), for reports."""
    cfg = choose_config(k_dim=k_dim, v_dim=v_dim, dtype=dtype, device=device, n_rows=n_rows, config=config)
    return [kernel(variant=cfg["VARIANT"], scalar_gate=scalar_gate, has_h0=initial_state,
                   store_final=output_final_state, interpret=launch.interpreted(device),
                   state_layout=cfg["STATE_LAYOUT"])]


# --------------------------------------------------------------------------------------------
# Traffic model
# --------------------------------------------------------------------------------------------


def hbm_bytes(N: int, NQ: int, T: int, K: int, V: int, in_bytes: int, variant: str, initial_state: bool,
              final_state: bool, *, scalar_gate: bool = False, out_bytes: Optional[int] = None,
              state_bytes: int = 4) -> int:
    """Bytes one :func:`forward` call moves through HBM (for a roofline estimate).

    Counted once each (the ``cdiv(V, BLOCK_V)`` programs of a row, and the ``N / NQ`` rows of a
    q/k row, re-read the same q, k, g vectors: assumed to hit L2): q and k ``2 · NQ · T · K ·
    in_bytes``; v ``N · T · V · in_bytes``; g ``N · T · K · in_bytes`` (``N · T`` with
    ``scalar_gate``); beta ``N · T · in_bytes``; o ``N · T · V · out_bytes`` (default
    ``in_bytes``); h0 ``N · K · V · state_bytes`` when ``initial_state`` (its dtype's size, 4 for
    float32); the final state ``N · K · V · 4`` when ``final_state``.

    ``"streamed"`` adds the workspace: written once at the start and, per token, read twice and
    written once: ``(1 + 3 T) · N · K · V · 4`` (the final state is the workspace: not counted
    twice). An upper bound: the part that stays in L2 (``N · K · V · 4`` bytes small enough) costs
    less.

    Raises:
        ValueError: unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    out_bytes = in_bytes if out_bytes is None else out_bytes
    total = 2 * NQ * T * K * in_bytes
    total += N * T * V * in_bytes + N * T * (1 if scalar_gate else K) * in_bytes + N * T * in_bytes
    total += N * T * V * out_bytes
    state = N * K * V * 4
    if initial_state:
        total += N * K * V * state_bytes
    if variant == "streamed":
        total += (1 + 3 * T) * state
    elif final_state:
        total += state
    return int(total)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------


def _prod(dims) -> int:
    # no int(): a symbolic size (dynamic shapes, while the op is traced for Inductor) stays symbolic
    out = 1
    for d in dims:
        out *= d
    return out


def check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype, *, lead_dims: bool = False):
    """The checks every KDA forward launcher makes of the interface's shapes, dtypes and devices
    (q, k ``[NQ, T, K]``, v ``[N, T, V]``, g ``[N, T, K]`` or ``[N, T]``, beta ``[N, T]``, h0
    ``[N, K, V]``; float32/float16/bfloat16 on one device).

    With ``lead_dims`` (the launchers that address their inputs' rows as stride groups,
    :func:`input_rows`) each input may instead carry its rows as several lead dims, row ``n`` the
    row-major index over them: q, k ``[*lead_q, T, K]`` (one shape, ``prod(lead_q) = NQ``), v
    ``[*lead, T, V]`` (``prod(lead) = N``), g ``[*lead_g, T, K]`` (``[*lead_g, T]`` with
    ``scalar_gate``) and beta ``[*lead_b, T]`` with ``prod(lead_g) = prod(lead_b) = N`` (e.g.
    every input of FLA's ``[B, T, H, *]`` layout ``movedim(1, -2)``-ed: ``[B, H, T, *]``, a view).
    At least one lead dim each (one row: ``[1, T, K]``, as ``out=`` takes it). h0 stays ``[N, K,
    V]``.

    Returns:
        ``(NQ, N, T, K, V)``.

    Raises:
        ValueError: naming the input and the fix.
    """
    nq, n, t, kd, vd = check_shapes(q, k, v, g, beta, initial_state, scalar_gate, lead_dims=lead_dims)
    if kd < 1 or vd < 1:
        raise ValueError(f"K and V must be >= 1, got K={kd}, V={vd}")
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if initial_state is not None:
        tensors["initial_state"] = initial_state
    for name, x in tensors.items():
        if x.dtype not in launch.DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; supported: float32, float16, bfloat16 (cast it first)")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: put every input on one device")
    if out_dtype is not None and out_dtype not in launch.DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    return nq, n, t, kd, vd


def check_shapes(q, k, v, g, beta, initial_state, scalar_gate, *, lead_dims: bool = False):
    """The shape checks of :func:`check_inputs` (and of the KDA backward, ``kda_bwd``): q, k,
    v, g, beta tensors of the interface's shapes (with ``lead_dims``, their lead-dim forms),
    ``initial_state`` ``[N, K, V]`` or None. No dtype, device or size (K, V ≥ 1) check.

    Returns:
        ``(NQ, N, T, K, V)``.

    Raises:
        ValueError: naming the input and the fix.
    """
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    lead_note = " (or [*lead, T, *] with prod(lead) = the rows, at least one lead dim)" if lead_dims else ""
    if (q.dim() < 3 if lead_dims else q.dim() != 3) or k.shape != q.shape:
        raise ValueError(f"q and k must be [NQ, T, K]{lead_note} of one shape (flatten batch and heads into NQ), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    nq, t, kd = _prod(q.shape[:-2]), q.shape[-2], q.shape[-1]
    if (v.dim() < 3 if lead_dims else v.dim() != 3) or v.shape[-2] != t:
        raise ValueError(f"v must be [N, T={t}, V]{lead_note} with N a multiple of NQ={nq} (value row n reads "
                         f"q/k row n // (N // NQ)), got {tuple(v.shape)}")
    n, vd = _prod(v.shape[:-2]), v.shape[-1]
    if n % nq if nq else n:
        raise ValueError(f"v must be [N, T={t}, V]{lead_note} with N a multiple of NQ={nq} (value row n reads "
                         f"q/k row n // (N // NQ)), got {tuple(v.shape)}")
    want_g = (n, t) if scalar_gate else (n, t, kd)
    g_tail = g.dim() - (1 if scalar_gate else 2)
    g_ok = (tuple(g.shape) == want_g if not lead_dims else
            g_tail >= 1 and _prod(g.shape[:g_tail]) == n and tuple(g.shape[g_tail:]) == want_g[1:])
    if not g_ok:
        raise ValueError(f"g must be {'[N, T]' if scalar_gate else '[N, T, K]'} = {want_g}{lead_note}"
                         f"{' (scalar_gate=True)' if scalar_gate else ' (pass scalar_gate=True for one decay per token)'}"
                         f", got {tuple(g.shape)}")
    b_ok = (tuple(beta.shape) == (n, t) if not lead_dims else
            beta.dim() >= 2 and _prod(beta.shape[:-1]) == n and beta.shape[-1] == t)
    if not b_ok:
        raise ValueError(f"beta must be [N, T] = {(n, t)}{lead_note}, got {tuple(beta.shape)}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (n, kd, vd):
            shape = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"initial_state must be [N, K, V] = {(n, kd, vd)} or None, got {shape}")
    return nq, n, t, kd, vd


def row_groups(shape, strides) -> Optional[tuple[int, int, int]]:
    """The rows of a tensor's lead dims (``shape``, ``strides``: the dims before ``[T, V]``; row
    ``n`` is their row-major index) as at most two stride groups: ``(n_inner, stride_outer,
    stride_inner)`` with row ``n`` at ``(n // n_inner) · stride_outer + (n % n_inner) ·
    stride_inner`` elements, or None when the dims do not merge into two groups (dims of size 1
    are dropped; neighbours merge when the outer stride is the inner one times the inner size).

    Examples: ``[B, H]`` contiguous -> ``(1, s_H, 0)`` (one group); ``[B, H]`` of a ``[B, T, H, V]``
    tensor (strides ``T·H·V, V``) -> ``(H, T·H·V, V)``; three dims none of which merge -> None.
    """
    groups: list[list[int]] = []  # [size, stride], outermost first
    for size, stride in zip(shape, strides):
        if size == 1:
            continue
        if groups and groups[-1][1] == stride * size:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if not groups:
        return 1, 0, 0
    if len(groups) == 1:
        return 1, groups[0][1], 0
    if len(groups) == 2:
        return groups[1][0], groups[0][1], groups[1][1]
    return None


def input_rows(x: torch.Tensor, tail: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """How the kernels address the rows of an input ``x`` ``[*lead, T, F]`` (``tail = 2``: q, k,
    v, a per-channel g, do) or ``[*lead, T]`` (``tail = 1``: beta, a scalar g), row ``n`` the
    row-major index over ``lead``: ``(x_arg, (n_inner, stride_outer, stride_inner))`` with row
    ``n`` of ``x_arg`` at ``(n // n_inner) · stride_outer + (n % n_inner) · stride_inner``
    elements (the template macro ``row_offset``), its time and feature strides
    ``x_arg.stride(-2)``, ``x_arg.stride(-1)`` (``[*lead, T]``: ``stride(-1)`` the time's).

    No copy when the lead dims merge into at most two stride groups (:func:`row_groups`): any
    ``[N, T, F]`` tensor; ``[B, T, H, F]`` with the time axis moved, ``[B, H, T, F]`` (FLA's
    layout as a view, rows ``b·H + h``: ``(H, T·H·F, F)``); ``[B, H, T, F]`` itself; a time slice
    ``narrow(-2, t0, T)`` of any of them (its offset is the tensor's own); a stride-0 broadcast
    lead dim (rows that share memory are only read). Otherwise (three groups that do not merge,
    e.g. ``permute`` of three lead dims) ``x_arg`` is a contiguous copy ``[N, T(, F)]`` and the
    rows one group: never wrong, one copy. Zero-size inputs are returned as they are (nothing is
    launched on them).

    Raises:
        ValueError: ``x`` has fewer than ``tail`` dims.
    """
    lead = x.dim() - tail
    if lead < 0:
        raise ValueError(f"an input of {tail} trailing dims has shape {tuple(x.shape)}")
    rows = row_groups(x.shape[:lead], x.stride()[:lead])
    if rows is None:
        x = x.reshape(_prod(x.shape[:lead]), *x.shape[lead:]).contiguous()
        rows = (1, x.stride(0), 0)
    return x, rows


def inputs_rows(q, k, v, g, beta, scalar_gate: bool):
    """:func:`input_rows` of the five forward inputs: ``(tensors, rows)``, each a 5-tuple in the
    order q, k, v, g, beta (the launchers' ``rows=``)."""
    pairs = [input_rows(x, tail) for x, tail in ((q, 2), (k, 2), (v, 2), (g, 1 if scalar_gate else 2), (beta, 1))]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def check_out(out, *, n: int, t: int, v_dim: int, dtype: torch.dtype, device) -> Optional[tuple[int, int, int]]:
    """Check a preallocated ``out=`` of the KDA forward launchers and say how the kernels address
    it.

    ``out``: ``[*lead, T, V]`` with ``prod(lead) == N`` (at least one lead dim; ``[N, T, V]`` is
    the plain case), row ``n`` the row-major index over ``lead``; any strides, but no stride 0
    on a dim longer than 1 (the rows would overlap); dtype ``dtype`` (o's: ``out_dtype``, else
    v's), on ``device``.

    Returns:
        ``(n_inner, stride_outer, stride_inner)`` of :func:`row_groups` (the kernels address row
        ``n`` as ``(n // n_inner) · stride_outer + (n % n_inner) · stride_inner``), or None when
        the lead dims do not fit two stride groups: the launcher then writes a contiguous
        temporary and copies it into ``out``.

    Raises:
        ValueError: ``out`` not a tensor, of the wrong shape, dtype or device, or overlapping.
    """
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor [*lead, T, V] or None, got {type(out).__name__}")
    shape = out.shape
    lead = shape[:-2]
    rows = 1
    for size in lead:
        rows *= size
    if out.dim() < 3 or tuple(shape[-2:]) != (t, v_dim) or rows != n:
        raise ValueError(f"out must be [N, T, V] = {(n, t, v_dim)} (or [*lead, T, V] with prod(lead) = N = {n}), "
                         f"got {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}, o's is {dtype} (out_dtype, else v's dtype): pass an out of "
                         f"that dtype or out_dtype={out.dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, the inputs on {device}")
    strides = out.stride()
    if any(st == 0 and size > 1 for size, st in zip(shape, strides)):
        raise ValueError(f"out overlaps itself (stride 0 in {tuple(strides)}, shape {tuple(shape)}): pass a "
                         "tensor with its own memory per element")
    return row_groups(lead, strides[:-2])


def out_buffer(out, n: int, t: int, v_dim: int, dtype: torch.dtype, device):
    """What a launcher's kernels write o to: ``(o, o_arg, o_rows)``, ``o`` the tensor it returns
    (``out``, or a new contiguous ``[N, T, V]``), ``o_arg`` the tensor the kernels write (``o``
    itself, or a contiguous ``[N, T, V]`` temporary when ``out``'s rows do not fit two stride
    groups: :func:`finish_out` copies it), ``o_rows`` the kernels' row addressing
    ``(n_inner, stride_outer, stride_inner)`` of ``o_arg``. Raises ValueError as
    :func:`check_out`."""
    if out is not None:
        rows = check_out(out, n=n, t=t, v_dim=v_dim, dtype=dtype, device=device)
        if rows is not None:
            return out, out, rows
    o_arg = launch.empty((n, t, v_dim), dtype, device)
    return (o_arg if out is None else out), o_arg, (1, o_arg.stride(0), 0)


def finish_out(o: torch.Tensor, o_arg: torch.Tensor) -> torch.Tensor:
    """``o`` after the kernels wrote ``o_arg`` (:func:`out_buffer`): the temporary copied in."""
    if o_arg is not o:
        o.copy_(o_arg.view(o.shape))
    return o


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            scale: float, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
            scalar_gate: bool = False, out_dtype: Optional[torch.dtype] = None,
            config: Optional[dict] = None,
            out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA forward by the token recurrence (module docstring), one kernel launch.

    Args:
        q, k: ``[NQ, T, K]``. v: ``[N, T, V]``, ``N = NQ · group``: value row n reads q/k row
            ``n // group`` (grouped value heads; batch and heads flattened batch-major). Every
            input may also carry its rows as lead dims (:func:`check_inputs` with ``lead_dims``):
            q, k ``[*lead_q, T, K]``, v ``[*lead, T, V]``, g ``[*lead, T(, K)]``, beta ``[*lead,
            T]``, e.g. FLA's ``[B, T, H, *]`` inputs as the views ``x.movedim(1, -2)`` (rows ``b·H
            + h``; with grouped heads ``H_q`` for q/k, ``H_v`` for the rest): read in place when
            the lead dims merge into at most two stride groups, else copied once
            (:func:`input_rows`).
        g: log-space decay, ``[N, T, K]`` (``[N, T]`` with ``scalar_gate``); ``g ≤ 0`` in
            practice (any value works: ``exp g`` multiplies the state).
        beta: ``[N, T]``, the delta-rule step size.
        scale: multiplies q (float; typically ``K ** -0.5``).
        initial_state: ``[N, K, V]`` or None (zeros).
        output_final_state: also return the state after the last token.
        scalar_gate: one decay per (row, token) instead of one per key channel.
        out_dtype: o's dtype (default v's).
        config: a launch config (keys of :func:`candidate_configs`; missing keys from the
            table's row of its variant that agrees with most given keys, see :func:`choose_config`); None: the table's
            default for this device, K, V and N.
        out: o preallocated, written in place, or None (a new contiguous ``[N, T, V]``):
            ``[N, T, V]``, or ``[*lead, T, V]`` with ``prod(lead) = N`` (row ``n`` the row-major
            index over ``lead``, e.g. ``o.movedim(1, 2)`` of a ``[B, T, H, V]`` o), any strides,
            in o's dtype (``out_dtype``, else v's), on the inputs' device (:func:`check_out`).
            The kernel writes it directly when its lead dims merge into at most two stride
            groups (always for a contiguous tensor with the time axis moved anywhere), else
            through a contiguous temporary and a copy.
        Every tensor: float32, float16 or bfloat16 (they may differ), any strides (never
        copied, but for lead dims of three or more stride groups: :func:`input_rows`), one
        device; CPU tensors run in Triton's interpreter. Arithmetic in float32.

    Returns:
        ``(o, final_state)``: o ``[N, T, V]`` in ``out_dtype``, contiguous (``out`` itself when
        given, in its own shape); final_state ``[N, K, V]`` float32 contiguous when
        ``output_final_state``, else None.

    Raises:
        ValueError: wrong ranks or shapes (q/k ``[NQ, T, K]``, v ``[N, T, V]`` with ``N % NQ ==
            0``, g, beta, initial_state, or their lead-dim forms), an unsupported dtype, tensors on different devices, a
            non-finite scale, a config that cannot work (:func:`choose_config`), or an ``out``
            of the wrong shape, dtype or device, or overlapping itself (:func:`check_out`).
    """
    nq, n, t, kd, vd = check_inputs(q, k, v, g, beta, initial_state, scalar_gate, out_dtype, lead_dims=True)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale}")
    cfg = choose_config(k_dim=kd, v_dim=vd, dtype=q.dtype, device=q.device, n_rows=n, config=config)
    device = q.device
    o, o_arg, o_rows = out_buffer(out, n, t, vd, out_dtype or v.dtype, device)
    streamed = cfg["VARIANT"] == "streamed"
    final = launch.empty((n, kd, vd), torch.float32, device) if output_final_state else None
    # the streamed variant keeps the state in the final-state buffer, or in a scratch one
    ht = final if final is not None or not streamed else launch.empty((n, kd, vd), torch.float32, device)
    if n == 0:  # no rows: nothing to launch
        return o, final
    interpret = launch.interpreted(device)
    has_h0 = initial_state is not None
    _, module = _module(cfg["VARIANT"], bool(scalar_gate), has_h0, bool(output_final_state), interpret,
                        cfg["STATE_LAYOUT"])
    ins, rows = inputs_rows(q, k, v, g, beta, bool(scalar_gate))
    args = list(ins) + [o_arg] + ([initial_state] if has_h0 else []) + ([ht] if ht is not None else [])
    with launch.launching(interpret):
        module.launch_kda_recurrent(*args, scale=scale, config=cfg, o_rows=o_rows, rows=rows)
    return finish_out(o, o_arg), final
