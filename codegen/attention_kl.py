"""Attention-KL kernels (Triton, base 2): launchers, allocation (config tables: ``attention_kl_configs.py``).

Per query row, the Kullback-Leibler divergence of a teacher attention distribution from a
student's over the same keys, ``L_i = Σ_j P1_ij (log P1_ij − log P2_ij)`` (natural log), with
``P1 = softmax(scale1 · Q1 K1ᵀ + mask)`` and ``P2 = softmax(scale2 · Q2 K2ᵀ + mask)`` — without
ever materialising a score matrix (math in ``docs/math.md``; float64 reference in
``patterns/attention_kl_reference.py``).

Forward (``templates/attention_kl_fwd.py.jinja``): grid ``(cdiv(Nq, BLOCK_M), B·H)``; each program
streams both sides' key tiles with running ``m1, l1, m2, l2`` and the offset-free accumulator,
and writes ``rows`` (nats) and, when asked, the base-2 statistics ``LSE1, LSE2, DELTA`` the
backward needs. ``split_k > 1`` (for grids too small to fill the GPU) adds a grid axis over key
ranges; each split stores its partial state and ``attention_kl_fwd_merge`` combines them exactly.

Backward (``templates/attention_kl_bwd.py.jinja``), for upstream ``g = dLoss/dL``:
``bwd_mode="two_kernel"`` — ``attention_kl_bwd_dk`` (grid over key blocks × B·Hkv, summing each kv
head's query-head group inside, no atomics) and ``attention_kl_bwd_dq`` (grid over query blocks ×
B·H), each recomputing P1 and P2; deterministic — or ``bwd_mode="atomic_dq"`` — one
``attention_kl_bwd_dk`` that also ``atomic_add``s dQ1, dQ2 into float32 accumulators. With a frozen
teacher (``needs_grad`` false for q1 and k1) a variant without any side-1 gradient work is used
(P1 is still recomputed: dS2 = g·(P2 − P1)). When the two sides group query heads differently
(``Hkv1 != Hkv2``) and both dK are wanted, the dK kernel is launched once per side.

Static variants are chosen at render time (causal or not, mask kind, row-broadcast mask, stats
stored or not, split-K or not, bwd mode, teacher trainable or frozen, interpreter or GPU, the fill
flags below); sizes are runtime arguments (sequence lengths are ``do_not_specialize``). Block
sizes come from one table via :func:`candidate_configs`.

Fills (hidden entries with finite scores, as eager gives ``masked_fill(m, -1e4)`` or a
``finfo.min`` mask): per side, a boolean mask's hidden entry takes ``mask_fill1`` / ``mask_fill2``
(replace: no gradient to its score) and an entry above the causal diagonal takes, or gets added,
``causal_fill1`` / ``causal_fill2`` (``causal_fill_mode`` "replace" / "add"; "add" passes the
gradient). The values are runtime float arguments (base 2 inside, clamped to ±FLT_MAX); ``-inf``
means hidden and renders today's variants unchanged (causal tile skipping included). A finite
causal fill visits every key tile. :func:`fill_variant` maps the values to the render flags
``mask_fill_finite`` and ``causal_fill`` ("hide" | "replace" | "add"). The backward treats
replaced entries as hidden (they pass no gradient; their share of the softmax is in the
statistics) and so keeps the tile skipping except for "add".

Two-part statistics: where a row max can be a huge finite value (finite fills, additive masks;
:func:`two_part_stats`), ``LSE = m + log2 l`` cannot hold ``log2 l`` next to ``|m| ~ 3e38``, and
``DELTA = acc/l1 + m1 − m2`` cancels catastrophically. Those variants store per side
``[2, B, H, Nq]`` (plane 0 the row max m, plane 1 log2 l; ``(0, +inf)`` for an empty row) and the
offset-free ``DELTA = acc/l1 = E_P1[(s1 − m1) − (s2 − m2)]``; the backward computes
``a = s − m``, ``P = exp2(a − log2 l)`` and ``dS1 ∝ P1 ((a1 − a2) − DELTA)``. Other variants keep
``LSE1, LSE2, DELTA`` ``[B, H, Nq]`` and their code.

Zeroed hidden terms (``zero_hidden``; MiniLM-style losses that fill with ``finfo.min`` and then
``masked_fill(m, 0)`` the KL terms): ``L_i = Σ_{j∈V_i} P1_ij r_ij`` over the visible keys only, the
hidden ones (the boolean mask or the causal structure hides them, whatever their fill) still
counting in both softmaxes. Only variants with a finite fill have hidden entries with mass, so
:func:`zero_hidden_flag` drops the flag elsewhere (``-inf`` hides: nothing to zero; today's
code). The forward keeps side 1's row sum in two parts, visible ``lv1`` and hidden ``lh1``
(each summed from its own entries), and ``acc`` over the visible entries; it stores side 1's
statistics ``[4, B, H, Nq]`` (planes: row max m1, log2 l1, the hidden mass ``h1 = lh1 / l1``,
the visible mass ``w1 = lv1 / l1``; ``(0, +inf, 0, 0)`` for an empty row), side 2's ``[2, B, H,
Nq]`` as above, and ``DELTA = acc / l1 − h1 (log2(l2 / l1) + log2 e)``. With ``c = log2(l2 / l1) +
log2 e`` and ``E = DELTA + c`` (0 where ``w1 = 0``) the backward computes, for upstream g,
visible ``dS1 = g P1 ln2 ((a1 − a2) − DELTA)``, ``dS2 = g (w1 P2 − P1)``; hidden entries a
causal ``"add"`` shifted ``dS1 = −g P1 ln2 E``, ``dS2 = g w1 P2``; replaced entries none.
These are ``dL/dS1_k = [k∈V] P1_k (r_k + 1) − P1_k (L + w1)`` and ``dL/dS2_k = −[k∈V] P1_k + w1 P2_k``
(natural units; with V = all keys, today's formulas). A teacher that fills hidden entries which
the student hides (``-inf``) has an infinite full KL but a finite zeroed one: the kernels give it
(side 2 of a row without any finite score stores ``(0, +inf)``).

Shapes: q1 ``[B, H, Nq, D1]``, k1 ``[B, Hkv1, Nk, D1]``, q2 ``[B, H, Nq, D2]``, k2
``[B, Hkv2, Nk, D2]`` (any strides, never copied); ``H % Hkv1 == H % Hkv2 == 0`` (query head h
reads kv head ``h // (H // Hkv)`` of each side); D1, D2 in 1..256 (padded to powers of two
inside); fp32 / fp16 / bf16, one dtype for all four.

Limits:
- A row whose visible scores all carry a huge finite bias (``finfo.min``) is uniform on both
  sides (the scores' O(1) parts are lost, as in eager and in the float64 reference): L = 0 and
  zero gradients there, exactly as the reference computes.
- Rows whose every entry is ``-inf`` on side 1 give L = 0 and zero gradient (eager: NaN).
- Fills under which side 1 keeps mass where side 2's score is ~1e38 lower (e.g. a moderate fill
  on one side, ``finfo.min`` on the other) have a KL of ~1e38: the kernels saturate (float32).
- ``B·H`` (and ``B·Hkv``) are the grids' second axis; above CUDA's 65535 a launch is split into slices
  of rows (``launch.jit_call``, ``ROW_BASE``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from . import launch, variants
from .launch import DTYPES
from .attention_kl_configs import candidate_configs
from .render import RenderedKernel, render

__all__ = [
    "forward",
    "backward",
    "alloc_rows",
    "alloc_stats",
    "alloc_grads",
    "kernels_for",
    "fwd_kernel",
    "bwd_kernel",
    "fill_variant",
    "two_part_stats",
    "zero_hidden_flag",
    "stat_planes",
    "candidate_configs",
    "default_split_k",
    "atomic_dq_chunks",
    "ATOMIC_DQ_WORKSPACE_BYTES",
    "CAUSAL_MODES",
    "MASK_KINDS",
    "BWD_MODES",
    "CAUSAL_FILLS",
    "CAUSAL_FILL_MODES",
]

# the kernel families' shared vocabulary, re-exported for callers of this family
CAUSAL_MODES, MASK_KINDS, BWD_MODES = variants.CAUSAL_MODES, variants.MASK_KINDS, variants.BWD_MODES

LOG2E = 1.4426950408889634
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256
MAX_SPLIT_K = 16
# Bound on the float32 dQ accumulators of the atomic_dq backward (16-bit inputs): larger
# problems run the backward in head/batch chunks (see atomic_dq_chunks).
ATOMIC_DQ_WORKSPACE_BYTES = 32 * 2**20

# How a causal variant treats the entries above the diagonal (render time): "hide" (-inf, tiles
# skipped), "replace" (a runtime fill value per side), "add" (a runtime value per side added)
CAUSAL_FILLS = ("hide", "replace", "add")
CAUSAL_FILL_MODES = ("replace", "add")
_CAUSAL_FILL_SUFFIX = {"hide": "", "replace": "_causalfill", "add": "_causaladd"}
FLT_MAX = 3.4028234663852886e38

FWD_TEMPLATE = "attention_kl_fwd.py.jinja"
BWD_TEMPLATE = "attention_kl_bwd.py.jinja"



# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------



def _fill_flags(causal: bool, mask_kind: str, mask_fill_finite: bool, causal_fill: str) -> tuple[bool, str]:
    """The render-time fill flags, normalised: a mask fill only exists for boolean masks, a
    causal fill only for causal variants (so no variant is rendered twice under two names)."""
    if causal_fill not in CAUSAL_FILLS:
        raise ValueError(f"causal_fill must be one of {CAUSAL_FILLS}, got {causal_fill!r}")
    return (bool(mask_fill_finite) and mask_kind in ("bool_keep", "bool_drop"),
            causal_fill if causal else "hide")


def zero_hidden_flag(zero_hidden: bool, mask_kind: str, mask_fill_finite: bool = False,
                     causal_fill: str = "hide") -> bool:
    """Whether a variant asked for ``zero_hidden`` really zeroes hidden terms: only where a hidden
    entry can carry mass (a finite mask fill on a boolean mask, or a finite causal fill). With
    ``-inf`` fills every hidden entry has P1 = 0 and today's code computes the same."""
    return bool(zero_hidden) and ((bool(mask_fill_finite) and mask_kind in ("bool_keep", "bool_drop"))
                                  or causal_fill != "hide")


