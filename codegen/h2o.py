"""H2O column sums: the plans' launchers, layouts, workspace and config tables.

H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023) scores each key for KV-cache eviction by the column sums of the attention
probabilities: with ``P = softmax(scale · Q Kᵀ (+ mask), dim=-1)`` ``[B, Hq, Nq, Nk]``,
``score[b, h, j] = Σ_i P[b, h, i, j]``, next to the usual ``out = P V``.

A column's terms need every row's final softmax statistics, known only once the whole row has
been streamed (``docs/math.md``, "H2O column sums"). Plans (:data:`PLANS`):

``"two_kernel"``
    kernel 0, the attention forward (:func:`fuser.codegen.attention.forward` with the statistics
    stored; without ``out``, the statistics-only row pass of ``templates/h2o_fwd.py.jinja``: no V
    loads, no P V dots): ``out`` and per row the base-2 ``LSE₂ = m₂ + log₂ l`` (``+inf`` for a
    row with no visible key), or with an additive mask the two-part statistics ``(m₂, log₂ l)``;
    kernel 1 (``templates/h2o_colsum.py.jinja``): column-parallel, grid ``(cdiv(Nk, BLOCK_N),
    B·Hq)``; each program loads one block of keys and streams the query blocks that can see it
    (causal: only those at or below the diagonal), recomputing ``P = exp2(s' − LSE₂)`` (or
    ``exp2((s' − m₂) − log₂ l)``) with ``s' = scale·log₂e·q·k (+ mask·log₂e)``, and sums it over
    the rows. Deterministic.
``"one_kernel"``
    ``templates/h2o_fwd.py.jinja`` with ``one_kernel``: row-parallel, one program per query
    block, two passes over the visible keys: pass 1 the row max and sum (online softmax, no V),
    pass 2 recomputes ``P`` with the final statistics, accumulates ``O = P V`` (normalised
    already: no rescaling) and adds the tile's column sums into ``score`` with float32
    ``tl.atomic_add`` (``score`` zeroed first). Q Kᵀ twice, as two_kernel, but one launch and no
    statistics through HBM; ``Nq / BLOCK_M`` atomic adds per score element. **Not
    deterministic**: the order in which the query blocks' atomics land varies, so ``score`` can
    differ bitwise between runs at float32 rounding (``out`` does not).
``"diag_cache"``
    two_kernel where kernel 0 (``h2o_fwd.py.jinja`` with ``cache_ranges``) also writes the float32
    base-2 scores ``s'`` (scaled, masked, ``-inf`` where hidden) of a set of cached
    ``[T, T]`` tiles (``T = BLOCK_M = BLOCK_N``, equal in both kernels) into a compact
    workspace, and kernel 1 reads those tiles instead of recomputing ``Q Kᵀ``: ``exp2(s' − LSE₂)``
    of the stored ``s'`` is what a recompute gives (``docs/math.md``, "Caching tiles between the
    kernels"). The set is given by ``diagonals`` K and a layout (:data:`CACHE_LAYOUTS`,
    :func:`cached_tiles`): ``"balanced"`` the cyclic block diagonals ``(c − r) mod n < K``
    (``n = max(row blocks, key blocks)``), ``"causal"`` (causal masks only) every visible tile
    of the first K query blocks: the short kernel-0 rows whose tiles belong to the long kernel-1
    columns. Per query block and per key block the cached tiles form at most two contiguous
    ranges, so both kernels split their loops into reuse and recompute ranges (no branch in
    any loop). ``diagonals=0`` is two_kernel. The workspace (:func:`workspace_bytes`) is
    allocated once per size and device and reused across calls, the layout tables copied to
    the device once per layout; in a call traced for Inductor (the op's GPU path) both are
    made per call inside the compiled graph (the tables by tensor ops, :func:`_device_tables`).

Variants: causal ``"none"``, ``"top_left"``, ``"bottom_right"`` (one rendered kernel serves both
alignments through the runtime causal offset), mask kinds ``"none"``, ``"bool_keep"``,
``"bool_drop"``, ``"additive"`` (an additive mask gives the two-part statistics), row-broadcast
masks, ``need_out`` False. Finite fills (``docs/math.md``, "Finite fills" under "H2O column
sums"), as the attention forward takes them: a boolean mask's hidden entries score the finite
``mask_fill`` (``masked_fill(~pad, finfo.min)``; every plan; two-part statistics), entries above
the causal diagonal score the finite ``causal_fill`` or ``s + causal_fill`` (two_kernel only,
with or without a data mask). Not supported (``ValueError``): index predicates (``mask_pred``).

Sizes (B, H, Nq, Nk, the causal offset, the workspace's slot count) are runtime arguments; the
sequence lengths and the offset are ``do_not_specialize``, so a new length does not recompile.

Shapes: q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` (any strides, never
copied), ``Hq % Hkv == 0`` (query head h reads kv head ``h // (Hq // Hkv)``), fp32 / fp16 /
bf16; ``score`` ``[B, Hq, Nk]`` float32.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Optional, Sequence

import torch

from . import attention, launch, variants
from .render import RenderedKernel, render

__all__ = [
    "forward", "colsum_kernel", "fwd_kernel", "kernels_for", "candidate_configs", "column_pass_config", "alloc_score",
    "cached_tiles", "diagonal_count", "workspace_bytes", "program_tiles", "empty_rows_possible", "PLANS",
    "CACHE_LAYOUTS", "SUPPORTED",
]

TEMPLATE = "h2o_colsum.py.jinja"
FWD_TEMPLATE = "h2o_fwd.py.jinja"
LOG2E = 1.4426950408889634
NEG_INF = float("-inf")

#: The plans :func:`forward` runs (module docstring).
PLANS = ("two_kernel", "one_kernel", "diag_cache")
#: The diag_cache layouts (:func:`cached_tiles`).
CACHE_LAYOUTS = ("balanced", "causal")

#: What the plans support, for error messages.
SUPPORTED = ("causal in ('none', 'top_left', 'bottom_right'), mask_kind in ('none', 'bool_keep', 'bool_drop', "
             "'additive'); a finite mask_fill of a boolean mask with every plan; a finite causal_fill (replace or "
             "add) with plan two_kernel; no mask_pred")


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _mask_fill_finite(mask_kind: str, mask_fill_finite: bool) -> bool:
    """A finite mask fill applies to the boolean mask kinds only (as in the attention kernels)."""
    return bool(mask_fill_finite) and mask_kind in ("bool_keep", "bool_drop")


def colsum_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, interpret: bool,
                  cache_ranges: int = 0, causal_fill: str = "hide", mask_fill_finite: bool = False) -> RenderedKernel:
    """Render the column-pass kernel module of one static variant (``causal``: a mode or a bool;
    the statistics are two-part for ``mask_kind="additive"``, a finite mask fill or a finite
    causal fill, as in the forward; ``cache_ranges`` 1 or 2: diag_cache's column pass reading
    that many cached ranges per key block, 0: two_kernel's; ``causal_fill`` ``"hide"`` (-inf
    above the diagonal), ``"replace"`` or ``"add"``: a finite runtime fill, as in the attention
    forward; ``mask_fill_finite``: a boolean mask's hidden entries score the runtime
    ``mask_fill`` instead of -inf, ignored for other mask kinds).

    Raises:
        ValueError: unknown causal mode, mask kind or fill kind, ``cache_ranges`` not in 0..2,
            a finite causal fill with a cache.
    """
    variants.check_variant(causal, mask_kind)
    if cache_ranges not in (0, 1, 2):
        raise ValueError(f"cache_ranges must be 0, 1 or 2, got {cache_ranges!r}")
    if causal_fill not in ("hide", "replace", "add"):
        raise ValueError(f"causal_fill must be 'hide', 'replace' or 'add', got {causal_fill!r}")
    causal = variants.is_causal(causal)
    fill = causal_fill if causal else "hide"
    if fill != "hide" and cache_ranges:
        raise ValueError("the column pass takes a finite causal fill without a cache only")
    mfill = _mask_fill_finite(mask_kind, mask_fill_finite)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    name = ("h2o_colsum" + ({"hide": "_causal", "replace": "_causalfill", "add": "_causaladd"}[fill] if causal else "")
            + variants.MASK_SUFFIX[mask_kind] + ("fill" if mfill else "") + ("_rowbcast" if row else "")
            + (f"_cache{cache_ranges}" if cache_ranges else "") + ("_interp" if interpret else ""))
    return render(
        TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
        two_part=mask_kind == "additive" or fill != "hide" or mfill, cache_ranges=int(cache_ranges),
        causal_fill=fill, mask_fill_finite=mfill, interpret=bool(interpret),
    )


def fwd_kernel(*, causal, mask_kind: str, mask_row_broadcast: bool, need_out: bool, one_kernel: bool,
               cache_ranges: int, interpret: bool, mask_fill_finite: bool = False,
               nan_rows: bool = False) -> RenderedKernel:
    """Render the row-parallel H2O kernel module (``templates/h2o_fwd.py.jinja``): the whole
    one_kernel plan (``one_kernel``), or kernel 0 storing the statistics (and ``out`` with
    ``need_out``), writing the cached tiles' scores with ``cache_ranges`` 1 or 2 (diag_cache).
    ``mask_fill_finite``: a boolean mask's hidden entries score the runtime ``mask_fill``
    (two-part statistics), ignored for other mask kinds. ``nan_rows`` (one_kernel only; ignored
    otherwise): a row with no visible key makes every column sum of its (batch, head) NaN
    (:func:`forward`'s ``nan_rows``).

    Raises:
        ValueError: unknown causal mode or mask kind, ``cache_ranges`` not in 0..2, or
            ``cache_ranges`` with ``one_kernel``.
    """
    variants.check_variant(causal, mask_kind)
    if cache_ranges not in (0, 1, 2) or (one_kernel and cache_ranges):
        raise ValueError(f"cache_ranges must be 0, 1 or 2 (0 with one_kernel), got {cache_ranges!r}")
    causal = variants.is_causal(causal)
    mfill = _mask_fill_finite(mask_kind, mask_fill_finite)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    nan = bool(nan_rows) and bool(one_kernel)
    name = ("h2o_" + ("onekernel" if one_kernel else "fwd") + ("_causal" if causal else "")
            + variants.MASK_SUFFIX[mask_kind] + ("fill" if mfill else "") + ("_rowbcast" if row else "")
            + ("" if need_out else "_noout")
            + (f"_cache{cache_ranges}" if cache_ranges else "") + ("_nanrows" if nan else "")
            + ("_interp" if interpret else ""))
    return render(
        FWD_TEMPLATE, name,
        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, two_part=mask_kind == "additive" or mfill,
        need_out=bool(need_out), one_kernel=bool(one_kernel), cache_ranges=int(cache_ranges),
        mask_fill_finite=mfill, nan_rows=nan, interpret=bool(interpret),
    )


@functools.lru_cache(maxsize=None)
def _colsum_module(causal: bool, mask_kind: str, row: bool, interpret: bool, cache_ranges: int = 0,
                   causal_fill: str = "hide", mask_fill_finite: bool = False):
    """The imported column-pass module of one static variant (rendered once per process)."""
    kernel = colsum_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, interpret=interpret,
                           cache_ranges=cache_ranges, causal_fill=causal_fill, mask_fill_finite=mask_fill_finite)
    return kernel, launch.kernel_module(kernel, interpret)


@functools.lru_cache(maxsize=None)
def _fwd_module(causal: bool, mask_kind: str, row: bool, need_out: bool, one_kernel: bool, cache_ranges: int,
                interpret: bool, mask_fill_finite: bool = False, nan_rows: bool = False):
    """The imported row-parallel module of one static variant (rendered once per process)."""
    kernel = fwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, need_out=need_out,
                        one_kernel=one_kernel, cache_ranges=cache_ranges, interpret=interpret,
                        mask_fill_finite=mask_fill_finite, nan_rows=nan_rows)
    return kernel, launch.kernel_module(kernel, interpret)


def _cache_ranges(cache: str) -> int:
    """Contiguous ranges per query block and per key block a layout needs in the kernels."""
    return 1 if cache == "causal" else 2


def kernels_for(*, plan: str, causal, mask_kind: str, mask_row_broadcast: bool, need_out: bool,
                interpret: bool, diagonals: int = 0, cache: str = "balanced", causal_fill: float = NEG_INF,
                causal_fill_mode: str = "replace", mask_fill: float = NEG_INF,
                nan_rows: bool = False) -> list[RenderedKernel]:
    """The kernel modules a plan runs for one static variant (for reports), in launch order (a
    finite ``causal_fill``: two_kernel's attention forward and column pass taking the fill; a
    finite ``mask_fill`` of a boolean mask: every plan's kernels taking it; ``nan_rows``: as
    :func:`forward`'s, for some sizes)."""
    _check_plan(plan, cache)
    row = bool(mask_row_broadcast) and mask_kind != "none"
    fill_k = variants.causal_fill_kind(causal, causal_fill, causal_fill_mode)
    mfill = variants.mask_fill_kind(mask_kind, mask_fill) != "hide"
    nan = bool(nan_rows) and empty_rows_possible(causal, mask_kind, mask_fill, fill_k)
    if fill_k != "hide":
        return [attention.fwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, need_lse=True,
                                     interpret=interpret, mask_fill=mask_fill, causal_fill=causal_fill,
                                     causal_fill_mode=causal_fill_mode),
                colsum_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, interpret=interpret,
                              causal_fill=fill_k, mask_fill_finite=mfill)]
    kw = dict(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, interpret=interpret, mask_fill_finite=mfill)
    if plan == "one_kernel":
        return [fwd_kernel(need_out=need_out, one_kernel=True, cache_ranges=0, nan_rows=nan, **kw)]
    ranges = _cache_ranges(cache) if plan == "diag_cache" and diagonals > 0 else 0
    if ranges == 0 and need_out:
        first = attention.fwd_kernel(causal=causal, mask_kind=mask_kind, mask_row_broadcast=row, need_lse=True,
                                     interpret=interpret, mask_fill=mask_fill)
    else:
        first = fwd_kernel(need_out=need_out, one_kernel=False, cache_ranges=ranges, **kw)
    return [first, colsum_kernel(cache_ranges=ranges, **kw)]


