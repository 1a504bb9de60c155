"""H2O column sums, plan "two kernels": launchers, allocation, config table.

H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023) scores each key for KV-cache eviction by the column sums of the attention
probabilities: with ``P = softmax(scale · Q Kᵀ (+ mask), dim=-1)`` ``[B, Hq, Nq, Nk]``,
``score[b, h, j] = Σ_i P[b, h, i, j]``, next to the usual ``out = P V``.

A row-parallel kernel cannot finish the column sums (a column's terms need every row's final
statistics, known only once its whole row has been streamed), so the plan runs two kernels
(``docs/math.md``, "H2O column sums"):

- kernel 0, the attention forward (:func:`fuser.codegen.attention.forward` with the statistics
  stored): ``out`` and per row the base-2 ``LSE₂ = m₂ + log₂ l`` (``+inf`` for a row with no
  visible key), or with an additive mask the two-part statistics ``(m₂, log₂ l)``;
- kernel 1 (``templates/h2o_colsum.py.jinja``): column-parallel, grid ``(cdiv(Nk, BLOCK_N),
  B·Hq)``; each program loads one block of keys and streams the query blocks that can see it
  (causal: only those at or below the diagonal), recomputing ``P = exp2(s' − LSE₂)`` (or
  ``exp2((s' − m₂) − log₂ l)``) with ``s' = scale·log₂e·q·k (+ mask·log₂e)``, and sums it over the
  rows.

Variants: causal ``"none"``, ``"top_left"``, ``"bottom_right"`` (one rendered kernel serves both
alignments through the runtime causal offset), mask kinds ``"none"``, ``"bool_keep"``,
``"bool_drop"``, ``"additive"`` (hidden entries ``-inf``; an additive mask gives the two-part
statistics, supported), row-broadcast masks. Not supported (``ValueError``): finite fills
(``mask_fill``, ``causal_fill``) and index predicates (``mask_pred``).

Sizes (B, H, Nq, Nk, the causal offset) are runtime arguments; the sequence lengths and the
offset are ``do_not_specialize``, so a new length does not recompile.

Shapes: q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` (any strides, never
copied), ``Hq % Hkv == 0`` (query head h reads kv head ``h // (Hq // Hkv)``), fp32 / fp16 /
bf16; ``score`` ``[B, Hq, Nk]`` float32.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import attention, launch, variants
from .render import RenderedKernel, render

__all__ = ["forward", "colsum_kernel", "candidate_configs", "alloc_score", "SUPPORTED"]

TEMPLATE = "h2o_colsum.py.jinja"
LOG2E = 1.4426950408889634
NEG_INF = float("-inf")

#: What this plan supports, for error messages.
SUPPORTED = ("causal in ('none', 'top_left', 'bottom_right'), mask_kind in ('none', 'bool_keep', 'bool_drop', "
             "'additive') with hidden entries -inf; no finite mask_fill/causal_fill, no mask_pred")


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def colsum_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, interpret: bool) -> RenderedKernel:
    """Render the column-sum kernel module of one static variant (``causal``: a mode or a bool;
    the statistics are two-part exactly for ``mask_kind="additive"``, as in the forward).

    Raises:
        ValueError: unknown causal mode or mask kind.
    """
    variants.check_variant(causal, mask_kind)
    causal = variants.is_causal(causal)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    name = ("h2o_colsum" + ("_causal" if causal else "") + variants.MASK_SUFFIX[mask_kind]
            + ("_rowbcast" if row else "") + ("_interp" if interpret else ""))
    return render(
        TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
        two_part=mask_kind == "additive", interpret=bool(interpret),
    )


@functools.lru_cache(maxsize=None)
def _colsum_module(causal: bool, mask_kind: str, row: bool, interpret: bool):
    """The imported column-sum module of one static variant (rendered once per process)."""
    kernel = colsum_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, interpret=interpret)
    return kernel, launch.kernel_module(kernel, interpret)


# --------------------------------------------------------------------------------------------
# Configs: keyed by (device kind, head-dim bucket, dtype size); best first.
# --------------------------------------------------------------------------------------------


def _cfg(bm, bn, w, s):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


# Interpreter: small tiles keep the CPU interpreter fast and still give several query blocks per
# key block (and ragged ones) at test sizes.
_INTERP = [_cfg(16, 32, 4, 1), _cfg(32, 16, 4, 1), _cfg(16, 16, 4, 1)]

# GPUs. sm90 fp16/bf16, D = 128: swept on the H100 (2026-11-23, B=1, H=32, D=128, fp16, N 1024..16384,
# causal and not; 24 configs BLOCK_M {32, 64, 128} x BLOCK_N {64, 128} x warps {4, 8} x stages {2, 3}):
# (128, 128, 4, 2) was best or within 3% at N >= 4096; (64, 64, 4, 3) / (32, 128, 4, 3) at N <= 2048.
# The D <= 64 row takes the same first choice, not measured; other rows are not measured: a program holds one [BLOCK_N, D] key tile and streams [BLOCK_M, D]
# query tiles, like the attention backward's dK/dV kernel without V and dO.
_TABLE = {
    ("sm90", 64, 2): [_cfg(128, 128, 4, 2), _cfg(64, 128, 4, 3), _cfg(64, 64, 4, 3)],
    ("sm90", 128, 2): [_cfg(128, 128, 4, 2), _cfg(64, 128, 4, 2), _cfg(32, 128, 4, 3), _cfg(64, 64, 4, 3)],
    ("sm90", 256, 2): [_cfg(32, 64, 4, 2), _cfg(32, 128, 8, 2), _cfg(16, 64, 4, 2)],
    ("sm90", 64, 4): [_cfg(32, 32, 4, 2), _cfg(32, 64, 4, 2)],
    ("sm90", 128, 4): [_cfg(32, 32, 4, 1), _cfg(32, 64, 8, 2)],
    ("sm90", 256, 4): [_cfg(16, 32, 4, 1), _cfg(16, 16, 4, 1)],
    ("cuda", 64, 2): [_cfg(64, 64, 4, 3), _cfg(32, 128, 4, 2)],
    ("cuda", 128, 2): [_cfg(32, 64, 4, 2), _cfg(64, 64, 8, 2)],
    ("cuda", 256, 2): [_cfg(16, 32, 4, 1), _cfg(32, 32, 4, 1)],
    ("cuda", 64, 4): [_cfg(32, 32, 4, 2), _cfg(16, 32, 4, 2)],
    ("cuda", 128, 4): [_cfg(16, 32, 4, 1), _cfg(16, 16, 4, 1)],
    ("cuda", 256, 4): [_cfg(16, 16, 4, 1)],
}


def _dim_bucket(head_dim: int) -> int:
    width = max(launch.next_power_of_2(head_dim), 16)
    return 64 if width <= 64 else 128 if width <= 128 else 256


def candidate_configs(*, head_dim: int, dtype: torch.dtype, device) -> list[dict]:
    """Launch configs of the column-sum kernel (``BLOCK_M`` query rows per step, ``BLOCK_N`` keys
    per program, ``num_warps``, ``num_stages``), best first (the first is the default): the
    interpreter's table on CPU tensors, else by device kind, head-dim bucket and dtype size."""
    dev = launch.device_kind(device)
    if dev == "interpreter":
        return [dict(c) for c in _INTERP]
    size = 4 if dtype == torch.float32 else 2
    return [dict(c) for c in _TABLE[(dev, _dim_bucket(head_dim), size)]]