def stat_planes(mask_kind: str, mask_fill_finite: bool = False, causal_fill: str = "hide",
                zero_hidden: bool = False) -> tuple[int, int]:
    """The statistics layout of a variant, ``(planes of lse1, planes of lse2)``: ``(0, 0)`` for
    ``[B, H, Nq]`` each (LSE), ``(2, 2)`` for two-part statistics ``[2, B, H, Nq]`` (row max,
    log2 l), ``(4, 2)`` with ``zero_hidden`` (side 1 adds the hidden and visible masses h1, w1).
    ``delta`` is always ``[B, H, Nq]``."""
    if not two_part_stats(mask_kind, mask_fill_finite, causal_fill):
        return 0, 0
    return (4 if zero_hidden_flag(zero_hidden, mask_kind, mask_fill_finite, causal_fill) else 2), 2


def _head(causal: bool, mask_kind: str, row: bool, mask_fill: bool = False, causal_fill: str = "hide",
          zero_hidden: bool = False) -> str:
    head = ("_causal" if causal else "") + variants.MASK_SUFFIX[mask_kind]
    head += "_rowbcast" if mask_kind != "none" and row else ""
    head += ("_maskfill" if mask_fill else "") + _CAUSAL_FILL_SUFFIX[causal_fill]
    return head + ("_zerohidden" if zero_hidden else "")