# --------------------------------------------------------------------------------------------
# Configs: keyed by (device kind, head-dim bucket, dtype size); best first.
# --------------------------------------------------------------------------------------------


def _cfg(bm, bn, w, s):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


# Interpreter: small tiles keep the CPU interpreter fast and still give several query blocks per
# key block (and ragged ones) at test sizes.
_INTERP = [_cfg(16, 32, 4, 1), _cfg(32, 16, 4, 1), _cfg(16, 16, 4, 1)]
_INTERP_PLANS = {
    "one_kernel": [_cfg(16, 16, 4, 1), _cfg(32, 16, 4, 1), _cfg(16, 32, 4, 1)],
    # diag_cache: one square tile T for both kernels (the cached tiles are [T, T])
    "diag_cache": [_cfg(16, 16, 4, 1), _cfg(32, 32, 4, 1)],
}

# GPUs. sm90 fp16/bf16, D = 128: swept on the H100 (2026-11-23, B=1, H=32, D=128, fp16, N 1024..16384,
# causal and not; 24 configs BLOCK_M {32, 64, 128} x BLOCK_N {64, 128} x warps {4, 8} x stages {2, 3}):
# (128, 128, 4, 2) was best or within 3% at N >= 4096; (64, 64, 4, 3) / (32, 128, 4, 3) at N <= 2048.
# BLOCK_N 256 (tried for BLOCK_M {64, 128}) was never better. The D <= 64 row takes the same first
# choice, not measured; other rows are not measured: a program holds one [BLOCK_N, D] key tile
# and streams [BLOCK_M, D] query tiles, like the attention backward's dK/dV kernel without V and dO.
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