def _configs(config: Optional[dict], q: torch.Tensor) -> list[dict]:
    """The given config alone (missing keys from the default), or every candidate (default first)."""
    cands = candidate_configs(head_dim=q.shape[-1], dtype=q.dtype, device=q.device)
    if config:
        return [launch.check_config({**cands[0], **config})]
    return [launch.check_config(c) for c in cands]


# --------------------------------------------------------------------------------------------
# Allocation and launch
# --------------------------------------------------------------------------------------------


def alloc_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``score`` ``[B, Hq, Nk]`` float32, contiguous, on q's device (poisoned under
    :func:`~fuser.codegen.launch.poison_outputs`)."""
    b, h = q.shape[:2]
    return launch.empty((b, h, k.shape[2]), torch.float32, q.device)


def _check_supported(mask_fill: float, causal_fill: float, mask_pred) -> None:
    if not (math.isinf(float(mask_fill)) and float(mask_fill) < 0):
        raise ValueError(f"H2O column sums: a finite mask_fill ({mask_fill!r}) is not supported; supported: {SUPPORTED}")
    if not (math.isinf(float(causal_fill)) and float(causal_fill) < 0):
        raise ValueError(f"H2O column sums: a finite causal_fill ({causal_fill!r}) is not supported; "
                         f"supported: {SUPPORTED}")
    if attention.as_predicate(mask_pred) is not None:
        raise ValueError(f"H2O column sums: index predicates (mask_pred) are not supported; supported: {SUPPORTED}")


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor] = None,
    *,
    scale: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    need_out: bool = True,
    config: Optional[dict] = None,
    fwd_config: Optional[dict] = None,
    mask_fill: float = NEG_INF,
    causal_fill: float = NEG_INF,
    mask_pred=None,
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """H2O column sums and attention output (plan "two kernels", see the module docstring).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]`` or ``None`` (only
            with ``need_out=False``). One dtype of fp32 / fp16 / bf16, any strides;
            ``Hq % Hkv == 0`` (GQA: query head h reads kv head ``h // (Hq // Hkv)``).
        scale: multiplies ``Q Kᵀ``.
        causal: ``"none"``, ``"top_left"`` (key j visible to query i iff ``j <= i``) or
            ``"bottom_right"`` (iff ``j <= i + Nk − Nq``); entries above the diagonal hidden.
        mask: broadcastable to ``[B, Hq, Nq, Nk]``; ``mask_kind`` ``"bool_keep"`` (True =
            visible), ``"bool_drop"`` (True = hidden), ``"additive"`` (float, added to the
            scaled scores), or ``"none"`` without a mask.
        need_out: also return ``out``; kernel 0 runs either way, for the statistics.
        config: the column-sum kernel's config (``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
            ``num_stages``; missing keys from the default); ``None``: the table's candidates.
        fwd_config: kernel 0's config (:func:`fuser.codegen.attention.forward`'s ``config``).
        mask_fill, causal_fill, mask_pred: only the defaults (``-inf``, ``-inf``, ``None``) are
            supported; anything else is rejected.

    Returns:
        ``(out, score)``: ``out`` ``[B, Hq, Nq, Dv]`` in q's dtype (``None`` unless
        ``need_out``; rows with no visible key give 0); ``score`` ``[B, Hq, Nk]`` float32,
        ``score[b, h, j] = Σ_i P[b, h, i, j]`` (rows with no visible key contribute 0, a key no
        query sees scores 0).

    Raises:
        ValueError: a finite fill or a predicate, an unknown causal mode or mask kind, a mask
            that does not match ``mask_kind``, ``v`` missing with ``need_out``, or the shape,
            dtype and head-dim errors of :func:`fuser.codegen.attention.forward`.
    """
    _check_supported(mask_fill, causal_fill, mask_pred)
    variants.check_variant(causal, mask_kind)
    if isinstance(causal, bool):
        raise ValueError("causal must be a mode string here: 'none', 'top_left' or 'bottom_right'")
    if v is None:
        if need_out:
            raise ValueError("H2O column sums: need_out=True needs v")
        # kernel 0 wants a value tensor; k has the right [B, Hkv, Nk, *] shape (its output is dropped)
        v = k
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q, k must be 4-D [B, H, N, D]")
    two_part = mask_kind == "additive"  # the forward's two-part statistics (attention.two_part_stats)
    # Kernel 0: the attention forward, for its statistics (and out). When out is not wanted a
    # statistics-only forward (no V loads, no P V dots) would do: a later optimisation.
    out, stats = attention.forward(q, k, v, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
                                   need_lse=True, config=fwd_config)
    score = alloc_score(q, k)
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    if score.numel() == 0:
        return (out if need_out else None), score
    if n_q == 0:  # no query sees any key
        score.zero_()
        return (out if need_out else None), score
    interpret = launch.interpreted(q.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, hq, n_q, n_k))
    row = bool(row_broadcast) and mask_kind != "none"
    kernel, module = _colsum_module(variants.is_causal(causal), mask_kind, row, interpret)
    configs = _configs(config, q)
    args = [q, k, stats, score]
    if mask4 is not None:
        args.append(mask4)
    precision = launch.dot_precision(q.dtype)
    assert stats.shape == ((b, hq, 2, n_q) if two_part else (b, hq, n_q)) and stats.is_contiguous()

    def run(cfg):
        with launch.launching(interpret):
            module.launch_colsum(
                *args,
                qk_scale=float(scale) * LOG2E,
                causal_offset=variants.causal_offset(causal, n_q, n_k),
                config=cfg,
                input_precision=precision,
            )

    key = (kernel.path, "colsum", q.dtype, d, None if mask4 is None else mask4.dtype, precision)
    launch.launch_first_fitting(key, configs, run)
    return (out if need_out else None), score