def fwd_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, need_stats: bool, split_k: bool,
               interpret: bool, mask_fill_finite: bool = False, causal_fill: str = "hide",
               zero_hidden: bool = False) -> RenderedKernel:
    """Render the forward module of one static variant (``causal``: a mode or a bool).

    ``mask_fill_finite``: a boolean mask's hidden entries take runtime fill values instead of
    being skipped; ``causal_fill``: ``"hide"`` (entries above the diagonal skipped, tiles
    skipped), ``"replace"`` or ``"add"`` (runtime fill values, every tile visited); see
    :func:`fill_variant`. ``zero_hidden``: the KL sums the visible entries only (see
    :func:`zero_hidden_flag`: ignored without a finite fill). The defaults render today's variants.
    """
    variants.check_variant(causal, mask_kind)
    causal = variants.is_causal(causal)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    mask_fill, causal_fill = _fill_flags(causal, mask_kind, mask_fill_finite, causal_fill)
    zero = zero_hidden_flag(zero_hidden, mask_kind, mask_fill, causal_fill)
    name = ("attention_kl_fwd" + _head(causal, mask_kind, row, mask_fill, causal_fill, zero)
            + ("" if need_stats else "_nostats") + ("_splitk" if split_k else "") + ("_interp" if interpret else ""))
    return render(
        FWD_TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
        need_stats=bool(need_stats), split_k=bool(split_k), interpret=bool(interpret),
        mask_fill_finite=mask_fill, causal_fill=causal_fill, zero_hidden=zero,
    )


def bwd_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, bwd_mode: str, teacher_grad: bool,
               interpret: bool, mask_fill_finite: bool = False, causal_fill: str = "hide",
               zero_hidden: bool = False) -> RenderedKernel:
    """Render the backward module (dK kernel and, for two_kernel, the dQ kernel); the fill
    flags as for :func:`fwd_kernel` (they pick the statistics layout and, for ``"add"``, the
    per-element causal bias and no tile skipping); ``zero_hidden`` as there."""
    variants.check_variant(causal, mask_kind, bwd_mode)
    causal = variants.is_causal(causal)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    mask_fill, causal_fill = _fill_flags(causal, mask_kind, mask_fill_finite, causal_fill)
    zero = zero_hidden_flag(zero_hidden, mask_kind, mask_fill, causal_fill)
    name = ("attention_kl_bwd" + _head(causal, mask_kind, row, mask_fill, causal_fill, zero)
            + ("" if teacher_grad else "_frozen") + ("_atomicdq" if bwd_mode == "atomic_dq" else "")
            + ("_interp" if interpret else ""))
    return render(
        BWD_TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
        atomic_dq=bwd_mode == "atomic_dq", teacher_grad=bool(teacher_grad), interpret=bool(interpret),
        mask_fill_finite=mask_fill, causal_fill=causal_fill, zero_hidden=zero,
    )


def kernels_for(
    *,
    causal,
    mask_kind: str,
    mask_row_broadcast: bool,
    split_k: bool,
    bwd_mode: str,
    interpret: bool,
    training: bool,
    teacher_grad: bool,
    mask_fill_finite: bool = False,
    causal_fill: str = "hide",
    zero_hidden: bool = False,
) -> list[RenderedKernel]:
    """The kernel modules a call of this static variant uses, rendered but not launched.

    ``training`` adds the backward module and makes the forward store the statistics
    (LSE1, LSE2, DELTA, or the two-part ones) the backward reads; ``teacher_grad`` picks the
    backward with side-1 gradients (else the frozen-teacher one). ``mask_fill_finite``,
    ``causal_fill``: the fill flags, from the fill values by :func:`fill_variant`;
    ``zero_hidden``: the hidden entries' KL terms zeroed (:func:`zero_hidden_flag`).
    """
    fills = dict(mask_fill_finite=mask_fill_finite, causal_fill=causal_fill, zero_hidden=zero_hidden)
    kernels = [
        fwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=mask_row_broadcast,
                   need_stats=training, split_k=split_k, interpret=interpret, **fills)
    ]
    if training:
        kernels.append(
            bwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=mask_row_broadcast,
                       bwd_mode=bwd_mode, teacher_grad=teacher_grad, interpret=interpret, **fills)
        )
    return kernels