# GPUs, the other plans. sm90 fp16/bf16 D = 128 swept on the H100 (2026-11-23, B=1, H=32, N=4096, causal
# and not): one_kernel 16 configs BLOCK_M {64, 128} x BLOCK_N {64, 128} x warps {4, 8} x stages {2, 3},
# (128, 64, 4, 2) best in both (0.76 / 1.09 ms; the earlier guess (128, 64, 8, 2) 0.96 / 1.77 ms);
# diag_cache (K=4) tiles {64, 128} x warps {4, 8} x stages {2, 3}, (64, 64, 4, 2) best in both
# (0.80 / 1.38 ms). Every other row: NOT MEASURED (guesses).
# one_kernel: a forward-shaped program (a [BLOCK_M, D] query tile resident, key tiles streamed
# twice), so the attention forward's tile shapes, a little smaller for the second pass's atomics.
# diag_cache: one square tile for both kernels; 64 keeps a cached fp32 tile at 16 KiB.
_TABLE_PLANS = {
    "one_kernel": {
        ("sm90", 64, 2): [_cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3)],
        ("sm90", 128, 2): [_cfg(128, 64, 4, 2), _cfg(64, 64, 4, 3), _cfg(128, 128, 8, 2)],
        ("sm90", 256, 2): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)],
        ("sm90", 64, 4): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)],
        ("sm90", 128, 4): [_cfg(32, 32, 4, 2), _cfg(32, 16, 4, 1)],
        ("sm90", 256, 4): [_cfg(16, 32, 4, 1), _cfg(16, 16, 4, 1)],
        ("cuda", 64, 2): [_cfg(64, 64, 4, 2), _cfg(64, 32, 4, 2)],
        ("cuda", 128, 2): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)],
        ("cuda", 256, 2): [_cfg(32, 32, 4, 1), _cfg(16, 32, 4, 1)],
        ("cuda", 64, 4): [_cfg(32, 32, 4, 2), _cfg(16, 32, 4, 2)],
        ("cuda", 128, 4): [_cfg(16, 32, 4, 1), _cfg(16, 16, 4, 1)],
        ("cuda", 256, 4): [_cfg(16, 16, 4, 1)],
    },
    "diag_cache": {
        ("sm90", 64, 2): [_cfg(64, 64, 4, 3), _cfg(128, 128, 8, 2)],
        ("sm90", 128, 2): [_cfg(64, 64, 4, 2), _cfg(128, 128, 8, 2), _cfg(64, 64, 4, 3)],
        ("sm90", 256, 2): [_cfg(32, 32, 4, 2), _cfg(64, 64, 8, 2)],
        ("sm90", 64, 4): [_cfg(32, 32, 4, 2), _cfg(64, 64, 4, 2)],
        ("sm90", 128, 4): [_cfg(32, 32, 4, 2), _cfg(16, 16, 4, 1)],
        ("sm90", 256, 4): [_cfg(16, 16, 4, 1)],
        ("cuda", 64, 2): [_cfg(64, 64, 4, 2), _cfg(32, 32, 4, 2)],
        ("cuda", 128, 2): [_cfg(32, 32, 4, 2), _cfg(64, 64, 8, 2)],
        ("cuda", 256, 2): [_cfg(32, 32, 4, 1), _cfg(16, 16, 4, 1)],
        ("cuda", 64, 4): [_cfg(32, 32, 4, 2), _cfg(16, 16, 4, 2)],
        ("cuda", 128, 4): [_cfg(16, 16, 4, 1)],
        ("cuda", 256, 4): [_cfg(16, 16, 4, 1)],
    },
}


def _dim_bucket(head_dim: int) -> int:
    width = max(launch.next_power_of_2(head_dim), 16)
    return 64 if width <= 64 else 128 if width <= 128 else 256


def candidate_configs(*, head_dim: int, dtype: torch.dtype, device, plan: str = "two_kernel") -> list[dict]:
    """Launch configs, best first (the first is the default): the interpreter's table on CPU
    tensors, else by device kind, head-dim bucket and dtype size.

    ``plan="two_kernel"``: the column pass (``BLOCK_M`` query rows per step, ``BLOCK_N`` keys per
    program; kernel 0 uses the attention forward's table). ``"one_kernel"``: the one kernel
    (``BLOCK_M`` rows per program, ``BLOCK_N`` keys per step). ``"diag_cache"``: both kernels,
    ``BLOCK_M == BLOCK_N`` (the cached tile is square).

    Raises:
        ValueError: unknown plan.
    """
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    dev = launch.device_kind(device)
    if dev == "interpreter":
        return [dict(c) for c in (_INTERP if plan == "two_kernel" else _INTERP_PLANS[plan])]
    size = 4 if dtype == torch.float32 else 2
    table = _TABLE if plan == "two_kernel" else _TABLE_PLANS[plan]
    return [dict(c) for c in table[(dev, _dim_bucket(head_dim), size)]]


def _configs(config: Optional[dict], q: torch.Tensor, plan: str = "two_kernel") -> list[dict]:
    """The given config alone (missing keys from the default), or every candidate (default first)."""
    cands = candidate_configs(head_dim=q.shape[-1], dtype=q.dtype, device=q.device, plan=plan)
    if config:
        return [launch.check_config({**cands[0], **config})]
    return [launch.check_config(c) for c in cands]


