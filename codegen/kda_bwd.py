"""KDA backward: the gradients of Kimi Delta Attention's chunked (WY) form as Triton kernels.

KDA (Kimi Linear, Moonshot AI 2025; the gated delta rule of Yang et al., "Gated Delta Networks",
ICLR 2025, with a per-key-channel decay; the chunked WY form as in FLA's chunk kernels) keeps a
``[K, V]`` state per value head. :func:`backward` returns the gradients of ``o`` (and of the
final state, when it is an output) with respect to q, k, v, g, β and the initial state. The
derivation (reverse mode through ``Δ = U − W S``, ``O = (Q̃∘e^G) S + A_qk Δ``, ``S' = diag(e^γ) S
+ (K∘e^{γ−G})ᵀ Δ``, ``M = (I + diag(β) A_kk)⁻¹`` and the pairwise decays) is ``docs/math.md``,
"KDA backward"; :func:`reference_backward` is the same algebra in float64 PyTorch (checked against
``torch.autograd`` through ``patterns/kda_reference.recurrent``).

Kernels (``templates/kda_bwd.py.jinja``), launched in order:

``kda_bwd_prep``, grid ``(n_chunks, N)``
    the forward quantities of each chunk, recomputed: ``G`` (the cumulative gate), ``A_kk``,
    ``A_qk`` (16-row strips: two tensor-core dots per K block through a reference row, the
    16 × 16 diagonal sub-block inside the strip; pairwise there when the gates are strong, see
    Numerics, stored over it), ``M`` (block forward substitution over the 16-row sub-blocks: each
    diagonal block ``(I + L_bb)⁻¹`` by six 16 × 16 dots, each row block's off-diagonal part by two
    dots against the rows of ``M`` already stored), ``W``, ``U``, ``KG = K∘e^{γ−G}`` and ``EG = e^γ`` (so the sequential passes take no
    exponential), and the terms of ``kda_bwd_dstates`` that do not depend on ``dS'``:
    ``A_qkᵀ dO`` (into the ``dΔ`` scratch) and ``(Q̃∘e^G)ᵀ dO`` (a ``[K, V]`` scratch per chunk).
``kda_bwd_prep_saved``, grid ``(n_chunks, N)`` (instead of kda_bwd_prep when ``saved`` holds the
chunked forward's workspaces, :data:`WORKSPACE_KEYS`)
    only the two ``dO`` terms, from the forward's ``Qg`` and ``A_qk``; ``G``, ``A_kk``, ``M = X``,
    ``W``, ``U``, ``KG = Kd`` are the forward's tensors and ``e^γ = exp(G_C)`` one PyTorch op.
    MEASURED (H100, torch 2.11 / Triton 3.6, B=1, T=4096, H=16, bf16 inputs, forward + backward
    through the op, device time; ``benchmarks/results/kda_save.md``): K = V = 128 2.12 → 2.03 ms
    (float32 dots), 1.76 → 1.49 ms (bfloat16 dots); K = 64 1.16 → 1.01, 0.98 → 0.83; K = 256 5.19 →
    4.95, 4.30 → 3.75. The prep's ~420 µs (K = 128) become ~75; float32 dots' float32 ``W``, ``Kd``
    slow the sequential passes (the recompute's are bfloat16 scratch), which keeping the chunk
    states offsets in part. Memory: the forward's workspaces live until the backward (peak above
    the inputs 836 against 467 MiB at K = 128, float32 dots).
``kda_bwd_states``, grid ``(cdiv(V, BLOCK_VS), N)``
    chunk after chunk: the start state ``S`` of every chunk and ``Δ = U − W S``. With
    ``saved={"chunk_states": ...}`` the states are read instead (grid ``(·, N, n_chunks)``, every
    chunk in parallel, only ``Δ``).
``kda_bwd_dstates``, grid ``(cdiv(V, BLOCK_VS), N)``
    last chunk first, ``dS`` ``[K, BLOCK_VS]`` carried in registers: the gradient ``dS'`` of every
    chunk's end state, ``dΔ``, and ``dh0`` (two dots per chunk: ``KG dS'`` and ``Wᵀ dΔ``).
``kda_bwd_seq``, grid ``(2·cdiv(V, BLOCK_VS), N)`` (``config["fuse_sequential"]``, the default,
not with ``saved``)
    the two passes above in one launch, side by side (both read only kda_bwd_prep's outputs):
    even programs ``kda_bwd_states``' work, odd ones ``kda_bwd_dstates``'.
``kda_bwd_intra1``, grid ``(n_chunks, N)``
    ``dv``, ``dβ``, ``dA_qk``, ``dA_kk`` (through ``dM``, ``dL = −Mᵀ dM Mᵀ``), and the ``W`` term
    ``dk4`` of ``dk`` (stored float32: in dk when that is float32, else in scratch;
    kda_bwd_intra2 adds the rest and takes its ``dG`` term).
``kda_bwd_intra2``, grid ``(n_chunks, N, cdiv(K, BLOCK_K))`` (one K block per program; the scalar
gate, whose ``dG`` sums over K, runs every K block in one program)
    ``dq``, ``dk`` (per value head): the state terms, the pairwise-decay terms per 16-row
    sub-block (four full-height ``[chunk, 16] × [16, BLOCK_K]`` tensor-core dots per sub-block: its
    columns against the rows from its start, its rows against the columns up to its end); ``dg`` (a
    reverse cumulative sum of ``dG`` inside the chunk, plus ``dγ``). ``dq``, the two parts of
    ``dk`` (row side, column side) and ``dG`` stay ``[chunk, BLOCK_K]`` register tiles; every
    output is stored once.

The gradients are written where the caller wants them (``out=``: views in the inputs' layouts,
rows as two stride groups, cast to their dtypes on store), else into new float32 tensors; an
``out`` tensor whose lead dims need three stride groups is written through a contiguous
temporary and copied. With grouped value heads (``N = NQ·group``) dq and dk are computed per value
head and summed over the group in PyTorch (``torch.sum(..., out=)`` into dq, dk). Scratch
(``T_pad = n_chunks · chunk`` rows per head, the chunked forward's workspace layout, so that its
workspaces are read as they are; rows past T are never read): float32
``[N, T_pad, K]`` (G), ``[N, T, K]`` (per-head dq, dk when ``group > 1``; ``dk4`` when ``group =
1`` and dk is not float32),
``[N, T_pad, chunk]`` ×5 (A_kk, A_qk, M, dA_qk, dA_kk); in ``config["scratch"]``'s dtype
(:data:`SCRATCH`) ``[N, T_pad, K]`` ×2 (W, KG), ``[N, n_chunks, K, V]`` ×3 (the states, their
gradients, ``(Q̃∘e^G)ᵀ dO`` per chunk; the first not with ``saved`` states); float32 ``[N, T_pad,
V]`` ×3 (U, Δ, dΔ, which first holds ``A_qkᵀ dO``). With the forward's workspaces in ``saved``,
G, A_kk, A_qk, M, W, KG, U are those (W, KG, U in the forward's dots dtype) and not allocated.

Numerics: no exponential of a cumulative gate over a whole chunk (``e^{G}·e^{−G}`` would overflow
with gates near −30); rows past ``T`` contribute 0. A pairwise decay ``e^{G_r − G_s}`` between
16-row sub-blocks splits through a reference row into two factors ≤ 1 when ``g ≤ 0`` (row 16b for
the rows of sub-block b, row 16b + 15 for its columns). Inside a 16 × 16 diagonal sub-block the
same reference is used with the factor ≥ 1 clamped to ``e^30``: exact while every
``|G_r − G_ref|`` of the sub-block (per K block in ``kda_bwd_intra2``, over all K in
``kda_bwd_prep``) is ≤ 30, so neither factor leaves ``[e^−30, e^30]``; a sub-block that spans more
(strong gates, checked at run time) is left out of those dots and computed pairwise instead, one
column (or row) of the sub-block per step, a ``[16, BLOCK_K]`` (kda_bwd_prep) or ``[chunk,
BLOCK_K]`` (kda_bwd_intra2) tile ``e^{G_r − G_s}`` with exponent ``−∞`` outside the pairs before
the exponential. ``M``'s dots are ``"ieee"`` float32.
Dots take float32 operands: ``"ieee"`` precision for float32 inputs (``"tf32"`` under
``torch.set_float32_matmul_precision("high")``), ``"tf32"`` when any input is 16-bit.

Performance: MEASURED on an H100 (torch 2.11, Triton 3.6; B=1, T=4096, H=16, bf16, chunk 64;
``scratch/kda_bwd_bench.py``). Before round 1 (a 16-step serial loop per diagonal sub-block in
kda_bwd_intra2 and kda_bwd_prep, ``C − 1`` dependent row steps for ``M``; 8 warps, 2 stages):
4.50 ms at K = V = 128. Round 1 (the reference-row diagonal, ``M`` by block forward substitution):
2.50 ms with 8 warps / 2 stages; 1.97 ms with 4 warps / 1 stage for the parallel kernels (prep
0.458, states 0.190, dstates 0.403, intra1 0.220, intra2 0.689; BLOCK_K = BLOCK_V = BLOCK_VS = 32,
the state kernels 8 warps / 2 stages); K = V = 64: 1.47 → 1.14 ms (prep 0.265, states 0.140,
dstates 0.323, intra1 0.103, intra2 0.299); K = V = 256: 5.59 → 4.47 ms (4.41 with BLOCK_K =
BLOCK_V = 64, 8 warps, 1 stage). Relative errors against float64 ~1.5e-3 (dg 3e-3) at every K.
Round 2 (below), MEASURED the same way: **1.40 ms** at K = V = 128 (prep 0.416, seq 0.299, intra1
0.205, intra2 0.472), 0.756 ms at K = V = 64, 3.65 ms at K = V = 256 (the _BIG_K state settings;
4.07 with round 2's first K > 128 guess); same errors; FLA chunk_kda's forward+backward is 2.92
ms at 128. Round 2's changes —
- kda_bwd_intra2: ``dq``, both parts of ``dk`` and ``dG`` accumulated in registers and stored once
  (round 1 read and wrote dQ, dK and dG back once per sub-block and twice more);
  kda_bwd_intra1 no longer writes dG;
- kda_bwd_prep: the diagonal sub-block inside its strip dots (two dots per K block instead of
  four); the pairwise fallbacks one column per step (no ``[16, 16, BLOCK_K]`` tile);
  ``A_qkᵀ dO`` and ``(Q̃∘e^G)ᵀ dO`` computed there, chunk-parallel, instead of on
  kda_bwd_dstates' dependent path (no ``QG`` scratch);
- the two sequential passes in one launch (``kda_bwd_seq``) with BLOCK_VS 16, 4 warps, 1 stage:
  256 programs at H = 16, V = 128, two per SM on 132 SMs (round 1: 64 per pass, one pass after
  the other); K > 128: two launches, 8 warps;
- the per-kernel config keys.
Compiled offline for sm90 with Triton 3.6 (K = V = 128, chunk 64, bf16 inputs, the default
config): kda_bwd_prep 40 KB shared memory, 189 registers, no spills (round 1: 255, 284 B
spilled); kda_bwd_seq 24 KB, 248, none (unfused with 8 warps: kda_bwd_states 164, kda_bwd_dstates
165, none; round 1's dstates with BLOCK_VS 32, 8 warps, 2 stages: 100 KB, 255, 360 B spilled);
kda_bwd_intra1 60 KB, 255, none; kda_bwd_intra2 16 KB, 242, none (round 1: 255, 296 B spilled;
206 registers with 8 warps; BLOCK_K = BLOCK_V = 64 with 8 warps 254, none, round 1 16 B spilled). K = V = 256 (unfused, 8 warps): kda_bwd_dstates spills 92 B, the
rest none; K = V = 64: none. Round 1 estimated the scratch traffic at about 1.6 GB at B=1,
T=4096, H=16, K=V=128 with float32 scratch (about 0.6 of it with bfloat16), so ``scratch`` is a
knob; the two recurrences run ``n_chunks`` dependent steps each (``saved`` removes the first).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import launch
from .kda_recurrent import _prod, check_shapes, finish_out, input_rows, row_groups
from .render import RenderedKernel, render

__all__ = ["backward", "reference_backward", "bwd_kernel", "candidate_configs", "kernel_config", "CHUNKS", "GRADS",
           "PARALLEL", "SAVED_KEYS", "SCRATCH"]

TEMPLATE = "kda_bwd.py.jinja"
#: The chunk sizes the kernels take (multiples of the 16-row sub-block; 64 keeps the [C, C]
#: register tiles of kda_bwd_intra1 at 4K float32 elements).
CHUNKS = (16, 32, 64)
#: The chunked forward's workspaces (``codegen/kda_chunk.forward(save_for_backward=True)``'s
#: ``saved`` dict) that :func:`backward` reads instead of recomputing them (kda_bwd_prep then only
#: computes its two dO terms): all of them or none.
WORKSPACE_KEYS = ("qg", "kd", "w", "u", "a_qk", "a_kk", "xm", "gcum", "g_last")
#: The keys :func:`backward`'s ``saved`` may hold: ``chunk_states`` (or the forward's name for
#: them, ``states``), :data:`WORKSPACE_KEYS`, and the rest of the forward's dict (``chunk``, which
#: must equal the backward's, and ``t_mat``, not read).
SAVED_KEYS = ("chunk_states", "states", "chunk", "t_mat") + WORKSPACE_KEYS


# --------------------------------------------------------------------------------------------
# Float64 reference of the hand-derived backward (docs/math.md, "KDA backward")
# --------------------------------------------------------------------------------------------


def _check_shapes(q, k, v, g, beta, do, initial_state, d_final_state, scalar_gate, lead_dims: bool = False):
    """(NQ, N, T, K, V, group) after checking the kernel interface's shapes (ValueError): q, k,
    v, g, beta and the initial state as the forward launchers check them
    (``kda_recurrent.check_shapes``), do ``[N, T, V]``, d_final_state ``[N, K, V]``.

    With ``lead_dims`` (:func:`backward`) an input may carry its rows as several lead dims (at
    least one), row ``n`` the row-major index over them: q, k ``[*lead_q, T, K]`` (one shape,
    ``prod(lead_q) = NQ``), v and do ``[*lead, T, V]``, g ``[*lead, T(, K)]``, beta ``[*lead,
    T]`` with ``prod(lead) = N`` for each (``codegen/kda_recurrent.input_rows`` addresses them)."""
    nq, n, t, kd, vd = check_shapes(q, k, v, g, beta, initial_state, scalar_gate, lead_dims=lead_dims)
    if not isinstance(do, torch.Tensor):
        raise ValueError(f"do (the gradient of o) must be a torch.Tensor, got {type(do).__name__}")
    if lead_dims:
        do_ok = do.dim() >= 3 and _prod(do.shape[:-2]) == n and tuple(do.shape[-2:]) == (t, vd)
    else:
        do_ok = tuple(do.shape) == (n, t, vd)
    if not do_ok:
        note = " (or [*lead, T, V] with prod(lead) = N)" if lead_dims else ""
        raise ValueError(f"do (the gradient of o) must be [N, T, V] = {(n, t, vd)}{note}, got {tuple(do.shape)}")
    if d_final_state is not None and tuple(d_final_state.shape) != (n, kd, vd):
        raise ValueError(f"d_final_state must be [N, K, V] = {(n, kd, vd)}, got {tuple(d_final_state.shape)}")
    return nq, n, t, kd, vd, (n // nq if nq else 1)


def reference_backward(q, k, v, g, beta, do, *, scale: float, initial_state=None, d_final_state=None,
                       scalar_gate: bool = False, chunk: int = 64):
    """The hand-derived KDA backward in float64 PyTorch, chunk by chunk (``docs/math.md``, "KDA
    backward"): the oracle the kernels' structure follows, itself checked against
    ``torch.autograd`` through :func:`fuser.patterns.kda_reference.recurrent`.

    Shapes as :func:`backward` (q, k ``[NQ, T, K]``; v, do ``[N, T, V]``; g ``[N, T, K]`` or
    ``[N, T]`` with ``scalar_gate``; beta ``[N, T]``; the states ``[N, K, V]``); any float dtypes.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0 or None)`` in float64, shaped like the inputs.

    Raises:
        ValueError: inconsistent shapes, ``chunk < 1``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    nq, n, t_len, kd, vd, group = _check_shapes(q, k, v, g, beta, do, initial_state, d_final_state, scalar_gate)
    f = torch.float64
    qs = q.to(f).repeat_interleave(group, 0) * scale          # q̃ = scale·q, per value head  [N, T, K]
    ks = k.to(f).repeat_interleave(group, 0)
    vs, bs, dos = v.to(f), beta.to(f), do.to(f)
    gs = g.to(f)
    if scalar_gate:
        gs = gs[..., None].expand(n, t_len, kd)
    s = torch.zeros(n, kd, vd, dtype=f, device=q.device)
    if initial_state is not None:
        s = s + initial_state.to(f)

    # forward: the per-chunk quantities the backward reads
    saved = []
    for c0 in range(0, t_len, chunk):
        sl = slice(c0, min(c0 + chunk, t_len))
        qc, kc, vc, bc = qs[:, sl], ks[:, sl], vs[:, sl], bs[:, sl]
        cg = gs[:, sl].cumsum(1)                                   # G  [N, C, K]
        m = qc.shape[1]
        incl = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        diff = (cg[:, :, None, :] - cg[:, None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
        decay = diff.exp()                                         # e^{G_r − G_s}, s ≤ r  [N, C, C, K]
        a_kk = torch.einsum("nrd,nsd,nrsd->nrs", kc, kc, decay).tril(-1)
        a_qk = torch.einsum("nrd,nsd,nrsd->nrs", qc, kc, decay)
        eye = torch.eye(m, dtype=f, device=q.device)
        minv = torch.linalg.solve_triangular(eye + bc[:, :, None] * a_kk, eye.expand(n, m, m), upper=False,
                                             unitriangular=True)   # M = (I + diag(β) A_kk)⁻¹
        ke = kc * cg.exp()
        u = minv @ (bc[:, :, None] * vc)
        w = minv @ (bc[:, :, None] * ke)
        delta = u - w @ s
        last = cg[:, -1]                                           # γ = G_C  [N, K]
        kdec = kc * (last[:, None, :] - cg).exp()                  # K ∘ e^{γ − G}
        saved.append((sl, qc, kc, vc, bc, cg, decay, a_kk, a_qk, minv, ke, w, delta, last, kdec, s))
        s = last.exp()[..., None] * s + kdec.transpose(1, 2) @ delta

    dq = torch.zeros_like(qs)
    dk = torch.zeros_like(ks)
    dv = torch.zeros_like(vs)
    dg = torch.zeros_like(gs)
    dbeta = torch.zeros_like(bs)
    ds = torch.zeros(n, kd, vd, dtype=f, device=q.device)          # dS', the gradient of the chunk's end state
    if d_final_state is not None:
        ds = ds + d_final_state.to(f)
    for sl, qc, kc, vc, bc, cg, decay, a_kk, a_qk, minv, ke, w, delta, last, kdec, s0 in reversed(saved):
        doc = dos[:, sl]
        qe = qc * cg.exp()
        # the sequential part: dΔ and the gradient of the chunk's start state
        d_delta = a_qk.transpose(1, 2) @ doc + kdec @ ds
        ds0 = last.exp()[..., None] * ds + qe.transpose(1, 2) @ doc - w.transpose(1, 2) @ d_delta
        # the chunk-parallel part
        dqe = doc @ s0.transpose(1, 2)                             # ∂/∂(Q̃∘e^G)
        dq1 = dqe * cg.exp()
        d_aqk = (doc @ delta.transpose(1, 2)).tril()
        d_w = -d_delta @ s0.transpose(1, 2)
        dk5 = (delta @ ds.transpose(1, 2)) * (last[:, None, :] - cg).exp()
        dgamma = last.exp() * (s0 * ds).sum(-1) + (kc * dk5).sum(1)
        mt_du = minv.transpose(1, 2) @ d_delta                     # Mᵀ dU  (dU = dΔ)
        mt_dw = minv.transpose(1, 2) @ d_w
        dv[:, sl] = bc[:, :, None] * mt_du
        d_m = d_delta @ (bc[:, :, None] * vc).transpose(1, 2) + d_w @ (bc[:, :, None] * ke).transpose(1, 2)
        d_l = -minv.transpose(1, 2) @ d_m @ minv.transpose(1, 2)
        d_akk = (bc[:, :, None] * d_l).tril(-1)
        dbeta[:, sl] = (mt_du * vc).sum(-1) + (mt_dw * ke).sum(-1) + (d_l * a_kk).sum(-1)
        dk4 = bc[:, :, None] * cg.exp() * mt_dw
        # through the pairwise decays: A_qk[r,s] = Σ_d q̃_rd k_sd e^{G_rd − G_sd}, A_kk likewise
        dq2 = torch.einsum("nrs,nsd,nrsd->nrd", d_aqk, kc, decay)
        dk2 = torch.einsum("nrs,nrd,nrsd->nsd", d_aqk, qc, decay)
        dk3r = torch.einsum("nrs,nsd,nrsd->nrd", d_akk, kc, decay)
        dk3c = torch.einsum("nrs,nrd,nrsd->nsd", d_akk, kc, decay)
        dqt = dq1 + dq2
        dq[:, sl] = dqt * scale
        dk[:, sl] = dk2 + dk3r + dk3c + dk4 + dk5
        d_g_cum = qc * dqt + kc * (dk3r + dk4) - kc * (dk2 + dk3c + dk5)   # ∂/∂G
        # G_r = Σ_{s≤r} g_s and γ = G_C: dg_s = Σ_{r≥s} dG_r + dγ
        dg[:, sl] = d_g_cum.flip(1).cumsum(1).flip(1) + dgamma[:, None, :]
        ds = ds0
    dq = dq.view(nq, group, t_len, kd).sum(1)
    dk = dk.view(nq, group, t_len, kd).sum(1)
    if scalar_gate:
        dg = dg.sum(-1)
    return dq, dk, dv, dg, dbeta, (ds if initial_state is not None else None)


# --------------------------------------------------------------------------------------------
# Rendering, configs
# --------------------------------------------------------------------------------------------


def bwd_kernel(*, scalar_gate: bool, interpret: bool) -> RenderedKernel:
    """Render the KDA backward kernel module (all four kernels) of one static variant; the gates
    are floored at ``kda_chunk.GATE_FLOOR`` where kda_bwd_prep loads them (as the chunked
    forward's kernels do)."""
    from .kda_chunk import GATE_FLOOR

    name = "kda_bwd" + ("_scalar" if scalar_gate else "") + ("_interp" if interpret else "")
    return render(TEMPLATE, name, scalar_gate=bool(scalar_gate), interpret=bool(interpret), gate_floor=GATE_FLOOR)


@functools.lru_cache(maxsize=None)
def _module(scalar_gate: bool, interpret: bool):
    kernel = bwd_kernel(scalar_gate=scalar_gate, interpret=interpret)
    return kernel, launch.kernel_module(kernel, interpret)


#: The parallel kernels, each of which may take its own ``BLOCK_K``, ``BLOCK_V``, ``num_warps``,
#: ``num_stages`` (config keys ``BLOCK_K_prep``, ``num_warps_intra2``, ...; None: the shared key's).
PARALLEL = ("prep", "intra1", "intra2")
_SHARED = ("BLOCK_K", "BLOCK_V", "num_warps", "num_stages")
_PER_KERNEL = tuple(f"{key}_{kern}" for kern in PARALLEL for key in _SHARED)


def _cfg(bk, bv, bvs, w, s, ws, ss, scratch="auto", fuse=True, **per_kernel):
    cfg = {"BLOCK_K": bk, "BLOCK_V": bv, "BLOCK_VS": bvs, "num_warps": w, "num_stages": s,
           "num_warps_state": ws, "num_stages_state": ss, "scratch": scratch, "fuse_sequential": fuse}
    assert set(per_kernel) <= set(_PER_KERNEL), per_kernel
    cfg.update(per_kernel)
    return cfg


def kernel_config(cfg: dict, kern: str) -> dict:
    """``BLOCK_K``, ``BLOCK_V``, ``num_warps``, ``num_stages`` of the parallel kernel ``kern``
    (one of :data:`PARALLEL`): its own keys where set, else the shared ones."""
    return {key: cfg[f"{key}_{kern}"] if cfg.get(f"{key}_{kern}") is not None else cfg[key] for key in _SHARED}


#: ``config["scratch"]``: the dtype of the large scratch tensors W, KG, the chunk states, their
#: gradients and (Q̃∘e^G)ᵀ dO per chunk (G, A_kk, A_qk, M, dA stay float32: bfloat16 would ruin the differences of
#: cumulative gates; U, Δ, dΔ too: Δ = U − W S cancels, and bfloat16 U, Δ, dΔ alone gave
#: ~5e-3 relative error in dq on the interpreter tests, against ~2e-3 for the rest together).
#: ``"auto"``: bfloat16 when any of q, k, v, do is 16-bit, else float32.
SCRATCH = ("auto", "float32", "bfloat16")


# BLOCK_K, BLOCK_V: the K and V blocks of kda_bwd_prep / kda_bwd_intra1 / kda_bwd_intra2
# ([chunk, BLOCK_K] and [chunk, BLOCK_V] tiles; intra2 runs one program per K block); each of the
# three may override these and num_warps / num_stages with its own key (BLOCK_K_intra2, ...);
# BLOCK_VS: the V block of the two sequential passes (a [K, BLOCK_VS] state tile per program:
# N · cdiv(V, BLOCK_VS) programs); num_warps / num_stages: the parallel kernels';
# num_warps_state / num_stages_state: the sequential passes'. A kernel whose pipelining does not
# fit in shared memory runs with fewer stages (checked before launching: _launch).
# Interpreter: small blocks so that the test shapes (K = 24, V = 40) run several ragged blocks;
# float32 scratch (the bfloat16 scratch has a test of its own).
_INTERP = [_cfg(16, 16, 16, 4, 1, 4, 1, "float32")]
# GPUs: the sm90 rows were measured on an H100 (torch 2.11, Triton 3.6; B=1 T=4096 H=16 bf16,
# chunk 64; scratch/round1_h100.txt, the kernels of round 1). 4 warps and 1 stage for the parallel
# kernels beat the former default (8 warps, 2 stages) at every K: K = V = 128 1.97 ms against
# 2.50 (prep 0.458, states 0.190, dstates 0.403, intra1 0.220, intra2 0.689); K = V = 64 1.14
# against 1.47; K = V = 256 4.47 against 5.59 (BLOCK_K 64, BLOCK_V 64, 8 warps, 1 stage: 4.41).
# Round 1's kernels, compiled offline for sm90 (Triton 3.6, K = V = 128, bf16 inputs) with 4 warps,
# 1 stage: kda_bwd_prep 255 registers, 284 B spilled; kda_bwd_intra2 255, 296 B; kda_bwd_intra1
# 255, none; kda_bwd_dstates (BLOCK_VS 32, 8 warps, 2 stages, measured 0.40 ms) 255, 360 B.
# NOT MEASURED, the current kernels (offline sm90, K = V = 128): kda_bwd_prep 189 registers, no
# spills; kda_bwd_intra2 242, none (206 with 8 warps); the state kernels' default: BLOCK_VS 16,
# 4 warps, 1 stage, fuse_sequential: both recurrences in one launch (kda_bwd_seq, grid
# (2 * V blocks, N), even programs S, odd ones dS'; they are independent, both read only
# kda_bwd_prep's outputs): 248 registers, no spills (K = 64: 129), so two programs fit per SM and
# all 256 at H = 16, V = 128 run at once (round 1: 64 programs per pass, one pass after the
# other); with 8 warps 247 (one per SM). Unfused with 8 warps: kda_bwd_states 164, kda_bwd_dstates
# 165, none. K > 128 (_BIG_K): kda_bwd_seq with 4 warps would spill 0.9 KB; unfused with 8 warps
# kda_bwd_states 255 registers, none, kda_bwd_dstates 92 B. The "cuda" rows are guesses.
_TABLE = {
    "sm90": [_cfg(32, 32, 16, 4, 1, 4, 1), _cfg(32, 32, 32, 4, 1, 8, 2, fuse=False),
             _cfg(64, 64, 32, 8, 1, 8, 1), _cfg(32, 32, 16, 8, 1, 8, 1, fuse=False)],
    "cuda": [_cfg(32, 32, 32, 4, 1, 8, 1), _cfg(16, 32, 16, 4, 1, 4, 1)],
}


#: sm90 defaults for K > 128 (where the user config does not give them): module docstring. The
#: state kernels' BLOCK_VS 32 / 2 stages MEASURED on the H100 (B=1, T=4096, H=16, K=V=256, bf16,
#: 2026-11-24): backward 3.65 ms against 4.07 with BLOCK_VS 16 / 1 stage (states 0.48 / dstates
#: 0.54 ms against 0.66 / 0.75), and against 3.92 with the fused passes.
_BIG_K = {"num_warps_state": 8, "fuse_sequential": False, "BLOCK_VS": 32, "num_stages_state": 2}


def candidate_configs(device) -> list[dict]:
    """Launch configs, best first (the first is the default): the interpreter's on CPU tensors,
    else by device kind (``launch.device_kind``)."""
    dev = launch.device_kind(device)
    return [dict(c) for c in (_INTERP if dev == "interpreter" else _TABLE[dev])]


def _config(config: Optional[dict], device, kd: int = 0) -> dict:
    """The launch config: :func:`candidate_configs`' first updated by ``config``. A shared key
    given without the per-kernel one (``num_warps`` without ``num_warps_intra2``) sets that knob for
    every parallel kernel, as before the per-kernel keys existed. The per-kernel keys of the result
    are resolved (never None)."""
    cfg = dict(candidate_configs(device)[0])
    if kd > 128 and launch.device_kind(device) == "sm90":
        cfg.update({key: value for key, value in _BIG_K.items() if key not in (config or {})})
    if config:
        known = set(cfg) | set(_PER_KERNEL)
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"unknown KDA backward config keys {sorted(unknown)}; known: {sorted(known)}")
        for key in _SHARED:
            if key in config:
                for kern in PARALLEL:
                    if f"{key}_{kern}" not in config:
                        cfg.pop(f"{key}_{kern}", None)
        cfg.update(config)
    for kern in PARALLEL:
        for key, value in kernel_config(cfg, kern).items():
            cfg[f"{key}_{kern}"] = value
    launch.check_config(cfg)
    for key in ("num_warps", "num_warps_state", *(f"num_warps_{kern}" for kern in PARALLEL)):
        if cfg[key] not in (1, 2, 4, 8, 16):
            raise ValueError(f"{key} must be 1, 2, 4, 8 or 16, got {cfg[key]!r}")
    for key in ("num_stages", "num_stages_state", *(f"num_stages_{kern}" for kern in PARALLEL)):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be an int >= 1, got {cfg[key]!r}")
    if not isinstance(cfg["fuse_sequential"], bool):
        raise ValueError(f"config['fuse_sequential'] must be a bool, got {cfg['fuse_sequential']!r}")
    if cfg["scratch"] not in SCRATCH:
        raise ValueError(f"config['scratch'] must be one of {SCRATCH}, got {cfg['scratch']!r}")
    return cfg


def _launch(kernel, grid, args, kwargs, stages: int) -> None:
    """``kernel[grid](*args, **kwargs, num_stages=s)`` with the largest ``s <= stages`` whose
    pipelining fits the device's shared memory: the stage counts ``stages, stages - 1, ..., 1``
    are the configs of :func:`launch.launch_first_fitting`, which checks them before launching
    (compiling the kernel; also while traced for Inductor) and remembers the count that fitted
    per kernel variant, keyword arguments (constexprs, warps), tensor dtypes and requested
    ``stages``. Raises ``launch.ConfigDoesNotFit`` when not even one stage fits."""
    fn = getattr(kernel, "fn", kernel)
    key = ("kda_bwd", getattr(fn, "__module__", None), getattr(fn, "__qualname__", str(kernel)),
           tuple(sorted(kwargs.items())),
           tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), stages)

    def run(cfg):
        launch.jit_call(kernel)[grid](*args, **kwargs, num_stages=cfg["num_stages"])

    launch.launch_first_fitting(key, [{"num_stages": s} for s in range(stages, 0, -1)], run)