def fill_variant(causal, mask_kind: str, mask_fill1: float = -math.inf, mask_fill2: float = -math.inf,
                 causal_fill1: float = -math.inf, causal_fill2: float = -math.inf,
                 causal_fill_mode: str = "replace") -> dict:
    """The render-time fill flags ``{"mask_fill_finite", "causal_fill"}`` of a call with these
    fill values (natural-log units, the scores each side's softmax sees).

    A boolean mask's hidden entries are replaced by ``mask_fill1`` (teacher) / ``mask_fill2``
    (student); entries above the causal diagonal get ``causal_fill1`` / ``causal_fill2`` by
    ``causal_fill_mode`` (``"replace"`` or ``"add"``). ``-inf`` hides (today's behaviour, tile
    skipping for causal); a finite value on either side makes the variant a fill variant (a
    side may still be ``-inf``: its entries are then hidden, per element). Raises
    ``ValueError`` for NaN or ``+inf`` fills, an unknown mode, or a finite fill without the
    mask or causal structure it belongs to.
    """
    variants.check_variant(causal, mask_kind)
    if causal_fill_mode not in CAUSAL_FILL_MODES:
        raise ValueError(f"causal_fill_mode must be one of {CAUSAL_FILL_MODES}, got {causal_fill_mode!r}")
    fills = dict(mask_fill1=mask_fill1, mask_fill2=mask_fill2, causal_fill1=causal_fill1, causal_fill2=causal_fill2)
    for name, value in fills.items():
        value = float(value)
        if math.isnan(value) or value == math.inf:
            raise ValueError(f"{name} must be finite or -inf, got {value}")
    mask_finite = mask_fill1 != -math.inf or mask_fill2 != -math.inf
    causal_finite = causal_fill1 != -math.inf or causal_fill2 != -math.inf
    if mask_finite and mask_kind not in ("bool_keep", "bool_drop"):
        raise ValueError(f"a finite mask_fill needs a boolean mask, got mask_kind {mask_kind!r}")
    if causal_finite and not variants.is_causal(causal):
        raise ValueError("a finite causal_fill needs a causal mode")
    return {"mask_fill_finite": mask_finite, "causal_fill": causal_fill_mode if causal_finite else "hide"}


def two_part_stats(mask_kind: str, mask_fill_finite: bool = False, causal_fill: str = "hide") -> bool:
    """Whether a variant keeps two-part statistics (per side the row max and log2 l, plus the
    offset-free DELTA): an additive mask or a finite fill can make a row max a huge finite value."""
    return (mask_kind == "additive" or (bool(mask_fill_finite) and mask_kind in ("bool_keep", "bool_drop"))
            or causal_fill != "hide")


def _base2_fill(value: float) -> float:
    """A fill in natural units as the kernels' base-2 score, kept finite (finfo.min * log2(e)
    would overflow float32; -inf stays -inf)."""
    if value == -math.inf:
        return value
    return min(max(float(value) * LOG2E, -FLT_MAX), FLT_MAX)


@functools.lru_cache(maxsize=None)
def _fwd_module(causal, mask_kind: str, row: bool, need_stats: bool, split_k: bool, interpret: bool,
                mask_fill_finite: bool = False, causal_fill: str = "hide", zero_hidden: bool = False):
    """The imported forward module of one static variant (rendered once per process)."""
    kernel = fwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, need_stats=need_stats,
                        split_k=split_k, interpret=interpret, mask_fill_finite=mask_fill_finite,
                        causal_fill=causal_fill, zero_hidden=zero_hidden)
    return kernel, launch.kernel_module(kernel, interpret)


@functools.lru_cache(maxsize=None)
def _bwd_module(causal, mask_kind: str, row: bool, bwd_mode: str, teacher_grad: bool, interpret: bool,
                mask_fill_finite: bool = False, causal_fill: str = "hide", zero_hidden: bool = False):
    """The imported backward module of one static variant (rendered once per process)."""
    kernel = bwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, bwd_mode=bwd_mode,
                        teacher_grad=teacher_grad, interpret=interpret, mask_fill_finite=mask_fill_finite,
                        causal_fill=causal_fill, zero_hidden=zero_hidden)
    return kernel, launch.kernel_module(kernel, interpret)


@functools.lru_cache(maxsize=None)
def _table_configs(d1: int, d2: int, dtype: torch.dtype, device: torch.device, causal, kind: str,
                   teacher_grad: bool) -> list[dict]:
    # cached: the launchers only read these dicts
    cands = candidate_configs(head_dim1=d1, head_dim2=d2, dtype=dtype, device=device, causal=causal, kind=kind,
                              teacher_grad=teacher_grad)
    return [launch.check_config(c) for c in cands]


def _configs(config: Optional[dict], q1, q2, causal, kind: str, teacher_grad: bool = True) -> list[dict]:
    """The given config alone (missing keys from the default), or every candidate (default first)."""
    cands = _table_configs(q1.shape[-1], q2.shape[-1], q1.dtype, q1.device, causal, kind, teacher_grad)
    if config:
        return [launch.check_config({**cands[0], **config})]
    return cands