#: Column-pass config for short sequences (N <= SHORT_N): with 128 x 128 tiles a head has too few
#: key blocks to fill the H100 (N=1024 causal: 0.19 ms against 0.11 ms with 64 x 64 tiles, H100
#: sweep of 2026-11-23).
SHORT_N = 2048
_SHORT = _cfg(64, 64, 4, 3)


def column_pass_config(*, head_dim: int, dtype: torch.dtype, device, n: int) -> dict:
    """The config two_kernel's column pass (kernel 1) launches with by default for sequences of
    ``n = max(Nq, Nk)`` tokens: :func:`candidate_configs`' first, or the short-sequence config
    when ``n <= SHORT_N`` on a device whose table starts with 128-wide tiles (the planner's cost
    model reads its tile size: the short config's 64 x 64 tiles run at a lower efficiency)."""
    return _short_first(candidate_configs(head_dim=head_dim, dtype=dtype, device=device), None, n)[0]


def _short_first(configs: list[dict], given: Optional[dict], n: Optional[int]) -> list[dict]:
    """Put the short-sequence column-pass config first when no config was given, the sequences
    are short (``n <= SHORT_N``; ``n`` None: unknown, a symbolic length under dynamic shapes,
    taken as long) and the device's table has 128-wide tiles first (sm90)."""
    if given or not isinstance(n, int) or n > SHORT_N or configs[0]["BLOCK_N"] < 128:
        return configs
    short = launch.check_config(dict(_SHORT))
    return [short] + [c for c in configs if c != short]


def _diag_config(config: Optional[dict], fwd_config: Optional[dict], q: torch.Tensor) -> tuple[dict, dict]:
    """diag_cache's (kernel 1 config, kernel 0 config): one square tile T for both; ``fwd_config``
    may change kernel 0's warps and stages, not its tile."""
    cfg = _configs(config, q, "diag_cache")[0]
    if cfg["BLOCK_M"] != cfg["BLOCK_N"]:
        raise ValueError(f"diag_cache needs BLOCK_M == BLOCK_N (square cached tiles), got {cfg['BLOCK_M']}x{cfg['BLOCK_N']}")
    fwd = dict(cfg, **(fwd_config or {}))
    if (fwd["BLOCK_M"], fwd["BLOCK_N"]) != (cfg["BLOCK_M"], cfg["BLOCK_N"]):
        raise ValueError("diag_cache: fwd_config may set num_warps and num_stages only; both kernels use config's "
                         f"tile {cfg['BLOCK_M']}x{cfg['BLOCK_N']}")
    return cfg, launch.check_config(fwd)


# --------------------------------------------------------------------------------------------
# diag_cache layouts: which [T, T] tiles kernel 0 caches for kernel 1 (docs/math.md)
# --------------------------------------------------------------------------------------------