# --------------------------------------------------------------------------------------------
# The backward
# --------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, g, beta, do, initial_state, d_final_state, scalar_gate, chunk, saved, out):
    dims = _check_shapes(q, k, v, g, beta, do, initial_state, d_final_state, scalar_gate, lead_dims=True)
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "do": do, "initial_state": initial_state,
             "d_final_state": d_final_state}
    for name, x in named.items():
        if x is None:
            continue
        if x.dtype not in launch.DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}: cast it first")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: move every input to one device")
    if chunk not in CHUNKS:
        raise ValueError(f"chunk must be one of {CHUNKS} (a multiple of the 16-row sub-block), got {chunk!r}")
    n, t, kd, vd = dims[1], dims[2], dims[3], dims[4]
    states = workspaces = None
    if saved is not None:
        unknown = set(saved) - set(SAVED_KEYS)
        if unknown:
            raise ValueError(f"saved may hold {SAVED_KEYS}, got unknown keys {sorted(unknown)}")
        if saved.get("chunk", chunk) != chunk:
            raise ValueError(f"saved comes from a forward with chunk={saved['chunk']}, the backward has chunk={chunk}: "
                             f"pass the forward's chunk")
        if saved.get("chunk_states") is not None and saved.get("states") is not None:
            raise ValueError("saved holds both 'chunk_states' and 'states' (the same thing): pass one")
        states = saved.get("chunk_states", saved.get("states"))
        workspaces = _check_workspaces(saved, n, t, kd, vd, chunk, scalar_gate, q.device)
        if states is not None:
            want = (n, launch.cdiv(t, chunk), kd, vd)
            if tuple(states.shape) != want:
                raise ValueError(f"saved['chunk_states'] must be [N, cdiv(T, chunk), K, V] = {want} (the state "
                                 f"before every chunk of {chunk} tokens), got {tuple(states.shape)}")
            if states.dtype not in launch.DTYPES or states.device != q.device:
                raise ValueError("saved['chunk_states'] must be a float tensor on q's device (float32 preferred)")
    if out is not None:
        _check_out(out, _grad_shapes(dims, scalar_gate), q.device)
    return dims, states, workspaces