def default_split_k(b: int, h: int, n_q: int, n_k: int, device, config: Optional[dict] = None) -> int:
    """How many key ranges to split each query block's keys into.

    1 when the one-pass grid ``cdiv(Nq, BLOCK_M) · B·H`` already fills about two waves of the
    GPU's SMs (and always on the interpreter); else enough splits to reach two waves, capped so
    that each split keeps at least 4 key tiles and at :data:`MAX_SPLIT_K`. ``config`` supplies
    BLOCK_M / BLOCK_N (default 128 / 64, the common 16-bit forward tiles).
    """
    if launch.interpreted(device):
        return 1
    config = config or {}
    block_m, block_n = config.get("BLOCK_M", 128), config.get("BLOCK_N", 64)
    programs = b * h * launch.cdiv(n_q, block_m)
    target = 2 * launch.sm_count(device)
    if programs == 0 or programs >= target:
        return 1
    split = launch.cdiv(target, programs)
    split = min(split, launch.cdiv(n_k, block_n) // 4, MAX_SPLIT_K)
    return max(1, split)


# --------------------------------------------------------------------------------------------
# Allocation (also used by the fake/meta implementations: shapes, dtypes and devices only)
# --------------------------------------------------------------------------------------------


def alloc_rows(q1: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[B, H, Nq]`` float32, contiguous (KL per query row, nats)."""
    b, h, n, _ = q1.shape
    return launch.empty((b, h, n), torch.float32, q1.device)


def alloc_stats(q1: torch.Tensor, two_part: bool = False, planes: int = 2) -> torch.Tensor:
    """One statistic, float32, contiguous, base 2: ``[B, H, Nq]`` (LSE1, LSE2 or DELTA), or with
    ``two_part`` one side's two-part statistics ``[planes, B, H, Nq]`` (plane 0 the row max,
    plane 1 log2 of the row sum; side 1 of a ``zero_hidden`` variant has ``planes=4``: plane 2
    the hidden mass h1, plane 3 the visible mass w1; see :func:`stat_planes`)."""
    b, h, n, _ = q1.shape
    return launch.empty((planes, b, h, n) if two_part else (b, h, n), torch.float32, q1.device)


def alloc_grads(q1, k1, q2, k2, needs_grad: Sequence[bool] = (True, True, True, True)):
    """``(dq1, dk1, dq2, dk2)``: contiguous tensors shaped and typed like the inputs; ``None``
    where not needed."""
    return tuple(
        launch.empty(t.shape, t.dtype, t.device) if need else None
        for t, need in zip((q1, k1, q2, k2), needs_grad)
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------



def _check_inputs(q1, k1, q2, k2, causal, mask, mask_kind) -> None:
    variants.check_variant(causal, mask_kind)
    if isinstance(causal, bool):
        raise ValueError("causal must be a mode string here: 'none', 'top_left' or 'bottom_right'")
    ts = (q1, k1, q2, k2)
    if any(t.dim() != 4 for t in ts):
        raise ValueError("q1, k1, q2, k2 must be 4-D [B, H, N, D]")
    if len({t.dtype for t in ts}) != 1 or q1.dtype not in DTYPES:
        raise ValueError(f"q1, k1, q2, k2 must share one dtype of {DTYPES}, got {[t.dtype for t in ts]}")
    if len({t.device for t in ts}) != 1:
        raise ValueError(f"q1, k1, q2, k2 must be on one device, got {[t.device for t in ts]}")
    b, h, n_q, d1 = q1.shape
    n_k = k1.shape[2]
    if q2.shape[:3] != (b, h, n_q) or k1.shape[0] != b or k2.shape[0] != b or k2.shape[2] != n_k:
        raise ValueError(
            f"both sides need the same B, H, Nq, Nk: q1 {tuple(q1.shape)}, k1 {tuple(k1.shape)}, "
            f"q2 {tuple(q2.shape)}, k2 {tuple(k2.shape)}"
        )
    for side, q, k in ((1, q1, k1), (2, q2, k2)):
        if k.shape[3] != q.shape[3]:
            raise ValueError(f"q{side} and k{side} head dims differ: {q.shape[3]} vs {k.shape[3]}")
        if not MIN_HEAD_DIM <= q.shape[3] <= MAX_HEAD_DIM:
            raise ValueError(f"head dims must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {q.shape[3]}")
        if k.shape[1] == 0 or h % k.shape[1]:
            raise ValueError(f"query heads ({h}) must be a multiple of k{side}'s kv heads ({k.shape[1]})")
    variants.check_mask(mask, mask_kind)


def _check_stats(q1, lse1, lse2, delta, planes: tuple[int, int]) -> None:
    """Raise ``ValueError`` unless the statistics have the layout of this variant
    (``planes``: :func:`stat_planes`)."""
    b, h, n, _ = q1.shape
    want = [(p, b, h, n) if p else (b, h, n) for p in planes]
    for name, t, shape in (("lse1", lse1, want[0]), ("lse2", lse2, want[1]), ("delta", delta, (b, h, n))):
        if t is not None and tuple(t.shape) != shape:
            layout = f"two-part [{shape[0]}, B, H, Nq]" if len(shape) == 4 else "[B, H, Nq]"
            raise ValueError(f"{name} must be {layout} = {shape} for this variant, got {tuple(t.shape)}")


def _fill_args(fills: dict, mask_fill1, mask_fill2, causal_fill1, causal_fill2, backward: bool = False) -> dict:
    """The runtime fill arguments (base 2) of a fill variant's launcher. The backward needs only
    an added causal fill (replaced entries pass no gradient and are hidden there)."""
    args = {}
    if fills["mask_fill_finite"] and not backward:
        args.update(mask_fill1=_base2_fill(mask_fill1), mask_fill2=_base2_fill(mask_fill2))
    if fills["causal_fill"] == "add" or (fills["causal_fill"] == "replace" and not backward):
        args.update(causal_fill1=_base2_fill(causal_fill1), causal_fill2=_base2_fill(causal_fill2))
    return args


def forward(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    *,
    scale1: float,
    scale2: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    need_stats: bool = True,
    split_k: int = 1,
    config: Optional[dict] = None,
    rows: Optional[torch.Tensor] = None,
    lse1: Optional[torch.Tensor] = None,
    lse2: Optional[torch.Tensor] = None,
    delta: Optional[torch.Tensor] = None,
    mask_fill1: float = -math.inf,
    mask_fill2: float = -math.inf,
    causal_fill1: float = -math.inf,
    causal_fill2: float = -math.inf,
    causal_fill_mode: str = "replace",
    zero_hidden: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per-row ``KL(P1 ‖ P2)`` with the given causal/mask/fill semantics (those of
    :func:`fuser.patterns.attention_kl_reference.reference`).

    Args:
        split_k: number of key ranges per query block (1: one pass); clamped to the number of
            key tiles. :func:`default_split_k` gives a heuristic value.
        config: launch config (missing keys from the table's default); ``None``: the table's
            candidates, the first that fits the device.
        rows, lse1, lse2, delta: output buffers to write (else allocated).
        mask_fill1, mask_fill2: the score (natural units, what each side's softmax sees) a
            boolean mask's hidden entry takes, per side (``-inf``: hidden, skipped).
        causal_fill1, causal_fill2, causal_fill_mode: the score an entry above the causal
            diagonal takes (``"replace"``) or gets added (``"add"``), per side (``-inf``: hidden,
            tiles above the diagonal skipped). See :func:`fill_variant`.
        zero_hidden: sum the KL terms of the visible entries only (entries the mask or the
            causal structure hides keep their share of both softmaxes); a no-op without a
            finite fill (:func:`zero_hidden_flag`).

    Returns:
        ``(rows, lse1, lse2, delta)``: ``rows`` ``[B, H, Nq]`` float32, L in nats (0 for a row
        with no visible key). Without finite fills or an additive mask: ``lse1, lse2`` (base 2,
        ``+inf`` for an empty row) and ``delta`` (``E_P1[s1 − s2]`` in base-2 units, 0 for an
        empty row) ``[B, H, Nq]`` float32. With them (:func:`two_part_stats`): ``lse1, lse2``
        are each side's two-part statistics ``[2, B, H, Nq]`` (row max m and log2 l, base 2;
        ``(0, +inf)`` for an empty row) and ``delta`` is offset-free,
        ``E_P1[(s1 − m1) − (s2 − m2)]`` (0 for an empty row). With an active ``zero_hidden``,
        ``lse1`` is ``[4, B, H, Nq]`` (adding plane 2 the teacher's hidden mass h1 and plane 3 its
        visible mass w1; 0 and 0 for an empty row) and ``delta`` is
        ``acc / l1 − h1 (log2(l2 / l1) + log2 e)`` over the visible entries (0 where w1 = 0);
        a row whose side 2 has no finite score stores ``(0, +inf)`` for side 2 as well.
        ``None`` each when ``need_stats`` is false.
    """
    _check_inputs(q1, k1, q2, k2, causal, mask, mask_kind)
    fills = fill_variant(causal, mask_kind, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode)
    two_part = two_part_stats(mask_kind, **fills)
    zero = zero_hidden_flag(zero_hidden, mask_kind, **fills)
    planes = stat_planes(mask_kind, **fills, zero_hidden=zero)
    b, h, n_q, d1 = q1.shape
    n_k = k1.shape[2]
    if rows is None:
        rows = alloc_rows(q1)
    if need_stats:
        lse1 = alloc_stats(q1, two_part, planes[0]) if lse1 is None else lse1
        lse2 = alloc_stats(q1, two_part, planes[1]) if lse2 is None else lse2
        delta = alloc_stats(q1) if delta is None else delta
        _check_stats(q1, lse1, lse2, delta, planes)
    else:
        lse1 = lse2 = delta = None
    if rows.numel() == 0 or n_k == 0:  # nothing to compute, or every row empty
        rows.zero_()
        if need_stats:
            for stat in (lse1, lse2):
                if two_part:
                    stat[0].zero_()
                    stat[1].fill_(math.inf)
                    stat[2:].zero_()  # zero_hidden: h1 = w1 = 0
                else:
                    stat.fill_(math.inf)
            delta.zero_()
        return rows, lse1, lse2, delta
    interpret = launch.interpreted(q1.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, h, n_q, n_k))
    row = bool(row_broadcast) and mask_kind != "none"
    configs = _configs(config, q1, q2, causal, "fwd")
    precision = launch.dot_precision(q1.dtype)
    split_k = max(1, int(split_k))
    fill_args = _fill_args(fills, mask_fill1, mask_fill2, causal_fill1, causal_fill2)

    def run(cfg):
        splits = min(split_k, launch.cdiv(n_k, cfg["BLOCK_N"]))
        kernel, module = _fwd_module(causal, mask_kind, row, bool(need_stats), splits > 1, interpret,
                                     fills["mask_fill_finite"], fills["causal_fill"], zero)
        args = [q1, k1, q2, k2, rows]
        if need_stats:
            args += [lse1, lse2, delta]
        if mask4 is not None:
            args.append(mask4)
        if splits > 1:
            # partial states: m1, l1, m2, l2, acc (zero_hidden: m1, lv1, lh1, m2, l2, acc)
            args.append(launch.empty((6 if zero else 5, splits, b * h * n_q), torch.float32, q1.device))
        with launch.launching(interpret):
            module.launch_fwd(
                *args,
                qk_scale1=float(scale1) * LOG2E,
                qk_scale2=float(scale2) * LOG2E,
                causal_offset=variants.causal_offset(causal, n_q, n_k),
                config=cfg,
                input_precision=precision,
                **fill_args,
            )

    key = ("attention_kl_fwd", causal, mask_kind, row, bool(need_stats), split_k > 1, interpret, q1.dtype,
           d1, q2.shape[-1], None if mask4 is None else mask4.dtype, precision, fills["mask_fill_finite"],
           fills["causal_fill"], zero)
    launch.launch_first_fitting(key, configs, run)
    return rows, lse1, lse2, delta