def _visible(n_q: int, n_k: int, tile: int, causal: str) -> tuple[list[int], list[int]]:
    """Per query block r the end of its visible key blocks ``[0, hi_r)`` and per key block c the
    first query block that sees it (``[lo_c, n_r)``; ``n_r`` when none): the tiles the kernels
    visit (a tile is visited iff one of its entries is visible)."""
    n_r, n_c = launch.cdiv(n_q, tile), launch.cdiv(n_k, tile)
    if causal == "none":
        return [n_c] * n_r, [0] * n_c
    off = variants.causal_offset(causal, n_q, n_k)
    row_hi = [min(max(launch.cdiv(min((r + 1) * tile, n_q) + off, tile), 0), n_c) for r in range(n_r)]
    col_lo = []
    for c in range(n_c):
        first = max(c * tile - off, 0)  # the first query that sees key c * tile
        col_lo.append(n_r if first >= n_q else first // tile)
    return row_hi, col_lo


def _layout(n_r: int, n_c: int, diagonals: int, cache: str, row_hi: Sequence[int]) -> list[tuple[int, int]]:
    """The cached tiles (r, c), row-major, among the visible ones (``c < row_hi[r]``)."""
    k = int(diagonals)
    if k <= 0:
        return []
    if cache == "balanced":
        n = max(n_r, n_c)
        return [(r, c) for r in range(n_r) for c in range(row_hi[r]) if (c - r) % n < k]
    # causal: every visible tile of the first K query blocks
    return [(r, c) for r in range(min(k, n_r)) for c in range(row_hi[r])]


def cached_tiles(n_blocks, diagonals: int, cache: str, causal) -> list[tuple[int, int]]:
    """The tiles ``(r, c)`` (query block, key block) diag_cache caches, row-major, pure Python.

    Args:
        n_blocks: blocks per side of a square grid (``Nq = Nk = n_blocks · T``), or
            ``(n_row_blocks, n_key_blocks)``.
        diagonals: K, in ``0..max(n_row_blocks, n_key_blocks)``.
        cache: ``"balanced"``: the cyclic block diagonals ``(c − r) mod n < K``, ``n =
            max(n_row_blocks, n_key_blocks)`` (every query block caches K tiles, every key block
            about K); ``"causal"``: every visible tile of the query blocks ``r < K``.
        causal: a causal mode (top-left alignment of the grid for ``"top_left"`` and ``True``;
            ``"bottom_right"`` aligns the last rows and keys) or a bool; only visible tiles are
            cached (for causal, those with ``c ≤ r`` on a square grid).

    Raises:
        ValueError: unknown layout, K out of range, the causal layout without causal masking.
    """
    n_r, n_c = (n_blocks, n_blocks) if isinstance(n_blocks, int) else (int(n_blocks[0]), int(n_blocks[1]))
    mode = causal if isinstance(causal, str) else ("top_left" if causal else "none")
    _check_plan("diag_cache", cache, diagonals, max(n_r, n_c), mode)
    row_hi, _ = _visible(n_r, n_c, 1, mode)
    return _layout(n_r, n_c, diagonals, cache, row_hi)


def program_tiles(n_blocks, diagonals: int, cache: str, causal) -> dict:
    """The per-program tile counts of diag_cache on the grid of :func:`cached_tiles`: ``"rows"``
    (kernel 0, per query block: ``(visited, written)``) and ``"cols"`` (kernel 1, per key block:
    ``(recomputed, read)``); K = 0 is two_kernel. For the balance derivation in
    ``docs/math.md`` and the cost model."""
    n_r, n_c = (n_blocks, n_blocks) if isinstance(n_blocks, int) else (int(n_blocks[0]), int(n_blocks[1]))
    mode = causal if isinstance(causal, str) else ("top_left" if causal else "none")
    tiles = set(cached_tiles((n_r, n_c), diagonals, cache, mode))
    row_hi, col_lo = _visible(n_r, n_c, 1, mode)
    rows = [(row_hi[r], sum((r, c) in tiles for c in range(row_hi[r]))) for r in range(n_r)]
    cols = []
    for c in range(n_c):
        read = sum((r, c) in tiles for r in range(col_lo[c], n_r))
        cols.append((n_r - col_lo[c] - read, read))
    return {"rows": rows, "cols": cols}


def _ranges(items: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted integers as maximal contiguous half-open ranges."""
    out: list[list[int]] = []
    for x in sorted(items):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return [tuple(r) for r in out]


def _pad_ranges(rs: list[tuple[int, int]], want: int, what: str) -> list[int]:
    """Ranges as ``2 · want`` ints; empty ranges sit at the previous range's end (the kernels
    clamp each bound to the previous one)."""
    if len(rs) > want:
        raise AssertionError(f"{what}: {len(rs)} cached ranges, the kernels take {want}")
    flat: list[int] = []
    end = rs[0][0] if rs else 0
    for a, b in rs:
        flat += [a, b]
        end = b
    while len(flat) < 2 * want:
        flat += [end, end]
    return flat


@functools.lru_cache(maxsize=256)
def _tables(n_q: int, n_k: int, tile: int, causal: str, diagonals: int, cache: str):
    """``(row_tab, col_tab, n_slots, tiles)`` of a layout (plain lists; rows of 5 and 4 ints)."""
    n_r, n_c = launch.cdiv(n_q, tile), launch.cdiv(n_k, tile)
    row_hi, col_lo = _visible(n_q, n_k, tile, causal)
    tiles = _layout(n_r, n_c, diagonals, cache, row_hi)
    want = _cache_ranges(cache)
    by_row: dict[int, list[int]] = collections.defaultdict(list)
    by_col: dict[int, list[int]] = collections.defaultdict(list)
    for r, c in tiles:
        by_row[r].append(c)
        by_col[c].append(r)
    row_tab, slot = [], 0
    for r in range(n_r):
        rs = _ranges(by_row[r])
        row_tab += _pad_ranges(rs, 2, f"query block {r}") + [slot]
        if want == 1:
            assert len(rs) <= 1
        slot += len(by_row[r])
    col_tab = []
    for c in range(n_c):
        rs = _ranges(by_col[c])
        assert all(a >= col_lo[c] for a, _ in rs)
        col_tab += _pad_ranges(rs, want, f"key block {c}") + [0] * (2 if want == 1 else 0)
    return row_tab, col_tab, slot, tiles


# The workspace and the layout tables, kept across calls (keyed by device, dtype, size); the
# workspace holds scratch data only between a call's two kernels. Bounded: the least recently
# used entries go first.
_WS_KEEP = 4
_TAB_KEEP = 64
_ws_lock = threading.Lock()
_workspaces: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()
_tab_tensors: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A float32 workspace of ``numel`` elements on ``device``, allocated on first use of that
    (device, dtype, size) and reused by later calls (poisoned when first allocated under
    :func:`~fuser.codegen.launch.poison_outputs`). While traced (:func:`~fuser.codegen.launch.tracing`:
    the kernels handed to Inductor) a new one per call: a kept tensor would be captured into the
    compiled graph, one buffer for every call of it."""
    if launch.tracing():
        return launch.empty((max(int(numel), 1),), torch.float32, device)
    key = (str(device), torch.float32, int(numel))
    with _ws_lock:
        ws = _workspaces.get(key)
        if ws is None:
            ws = launch.empty((max(int(numel), 1),), torch.float32, device)
            _workspaces[key] = ws
            while len(_workspaces) > _WS_KEEP:
                _workspaces.popitem(last=False)
        _workspaces.move_to_end(key)
        return ws


def _two_ranges(a0, b0, a1, b1):
    """Two sorted half-open ranges (``b0 <= a1``; int tensors, elementwise) in the tables' form
    (:func:`_ranges` then :func:`_pad_ranges`): adjacent ranges merged, empty ones dropped, the
    rest padded with empty ranges at the last end (``0`` when none is left)."""
    e0, e1 = b0 > a0, b1 > a1
    both = e0 & e1
    merged = both & (b0 == a1)
    first_a = torch.where(e0, a0, torch.where(e1, a1, 0))
    first_b = torch.where(merged, b1, torch.where(e0, b0, torch.where(e1, b1, 0)))
    second_a = torch.where(both & ~merged, a1, first_b)
    second_b = torch.where(both & ~merged, b1, first_b)
    return first_a, first_b, second_a, second_b


def _device_tables(device: torch.device, n_q: int, n_k: int, tile: int, causal: str, diagonals: int, cache: str):
    """``(row_tab, col_tab)`` of :func:`_tables` computed by tensor ops on ``device`` from block
    indices (``torch.arange``), no data from the host: the form a traced call (the kernels handed
    to Inductor) allocates per call, where a tensor made from Python lists would become a
    constant of the compiled graph (copied from the host on every call). The same values as
    :func:`_tables` (``tests/codegen/test_h2o_kernels.py`` compares them)."""
    n_r, n_c = launch.cdiv(n_q, tile), launch.cdiv(n_k, tile)
    n = max(n_r, n_c)
    kk = int(diagonals)
    r = torch.arange(n_r, dtype=torch.int32, device=device)
    c = torch.arange(n_c, dtype=torch.int32, device=device)
    if causal == "none":
        hi = torch.full_like(r, n_c)
        lo = torch.zeros_like(c)
    else:
        off = variants.causal_offset(causal, n_q, n_k)
        last = torch.clamp((r + 1) * tile, max=n_q) + off  # (the last visible query row + 1) + offset
        hi = torch.clamp(torch.div(last + tile - 1, tile, rounding_mode="floor"), min=0, max=n_c)
        first = torch.clamp(c * tile - off, min=0)  # the first query that sees the key block
        lo = torch.where(first >= n_q, n_r, torch.div(first, tile, rounding_mode="floor"))
    zero_r, zero_c = torch.zeros_like(r), torch.zeros_like(c)
    if cache == "balanced":
        # row r caches the key blocks c with (c - r) mod n < K: [0, r + K - n) (wrapped) and
        # [r, r + K), within the visible [0, hi); key block c is cached by the query blocks
        # [c - K + 1, c + 1) and [c + n - K + 1, n_r) (wrapped), within the visible [lo, n_r)
        w = torch.minimum(torch.clamp(r + kk - n, min=0), hi)
        m = torch.minimum(r + kk, hi)
        row = _two_ranges(zero_r, w, r, torch.maximum(m, r))
        a = torch.maximum(torch.clamp(c - kk + 1, min=0), lo)
        b = torch.clamp(c + 1, max=n_r)
        a2 = torch.maximum(c + n - kk + 1, lo)
        b = torch.maximum(b, a)
        col = _two_ranges(a, b, torch.maximum(a2, b), torch.maximum(torch.full_like(c, n_r), torch.maximum(a2, b)))
    else:
        # causal: the query blocks r < K cache their whole visible row [0, hi)
        end = torch.where(r < kk, hi, 0)
        row = (zero_r, end, end, end)
        a = torch.clamp(lo, max=n_r)
        b = torch.clamp(torch.full_like(c, min(kk, n_r)), min=0)
        nonempty = b > a
        col = (torch.where(nonempty, a, 0), torch.where(nonempty, b, 0), zero_c, zero_c)
    counts = (row[1] - row[0]) + (row[3] - row[2])
    slots = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    row_tab = torch.stack([*row, slots], dim=1).reshape(-1).to(torch.int32)
    col_tab = torch.stack(list(col), dim=1).reshape(-1).to(torch.int32)
    return row_tab, col_tab


def _table_tensors(device: torch.device, n_q: int, n_k: int, tile: int, causal: str, diagonals: int, cache: str):
    """``(row_tab, col_tab, n_slots)`` as int32 tensors on ``device``: copied there once per
    layout and kept; while traced (:func:`~fuser.codegen.launch.tracing`), computed on the
    device per call (:func:`_device_tables`), nothing kept."""
    if launch.tracing():
        n_slots = _tables(n_q, n_k, tile, causal, diagonals, cache)[2]
        return (*_device_tables(device, n_q, n_k, tile, causal, diagonals, cache), n_slots)
    key = (str(device), n_q, n_k, tile, causal, diagonals, cache)
    with _ws_lock:
        hit = _tab_tensors.get(key)
        if hit is not None:
            _tab_tensors.move_to_end(key)
            return hit
    row_tab, col_tab, n_slots, _ = _tables(n_q, n_k, tile, causal, diagonals, cache)
    out = (torch.tensor(row_tab, dtype=torch.int32).to(device), torch.tensor(col_tab, dtype=torch.int32).to(device),
           n_slots)
    with _ws_lock:
        _tab_tensors[key] = out
        while len(_tab_tensors) > _TAB_KEEP:
            _tab_tensors.popitem(last=False)
    return out


def clear_workspaces() -> None:
    """Drop the kept workspaces and layout tables (their memory is freed once unused)."""
    with _ws_lock:
        _workspaces.clear()
        _tab_tensors.clear()


def _check_plan(plan: str, cache: str, diagonals: int = 0, count: Optional[int] = None, causal: str = "none") -> None:
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    if cache not in CACHE_LAYOUTS:
        raise ValueError(f"cache must be one of {CACHE_LAYOUTS}, got {cache!r}")
    if not isinstance(diagonals, int) or isinstance(diagonals, bool) or diagonals < 0 or (
            count is not None and diagonals > count):
        top = "" if count is None else f"..{count}"
        raise ValueError(f"diagonals must be an int in 0{top} (the block diagonals of this shape and config), "
                         f"got {diagonals!r}")
    if plan == "diag_cache" and cache == "causal" and diagonals > 0 and causal not in ("top_left", "bottom_right"):
        raise ValueError("cache='causal' (the mask-aware layout) needs causal masking ('top_left' or 'bottom_right'); "
                         f"got causal={causal!r}: use cache='balanced'")


def _tile(config: Optional[dict], q: torch.Tensor) -> int:
    cfg = _configs(config, q, "diag_cache")[0]
    if cfg["BLOCK_M"] != cfg["BLOCK_N"]:
        raise ValueError(f"diag_cache needs BLOCK_M == BLOCK_N (square cached tiles), got {cfg['BLOCK_M']}x{cfg['BLOCK_N']}")
    return cfg["BLOCK_M"]


def diagonal_count(q: torch.Tensor, k: torch.Tensor, causal: str = "none", config: Optional[dict] = None) -> int:
    """How many block diagonals diag_cache's ``diagonals`` may range over (``0..`` this) for
    q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]`` and the tile of ``config`` (the default diag_cache
    config when None): ``max(cdiv(Nq, T), cdiv(Nk, T))``. With ``cache="causal"`` every K at or
    past the number of query blocks caches every visible tile."""
    variants.check_variant(causal, "none")
    t = _tile(config, q)
    return max(launch.cdiv(q.shape[2], t), launch.cdiv(k.shape[2], t))


def workspace_bytes(q: torch.Tensor, k: torch.Tensor, *, plan: str, diagonals: int, cache: str,
                    config: Optional[dict] = None, causal: Optional[str] = None) -> int:
    """Extra HBM a plan allocates beyond ``out``, ``score`` and the statistics: for diag_cache
    the cached tiles, ``B · Hq · slots · T² · 4`` bytes (``T`` the config's tile), else 0.

    ``causal``: the causal mode the call will use (only visible tiles are cached); default
    ``"top_left"`` for ``cache="causal"``, ``"none"`` for ``"balanced"``.

    Raises:
        ValueError: unknown plan or layout, K out of range.
    """
    causal = causal if causal is not None else ("top_left" if cache == "causal" else "none")
    _check_plan(plan, cache)
    if plan != "diag_cache" or diagonals == 0:
        return 0
    count = diagonal_count(q, k, causal, config)
    _check_plan(plan, cache, diagonals, count, causal)
    t = _tile(config, q)
    n_slots = _tables(q.shape[2], k.shape[2], t, causal, diagonals, cache)[2]
    return q.shape[0] * q.shape[1] * n_slots * t * t * 4


# --------------------------------------------------------------------------------------------
# Allocation and launch
# --------------------------------------------------------------------------------------------


def alloc_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``score`` ``[B, Hq, Nk]`` float32, contiguous, on q's device (poisoned under
    :func:`~fuser.codegen.launch.poison_outputs`)."""
    b, h = q.shape[:2]
    return launch.empty((b, h, k.shape[2]), torch.float32, q.device)


def empty_rows_possible(causal, mask_kind: str, mask_fill: float = NEG_INF, causal_fill_kind: str = "hide",
                        n_q: Optional[int] = None, n_k: Optional[int] = None) -> bool:
    """Whether a query row can have no visible key (every score ``-inf``): a ``-inf`` causal mask
    aligned bottom-right with ``Nq > Nk`` (any sizes when ``n_q``/``n_k`` are None, or symbolic
    sizes whose ``Nk >= Nq`` is not proven: no guard), or a data mask hiding with ``-inf`` (a
    boolean mask without a finite ``mask_fill``, an additive mask). ``causal_fill_kind``:
    ``"hide"`` or a finite fill's kind (:func:`variants.causal_fill_kind`)."""
    if mask_kind == "additive" or (mask_kind in ("bool_keep", "bool_drop") and mask_fill == NEG_INF):
        return True
    if causal_fill_kind != "hide" or causal != "bottom_right":
        return False
    return n_q is None or n_k is None or not launch.proven(variants.causal_offset(causal, n_q, n_k) >= 0)