def _check_workspaces(saved, n, t, kd, vd, chunk, scalar_gate, device) -> Optional[dict]:
    """The forward's workspaces in ``saved`` (:data:`WORKSPACE_KEYS`, all or none), checked
    against the shapes ``codegen/kda_chunk.forward`` gives them (``T_pad = cdiv(T, chunk) ·
    chunk`` rows per head, contiguous, on ``device``; G, X, A_kk and G_C float32, the rest any
    float dtype); None when ``saved`` holds none. ValueError naming the key and the fix."""
    given = [key for key in WORKSPACE_KEYS if saved.get(key) is not None]
    if not given:
        return None
    missing = [key for key in WORKSPACE_KEYS if key not in given]
    if missing:
        raise ValueError(f"saved holds some of the forward's workspaces but not {missing}: pass all of "
                         f"{WORKSPACE_KEYS} (kda_chunk.forward(save_for_backward=True)'s dict) or none")
    nc = launch.cdiv(t, chunk)
    tp = nc * chunk
    want = {"qg": (n, tp, kd), "kd": (n, tp, kd), "w": (n, tp, kd), "u": (n, tp, vd), "a_qk": (n, tp, chunk),
            "a_kk": (n, tp, chunk), "xm": (n, tp, chunk), "gcum": (n, tp) if scalar_gate else (n, tp, kd),
            "g_last": (n, nc, kd)}
    for key, shape in want.items():
        x = saved[key]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            raise ValueError(f"saved[{key!r}] must be a tensor of shape {shape} (kda_chunk.forward's workspace for "
                             f"T={t}, chunk={chunk}), got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
        exact32 = key in ("a_kk", "xm", "gcum", "g_last")
        if x.device != device or (x.dtype != torch.float32 if exact32 else x.dtype not in launch.DTYPES):
            raise ValueError(f"saved[{key!r}] must be a {'float32' if exact32 else 'float'} tensor on {device}, got "
                             f"{x.dtype} on {x.device}")
        if not x.is_contiguous():
            raise ValueError(f"saved[{key!r}] must be contiguous (as kda_chunk.forward allocates it)")
    return {key: saved[key] for key in WORKSPACE_KEYS}


#: The gradients :func:`backward` writes into its ``out=`` tuple, in that order.
GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def _grad_shapes(dims, scalar_gate: bool) -> tuple:
    """The flat shapes of :data:`GRADS` (``dims`` = (NQ, N, T, K, V, group)): dq, dk ``[NQ, T,
    K]``, dv ``[N, T, V]``, dg ``[N, T, K]`` (``[N, T]`` with ``scalar_gate``), dbeta ``[N, T]``."""
    nq, n, t, kd, vd, _ = dims
    return (nq, t, kd), (nq, t, kd), (n, t, vd), (n, t) if scalar_gate else (n, t, kd), (n, t)


def _check_out(out, shapes, device) -> None:
    """Check :func:`backward`'s ``out`` against the flat gradient shapes ``shapes``
    (:func:`_grad_shapes`); ValueError naming the gradient and the fix."""
    if not isinstance(out, (tuple, list)) or len(out) != len(GRADS):
        raise ValueError(f"out must be a tuple (dq, dk, dv, dg, dbeta) of five tensors or None, got "
                         f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, (tuple, list)) else ''}")
    for name, x, want in zip(GRADS, out, shapes):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"out's {name} must be a torch.Tensor, got {type(x).__name__}")
        tail = len(want) - 1
        lead = x.shape[:x.dim() - tail]
        if x.dim() <= tail or _prod(lead) != want[0] or tuple(x.shape[x.dim() - tail:]) != want[1:]:
            raise ValueError(f"out's {name} must be {list(want)} (or [*lead, {', '.join(map(str, want[1:]))}] with "
                             f"prod(lead) = {want[0]}), got {tuple(x.shape)}")
        if x.dtype not in launch.DTYPES:
            raise ValueError(f"out's {name} must be float32, float16 or bfloat16, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"out's {name} is on {x.device}, the inputs on {device}")
        if any(st == 0 and size > 1 for size, st in zip(x.shape, x.stride())):
            raise ValueError(f"out's {name} overlaps itself (stride 0 in {tuple(x.stride())}, shape "
                             f"{tuple(x.shape)}): pass a tensor with its own memory per element")


def _out_rows(x: torch.Tensor, tail: int, shape, device) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(x_arg, rows)``: how the kernels write the gradient ``x`` (``[*lead, T(, F)]``, ``tail``
    trailing dims): ``x`` itself, its lead dims as at most two stride groups
    (``kda_recurrent.row_groups``), or, when they need three, a contiguous temporary of the flat
    ``shape`` in ``x``'s dtype (copied into ``x`` after the kernels: ``kda_recurrent.finish_out``)."""
    lead = x.dim() - tail
    rows = row_groups(x.shape[:lead], x.stride()[:lead])
    if rows is None:
        tmp = launch.empty(shape, x.dtype, device)
        return tmp, (1, tmp.stride(0), 0)
    return x, rows


def backward(q, k, v, g, beta, do, *, scale: float, initial_state=None, d_final_state=None,
             scalar_gate: bool = False, chunk: int = 64, config: Optional[dict] = None,
             saved: Optional[dict] = None, out: Optional[tuple] = None):
    """Gradients of KDA (the interface of the KDA forward launchers) from ``do``.

    Args:
        q, k: ``[NQ, T, K]``; v: ``[N, T, V]`` with ``N = NQ·group`` (value row n reads q/k row
            ``n // group``); g: ``[N, T, K]`` log decay per key channel, or ``[N, T]`` with
            ``scalar_gate``; beta: ``[N, T]``; do: ``[N, T, V]`` the gradient of ``o``. Any of
            float32 / float16 / bfloat16 (they may differ), any strides. Each may also carry
            its rows as lead dims (at least one): q, k ``[*lead_q, T, K]``, v, do ``[*lead, T,
            V]``, g ``[*lead, T(, K)]``, beta ``[*lead, T]`` (e.g. FLA's ``[B, T, H, *]`` as the
            views ``movedim(1, -2)``), read in place when the lead dims merge into at most two
            stride groups, else copied once (``kda_recurrent.input_rows``). Gates below
            ``kda_chunk.GATE_FLOOR`` are raised to it as they are loaded (−inf: a hard reset,
            its dg 0; NaN stays NaN), as in the chunked forward.
        scale: the factor on q (``o_t = Sᵀ(scale·q_t)``).
        initial_state: ``[N, K, V]`` or None (zeros; then no dh0).
        d_final_state: ``[N, K, V]`` the gradient of the final state when the forward returned it;
            None: zero.
        scalar_gate: g is one decay per head and token (the gated delta rule).
        chunk: tokens per chunk, one of :data:`CHUNKS`.
        config: keys ``BLOCK_K``, ``BLOCK_V``, ``BLOCK_VS`` (powers of two >= 16), ``num_warps``,
            ``num_stages``, ``num_warps_state``, ``num_stages_state`` (see ``_TABLE``), ``scratch``
            (:data:`SCRATCH`); per parallel kernel (:data:`PARALLEL`: prep, intra1, intra2)
            ``BLOCK_K_<kernel>``, ``BLOCK_V_<kernel>``, ``num_warps_<kernel>``,
            ``num_stages_<kernel>`` (None: the shared key's; a shared key given without them sets
            that knob for all three); ``fuse_sequential`` (bool: the two recurrences in one
            launch, not with ``saved``); missing keys from :func:`candidate_configs`' first
            (on sm90 with K > 128 updated by ``_BIG_K``).
        saved: optional precomputed forward quantities (:data:`SAVED_KEYS`); ``{"chunk_states":
            S}`` with ``S`` ``[N, cdiv(T, chunk), K, V]`` (float32 preferred) the state *before*
            each chunk of ``chunk`` tokens (``S[:, 0]`` the initial state), as a chunked forward
            with the same chunk computes them: the sequential recompute of the states is then
            skipped. Or the dict ``codegen/kda_chunk.forward(..., save_for_backward=True)``
            returns (its ``"states"`` are the chunk states, None for none): its workspaces
            (:data:`WORKSPACE_KEYS`, all of them, checked by :func:`_check_workspaces`) replace
            kda_bwd_prep's recomputation (``kda_bwd_prep_saved``); its ``"chunk"`` must be
            ``chunk``.
        out: the gradients preallocated, written in place, or None (new float32 ones): a tuple
            ``(dq, dk, dv, dg, dbeta)`` (:data:`GRADS`), dq, dk ``[*lead_q, T, K]`` with
            ``prod(lead_q) = NQ``, dv ``[*lead, T, V]``, dg ``[*lead, T, K]`` (``[*lead, T]``
            with ``scalar_gate``), dbeta ``[*lead, T]`` with ``prod(lead) = N`` (``[NQ, T, K]``
            etc. the plain case; row ``n`` the row-major index over the lead dims, as for the
            inputs: e.g. the gradients of FLA's ``[B, T, H, *]`` inputs as the views
            ``movedim(1, -2)``, or a time window ``narrow`` of them), any strides but no stride
            0 on a dim longer than 1, each float32, float16 or bfloat16 (the op passes the
            inputs' dtypes; the kernels accumulate in float32 and round as they store), on the
            inputs' device; none may overlap another or an input. The kernels write each one
            directly when its lead dims merge into at most two stride groups
            (``kda_recurrent.row_groups``; any tensor with the time axis moved), else through a
            contiguous temporary and a copy. With grouped value heads (``group > 1``) dq and dk
            are computed per value head in float32 scratch and summed over the group into
            ``out``'s dq, dk (``torch.sum(..., out=)``, whatever their layout). dh0 is not in
            ``out``: it is always a new float32 ``[N, K, V]``.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)``: with ``out``, its five tensors themselves (in their
        own shapes and dtypes); else float32 contiguous dq, dk ``[NQ, T, K]`` (summed over the
        value heads of a group), dv ``[N, T, V]``, dg ``[N, T, K]`` (``[N, T]`` with
        ``scalar_gate``), dbeta ``[N, T]``. dh0 ``[N, K, V]`` float32 (None without
        ``initial_state``). Gradients of broadcast inputs (a stride-0 lead dim) are per row, not
        summed.

    Raises:
        ValueError: wrong ranks or shapes, an unsupported dtype, inputs on several devices, a
            chunk not in :data:`CHUNKS`, a bad config or ``saved``, an ``out`` that is not five
            tensors of the gradients' shapes (or lead-dim forms), float dtypes and device, or
            one overlapping itself (:func:`_check_out`).
    """
    dims, states_in, wsp = _check_inputs(q, k, v, g, beta, do, initial_state, d_final_state, scalar_gate, chunk, saved,
                                    out)
    nq, n, t, kd, vd, group = dims
    dev = q.device
    f32 = torch.float32
    if t == 0 or n == 0 or kd == 0 or vd == 0:
        return _empty_grads(dims, scalar_gate, initial_state, d_final_state, dev, out)
    cfg = _config(config, dev, kd)
    interpret = launch.interpreted(dev)
    # every input's rows as at most two stride groups (a contiguous copy only for three or more)
    (q, rw_q), (k, rw_k), (v, rw_v), (g, rw_g), (beta, rw_b), (do, rw_do) = (
        input_rows(x, tail) for x, tail in ((q, 2), (k, 2), (v, 2), (g, 1 if scalar_gate else 2), (beta, 1),
                                            (do, 2)))

    def st(x, rows, tail=2):  # the kernels' stride arguments of an input: its row groups, then time (and feature)
        return (*rows, *x.stride()[-tail:])

    _, mod = _module(bool(scalar_gate), interpret)
    all32 = all(x.dtype == f32 for x in (q, k, v, g, beta, do))
    precision = launch.dot_precision(f32) if all32 else "tf32"
    bt, bvs = int(chunk), cfg["BLOCK_VS"]
    kc = {kern: kernel_config(cfg, kern) for kern in PARALLEL}
    bkf = max(16, launch.next_power_of_2(kd))
    nc = launch.cdiv(t, bt)
    nvs = launch.cdiv(vd, bvs)
    ws = cfg["num_warps_state"]
    emp = launch.empty

    tp = nc * bt  # scratch rows per head: T padded to whole chunks (the forward's workspace layout)
    sd = {"float32": f32, "bfloat16": torch.bfloat16}.get(cfg["scratch"])
    if sd is None:  # auto
        sd = f32 if all(x.dtype == f32 for x in (q, k, v, do)) else torch.bfloat16
    if wsp is None:
        g_c = emp((n, tp) if scalar_gate else (n, tp, kd), f32, dev)
        e_g = emp((n, nc) if scalar_gate else (n, nc, kd), f32, dev)
        a_kk, a_qk, m_inv = (emp((n, tp, bt), f32, dev) for _ in range(3))
        w_b, k_g = (emp((n, tp, kd), sd, dev) for _ in range(2))
        # U stays float32 (as Δ, dΔ below): Δ = U − W S cancels, and bfloat16 U / Δ cost ~5e-3 in dq
        u_b = emp((n, tp, vd), f32, dev)
    else:  # the forward's: KG = Kd = k e^{γ − G}, M = X, e^γ from G_C
        g_c, a_kk, a_qk, m_inv, w_b, k_g, u_b = (wsp[key] for key in ("gcum", "a_kk", "a_qk", "xm", "w", "kd", "u"))
        e_g = torch.exp(wsp["g_last"][..., 0] if scalar_gate else wsp["g_last"])
    d_aqk, d_akk = (emp((n, tp, bt), f32, dev) for _ in range(2))
    delta, d_delta = (emp((n, tp, vd), f32, dev) for _ in range(2))
    d_states = emp((n, nc, kd, vd), sd, dev)
    r_q = emp((n, nc, kd, vd), sd, dev)   # QG^T dO per chunk (kda_bwd_prep for kda_bwd_dstates)
    states = states_in if states_in is not None else emp((n, nc, kd, vd), sd, dev)
    # the gradients: out's tensors (written through their row groups, or a temporary for three
    # groups), else new float32 ones; dq, dk per value head in float32 scratch when group > 1, summed
    # below; dk4 (kda_bwd_intra1's term of dk, read back by kda_bwd_intra2) kept float32
    shapes = _grad_shapes(dims, scalar_gate)
    grads = tuple(out) if out is not None else tuple(emp(shape, f32, dev) for shape in shapes)
    (dq_a, rw_dq), (dk_a, rw_dk), (dv_a, rw_dv), (dg_a, rw_dg), (db_a, rw_db) = (
        _out_rows(x, len(shape) - 1, shape, dev) if group == 1 or i > 1 else (x, None)
        for i, (x, shape) in enumerate(zip(grads, shapes)))
    if group > 1:
        dq_v, dk_v = emp((n, t, kd), f32, dev), emp((n, t, kd), f32, dev)
        rw_dq = rw_dk = (1, dq_v.stride(0), 0)
        dk4, rw_dk4 = dk_v, rw_dk
    elif dk_a.dtype == f32:
        dq_v, dk_v = dq_a, dk_a
        dk4, rw_dk4 = dk_a, rw_dk
    else:
        dq_v, dk_v = dq_a, dk_a
        dk4 = emp((n, t, kd), f32, dev)
        rw_dk4 = (1, dk4.stride(0), 0)
    dh0 = emp((n, kd, vd), f32, dev) if initial_state is not None else None
    h0 = initial_state if initial_state is not None else delta      # a placeholder pointer, never read
    dht = d_final_state if d_final_state is not None else delta
    h0_st = initial_state.stride() if initial_state is not None else (0, 0, 0)
    dht_st = d_final_state.stride() if d_final_state is not None else (0, 0, 0)
    common = dict(KD=kd, VD=vd, BT=bt, INPUT_PRECISION=precision)

    sst = cfg["num_stages_state"]

    def par(kern):  # the constexprs and warps of a parallel kernel; its stages
        c = kc[kern]
        return dict(BK=c["BLOCK_K"], BV=c["BLOCK_V"], num_warps=c["num_warps"], **common), c["num_stages"]
    with launch.launching(interpret):
        if wsp is None:
            _launch(mod.kda_bwd_prep, (nc, n), (
                q, k, v, g, beta, do, g_c, a_kk, a_qk, m_inv, w_b, u_b, k_g, e_g, d_delta, r_q,
                *st(q, rw_q), *st(k, rw_k), *st(v, rw_v), *st(g, rw_g, 1 if scalar_gate else 2), *st(beta, rw_b, 1),
                *st(do, rw_do), t, nc, group, float(scale)), *par("prep"))
        else:
            _launch(mod.kda_bwd_prep_saved, (nc, n), (wsp["qg"], a_qk, do, d_delta, r_q, *st(do, rw_do), t, nc),
                    *par("prep"))
        if cfg["fuse_sequential"] and states_in is None:
            # the two recurrences side by side in one launch (even programs S, odd ones dS')
            _launch(mod.kda_bwd_seq, (2 * nvs, n), (
                k_g, e_g, w_b, u_b, h0, states, delta, r_q, dht, dh0 if dh0 is not None else delta, d_states,
                d_delta, *h0_st, *states.stride(), *dht_st, t, nc),
                dict(BKF=bkf, BV=bvs, HAS_H0=initial_state is not None, HAS_DHT=d_final_state is not None,
                     num_warps=ws, **common), sst)
        else:
            _launch(mod.kda_bwd_states, (nvs, n, nc if states_in is not None else 1), (
                k_g, e_g, w_b, u_b, h0, states, delta,
                *h0_st, *states.stride(), t, nc),
                dict(BKF=bkf, BV=bvs, HAS_H0=initial_state is not None, LOAD_STATES=states_in is not None,
                     num_warps=ws, **common), sst)
            _launch(mod.kda_bwd_dstates, (nvs, n), (
                k_g, r_q, e_g, w_b, dht, dh0 if dh0 is not None else delta, d_states, d_delta,
                *dht_st, t, nc),
                dict(BKF=bkf, BV=bvs, HAS_DHT=d_final_state is not None, HAS_H0=initial_state is not None,
                     num_warps=ws, **common), sst)
        _launch(mod.kda_bwd_intra1, (nc, n), (
            k, v, beta, do, g_c, a_kk, m_inv, states, delta, d_delta, d_aqk, d_akk,
            dk4, dv_a, db_a,
            *st(k, rw_k), *st(v, rw_v), *st(beta, rw_b, 1), *st(do, rw_do),
            *st(dk4, rw_dk4), *st(dv_a, rw_dv), *st(db_a, rw_db, 1), *states.stride(),
            t, group), *par("intra1"))
        _launch(mod.kda_bwd_intra2, (nc, n, 1 if scalar_gate else launch.cdiv(kd, kc["intra2"]["BLOCK_K"])), (
            q, k, do, g_c, states, d_states, delta, d_aqk, d_akk,
            dk4, dq_v, dk_v, dg_a,
            *st(q, rw_q), *st(k, rw_k), *st(do, rw_do),
            *st(dk4, rw_dk4), *st(dq_v, rw_dq), *st(dk_v, rw_dk), *st(dg_a, rw_dg, 1 if scalar_gate else 2),
            *states.stride(), t, nc, group, float(scale)), *par("intra2"))
    dq, dk, dv, dg, dbeta = grads
    if group > 1:
        # the sum over each group's value heads, written into dq, dk in their own layouts
        for x, per_head in ((dq, dq_v), (dk, dk_v)):
            torch.sum(per_head.view(*x.shape[:-2], group, t, kd), dim=x.dim() - 2, out=x)
    else:
        finish_out(dq, dq_a)
        finish_out(dk, dk_a)
    for x, x_arg in ((dv, dv_a), (dg, dg_a), (dbeta, db_a)):
        finish_out(x, x_arg)
    return dq, dk, dv, dg, dbeta, dh0


def _empty_grads(dims, scalar_gate, initial_state, d_final_state, device, out=None):
    """The gradients when there is nothing to compute (T, N, K or V zero; ``dims`` = (NQ, N, T,
    K, V, group)): zeros in :func:`backward`'s shapes (``[NQ, T, K]``, ..., whatever the inputs'
    lead dims), or ``out``'s tensors zeroed; dh0 the gradient of the final state (the final
    state is the initial state when T = 0)."""
    f32 = torch.float32
    dh0 = None
    if initial_state is not None:
        dh0 = torch.zeros(initial_state.shape, dtype=f32, device=device)
        if d_final_state is not None and dims[2] == 0:
            dh0 += d_final_state.to(f32)
    if out is not None:
        return (*(x.zero_() for x in out), dh0)
    return (*(torch.zeros(shape, dtype=f32, device=device) for shape in _grad_shapes(dims, scalar_gate)), dh0)