def backward(
    g_rows: torch.Tensor,
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    lse1: torch.Tensor,
    lse2: torch.Tensor,
    delta: Optional[torch.Tensor],
    *,
    scale1: float,
    scale2: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    needs_grad: Sequence[bool] = (True, True, True, True),
    bwd_mode: str = "two_kernel",
    config: Optional[dict] = None,
    mask_fill1: float = -math.inf,
    mask_fill2: float = -math.inf,
    causal_fill1: float = -math.inf,
    causal_fill2: float = -math.inf,
    causal_fill_mode: str = "replace",
    zero_hidden: bool = False,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients ``(dq1, dk1, dq2, dk2)`` of ``Σ_i g_rows_i · L_i``; ``None`` for each one
    ``needs_grad`` turns off.

    ``g_rows`` ``[B, H, Nq]`` (any strides, any float dtype); ``lse1, lse2, delta``: the
    forward's statistics (base 2; ``delta`` may be ``None`` when no side-1 gradient is wanted),
    in the layout the forward stored for the same mask kind and fills (two-part ``[2, B, H,
    Nq]`` per side where :func:`two_part_stats`). Entries a fill replaced pass no gradient to
    their scores; entries a causal ``"add"`` fill shifted do.
    ``bwd_mode``: ``"two_kernel"`` (deterministic: a dK kernel and a dQ kernel) or
    ``"atomic_dq"`` (one kernel; dQ accumulated with float32 atomics, then cast; for 16-bit
    inputs the accumulators are bounded by :data:`ATOMIC_DQ_WORKSPACE_BYTES`, larger problems
    are launched in head/batch chunks, see :func:`atomic_dq_chunks`). Without
    side-1 gradients the frozen-teacher kernels run (no DELTA term, no side-1 products).
    ``zero_hidden``: gradients of the zeroed-hidden-terms KL (as the forward's; it must match
    the forward's flag: the statistics differ, side 1's are ``[4, B, H, Nq]``).
    """
    _check_inputs(q1, k1, q2, k2, causal, mask, mask_kind)
    variants.check_variant(causal, mask_kind, bwd_mode)
    fills = fill_variant(causal, mask_kind, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode)
    zero = zero_hidden_flag(zero_hidden, mask_kind, **fills)
    planes = stat_planes(mask_kind, **fills, zero_hidden=zero)
    need = tuple(bool(x) for x in needs_grad)
    if len(need) != 4:
        raise ValueError(f"needs_grad must have 4 entries (q1, k1, q2, k2), got {needs_grad!r}")
    dq1, dk1, dq2, dk2 = alloc_grads(q1, k1, q2, k2, need)
    if not any(need):
        return None, None, None, None
    b, h, n_q, d1 = q1.shape
    n_k = k1.shape[2]
    if tuple(g_rows.shape) != (b, h, n_q):
        raise ValueError(f"g_rows must be [B, H, Nq] = {(b, h, n_q)}, got {tuple(g_rows.shape)}")
    if b * h == 0 or n_q == 0 or n_k == 0:  # nothing flows
        for t in (dq1, dk1, dq2, dk2):
            if t is not None:
                t.zero_()
        return dq1, dk1, dq2, dk2
    teacher_grad = need[0] or need[1]
    if teacher_grad and delta is None:
        raise ValueError("side-1 gradients need the forward's delta")
    _check_stats(q1, lse1, lse2, delta, planes)
    lse1, lse2 = lse1.contiguous(), lse2.contiguous()
    if delta is not None:
        delta = delta.contiguous()
    if not g_rows.is_floating_point():
        g_rows = g_rows.float()
    interpret = launch.interpreted(q1.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, h, n_q, n_k))
    row = bool(row_broadcast) and mask_kind != "none"
    configs = _configs(config, q1, q2, causal, "bwd", teacher_grad)
    kernel, module = _bwd_module(causal, mask_kind, row, bwd_mode, teacher_grad, interpret,
                                 fills["mask_fill_finite"], fills["causal_fill"], zero)
    fill_args = _fill_args(fills, mask_fill1, mask_fill2, causal_fill1, causal_fill2, backward=True)
    precision = launch.dot_precision(q1.dtype)
    outs = (dq1, dk1, dq2, dk2)
    group1, group2 = h // k1.shape[1], h // k2.shape[1]  # query heads per kv head, per side
    if bwd_mode == "atomic_dq" and q1.dtype != torch.float32:
        # float32 dQ accumulators, bounded: the launch is split into head/batch chunks
        row_bytes = 4 * (d1 * (dq1 is not None) + q2.shape[-1] * (dq2 is not None))
        chunks = atomic_dq_chunks(b, h, group1, group2, n_q * row_bytes)
    else:
        chunks = [(slice(None), slice(None))]

    def launch_chunk(cfg, bs: slice, hs: slice, workspace: list):
        if bs == hs == slice(None):  # the whole problem: no views to make (host time)
            cq1, ck1, cq2, ck2, g = q1, k1, q2, k2, g_rows
            stats, grads, cmask = [lse1, lse2, delta], [dq1, dk1, dq2, dk2], mask4
        else:
            hs1 = slice(hs.start // group1, hs.stop // group1) if hs != slice(None) else hs
            hs2 = slice(hs.start // group2, hs.stop // group2) if hs != slice(None) else hs
            sub = lambda t, heads: None if t is None else t[bs, heads]  # noqa: E731
            cq1, ck1, cq2, ck2, g = sub(q1, hs), sub(k1, hs1), sub(q2, hs), sub(k2, hs2), g_rows[bs, hs]
            # two-part statistics are [2, B, H, Nq]: the chunk keeps both planes
            stats = [None if t is None else (t[:, bs, hs] if t.dim() == 4 else t[bs, hs]).contiguous()
                     for t in (lse1, lse2, delta)]
            grads = [sub(dq1, hs), sub(dk1, hs1), sub(dq2, hs), sub(dk2, hs2)]
            cmask = sub(mask4, hs)
        args = [g, cq1, ck1, cq2, ck2, *stats, *grads]
        if cmask is not None:
            args.append(cmask)
        accs = []
        if bwd_mode == "atomic_dq":
            for i, (dq, q) in enumerate(((grads[0], cq1), (grads[2], cq2))):
                if dq is None:
                    accs.append(None)
                elif dq.dtype == torch.float32 and dq.is_contiguous():  # accumulate in place
                    accs.append(dq)
                else:  # one reused buffer per side, sized by the first (largest) chunk
                    if workspace[i] is None or workspace[i].numel() < q.numel():
                        workspace[i] = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
                    # the whole buffer as a view, not a slice, where it fits exactly (always for
                    # one chunk): written through a slice, it would be scattered back into the
                    # buffer by a copy kernel when Inductor functionalises the launch
                    ws = workspace[i] if workspace[i].numel() == q.numel() else workspace[i][: q.numel()]
                    accs.append(ws.view(q.shape))
            args += accs
        with launch.launching(interpret):
            module.launch_bwd(
                *args,
                scale1=float(scale1),
                scale2=float(scale2),
                causal_offset=variants.causal_offset(causal, n_q, n_k),
                config=cfg,
                input_precision=precision,
                **fill_args,
            )
        for dq, acc in zip((grads[0], grads[2]), accs):
            if acc is not None and acc is not dq:
                dq.copy_(acc)

    def run(cfg):
        # re-running after an OutOfResources is safe: it is raised at compile time, before the
        # first chunk writes anything; the dQ accumulators are zeroed by every launch
        workspace = [None, None]
        for bs, hs in chunks:
            launch_chunk(cfg, bs, hs, workspace)

    key = (kernel.path, "bwd", q1.dtype, d1, q2.shape[-1], None if mask4 is None else mask4.dtype, precision, need)
    launch.launch_first_fitting(key, configs, run)
    return outs


def atomic_dq_chunks(b: int, h: int, group1: int, group2: int, head_bytes: int,
                     budget: Optional[int] = None) -> list[tuple[slice, slice]]:
    """How to split an ``atomic_dq`` backward so its float32 dQ accumulators stay within budget.

    Args:
        b, h: batch size and query heads; ``group1, group2``: query heads per kv head of each side.
        head_bytes: accumulator bytes for one (batch, query head): ``4 · Nq · (D1 + D2)`` over
            the sides whose dQ is wanted.
        budget: bytes (default :data:`ATOMIC_DQ_WORKSPACE_BYTES`).

    Returns:
        ``[(batch slice, query-head slice), ...]`` covering ``[0, B) × [0, H)``; one entry
        ``(slice(None), slice(None))`` when everything fits. Head slices are whole multiples of
        ``lcm(group1, group2)`` (a dK program sums all query heads of its kv head), so one
        chunk may exceed the budget when a single such unit does (very long sequences).
    """
    budget = ATOMIC_DQ_WORKSPACE_BYTES if budget is None else budget
    if b * h * head_bytes <= budget:
        return [(slice(None), slice(None))]
    unit = math.lcm(group1, group2)
    if h * head_bytes <= budget:  # whole batches per chunk
        per = max(1, budget // (h * head_bytes))
        return [(slice(i, min(i + per, b)), slice(None)) for i in range(0, b, per)]
    heads = max(unit, (budget // (head_bytes * unit)) * unit)
    return [(slice(i, i + 1), slice(j, min(j + heads, h))) for i in range(b) for j in range(0, h, heads)]