def _nan_where_empty_rows(score: torch.Tensor, stats: torch.Tensor, two_part: bool) -> None:
    """``score[b, h, :] = NaN`` (in place) where a row of (b, h) has no visible key: its
    statistics' first part (``LSE₂``, or the row max ``m₂``) is ``+inf`` (the kernels' mark)."""
    first = stats[:, :, 0] if two_part else stats
    score.masked_fill_(torch.isposinf(first).any(-1, keepdim=True), float("nan"))


def _check_supported(mask_fill: float, causal, causal_fill: float, causal_fill_mode: str, mask_kind: str,
                     mask_pred, plan: str, diagonals: int) -> tuple[str, str]:
    """``(mask fill kind, causal fill kind)`` (each ``"hide"``, ``"replace"`` or ``"add"``)
    after checking what the plans support: a finite ``mask_fill`` (of a boolean mask; ignored
    for other kinds, as in the attention kernels) with every plan; a finite ``causal_fill``
    with two_kernel (or diag_cache with no cached tile), with or without a data mask; no
    predicate."""
    variants.check_fill("mask_fill", mask_fill)
    if attention.as_predicate(mask_pred) is not None:
        raise ValueError(f"H2O column sums: index predicates (mask_pred) are not supported; supported: {SUPPORTED}")
    variants.check_fill("causal_fill", causal_fill, causal_fill_mode)
    kind = variants.causal_fill_kind(causal, causal_fill, causal_fill_mode)
    if kind != "hide" and (plan == "one_kernel" or (plan == "diag_cache" and diagonals)):
        raise ValueError(f"H2O column sums: a finite causal_fill ({causal_fill!r}) runs with plan='two_kernel' "
                         f"only (got plan={plan!r}{f', diagonals={diagonals}' if plan == 'diag_cache' else ''})")
    return variants.mask_fill_kind(mask_kind, mask_fill), kind


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
    plan: str = "two_kernel",
    diagonals: int = 0,
    cache: str = "balanced",
    config: Optional[dict] = None,
    fwd_config: Optional[dict] = None,
    mask_fill: float = NEG_INF,
    causal_fill: float = NEG_INF,
    mask_pred=None,
    causal_fill_mode: str = "replace",
    nan_rows: bool = False,
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """H2O column sums and attention output with one of :data:`PLANS` (module docstring).

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
        need_out: also return ``out``; without it no kernel loads V.
        plan: ``"two_kernel"``, ``"one_kernel"`` (score by atomics: not bitwise deterministic)
            or ``"diag_cache"``.
        diagonals: diag_cache's K, in ``0..diagonal_count(q, k, causal, config)``; 0 runs
            two_kernel. Ignored by the other plans.
        cache: diag_cache's layout, ``"balanced"`` or ``"causal"`` (causal masking only).
        config: two_kernel: the column pass's config; one_kernel: the kernel's; diag_cache: both
            kernels' (``BLOCK_M == BLOCK_N``). Keys ``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
            ``num_stages``; missing keys from the plan's default; ``None``: the plan's table.
        fwd_config: two_kernel: kernel 0's config (:func:`fuser.codegen.attention.forward`'s
            ``config``, or the statistics-only pass's without ``need_out``); diag_cache: kernel
            0's ``num_warps``/``num_stages`` (its tile is ``config``'s); one_kernel: ignored.
        causal_fill, causal_fill_mode: with causal masking, entries above the diagonal score
            ``causal_fill`` (``"replace"``) or ``s + causal_fill`` (``"add"``: transformers'
            eager ``finfo.min`` causal mask; an entry a data mask hid with ``-inf`` stays
            hidden) in natural-log units, after the data mask; a finite fill is supported by
            two_kernel (and diag_cache with ``diagonals=0``): kernel 0 is then the attention
            forward (also without ``need_out``), and the column pass visits the query blocks
            above the diagonal unless, without a data mask, the forward's run-time bound
            (:func:`fuser.codegen.attention.hidden_tiles_skippable`) proves they weigh 0.
        mask_fill: the score a boolean mask's hidden entry gets, in natural-log units (``-inf``:
            hidden); a finite value (``masked_fill(~pad, finfo.min)``) is a score like any
            other, as in eager: a row whose keys are all hidden spreads its weight uniformly,
            a partly hidden row gives its hidden keys ``exp(fill − max)`` (computed, never
            assumed 0). Every plan; ignored for the other mask kinds.
        mask_pred: only the default (``None``) is supported.
        nan_rows: eager's semantics for a query row with no visible key (every score ``-inf``):
            its softmax row is NaN, so ``score[b, h, :]`` is NaN for every key of its (b, h)
            (``out``'s row stays 0). False: such a row contributes 0. Costs nothing where no
            row can be empty (:func:`empty_rows_possible`); else one pass over the statistics
            (two_kernel, diag_cache) or a per-program check (one_kernel).

    Returns:
        ``(out, score)``: ``out`` ``[B, Hq, Nq, Dv]`` in q's dtype (``None`` unless
        ``need_out``; rows whose scores are all ``-inf`` give 0); ``score`` ``[B, Hq, Nk]`` float32,
        ``score[b, h, j] = Σ_i P[b, h, i, j]`` (rows with no visible key contribute 0, or make
        their (b, h) NaN with ``nan_rows``; a key no query sees scores 0).

    Raises:
        ValueError: an unknown plan or layout, ``diagonals`` out of range, the causal layout
            without causal masking, a non-square diag_cache tile, a NaN or ``+inf`` fill, a finite
            causal fill with another plan, a predicate,
            an unknown causal mode or mask kind, a mask that does not match ``mask_kind``, ``v``
            missing with ``need_out``, or the shape, dtype and head-dim errors of
            :func:`fuser.codegen.attention.forward`.
    """
    variants.check_variant(causal, mask_kind)
    _check_plan(plan, cache)
    mfill_k, fill_k = _check_supported(mask_fill, causal, causal_fill, causal_fill_mode, mask_kind, mask_pred, plan,
                                       diagonals)
    if isinstance(causal, bool):
        raise ValueError("causal must be a mode string here: 'none', 'top_left' or 'bottom_right'")
    if v is None:
        if need_out:
            raise ValueError("H2O column sums: need_out=True needs v")
        # the shape checks want a value tensor; k has the right [B, Hkv, Nk, *] shape (never read)
        v = k
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q, k must be 4-D [B, H, N, D]")
    attention._check_inputs(q, k, v, causal, mask, mask_kind)
    variants.check_mask(mask, mask_kind)
    if plan == "diag_cache":
        count = diagonal_count(q, k, causal, config)
        _check_plan(plan, cache, diagonals, count, causal)
        if diagonals == 0:
            plan = "two_kernel"
    mfill = mask_fill if mfill_k != "hide" else NEG_INF
    if plan == "one_kernel":
        # the kernel variant by what can happen at any size (one variant serves every length)
        nan = bool(nan_rows) and empty_rows_possible(causal, mask_kind, mfill, fill_k)
        return _one_kernel(q, k, v, scale, causal, mask, mask_kind, need_out, config, mfill, nan)
    nan = bool(nan_rows) and empty_rows_possible(causal, mask_kind, mfill, fill_k, q.shape[2], k.shape[2])
    return _two_kernel(q, k, v, scale, causal, mask, mask_kind, need_out, config, fwd_config,
                       diagonals if plan == "diag_cache" else 0, cache, fill_k, causal_fill, mfill, nan)


