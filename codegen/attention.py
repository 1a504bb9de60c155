"""Attention kernels (FlashAttention-2 in Triton, base 2): launchers, allocation, config table.

Forward (``templates/attention_fwd.py.jinja``): one kernel, grid ``(cdiv(Nq, BLOCK_M), B*Hq)``,
writes ``out`` and, when asked, the softmax statistics per row (scores pre-scaled by
``scale·log₂e``): ``LSE₂ = m₂ + log₂ l`` (``+inf`` for a row with no visible key), or, in the
two-part variants (see below), ``m₂`` and ``log₂ l`` separately.

Hidden entries ("fills"): a boolean mask's hidden entries score ``mask_fill`` and entries above
the causal diagonal score ``causal_fill`` (``causal_fill_mode="replace"``) or ``s +
causal_fill`` (``"add"``), in natural-log units (the scores the softmax sees). ``-inf`` (the
default) hides them: exactly the kernels without fills, with tile skipping for causal. A finite
fill is a runtime float argument (one compiled kernel per kind, not per value); a finite
``causal_fill`` visits every key tile. A replaced score is a constant: no gradient flows to q, k
there. A fill below about ``-2.35e38`` (e.g. ``finfo(float32).min``) is held as ``-2.35e38``
(the most negative score float32 holds in base 2). With ``"add"``, a finite sum below what
float32 holds (``finfo.min`` added to a ``finfo.min`` mask entry) saturates at ``-FLT_MAX``
(base 2) instead of overflowing to ``-inf``: still finite and below every single fill, as in
float64 (float32 eager would hide that entry).

Two-part statistics: where a row's maximum can be a huge finite value (an additive mask, a
finite ``mask_fill`` with a boolean mask, a finite ``causal_fill`` with causal masking, a
finite ``pred_fill`` with a predicate; :func:`two_part_stats`), ``m₂ + log₂ l`` cannot hold
``log₂ l`` beside ``|m₂| ~ 3e38``. Those variants store ``stats`` ``[B, Hq, 2, Nq]``
float32: ``stats[:, :, 0]`` the row max ``m₂``, ``stats[:, :, 1]`` ``log₂ l`` (``+inf`` and
``0`` for a row whose scores are all ``-inf``), and the backward computes ``P = exp2((s' −
m₂) − log₂ l)``: exact on a fully filled row (``1/Nk``). The other variants keep the single
``LSE₂`` ``[B, Hq, Nq]``.

Index predicates (``mask_pred``, :mod:`~fuser.codegen.predicate`): a formula over query i and
key j (``and``/``or`` of atoms ``a*i + b*j + C[k] >= 0``; sliding windows, prefix-LM, ``j < L``)
evaluated in the kernels, with the constants ``C`` as runtime integer arguments (``PC0``, ...,
never specialised: a new length or window width does not recompile). A key the predicate drops
for a row scores ``pred_fill`` (``pred_fill_mode="replace"``, no gradient to q.k there) or ``s +
pred_fill`` (``"add"``); ``-inf`` (the default) hides it. Applied after the masks (additive,
then boolean); with causal masking it is an error (the analysis folds causal into the
predicate). Per block of query rows (dK/dV: per block of keys, roles swapped) interval
reasoning gives loop bounds: the key range outside of which every row drops every key (never
visited when hidden) and the range every row keeps entirely (tiles there skip the per-element
test); the other tiles test the predicate per element. A finite ``pred_fill`` visits every tile
and uses the two-part statistics. Kernel names carry ``_pred_<digest>`` (``_predfill_``,
``_predadd_`` for finite fills) of the predicate's canonical text. Rows the predicate hides
entirely give ``out = 0`` and zero gradients.

Loads and stores of the forward (:func:`desc_mode`, :data:`DESC_MODES`): pointers by default
(every layout, any head dim); on request (``forward(tma=...)`` or ``FUSER_ATTN_TMA=host|device``),
on Hopper with 16-bit inputs whose head dims are powers of two (16..256) and whose q, k, v, out
have a contiguous last dim, 16-byte multiple strides and 16-byte aligned data, TMA tensor
descriptors: host-built ``TensorDescriptor``s (3-D over ``[B, N, H·D]`` memory, else 4-D over
``[B, H, N, D]``) when the op runs eagerly, descriptors built in the kernel per (batch, head)
when it is traced for Inductor. Both zero-fill rows past a ragged N per head and never write
past it; GQA and strided views stay exact. Only Q, K, V, O move so (masks, statistics, the
backward: pointers). Why opt-in (H100 measurements: host descriptors faster on the GPU but ~27
us more host time per call and not usable on the traced path; device-built ones slower than
pointers): :func:`desc_mode`. Offline (Triton 3.9, sm90): the descriptor paths' main loop is the
minimal descriptor kernel's (same TTGIR ops), 0 bytes of spills where the pointer path spills
160 bytes (128x64, 4 warps) and 16 bytes (128x128, 8 warps).

Backward (``templates/attention_bwd.py.jinja``): ``attention_bwd_preprocess`` (``delta =
rowsum(dO∘O)``), then either ``bwd_mode="two_kernel"`` — ``attention_bwd_dkdv`` (grid over key
blocks × B·Hkv, summing the GQA group inside) and ``attention_bwd_dq`` (grid over query blocks ×
B·Hq), deterministic — or ``bwd_mode="atomic_dq"`` — one ``attention_bwd_dkdv`` that also
``atomic_add``s dQ into a float32 accumulator.

Static variants are chosen at render time (causal or not, mask kind, row-broadcast mask, LSE
stored or not, fills -inf or finite (and the causal fill mode), the predicate's formula and fill
kind, bwd mode, interpreter or GPU); sizes, fill values and predicate constants are runtime
arguments (sequence lengths and predicate constants are ``do_not_specialize``, floats are never
specialised, so one compiled kernel serves every length and fill value). Block sizes and warps
come from one table (:data:`_FWD_TABLE`, :data:`_BWD_TABLE`; a causal forward over at most
:data:`SHORT_CAUSAL_N` keys and queries from :data:`_FWD_SHORT_CAUSAL_TABLE`) via :func:`candidate_configs`.

Shapes: q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` (any strides, never
copied), ``Hq % Hkv == 0`` (query head h reads kv head ``h // (Hq // Hkv)``), D and Dv in
16..256 (any size; padded to a power of two inside the kernels), fp32 / fp16 / bf16.

Limits:
- Rows whose scores are all ``-inf`` (hidden) give ``out = 0`` and zero gradients (eager gives NaN).
- Scores are formed in float32: a finite fill added to a score (``"add"``, an additive mask)
  swallows the score where float32 cannot hold both (``s + finfo.min == finfo.min``, as in
  float32 eager; float64 keeps ``s`` beside fills up to about ``2^53·|s|``).
- ``B * Hq`` (and ``B * Hkv``) are the grids' second axis; above CUDA's 65535 a launch is split into
  slices of rows (``launch.jit_call``, ``ROW_BASE``).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional, Sequence

import torch

from . import launch, predicate, variants
from .render import RenderedKernel, render

__all__ = [
    "forward",
    "backward",
    "alloc_out",
    "alloc_lse",
    "two_part_stats",
    "as_predicate",
    "alloc_grads",
    "kernels_for",
    "fwd_kernel",
    "bwd_kernel",
    "candidate_configs",
    "context_length",
    "short_causal",
]

# the kernel families' shared vocabulary, re-exported for callers of this family
CAUSAL_MODES, MASK_KINDS, BWD_MODES, causal_offset = variants.CAUSAL_MODES, variants.MASK_KINDS, variants.BWD_MODES, variants.causal_offset
FILL_MODES = variants.FILL_MODES
NEG_INF = float("-inf")

LOG2E = 1.4426950408889634

DTYPES = launch.DTYPES
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256

FWD_TEMPLATE = "attention_fwd.py.jinja"

#: How the forward kernel moves Q, K, V and O (:func:`fwd_kernel`'s ``desc``): ``"none"``
#: pointer loads and stores (every layout and head dim); ``"host"`` 4-D tensor descriptors built
#: on the host (``TensorDescriptor.from_tensor`` of q, k, v, out as they are); ``"device"`` 2-D
#: descriptors per (batch, head) built in the kernel (``tl.make_tensor_descriptor``; its global
#: scratch comes from Triton's allocator). See :func:`desc_mode` for which one a call takes.
DESC_MODES = ("none", "host", "device")
_DESC_SUFFIX = {"none": "", "host": "_tmahost", "device": "_tmadev"}

#: ``FUSER_ATTN_TMA`` (read at import): ``"auto"`` (default: pointers, see :func:`desc_mode`),
#: ``"off"`` (pointers), ``"host"`` or ``"device"`` (that mode wherever the layout allows it, on
#: any path; opt-in).
TMA_SETTING = os.environ.get("FUSER_ATTN_TMA", "auto").strip().lower() or "auto"
BWD_TEMPLATE = "attention_bwd.py.jinja"
#: per-row statistics of a data mask split at the diagonal (:func:`mask_tiles_skippable`)
MASK_ROWS_TEMPLATE = "attention_mask_rows.py.jinja"
#: the mask-rows kernel's launch config (bandwidth-bound: one read of the mask)
MASK_ROWS_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4}



# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------




def _fill_kinds(causal, mask_kind: str, mask_fill: float, causal_fill: float, causal_fill_mode: str) -> tuple[str, str]:
    """(mask fill kind, causal fill kind), each ``"hide"`` (-inf or not applicable), ``"replace"``
    or ``"add"``; raises ``ValueError`` for a NaN or ``+inf`` fill or an unknown mode."""
    variants.check_fill("mask_fill", mask_fill)
    variants.check_fill("causal_fill", causal_fill, causal_fill_mode)
    return (variants.mask_fill_kind(mask_kind, mask_fill),
            variants.causal_fill_kind(causal, causal_fill, causal_fill_mode))


def as_predicate(mask_pred) -> Optional[tuple]:
    """The index predicate of a ``mask_pred`` argument, simplified: ``None`` or ``""`` (no
    predicate), a :mod:`~fuser.codegen.predicate` tuple or its serialized text. A predicate that
    simplifies to ``true`` is no predicate (the kernels without one)."""
    if mask_pred is None or (isinstance(mask_pred, str) and not mask_pred.strip()):
        return None
    pred = predicate.parse(mask_pred) if isinstance(mask_pred, str) else predicate.validate(mask_pred)
    pred = predicate.simplify(pred)
    return None if pred == predicate.TRUE else pred


def _pred_kinds(causal, mask_pred, pred_consts, pred_fill: float, pred_fill_mode: str) -> tuple[Optional[tuple], str]:
    """(simplified predicate or None, its fill kind ``"hide"``/``"replace"``/``"add"``); raises
    ``ValueError`` for a predicate with causal masking, too few constants, or a bad fill."""
    variants.check_fill("pred_fill", pred_fill, pred_fill_mode)
    if mask_pred is None or (isinstance(mask_pred, str) and not mask_pred.strip()):
        return None, "hide"
    raw = predicate.parse(mask_pred) if isinstance(mask_pred, str) else predicate.validate(mask_pred)
    if variants.is_causal(causal):
        raise ValueError("an index predicate and causal masking together are not supported: fold the causal "
                         "condition into the predicate (j <= i + offset)")
    if pred_consts is not None and len(pred_consts) < predicate.n_consts(raw):
        raise ValueError(f"the predicate {predicate.serialize(raw)} reads {predicate.n_consts(raw)} constants, "
                         f"got {len(pred_consts)}")
    pred = as_predicate(raw)
    if pred is None:
        return None, "hide"
    return pred, variants.fill_kind(True, pred_fill, pred_fill_mode)


def two_part_stats(*, causal, mask_kind: str, mask_fill: float = NEG_INF, causal_fill: float = NEG_INF,
                   causal_fill_mode: str = "replace", mask_pred=None, pred_fill: float = NEG_INF,
                   pred_fill_mode: str = "replace") -> bool:
    """Whether this variant stores two-part softmax statistics (``[B, Hq, 2, Nq]``: row max and
    log2 l) instead of one LSE ``[B, Hq, Nq]``: where a row's max can be a huge finite value (an
    additive mask, a finite ``mask_fill`` with a boolean mask, a finite ``causal_fill``, a finite
    ``pred_fill`` with a predicate)."""
    mask_fill_k, causal_fill_k = _fill_kinds(causal, mask_kind, mask_fill, causal_fill, causal_fill_mode)
    _, pred_fill_k = _pred_kinds(causal, mask_pred, None, pred_fill, pred_fill_mode)
    return mask_kind == "additive" or mask_fill_k != "hide" or causal_fill_k != "hide" or pred_fill_k != "hide"


def _suffix(causal: bool, mask_kind: str, mask_row_broadcast: bool, interpret: bool,
            mask_fill_k: str = "hide", causal_fill_k: str = "hide", pred: Optional[tuple] = None,
            pred_fill_k: str = "hide") -> tuple[str, str]:
    # fills: _causalfill / _causaladd (finite causal_fill), _maskkeepfill / _maskdropfill (finite mask_fill)
    # predicates: _pred_<digest> (dropped keys hidden), _predfill_<digest>, _predadd_<digest>
    causal_part = {"hide": "_causal", "replace": "_causalfill", "add": "_causaladd"}[causal_fill_k] if causal else ""
    if pred is not None:
        causal_part = {"hide": "_pred", "replace": "_predfill", "add": "_predadd"}[pred_fill_k] + "_" + predicate.digest(pred)
    head = causal_part + variants.MASK_SUFFIX[mask_kind] + ("fill" if mask_fill_k != "hide" else "")
    if mask_kind != "none" and mask_row_broadcast:
        head += "_rowbcast"
    return head, ("_interp" if interpret else "")


def _pred_params(pred: Optional[tuple], pred_fill_k: str, backward: bool) -> dict:
    """The template parameters of a predicate (none without one: today's renders unchanged):
    the tuple, its fill kind, and its rendered pieces (words, tile expressions, loop bounds)."""
    if pred is None:
        return {}
    consts = tuple(f"PC{k}" for k in range(predicate.n_consts(pred)))
    hull = pred_fill_k == "hide"  # with a finite fill every tile is visited: no [lo, hi) needed
    params = dict(
        mask_pred=pred,
        pred_fill=pred_fill_k,
        pred_text=predicate.describe(pred, consts),
        pred_keep=predicate.render_elementwise(pred, consts=consts),
        pred_bounds=tuple(predicate.render_bounds(pred, consts=consts, hull=hull)),
        pred_consts=consts,
        pred_helpers=predicate.FLOORDIV_HELPER if predicate.needs_floordiv(pred) else "",
    )
    if backward:
        # the dK/dV kernel: a block of keys [n_first, n_last], ranges of queries (roles swapped)
        params["pred_keep_t"] = predicate.render_elementwise(pred, i="offs_m[None, :]", j="offs_n[:, None]",
                                                             consts=consts)
        params["pred_bounds_t"] = tuple(predicate.render_bounds(predicate.swap(pred), first="n_first", last="n_last",
                                                                size="N_Q", consts=consts, hull=hull))
    return params


def fwd_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, need_lse: bool, interpret: bool,
               mask_fill: float = NEG_INF, causal_fill: float = NEG_INF,
               causal_fill_mode: str = "replace", mask_pred=None, pred_consts: Sequence[int] = (),
               pred_fill: float = NEG_INF, pred_fill_mode: str = "replace", desc: str = "none") -> RenderedKernel:
    """Render the forward kernel module of one static variant (``causal``: a mode or a bool).

    The fills matter only as ``-inf`` or finite (their values are runtime kernel arguments);
    ``mask_pred`` (see :func:`as_predicate`) renders its formula, ``pred_consts`` are runtime
    (only their number is checked, when given). ``desc``: how Q, K, V, O move (see
    :data:`DESC_MODES`): ``"none"`` pointers, ``"host"`` host tensor descriptors, ``"device"``
    descriptors built in the kernel; names carry ``_tmahost`` / ``_tmadev``."""
    if desc not in DESC_MODES:
        raise ValueError(f"desc must be one of {DESC_MODES}, got {desc!r}")
    variants.check_variant(causal, mask_kind)
    mask_fill_k, causal_fill_k = _fill_kinds(causal, mask_kind, mask_fill, causal_fill, causal_fill_mode)
    pred, pred_fill_k = _pred_kinds(causal, mask_pred, pred_consts or None, pred_fill, pred_fill_mode)
    causal = variants.is_causal(causal)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    head, tail = _suffix(causal, mask_kind, row, interpret, mask_fill_k, causal_fill_k, pred, pred_fill_k)
    name = "attention_fwd" + head + ("" if need_lse else "_nolse") + _DESC_SUFFIX[desc] + tail
    return render(
        FWD_TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
        need_lse=bool(need_lse), interpret=bool(interpret), desc=desc,
        causal_fill=causal_fill_k, mask_fill_finite=mask_fill_k != "hide", mask_skip_bits=_MASK_SKIP_BITS,
        **_pred_params(pred, pred_fill_k, backward=False),
    )


def bwd_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, bwd_mode: str, interpret: bool,
               mask_fill: float = NEG_INF, causal_fill: float = NEG_INF,
               causal_fill_mode: str = "replace", mask_pred=None, pred_consts: Sequence[int] = (),
               pred_fill: float = NEG_INF, pred_fill_mode: str = "replace") -> RenderedKernel:
    """Render the backward kernel module (preprocess, dK/dV and, for two_kernel, dQ kernels)."""
    variants.check_variant(causal, mask_kind, bwd_mode)
    mask_fill_k, causal_fill_k = _fill_kinds(causal, mask_kind, mask_fill, causal_fill, causal_fill_mode)
    pred, pred_fill_k = _pred_kinds(causal, mask_pred, pred_consts or None, pred_fill, pred_fill_mode)
    causal = variants.is_causal(causal)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    head, tail = _suffix(causal, mask_kind, row, interpret, mask_fill_k, causal_fill_k, pred, pred_fill_k)
    name = "attention_bwd" + head + ("_atomicdq" if bwd_mode == "atomic_dq" else "") + tail
    return render(
        BWD_TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
        atomic_dq=bwd_mode == "atomic_dq", interpret=bool(interpret),
        causal_fill=causal_fill_k, mask_fill_finite=mask_fill_k != "hide", mask_skip_bits=_MASK_SKIP_BITS,
        **_pred_params(pred, pred_fill_k, backward=True),
    )


def kernels_for(
    *,
    causal,
    mask_kind: str,
    mask_row_broadcast: bool,
    bwd_mode: str,
    interpret: bool,
    need_lse: bool,
    training: bool,
    mask_fill: float = NEG_INF,
    causal_fill: float = NEG_INF,
    causal_fill_mode: str = "replace",
    mask_pred=None,
    pred_consts: Sequence[int] = (),
    pred_fill: float = NEG_INF,
    pred_fill_mode: str = "replace",
) -> list[RenderedKernel]:
    """The kernel modules a call of this static variant uses, rendered but not launched.

    ``training`` adds the backward module (and forces the statistics the backward needs).
    """
    fills = dict(mask_fill=mask_fill, causal_fill=causal_fill, causal_fill_mode=causal_fill_mode,
                 mask_pred=mask_pred, pred_consts=pred_consts, pred_fill=pred_fill, pred_fill_mode=pred_fill_mode)
    kernels = [
        fwd_kernel(
            causal=causal, mask_kind=mask_kind, mask_row_broadcast=mask_row_broadcast,
            need_lse=need_lse or training, interpret=interpret, **fills,
        )
    ]
    if training:
        kernels.append(
            bwd_kernel(
                causal=causal, mask_kind=mask_kind, mask_row_broadcast=mask_row_broadcast,
                bwd_mode=bwd_mode, interpret=interpret, **fills,
            )
        )
    if mask_skips(causal, mask_kind, mask_row_broadcast, as_predicate(mask_pred)):
        kernels.append(mask_rows_kernel(mask_kind=mask_kind, interpret=interpret))
    return kernels


def mask_skips(causal, mask_kind: str, mask_row_broadcast: bool, pred: Optional[tuple]) -> bool:
    """Whether a variant skips, on a run-time proof (:func:`mask_tiles_skippable`), the key tiles
    that its data mask hides above the diagonal: a full ``[Nq, Nk]`` data mask (not one row
    broadcast over the queries), no causal masking and no index predicate of the pattern's own
    (those have static bounds). The templates hold the same condition (``mask_skip``)."""
    return mask_kind != "none" and not variants.is_causal(causal) and pred is None and not mask_row_broadcast


def mask_rows_kernel(*, mask_kind: str, interpret: bool) -> RenderedKernel:
    """Render the mask-rows kernel (:func:`mask_tiles_skippable`) for a data mask kind."""
    if mask_kind not in MASK_KINDS or mask_kind == "none":
        raise ValueError(f"mask_kind must be one of {[m for m in MASK_KINDS if m != 'none']}, got {mask_kind!r}")
    name = "attention_mask_rows" + variants.MASK_SUFFIX[mask_kind] + ("_interp" if interpret else "")
    return render(MASK_ROWS_TEMPLATE, name, mask_kind=mask_kind, interpret=bool(interpret))


@functools.lru_cache(maxsize=None)
def _rows_module(mask_kind: str, interpret: bool):
    kernel = mask_rows_kernel(mask_kind=mask_kind, interpret=interpret)
    return kernel, launch.kernel_module(kernel, interpret)


# --------------------------------------------------------------------------------------------
# Configs: one table, keyed by (device kind, head-dim bucket, dtype size); best first.
# --------------------------------------------------------------------------------------------


def _fwd(bm, bn, w, s):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


def _bwd(m1, n1, m2, n2, w, s, pre=64):
    return {
        "BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2,
        "PRE_BLOCK_M": pre, "num_warps": w, "num_stages": s,
    }


# Interpreter: small tiles keep the CPU interpreter fast and still exercise several full and
# boundary tiles per row at test sizes. The key's head-dim bucket and dtype size do not matter.
_INTERP_FWD = [_fwd(32, 16, 4, 1), _fwd(16, 32, 4, 1), _fwd(16, 16, 4, 1)]
_INTERP_BWD = [_bwd(16, 32, 32, 16, 4, 1, pre=32), _bwd(32, 16, 16, 32, 4, 1, pre=16)]

# Hopper (sm90, 227 KB shared memory per block). Head-dim bucket = max(next_pow2(D), next_pow2(Dv)).
_FWD_TABLE = {
    # 16-bit inputs. Measured on an H100 (Triton 3.6, bf16, B=4, H=16, N=4096): D=64 non-causal
    # 128x64/4 warps 402 TFLOP/s, causal 64x64 384; D=128 128x128/8 warps/3 stages 507 (causal 425).
    # Swept again on an H200 (benchmarks/results/tune_attention_d64.md, tune_attention_d128.md; GPU
    # time under CUDA graphs, N = 1024 ... 4096): D=64 non-causal 128x64/8 warps/3 stages 1.06x the
    # 4-warp one at N=1024, 1.02x at 4096 (the first entry since); D=128 128x128/8/3 within 0.4% of
    # the best everywhere but causal N=1024 (64x64/4/3 1.12x faster: _FWD_SHORT_CAUSAL_TABLE) and 2048 (1.7%).
    ("sm90", 64, 2): [_fwd(128, 64, 8, 3), _fwd(128, 64, 4, 3), _fwd(64, 64, 4, 3), _fwd(64, 128, 4, 3),
                      _fwd(128, 64, 8, 4)],
    ("sm90", 128, 2): [_fwd(128, 128, 8, 3), _fwd(64, 64, 4, 3), _fwd(128, 64, 8, 3), _fwd(128, 32, 4, 3)],
    ("sm90", 256, 2): [_fwd(64, 64, 4, 2), _fwd(128, 64, 8, 2), _fwd(128, 32, 8, 2), _fwd(64, 32, 4, 2)],
    # fp32 inputs (tiles twice the bytes)
    # fp32 inputs ("ieee" dots run on CUDA cores; large tiles spill): H100, B=2, H=16, N=2048:
    # D=64 32x32 11.6 TFLOP/s; D=128 32x32/1 stage 9.3 (64x32/4 warps: 0.8); D=256 32x32/1 stage 3.0
    ("sm90", 64, 4): [_fwd(32, 32, 4, 2), _fwd(32, 32, 4, 1), _fwd(64, 64, 4, 2)],
    ("sm90", 128, 4): [_fwd(32, 32, 4, 1), _fwd(64, 32, 8, 3), _fwd(32, 32, 4, 2)],
    ("sm90", 256, 4): [_fwd(32, 32, 4, 1), _fwd(16, 32, 4, 1)],
    # other CUDA GPUs (Ampere/Ada: 99..163 KB shared memory): conservative, not measured
    ("cuda", 64, 2): [_fwd(128, 64, 4, 3), _fwd(64, 64, 4, 3), _fwd(128, 32, 4, 3)],
    ("cuda", 128, 2): [_fwd(64, 64, 4, 3), _fwd(128, 64, 8, 2), _fwd(128, 32, 4, 3)],
    ("cuda", 256, 2): [_fwd(64, 32, 4, 2), _fwd(32, 32, 4, 2), _fwd(64, 64, 8, 1)],
    ("cuda", 64, 4): [_fwd(32, 32, 4, 2), _fwd(32, 32, 4, 1)],
    ("cuda", 128, 4): [_fwd(32, 32, 4, 1), _fwd(16, 32, 4, 1)],
    ("cuda", 256, 4): [_fwd(32, 32, 4, 1), _fwd(16, 16, 4, 1)],
}

# Causal forward: smaller query blocks balance the triangle better (H100, D=64: 64x64 384 TFLOP/s
# vs 128x64 324). Keys missing here fall back to _FWD_TABLE.
_FWD_CAUSAL_TABLE = {
    ("sm90", 64, 2): [_fwd(64, 64, 4, 3), _fwd(128, 64, 8, 4), _fwd(128, 64, 4, 3), _fwd(64, 128, 4, 3)],
}

# Causal forward over short sequences (max(Nq, Nk) <= SHORT_CAUSAL_N): the triangle leaves few key
# tiles per 128-row block, and smaller blocks balance it across the SMs. H200, bf16, B=4, H=16,
# D=128, GPU time under CUDA graphs (benchmarks/results/tune_attention_d128.md): N=1024 64x64/4
# warps/3 stages 0.066 ms against 0.074 for _FWD_TABLE's first (128x128/8/3); at N=2048 that one
# is within 2% of the best (64x64 4% slower), so the bound is 1024. D=64 keeps _FWD_CAUSAL_TABLE
# (64x64/4/3, also the best at N=1024). Keys missing here fall back to the tables above.
SHORT_CAUSAL_N = 1024
_FWD_SHORT_CAUSAL_TABLE = {
    ("sm90", 128, 2): [_fwd(64, 64, 4, 3), _fwd(64, 32, 4, 3), _fwd(128, 128, 8, 3), _fwd(128, 64, 8, 3)],
}

# Tensor-descriptor forward (desc "host"/"device", 16-bit, sm90). Measured on an H100 this session
# (torch 2.11, Triton 3.6, bf16, B=4, H=16, D=128, GPU time under CUDA graphs) with a minimal
# FA2 kernel loading through host descriptors (scratch/att_tma.py's _fa_desc, the same loop as
# the template's full tiles), best of 15 configs: non-causal 128x64/4 warps/2 stages at N=1024,
# 2048 and 4096 (0.0767, 0.2817, 1.0798 ms; SDPA 0.0645, 0.2299, 0.9092); causal 64x64/4/3 at
# N=1024 and 2048 (0.0560, 0.1808 ms), 128x64/4/2 at 4096 (0.6283 ms). The template itself with
# these configs: NOT MEASURED (scratch/att_desc_bench.py measures it). Other keys, and D=64/256:
# the pointer tables below (not measured with descriptors).
_FWD_DESC_TABLE = {
    ("sm90", 128, 2): [_fwd(128, 64, 4, 2), _fwd(128, 128, 8, 3), _fwd(128, 64, 4, 3), _fwd(64, 64, 4, 3)],
}
_FWD_DESC_CAUSAL_TABLE = {
    ("sm90", 128, 2): [_fwd(64, 64, 4, 3), _fwd(128, 64, 4, 2), _fwd(64, 64, 4, 4), _fwd(128, 128, 8, 3)],
}

_BWD_TABLE = {
    # H100 (bf16, B=4, H=16, N=4096, two_kernel): D=64 32/128/128/32 4 warps ~274 TFLOP/s
    # (causal 272); D=128 64/128/128/64 8 warps 3 stages ~331 (causal 330).
    ("sm90", 64, 2): [_bwd(32, 128, 128, 32, 4, 3), _bwd(32, 64, 64, 32, 4, 4), _bwd(64, 64, 64, 64, 4, 3),
                      _bwd(64, 128, 128, 64, 8, 3)],
    ("sm90", 128, 2): [_bwd(64, 128, 128, 64, 8, 3), _bwd(32, 64, 64, 32, 4, 3), _bwd(32, 128, 128, 32, 8, 3),
                       _bwd(32, 64, 64, 32, 4, 4)],
    ("sm90", 256, 2): [_bwd(32, 64, 64, 32, 8, 2), _bwd(16, 64, 64, 16, 8, 2), _bwd(32, 64, 64, 32, 8, 1),
                       _bwd(16, 32, 32, 16, 4, 2)],
    # fp32 (H100, N=2048): D=64 32/32/32/32 (atomic_dq 11.6 TFLOP/s, two_kernel 6.9);
    # D=128 32/64/64/32 8 warps (8.0 / 5.9); D=256 16/32/32/16 1 stage (7.7 / 4.1)
    ("sm90", 64, 4): [_bwd(32, 32, 32, 32, 4, 2), _bwd(16, 64, 64, 16, 4, 2), _bwd(32, 64, 64, 32, 8, 2)],
    ("sm90", 128, 4): [_bwd(32, 64, 64, 32, 8, 2), _bwd(32, 32, 32, 32, 4, 2), _bwd(16, 32, 32, 16, 4, 1)],
    ("sm90", 256, 4): [_bwd(16, 32, 32, 16, 4, 1), _bwd(16, 16, 16, 16, 4, 1)],
    ("cuda", 64, 2): [_bwd(32, 64, 64, 32, 4, 3), _bwd(32, 128, 128, 32, 4, 2)],
    ("cuda", 128, 2): [_bwd(32, 64, 64, 32, 4, 2), _bwd(16, 64, 64, 16, 4, 2)],
    ("cuda", 256, 2): [_bwd(16, 32, 32, 16, 8, 1), _bwd(16, 16, 16, 16, 4, 1)],
    ("cuda", 64, 4): [_bwd(32, 32, 32, 32, 4, 2), _bwd(16, 32, 32, 16, 4, 2)],
    ("cuda", 128, 4): [_bwd(16, 32, 32, 16, 4, 1), _bwd(16, 16, 16, 16, 4, 1)],
    ("cuda", 256, 4): [_bwd(16, 16, 16, 16, 4, 1)],
}


def _dim_bucket(head_dim: int, head_dim_v: int) -> int:
    width = max(launch.next_power_of_2(head_dim), launch.next_power_of_2(head_dim_v), 16)
    return 64 if width <= 64 else 128 if width <= 128 else 256


def candidate_configs(*, head_dim: int, head_dim_v: int, dtype: torch.dtype, device, causal="none", kind: str = "fwd",
                      desc: str = "none", n_ctx: Optional[int] = None) -> list[dict]:
    """Launch configs for one problem kind, best first (the first is the default).

    Keys: fwd ``BLOCK_M, BLOCK_N, num_warps, num_stages``; bwd ``BLOCK_M1, BLOCK_N1`` (dK/dV
    kernel: BLOCK_N1 keys per program, BLOCK_M1 query rows per step), ``BLOCK_M2, BLOCK_N2`` (dQ
    kernel), ``PRE_BLOCK_M`` (delta preprocess), ``num_warps, num_stages``. ``causal`` (a mode
    or a bool) picks the causal forward ordering where one is measured (:data:`_FWD_CAUSAL_TABLE`).
    ``desc`` (the forward's path, :func:`desc_mode`): a descriptor path takes
    :data:`_FWD_DESC_TABLE` / :data:`_FWD_DESC_CAUSAL_TABLE` where they have the key.
    ``n_ctx``: ``max(Nq, Nk)`` where known (an int; None: unknown, the long-sequence tables): a
    causal pointer forward with ``n_ctx <= SHORT_CAUSAL_N`` takes :data:`_FWD_SHORT_CAUSAL_TABLE`
    where it has the key (:func:`short_causal`).
    """
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    dev = launch.device_kind(device)
    if dev == "interpreter":
        table = _INTERP_FWD if kind == "fwd" else _INTERP_BWD
        return [dict(c) for c in table]
    size = 4 if dtype == torch.float32 else 2
    key = (dev, _dim_bucket(head_dim, head_dim_v), size)
    if kind == "bwd":
        return [dict(c) for c in _BWD_TABLE[key]]
    causal_fwd = causal not in ("none", False)
    if desc != "none":
        table = _FWD_DESC_CAUSAL_TABLE if causal_fwd else _FWD_DESC_TABLE
        if key in table:
            return [dict(c) for c in table[key]]
    if causal_fwd and short_causal(n_ctx) and key in _FWD_SHORT_CAUSAL_TABLE:
        return [dict(c) for c in _FWD_SHORT_CAUSAL_TABLE[key]]
    if causal_fwd and key in _FWD_CAUSAL_TABLE:
        return [dict(c) for c in _FWD_CAUSAL_TABLE[key]]
    return [dict(c) for c in _FWD_TABLE[key]]


def context_length(n_q, n_k) -> Optional[int]:
    """``max(Nq, Nk)`` when both are ints (the ``n_ctx`` of :func:`candidate_configs`); None when
    either is symbolic (``max`` of SymInts would add a guard to the caller's shape environment)."""
    return max(n_q, n_k) if isinstance(n_q, int) and isinstance(n_k, int) else None


def short_causal(n_ctx) -> bool:
    """Whether ``n_ctx`` (``max(Nq, Nk)``; an int, or None / a symbolic size: unknown) is short
    enough for :data:`_FWD_SHORT_CAUSAL_TABLE`: only a known ``n_ctx <= SHORT_CAUSAL_N``."""
    return isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx <= SHORT_CAUSAL_N



def _configs(config: Optional[dict], q, v, causal, kind: str, desc: str = "none", short: bool = False) -> list[dict]:
    """The configs to try in order: the given one alone (missing keys from the default), or
    every candidate of the table (the default first). ``short``: :func:`short_causal` of the call."""
    if config:
        cands = _table_configs(q.shape[-1], v.shape[-1], q.dtype, q.device, causal, kind, desc, short)
        return [launch.check_config({**cands[0], **config})]
    return _table_configs(q.shape[-1], v.shape[-1], q.dtype, q.device, causal, kind, desc, short)


@functools.lru_cache(maxsize=None)
def _table_configs(head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device, causal, kind: str,
                   desc: str = "none", short: bool = False) -> list[dict]:
    # cached: the launchers only read these dicts
    cands = candidate_configs(head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype, device=device, causal=causal,
                              kind=kind, desc=desc, n_ctx=SHORT_CAUSAL_N if short else None)
    return [launch.check_config(c) for c in cands]



# --------------------------------------------------------------------------------------------
# Allocation (also used by the fake/meta implementations: shapes, dtypes and devices only)
# --------------------------------------------------------------------------------------------


def alloc_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``out`` ``[B, Hq, Nq, Dv]`` in q's dtype, laid out as contiguous ``[B, Nq, Hq, Dv]`` memory
    (so ``out.transpose(1, 2).reshape(B, Nq, Hq * Dv)`` is a free view)."""
    b, h, n, _ = q.shape
    return launch.empty((b, n, h, v.shape[-1]), q.dtype, q.device).permute(0, 2, 1, 3)


def alloc_lse(q: torch.Tensor, two_part: bool = False) -> torch.Tensor:
    """The softmax statistics, float32, contiguous: ``lse`` ``[B, Hq, Nq]`` (base-2 log-sum-exp),
    or with ``two_part`` ``[B, Hq, 2, Nq]`` (row max ``m₂``, then ``log₂ l``; see
    :func:`two_part_stats`)."""
    return launch.empty(_stats_shape(q, two_part), torch.float32, q.device)


def _stats_shape(q: torch.Tensor, two_part: bool) -> tuple:
    b, h, n, _ = q.shape
    return (b, h, 2, n) if two_part else (b, h, n)


def _fill_empty_rows(lse: torch.Tensor, two_part: bool) -> None:
    """The statistics of rows with no key at all: ``LSE = +inf`` or ``m₂ = +inf, log₂ l = 0``."""
    if two_part:
        lse[:, :, 0].fill_(math.inf)
        lse[:, :, 1].fill_(0.0)
    else:
        lse.fill_(math.inf)


def alloc_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, needs_grad: Sequence[bool] = (True, True, True)):
    """``(dq, dk, dv)``: contiguous tensors shaped and typed like q, k, v; ``None`` where not needed."""
    return tuple(
        launch.empty(t.shape, t.dtype, t.device) if need else None
        for t, need in zip((q, k, v), needs_grad)
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------



def _check_inputs(q, k, v, causal, mask, mask_kind) -> None:
    variants.check_variant(causal, mask_kind)
    if isinstance(causal, bool):
        raise ValueError("causal must be a mode string here: 'none', 'top_left' or 'bottom_right'")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D [B, H, N, D]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(f"q, k, v must share one dtype of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k.shape[3]}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
    for dim in (d, v.shape[3]):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dims must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {dim}")
    variants.check_mask(mask, mask_kind)



# A finite fill stands for every finite value in the module caches below (values are runtime).
_FINITE = 0.0


def _fill_key(kind: str) -> float:
    return NEG_INF if kind == "hide" else _FINITE


def _pred_key(pred: Optional[tuple], pred_fill_k: str) -> dict:
    """A predicate variant as kernel arguments for the module caches (values are runtime)."""
    if pred is None:
        return {}
    return dict(mask_pred=pred, pred_fill=_fill_key(pred_fill_k),
                pred_fill_mode="replace" if pred_fill_k == "hide" else pred_fill_k)


@functools.lru_cache(maxsize=None)
def _fwd_module(causal, mask_kind: str, row: bool, need_lse: bool, interpret: bool,
                mask_fill_k: str = "hide", causal_fill_k: str = "hide", pred: Optional[tuple] = None,
                pred_fill_k: str = "hide", desc: str = "none"):
    """The imported forward module of one static variant (rendered once per process; keeps
    rendering and imports off the per-call path)."""
    kernel = fwd_kernel(
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, need_lse=need_lse, interpret=interpret,
        desc=desc,
        mask_fill=_fill_key(mask_fill_k), causal_fill=_fill_key(causal_fill_k),
        causal_fill_mode="replace" if causal_fill_k == "hide" else causal_fill_k,
        **_pred_key(pred, pred_fill_k),
    )
    return kernel, launch.kernel_module(kernel, interpret)


@functools.lru_cache(maxsize=None)
def _bwd_module(causal, mask_kind: str, row: bool, bwd_mode: str, interpret: bool,
                mask_fill_k: str = "hide", causal_fill_k: str = "hide", pred: Optional[tuple] = None,
                pred_fill_k: str = "hide"):
    """The imported backward module of one static variant (see :func:`_fwd_module`)."""
    kernel = bwd_kernel(
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, bwd_mode=bwd_mode, interpret=interpret,
        mask_fill=_fill_key(mask_fill_k), causal_fill=_fill_key(causal_fill_k),
        causal_fill_mode="replace" if causal_fill_k == "hide" else causal_fill_k,
        **_pred_key(pred, pred_fill_k),
    )
    return kernel, launch.kernel_module(kernel, interpret)


def _fill_args(mask_fill_k: str, causal_fill_k: str, mask_fill: float, causal_fill: float,
               pred: Optional[tuple] = None, pred_fill_k: str = "hide", pred_fill: float = NEG_INF,
               pred_consts: Sequence[int] = ()) -> dict:
    """The runtime fill arguments of a variant's launcher, in base 2 (none for -inf fills), and
    the predicate's constants (as many as it reads)."""
    args = {}
    if mask_fill_k != "hide":
        args["mask_fill"] = variants.fill_base2(mask_fill)
    if causal_fill_k != "hide":
        args["causal_fill"] = variants.fill_base2(causal_fill)
    if pred is not None:
        if pred_fill_k != "hide":
            args["pred_fill"] = variants.fill_base2(pred_fill)
        args["pred_consts"] = tuple(int(c) for c in pred_consts[: predicate.n_consts(pred)])
    return args



# exp2(x) of a float32 x below -150 is exactly 0 (the smallest subnormal is 2^-149); the margin
# a hidden score must keep below its row's max, in base-2 units, for its tile to be skipped
SKIP_MARGIN_BASE2 = 200.0


#: the relative error of one float32 rounding (the kernels' ``s + b``)
_F32_ROUNDING = 2.0 ** -24


def _score_bound(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``S``, a 0-dim float32 tensor on q's device: every base-2 score ``|scale·log2(e)·q_i·k_j|``
    is at most S (Cauchy–Schwarz over the largest norms, 1e-3 relative margin for the float32
    norms and the dots' rounding); ``inf``/``nan`` when a norm is not finite."""
    q_norm = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32).amax()
    k_norm = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax()
    return (abs(float(scale)) * LOG2E * (1.0 + 1e-3)) * q_norm * k_norm


def hidden_tiles_skippable(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal_fill: float,
                           causal_fill_mode: str, causal_offset: int) -> torch.Tensor:
    """Whether the key tiles entirely above the causal diagonal may be skipped although their
    entries carry a finite ``causal_fill`` instead of ``-inf`` (transformers' eager causal mask
    adds ``finfo.min``): a 0-dim int32 tensor on q's device, computed there (no host sync), read
    by the kernels of the variants with a finite causal fill and no data mask.

    q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]`` (Nq, Nk ≥ 1); ``scale`` and ``causal_fill`` in
    natural-log units (the scores softmax sees); ``causal_fill_mode`` ``"replace"`` or ``"add"``.

    Derivation (all base 2, as the kernels compute: ``s = scale·log2(e)·q_i·k_j``, fill ``F =
    causal_fill·log2(e)``). By Cauchy–Schwarz every score satisfies ``|s| ≤ S = |scale|·log2(e)·
    max_i‖q_i‖·max_j‖k_j‖``. With ``causal_offset ≥ 0`` every row i keeps key 0, so its max
    ``m_i ≥ -S``. An entry above the diagonal scores ``F`` (replace) or ``s + F`` (add), at most
    ``F + S`` or ``F + 2S``; its weight ``exp2(score - m_i)`` is at most ``exp2(F + 2S)`` (add)
    or ``exp2(F + S)`` (replace). When that exponent is below ``-SKIP_MARGIN_BASE2`` (-200, far
    under float32's -150 underflow) the weight is exactly 0 in float32: the entry adds nothing to
    the row's max, sum or output, and its backward terms (P = 0, so dS = 0) vanish — skipping it
    is exact, as for a ``-inf`` fill. Otherwise (huge scores, a small fill, a positive fill,
    rows with no visible key when ``causal_offset < 0``, or a non-finite norm) it returns 0 and
    every tile is visited. The norms are rounded float32: the bound carries a 1e-3 relative
    margin. Costs one read of q and k (a few small reductions).
    """
    # a symbolic offset (dynamic shapes) that may be negative: visit every tile (exact) rather
    # than guard on the lengths
    if not launch.proven(causal_offset >= 0) or not causal_fill < 0:
        return torch.zeros((), dtype=torch.int32, device=q.device)
    reach = (2.0 if causal_fill_mode == "add" else 1.0) * _score_bound(q, k, scale) + SKIP_MARGIN_BASE2
    return (reach < -float(causal_fill) * LOG2E).to(torch.int32)


def _skip_arg(q, k, scale: float, causal, mask_kind: str, causal_fill_k: str, causal_fill: float,
              flag: Optional[torch.Tensor] = None) -> dict:
    """``{"skip_hidden": flag}`` for the variants that read it (a finite causal fill, no data
    mask; see :func:`hidden_tiles_skippable`), else nothing. ``flag``: the flag a caller already
    computed for these q, k, scale and fill (not computed again)."""
    if causal_fill_k == "hide" or mask_kind != "none":
        return {}
    if flag is None:
        offset = variants.causal_offset(causal, q.shape[2], k.shape[2])
        flag = hidden_tiles_skippable(q, k, scale=scale, causal_fill=causal_fill, causal_fill_mode=causal_fill_k,
                                      causal_offset=offset)
    return {"skip_hidden": flag}


#: :func:`mask_tiles_skippable`'s bit: the key tiles above the diagonal are skipped
MASK_SKIP_ABOVE = 1
#: :func:`mask_tiles_skippable`'s bit: the mask is not read on tiles entirely on or below the diagonal
MASK_FREE_BELOW = 2


#: the flag values the kernels test (their template parameter ``mask_skip_bits``)
_MASK_SKIP_BITS = {"above": MASK_SKIP_ABOVE, "free": MASK_FREE_BELOW}


def mask_tiles_skippable(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, *, scale: float, mask_kind: str,
                         mask_fill: float = NEG_INF, offset: int = 0) -> torch.Tensor:
    """What the kernels may leave out of a data mask's work: a 0-dim int32 tensor of bit flags on
    q's device, computed there (no host sync; capture-safe), read by the variants of
    :func:`mask_skips`:

    - :data:`MASK_SKIP_ABOVE` (1): every entry above the diagonal ``j > i + offset`` adds
      exactly 0 to its row, so the kernels skip the key tiles past each query block's last
      diagonal (and the dK/dV kernel the query tiles before a key block's first);
    - :data:`MASK_FREE_BELOW` (2): the mask leaves every entry on and below the diagonal as it
      is (an additive 0, a boolean keep), so the kernels do not read it on the tiles that lie
      there entirely (they compute ``s`` where they would compute ``s + 0``: the same bits).

    Both set, a causal mask given as data costs causal attention's work plus the mask's reads on
    the diagonal tiles and this test. Models that build their causal mask outside the compiled
    code (a transformer block compiled on its own under FSDP2, a graph piece of DDP's optimizer, a mask
    made before ``torch.compile``) hand it to fuser as a plain tensor: this recovers the causal
    tile skipping from the mask's values, at the cost of one read of the mask.

    q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, mask ``[B, Hq, Nq, Nk]`` (the kernels' expanded
    view, stride 0 on broadcast dims; bool as bool or uint8); ``mask_kind`` ``"additive"``,
    ``"bool_keep"`` or ``"bool_drop"``; ``mask_fill`` the score of a boolean mask's hidden entry
    (natural-log units; ``-inf`` hides it); ``scale`` natural-log units.

    Derivation (base 2, as the kernels compute). Every score satisfies ``|s_ij| ≤ S``
    (:func:`_score_bound`). The softmax sees ``e_ij = s_ij + b_ij`` (additive mask, ``b`` its
    base-2 value, as the kernels compute it), ``s_ij`` or ``-inf`` (boolean, hidden entries
    ``-inf``), or ``s_ij`` or ``F`` (boolean with a finite fill ``F``: replaced). Split each row i
    at the diagonal into A (keys ``j > i + offset``) and D (the rest); the kernels skip only keys
    in A. Per row the mask-rows kernel (``templates/attention_mask_rows.py.jinja``, one read of the
    mask) gives ``max_A b``, ``max_D b`` (boolean: 0 for a visible entry, ``-inf`` for a hidden
    one; NaN counted as ``+inf``) and whether A and D hold hidden entries. The kernels form
    ``s + b`` in float32, one rounding of relative error ``u = 2^-24``: so every entry of A is at
    most ``U_i = (max_A b + S)(1 ∓ u)`` (widened away from zero; with a finite fill also ``F`` when
    A holds a hidden entry) and the row's max over D at least ``L_i = (max_D b − S)(1 ± u)`` (resp.
    ``F``), evaluated in float64. When ``U_i − L_i ≤ −200`` (or A adds only ``-inf``), every
    skipped entry lies at least 200 below its row's max, which the unskipped part of the row
    then attains alone: its weight ``exp2(e − m)`` (forward) and ``P = exp2(e − LSE)`` (backward)
    are exactly 0 in float32, as computed they would be, so skipping changes no bit of the
    output, the statistics or the gradients. A row whose D holds nothing above the fill's level
    while A holds finite entries (left padding: eager spreads such a row over every key, all its
    float32 scores rounding to ``finfo.min``), a NaN or ``+inf`` in A, huge scores, or a
    non-finite norm fails the test: then every tile is visited. transformers' causal mask (0 on
    and below the diagonal, ``finfo.min`` above; right padding too) passes whenever ``S`` is
    below ~1e38.

    The second flag needs no bound: per row the kernel also gives ``min_D b``; the mask is a
    no-op on D when ``max_D b ≤ 0 ≤ min_D b`` (additive: every entry ±0, NaN counted ``+inf``;
    boolean: no hidden entry in D). Right padding (``finfo.min`` on the padded keys, below the
    diagonal) clears it: those tiles read the mask.
    """
    _, module = _rows_module(mask_kind, launch.interpreted(q.device))
    b, h, n_q, n_k = mask.shape
    # broadcast dims of the mask (stride 0) are one problem, not B or H copies of it
    rows_b = 1 if mask.stride(0) == 0 else b
    rows_h = 1 if mask.stride(1) == 0 else h
    m = mask[:rows_b, :rows_h]
    stats = launch.empty((rows_b * rows_h, 5, n_q), torch.float32, q.device)
    with launch.launching(launch.interpreted(q.device)):
        module.launch_rows(m, stats, offset=offset, config=MASK_ROWS_CONFIG)  # a SymInt stays symbolic
    above, below, above_hidden, below_hidden, below_min = (x.double() for x in stats.unbind(1))
    free_below = ((below <= 0) & (below_min >= 0) & (below_hidden == 0)).all()
    bound = _score_bound(q, k, scale).double()
    # in float64, widened by the kernels' one float32 rounding of s + b (relative 2^-24): near
    # finfo.min a float32 sum swallows the score, and entries of the two parts can round equal
    upper = above + bound
    upper = torch.where(above == NEG_INF, above, upper + _F32_ROUNDING * upper.abs())
    lower = below - bound
    lower = lower - _F32_ROUNDING * lower.abs()
    if mask_kind != "additive" and mask_fill > NEG_INF:
        fill = variants.fill_base2(mask_fill)  # replaced scores: exactly the fill
        upper = torch.maximum(upper, torch.where(above_hidden > 0, fill, NEG_INF))
        lower = torch.maximum(lower, torch.where(below_hidden > 0, fill, NEG_INF))
    # the difference, not lower - 200: float64 cannot hold 200 beside ~3e38 either
    ok = (upper == NEG_INF) | (upper - lower <= -SKIP_MARGIN_BASE2)
    above_ok = ok.all() & torch.isfinite(bound)
    return above_ok.to(torch.int32) * MASK_SKIP_ABOVE + free_below.to(torch.int32) * MASK_FREE_BELOW


def _mask_skip(q, k, mask4, scale: float, causal, mask_kind: str, row_broadcast: bool, pred,
               mask_fill_k: str, mask_fill: float) -> tuple[dict, int]:
    """``(fills, offset)`` of a launch: for the variants of :func:`mask_skips` the flag of
    :func:`mask_tiles_skippable` (``{"skip_hidden": flag}``) tested at the bottom-right diagonal
    (:func:`mask_skip_offset`), which is then the kernels' ``CAUSAL_OFFSET``; otherwise nothing
    and the causal alignment's offset."""
    n_q, n_k = q.shape[2], k.shape[2]
    if mask4 is None or not mask_skips(causal, mask_kind, row_broadcast, pred):
        return {}, variants.causal_offset(causal, n_q, n_k)
    offset = mask_skip_offset(n_q, n_k)
    fill = mask_fill if mask_fill_k != "hide" else NEG_INF
    flag = mask_tiles_skippable(q, k, mask4, scale=scale, mask_kind=mask_kind, mask_fill=fill, offset=offset)
    return {"skip_hidden": flag}, offset


def mask_skip_offset(n_q: int, n_k: int) -> int:
    """The diagonal the mask-skipping variants test (:func:`mask_tiles_skippable`): bottom-right,
    ``Nk − Nq`` (0 for self-attention; transformers' mask with a KV cache lies so)."""
    return n_k - n_q


def _desc_layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether q, k, v, out can move through tensor descriptors: head dims powers of two in
    16..256 (no padding), a contiguous last dim, every other stride a positive multiple of 16
    bytes, and 16-byte aligned data (a fake tensor: its storage offset; Inductor's buffers are
    aligned)."""
    for dim in (q.shape[-1], v.shape[-1]):
        if dim < 16 or dim > 256 or dim & (dim - 1):
            return False
    for t in (q, k, v, out):
        size = t.element_size()
        if t.stride(-1) != 1 or any(st <= 0 or (st * size) % 16 for st in t.stride()[:-1]):
            return False
        try:
            ptr = t.data_ptr()
        except Exception:  # noqa: BLE001 - fake / functional tensors have no data pointer
            ptr = t.storage_offset() * size
        if ptr % 16:
            return False
    return True


def desc_mode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, tma: Optional[str] = None) -> str:
    """How the forward moves Q, K, V and O for these tensors (:data:`DESC_MODES`).

    ``tma``: ``None`` follows :data:`TMA_SETTING` (``FUSER_ATTN_TMA``, default ``"auto"``);
    ``"none"``/``"off"`` pointers; ``"host"``/``"device"`` that descriptor mode wherever the
    layout allows it (:func:`_desc_layout_ok`), in the interpreter too (tests).

    ``"auto"`` (the default): pointers. Measured on the H100 (torch 2.11, Triton 3.6, bf16, B=4,
    H=16, D=128, GPU time under CUDA graphs, scratch/att_desc_bench.py, 2026-11-24): host
    descriptors run the kernel faster (N=1024: 0.84x SDPA non-causal, 0.89x causal, against the
    pointers' 0.75x / 0.69x; N=4096 non-causal 0.84x against 0.80x) but cost about 27 us of host
    time per call to build (0.119 against 0.092 ms per call without graphs at N=1024), and with
    this table's default causal config they were slower at N=2048/4096 causal (0.67x against
    0.78x, cause not found); device-built descriptors were slower than pointers almost
    everywhere (causal 0.54-0.70x). And the path that matters on a GPU, the op traced for
    Inductor, cannot take host descriptors: torch's ``wrap_triton`` outside Dynamo records a host
    ``TensorDescriptor`` argument as an opaque constant (``triton_kernel_wrap.py``'s non-Dynamo
    ``call_HOP`` passes ``tma_descriptor_metadata={}``: "TMA descriptor capturing not yet
    supported in non-dynamo tracing", torch 2.13). So descriptors are opt-in: ``"host"`` and
    ``"device"`` give that mode wherever the layout allows it (:func:`_desc_layout_ok`; in the
    interpreter too, for tests), except that a ``"host"`` request while traced
    (:func:`launch.tracing`) gives ``"device"`` (a descriptor built in the kernel needs only plain
    pointers; Inductor's launcher supplies its global scratch).
    """
    want = TMA_SETTING if tma is None else str(tma).lower()
    if want in ("none", "off"):
        return "none"
    if want not in ("auto", "host", "device"):
        if tma is None:
            raise ValueError(f"FUSER_ATTN_TMA={TMA_SETTING!r}: expected one of auto, off, host, device")
        raise ValueError(f"tma must be None, 'none', 'off', 'auto', 'host' or 'device', got {tma!r}")
    if want == "auto" or not _desc_layout_ok(q, k, v, out):
        return "none"
    if want == "host" and launch.tracing():
        return "device"
    return want


#: (dtype, D, Dv, desc mode) whose descriptor kernel failed to compile or launch in this process
#: (automatic choices only): later calls take the pointer kernel (:func:`forward`).
_DESC_FAILED: set = set()


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator for the device-built descriptors' global scratch when none is
    set (a user's or Inductor's own is kept); while traced nothing is needed here (Inductor
    sets its own when it launches the kernel)."""
    if launch.tracing():
        return
    import triton
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    current = current.get() if hasattr(current, "get") else current
    if current is None or type(current).__name__ == "NullAllocator":
        triton.set_allocator(_torch_scratch)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    need_lse: bool = True,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    mask_fill: float = NEG_INF,
    causal_fill: float = NEG_INF,
    causal_fill_mode: str = "replace",
    mask_pred=None,
    pred_consts: Sequence[int] = (),
    pred_fill: float = NEG_INF,
    pred_fill_mode: str = "replace",
    skip_hidden: Optional[torch.Tensor] = None,
    tma: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``out = softmax(scale · q kᵀ (+ mask)) v`` with the given causal/mask/fill/predicate
    semantics (those of :func:`fuser.patterns.attention.reference`).

    ``skip_hidden``: with a finite ``causal_fill`` and no data mask, the flag of
    :func:`hidden_tiles_skippable` for these q, k, scale and fill when the caller has it (the H2O
    column pass reads the same flag); ``None``: computed here.

    ``mask_pred``: an index predicate (:mod:`~fuser.codegen.predicate` tuple or text, see
    :func:`as_predicate`) over query i and key j with runtime constants ``pred_consts``; a key it
    drops for a row scores ``pred_fill`` (``pred_fill_mode="replace"``) or ``s + pred_fill``
    (``"add"``), ``-inf`` hiding it (key tiles dropped by a whole query block are then skipped).
    Applied after the masks (additive, then boolean); not with ``causal`` (fold it into the
    predicate).

    ``tma``: ``None`` (default) lets :func:`desc_mode` choose how Q, K, V, O move (pointers or
    tensor descriptors); ``"none"``, ``"host"`` or ``"device"`` asks for that mode (tests force
    descriptors in the interpreter); a descriptor mode the layout does not allow falls back to
    pointers.

    Returns ``(out, lse)``: ``out`` from :func:`alloc_out` (or the given buffer); ``lse`` the
    softmax statistics from :func:`alloc_lse` (or the given buffer) — ``[B, Hq, Nq]`` float32
    base-2 log-sum-exp (``+inf`` for rows with no visible key), or in the two-part variants
    (:func:`two_part_stats`) ``[B, Hq, 2, Nq]`` (row max, log2 l) — or ``None`` when
    ``need_lse`` is false. Rows whose scores are all ``-inf`` give ``out = 0``.
    """
    _check_inputs(q, k, v, causal, mask, mask_kind)
    mask_fill_k, causal_fill_k = _fill_kinds(causal, mask_kind, mask_fill, causal_fill, causal_fill_mode)
    pred, pred_fill_k = _pred_kinds(causal, mask_pred, pred_consts, pred_fill, pred_fill_mode)
    two_part = mask_kind == "additive" or mask_fill_k != "hide" or causal_fill_k != "hide" or pred_fill_k != "hide"
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    if out is None:
        out = alloc_out(q, v)
    if not need_lse:
        lse = None
    elif lse is None:
        lse = alloc_lse(q, two_part)
    elif tuple(lse.shape) != _stats_shape(q, two_part):
        raise ValueError(f"lse must have shape {_stats_shape(q, two_part)} here, got {tuple(lse.shape)}")
    if out.numel() == 0:  # Nq == 0 or B*H == 0: nothing to compute
        if lse is not None:
            _fill_empty_rows(lse, two_part)
        return out, lse
    if n_k == 0:  # no keys: every row is empty
        out.zero_()
        if lse is not None:
            _fill_empty_rows(lse, two_part)
        return out, lse
    interpret = launch.interpreted(q.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, hq, n_q, n_k))
    desc = desc_mode(q, k, v, out, tma)
    fills = _fill_args(mask_fill_k, causal_fill_k, mask_fill, causal_fill, pred, pred_fill_k, pred_fill, pred_consts)
    fills.update(_skip_arg(q, k, scale, causal, mask_kind, causal_fill_k, causal_fill, skip_hidden))
    skip, offset = _mask_skip(q, k, mask4, scale, causal, mask_kind, bool(row_broadcast), pred, mask_fill_k,
                              mask_fill)
    fills.update(skip)
    args = [q, k, v, out]
    if need_lse:
        args.append(lse)
    if mask4 is not None:
        args.append(mask4)
    precision = launch.dot_precision(q.dtype)

    # a short causal call takes its own table (candidate_configs), and its own remembered config
    short = variants.is_causal(causal) and short_causal(context_length(n_q, n_k))

    def launch_path(desc: str) -> None:
        configs = _configs(config, q, v, causal, "fwd", desc, short)
        if desc == "device" and not interpret:
            _ensure_allocator()
        kernel, module = _fwd_module(causal, mask_kind, bool(row_broadcast) and mask_kind != "none", bool(need_lse),
                                     interpret, mask_fill_k, causal_fill_k, pred, pred_fill_k, desc)

        def run(cfg):
            with launch.launching(interpret):
                module.launch_fwd(
                    *args,
                    qk_scale=float(scale) * LOG2E,
                    causal_offset=offset,
                    config=cfg,
                    input_precision=precision,
                    **fills,
                )

        key = (kernel.path, "fwd", q.dtype, d, v.shape[-1], None if mask4 is None else mask4.dtype, precision, short)
        launch.launch_first_fitting(key, configs, run)

    if desc == "none" or tma is not None or launch.tracing() or interpret:
        launch_path(desc)
        return out, lse
    # an automatic descriptor choice that fails to build falls back: host -> device -> pointers
    for mode in ((desc, "device", "none") if desc == "host" else (desc, "none")):
        if mode != "none" and (q.dtype, d, v.shape[-1], mode) in _DESC_FAILED:
            continue
        if mode == "none":
            launch_path(mode)
            break
        try:
            launch_path(mode)
            break
        except Exception as exc:  # noqa: BLE001 - a descriptor kernel this Triton cannot build
            if isinstance(exc, launch.ConfigDoesNotFit) or type(exc).__name__ == "OutOfResources":
                raise
            _DESC_FAILED.add((q.dtype, d, v.shape[-1], mode))
            launch.log.warning("fuser: the attention forward's %s-descriptor kernel failed (%s: %s); not using it "
                               "for %s, D=%d, Dv=%d from now on", mode, type(exc).__name__, str(exc)[:300],
                               q.dtype, d, v.shape[-1])
    return out, lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    bwd_mode: str = "two_kernel",
    needs_grad: Sequence[bool] = (True, True, True),
    config: Optional[dict] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    mask_fill: float = NEG_INF,
    causal_fill: float = NEG_INF,
    causal_fill_mode: str = "replace",
    mask_pred=None,
    pred_consts: Sequence[int] = (),
    pred_fill: float = NEG_INF,
    pred_fill_mode: str = "replace",
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients ``(dq, dk, dv)`` of :func:`forward` for upstream ``dout``; ``None`` for each
    one ``needs_grad`` turns off. ``out`` and ``lse`` are the forward's (its statistics, base 2:
    one LSE or two-part, as :func:`two_part_stats` says for these arguments).

    ``bwd_mode``: ``"two_kernel"`` (deterministic: a dK/dV kernel and a dQ kernel) or
    ``"atomic_dq"`` (one kernel; dQ accumulated with float32 atomics, then cast).
    """
    _check_inputs(q, k, v, causal, mask, mask_kind)
    variants.check_variant(causal, mask_kind, bwd_mode)
    mask_fill_k, causal_fill_k = _fill_kinds(causal, mask_kind, mask_fill, causal_fill, causal_fill_mode)
    pred, pred_fill_k = _pred_kinds(causal, mask_pred, pred_consts, pred_fill, pred_fill_mode)
    two_part = mask_kind == "additive" or mask_fill_k != "hide" or causal_fill_k != "hide" or pred_fill_k != "hide"
    need_dq, need_dk, need_dv = (bool(x) for x in needs_grad)
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    want = _stats_shape(q, two_part)
    if tuple(lse.shape) != want:
        raise ValueError(
            f"lse must be the forward's {'two-part statistics' if two_part else 'LSE'} of shape {want}, "
            f"got {tuple(lse.shape)}"
        )
    a_dq, a_dk, a_dv = alloc_grads(
        q, k, v, (need_dq and dq is None, need_dk and dk is None, need_dv and dv is None)
    )
    dq = (dq if dq is not None else a_dq) if need_dq else None
    dk = (dk if dk is not None else a_dk) if need_dk else None
    dv = (dv if dv is not None else a_dv) if need_dv else None
    if not (need_dq or need_dk or need_dv):
        return None, None, None
    if b * hq == 0 or n_q == 0 or n_k == 0:
        # nothing flows: no query rows, or no keys (every row empty)
        for g in (dq, dk, dv):
            if g is not None:
                g.zero_()
        return dq, dk, dv
    if dout.dtype != v.dtype:
        dout = dout.to(v.dtype)
    if not lse.is_contiguous():
        lse = lse.contiguous()
    interpret = launch.interpreted(q.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, hq, n_q, n_k))
    configs = _configs(config, q, v, causal, "bwd")
    kernel, module = _bwd_module(causal, mask_kind, bool(row_broadcast) and mask_kind != "none", bwd_mode, interpret,
                                 mask_fill_k, causal_fill_k, *((pred, pred_fill_k) if pred is not None else ()))
    fills = _fill_args(mask_fill_k, causal_fill_k, mask_fill, causal_fill, pred, pred_fill_k, pred_fill, pred_consts)
    fills.update(_skip_arg(q, k, scale, causal, mask_kind, causal_fill_k, causal_fill))
    skip, offset = _mask_skip(q, k, mask4, scale, causal, mask_kind, bool(row_broadcast), pred, mask_fill_k,
                              mask_fill)
    fills.update(skip)
    delta = launch.empty((b, hq, n_q), torch.float32, q.device)
    args = [dout, q, k, v, out, lse, delta, dq, dk, dv]
    if mask4 is not None:
        args.append(mask4)
    dq_acc = None
    if bwd_mode == "atomic_dq":
        if need_dq:
            # accumulate straight into dq when it is a contiguous float32 buffer
            if dq.dtype == torch.float32 and dq.is_contiguous():
                dq_acc = dq
            else:
                dq_acc = launch.empty(q.shape, torch.float32, q.device)
        args.append(dq_acc)
    precision = launch.dot_precision(q.dtype)

    def run(cfg):
        # re-running after an OutOfResources is safe: preprocess rewrites delta (and re-zeroes
        # the dq accumulator), the other kernels overwrite their outputs
        with launch.launching(interpret):
            module.launch_bwd(
                *args,
                scale=float(scale),
                qk_scale=float(scale) * LOG2E,
                causal_offset=offset,
                config=cfg,
                input_precision=precision,
                **fills,
            )

    key = (kernel.path, "bwd", q.dtype, d, v.shape[-1], None if mask4 is None else mask4.dtype, precision,
           need_dq, need_dk, need_dv)
    launch.launch_first_fitting(key, configs, run)
    if dq_acc is not None and dq_acc is not dq:
        dq.copy_(dq_acc)
    return dq, dk, dv