def _empty_result(q, k, v, need_out: bool):
    """``(out, score)`` when there is nothing to stream (no query rows, no keys, or B·H = 0)."""
    score = alloc_score(q, k)
    score.zero_()
    out = None
    if need_out:
        out = attention.alloc_out(q, v)
        out.zero_()
    return out, score


def _mask_fill_args(mask_fill: float) -> dict:
    """The launchers' ``mask_fill`` argument (base 2) for a finite fill; nothing for ``-inf``."""
    return {} if mask_fill == NEG_INF else {"mask_fill": variants.fill_base2(mask_fill)}


def _one_kernel(q, k, v, scale, causal, mask, mask_kind, need_out, config, mask_fill=NEG_INF, nan_rows=False):
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    if b * hq == 0 or n_q == 0 or n_k == 0:
        return _empty_result(q, k, v, need_out)
    interpret = launch.interpreted(q.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, hq, n_q, n_k))
    row = bool(row_broadcast) and mask_kind != "none"
    mfill = _mask_fill_args(mask_fill)
    kernel, module = _fwd_module(variants.is_causal(causal), mask_kind, row, bool(need_out), True, 0, interpret,
                                 bool(mfill), bool(nan_rows))
    score = alloc_score(q, k)
    out = attention.alloc_out(q, v) if need_out else None
    args = [q, k] + ([v, out] if need_out else []) + [score] + ([mask4] if mask4 is not None else [])
    precision = launch.dot_precision(q.dtype)

    def run(cfg):
        score.zero_()  # the kernel adds into it (and a retried config starts over)
        with launch.launching(interpret):
            module.launch_h2o_fwd(*args, qk_scale=float(scale) * LOG2E,
                                  causal_offset=variants.causal_offset(causal, n_q, n_k),
                                  config=cfg, input_precision=precision, **mfill)

    key = (kernel.path, "one_kernel", q.dtype, d, v.shape[-1] if need_out else 0,
           None if mask4 is None else mask4.dtype, precision)
    launch.launch_first_fitting(key, _configs(config, q, "one_kernel"), run)
    return out, score


def _stats_pass(q, k, v, scale, causal, mask4, mask_kind, row, need_out, configs, cache_args=None, ranges=0,
                mask_fill=NEG_INF):
    """Kernel 0 from ``templates/h2o_fwd.py.jinja``: the statistics (and out with ``need_out``),
    and with ``cache_args`` = ``(ws, row_tab, n_slots)`` the cached tiles' scores; the first of
    ``configs`` that fits. Returns ``(out or None, stats)``."""
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    interpret = launch.interpreted(q.device)
    mfill = _mask_fill_args(mask_fill)
    two_part = mask_kind == "additive" or bool(mfill)
    kernel, module = _fwd_module(variants.is_causal(causal), mask_kind, row, bool(need_out), False, ranges, interpret,
                                 bool(mfill))
    out = attention.alloc_out(q, v) if need_out else None
    stats = attention.alloc_lse(q, two_part)
    args = [q, k] + ([v, out] if need_out else []) + [stats] + ([mask4] if mask4 is not None else [])
    if cache_args is not None:
        args += list(cache_args)
    precision = launch.dot_precision(q.dtype)

    def run(cfg):
        with launch.launching(interpret):
            module.launch_h2o_fwd(*args, qk_scale=float(scale) * LOG2E,
                                  causal_offset=variants.causal_offset(causal, n_q, n_k),
                                  config=cfg, input_precision=precision, **mfill)

    key = (kernel.path, "h2o_fwd", q.dtype, d, v.shape[-1] if need_out else 0,
           None if mask4 is None else mask4.dtype, precision)
    launch.launch_first_fitting(key, configs, run)
    return out, stats


def _two_kernel(q, k, v, scale, causal, mask, mask_kind, need_out, config, fwd_config, diagonals, cache,
                fill_k="hide", causal_fill=NEG_INF, mask_fill=NEG_INF, nan_rows=False):
    """two_kernel (``diagonals == 0``) or diag_cache: kernel 0, then the column pass (``fill_k``:
    the causal fill kind, finite only for two_kernel; ``mask_fill``: the boolean mask's fill,
    ``-inf`` or finite, for every plan; ``nan_rows``: NaN scores for the (b, h) with an empty row)."""
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    if b * hq == 0 or n_q == 0 or n_k == 0:
        return _empty_result(q, k, v, need_out)
    interpret = launch.interpreted(q.device)
    mask4, row_broadcast = variants.expand_mask(mask, mask_kind, (b, hq, n_q, n_k))
    row = bool(row_broadcast) and mask_kind != "none"
    mfill = _mask_fill_args(mask_fill)
    two_part = mask_kind == "additive" or fill_k != "hide" or bool(mfill)
    ranges = 0
    fill_args = dict(mfill)
    if diagonals > 0:
        cfg, fwd_cfg = _diag_config(config, fwd_config, q)
        tile = cfg["BLOCK_M"]
        ranges = _cache_ranges(cache)
        row_tab, col_tab, n_slots = _table_tensors(q.device, n_q, n_k, tile, causal, diagonals, cache)
        ws = _workspace(q.device, b * hq * n_slots * tile * tile)
        out, stats = _stats_pass(q, k, v, scale, causal, mask4, mask_kind, row, need_out, [fwd_cfg],
                                 (ws, row_tab, n_slots), ranges, mask_fill)
        configs = [cfg]
    elif fill_k != "hide":
        # kernel 0: the attention forward with the finite causal fill (and the data mask with its
        # fill; its two-part statistics); without need_out it runs with k as v (its out is
        # dropped: the statistics-only pass takes no causal fill). The skip flag (no data mask
        # only) is computed once, for both kernels.
        skip = attention._skip_arg(q, k, scale, causal, mask_kind, fill_k, causal_fill)
        out, stats = attention.forward(q, k, v, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
                                       need_lse=True, config=fwd_config, mask_fill=mask_fill, causal_fill=causal_fill,
                                       causal_fill_mode=fill_k, skip_hidden=skip.get("skip_hidden"))
        fill_args.update(causal_fill=variants.fill_base2(causal_fill), **skip)
        configs = _short_first(_configs(config, q), config, attention.context_length(n_q, n_k))
    else:
        if need_out:
            # kernel 0: the attention forward, for its statistics and out
            out, stats = attention.forward(q, k, v, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
                                           need_lse=True, config=fwd_config, mask_fill=mask_fill)
        else:
            # kernel 0 without out: the statistics-only row pass (no V loads, no P V dots)
            out, stats = _stats_pass(q, k, v, scale, causal, mask4, mask_kind, row, False,
                                     attention._configs(fwd_config, q, v, causal, "fwd"), mask_fill=mask_fill)
        configs = _short_first(_configs(config, q), config, attention.context_length(n_q, n_k))
    score = alloc_score(q, k)
    kernel, module = _colsum_module(variants.is_causal(causal), mask_kind, row, interpret, ranges, fill_k, bool(mfill))
    args = [q, k, stats, score]
    if mask4 is not None:
        args.append(mask4)
    if ranges:
        args += [ws, row_tab, col_tab, n_slots]
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
                **fill_args,
            )

    key = (kernel.path, "colsum", q.dtype, d, None if mask4 is None else mask4.dtype, precision,
           configs[0]["BLOCK_N"])
    launch.launch_first_fitting(key, configs, run)
    if nan_rows:
        _nan_where_empty_rows(score, stats, two_part)
    return (out if need_out else None), score
