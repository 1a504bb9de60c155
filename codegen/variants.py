"""The static-variant vocabulary the attention-like kernel families share.

Causal modes, mask kinds, backward modes, finite fills and the helpers that check them and
prepare their run-time arguments (the causal offset, the mask as a 4-D view). Rendered kernel
variants are named from these (``MASK_SUFFIX``); ``codegen/attention.py`` and
``codegen/attention_kl.py`` build on them. Generic launching (modules, configs, autotuning,
poisoned outputs) is in ``codegen/launch.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .launch import tracing

CAUSAL_MODES = ("none", "top_left", "bottom_right")
MASK_KINDS = ("none", "bool_keep", "bool_drop", "additive")
BWD_MODES = ("two_kernel", "atomic_dq")
MASK_SUFFIX = {"none": "", "bool_keep": "_maskkeep", "bool_drop": "_maskdrop", "additive": "_maskadd"}


def check_variant(causal, mask_kind: str, bwd_mode: str | None = None) -> None:
    """Raise ``ValueError`` naming the valid values for an unknown causal mode (a mode or a
    bool), mask kind or backward mode."""
    if causal not in CAUSAL_MODES and not isinstance(causal, bool):
        raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    if bwd_mode is not None and bwd_mode not in BWD_MODES:
        raise ValueError(f"bwd_mode must be one of {BWD_MODES}, got {bwd_mode!r}")


# Hidden-entry values ("fills"). A boolean mask's hidden entries and the entries above a causal
# diagonal score ``-inf`` by default: hidden, contributing exactly 0, and the kernels may skip
# tiles that are entirely hidden. A finite fill instead gives those entries a real score (what
# eager PyTorch computes for ``masked_fill(m, -1e4)`` or an additive ``finfo.min`` causal mask),
# passed to the kernels as a runtime float (one compiled kernel serves every value). The causal
# structure either replaces the score (``"replace"``: no gradient flows to q.k there) or adds to
# it (``"add"``: an additive static mask). Render-time, a fill is one of :data:`FILL_KINDS`:
# ``"hide"`` (-inf), ``"replace"`` or ``"add"`` (finite, runtime value).
FILL_MODES = ("replace", "add")
FILL_KINDS = ("hide",) + FILL_MODES
# |x| * log2(e) must stay below the largest float32 (3.4028e38) to be held in base 2
_BASE2_LIMIT = 2.35e38
LOG2E = 1.4426950408889634


def check_fill(name: str, value: float, mode: str | None = None) -> float:
    """Raise ``ValueError`` for a fill that is NaN or ``+inf`` (or an unknown fill mode);
    return the value as a float."""
    value = float(value)
    if value != value or value == float("inf"):
        raise ValueError(f"{name} must be finite or -inf, got {value!r}")
    if mode is not None and mode not in FILL_MODES:
        raise ValueError(f"{name}_mode must be one of {FILL_MODES}, got {mode!r}")
    return value


def fill_kind(active: bool, value: float, mode: str = "replace") -> str:
    """The render-time kind of one fill: ``"hide"`` where it does not apply (``active`` false:
    no causal structure, or no boolean mask) or where the value is ``-inf``; else ``mode``."""
    if not active or float(value) == float("-inf"):
        return "hide"
    return mode


def mask_fill_kind(mask_kind: str, mask_fill: float) -> str:
    """``"replace"`` for a boolean mask kind with a finite ``mask_fill``, else ``"hide"``
    (a boolean mask's fill always replaces the score; other mask kinds ignore it)."""
    return fill_kind(mask_kind in ("bool_keep", "bool_drop"), mask_fill, "replace")


def causal_fill_kind(causal, causal_fill: float, causal_fill_mode: str) -> str:
    """``"hide"`` without causal masking or for ``causal_fill = -inf`` (tiles above the diagonal
    may be skipped), else ``causal_fill_mode`` (``"replace"`` or ``"add"``)."""
    return fill_kind(is_causal(causal), causal_fill, causal_fill_mode)


def fill_base2(value: float) -> float:
    """A score in natural-log units moved to base 2 (times log2 e) for kernels that pre-scale
    their scores by ``scale * log2(e)``: clamped to +-2.35e38 first so that it stays a finite
    float32 (``finfo(float32).min`` stays finite, about -3.39e38); ``-inf`` stays ``-inf``."""
    value = float(value)
    if value == float("-inf"):
        return value
    return max(-_BASE2_LIMIT, min(_BASE2_LIMIT, value)) * LOG2E


def check_mask(mask: Optional[torch.Tensor], mask_kind: str) -> None:
    """Raise ``ValueError`` unless ``mask`` matches ``mask_kind``: none for ``"none"``, else
    present; floating point for ``"additive"``, ``torch.bool`` for the boolean kinds."""
    if (mask is None) != (mask_kind == "none"):
        raise ValueError("a mask needs a mask_kind other than 'none', and mask_kind needs a mask")
    if mask is not None:
        if mask_kind == "additive" and not mask.is_floating_point():
            raise ValueError(f"an additive mask must be floating point, got {mask.dtype}")
        if mask_kind != "additive" and mask.dtype != torch.bool:
            raise ValueError(f"a {mask_kind} mask must be torch.bool, got {mask.dtype}")


def is_causal(causal) -> bool:
    """A causal mode (or bool) as the render-time bool: one kernel variant serves both alignments."""
    return causal if isinstance(causal, bool) else causal != "none"


def causal_offset(causal: str, n_q: int, n_k: int) -> int:
    """Key j is visible to query i iff ``j <= i + offset``: 0 for top-left alignment,
    ``n_k - n_q`` for bottom-right; unused (0) without causal masking."""
    if causal == "bottom_right":
        return n_k - n_q
    return 0


def expand_mask(mask, mask_kind: str, shape) -> tuple:
    """The mask as a 4-D ``[B, H, Nq, Nk]`` view (stride 0 on broadcast dims; bool as uint8 when
    the kernels are launched from here, as bool when Inductor launches them: its lowering cannot
    reinterpret a bool tensor, and Triton loads a bool pointer as bytes either way) and whether
    it is the same for every query row (then kernels load one vector per key tile)."""
    if mask is None:
        return None, False
    if mask.dim() > 4:
        raise ValueError(f"mask must have at most 4 dims, got {tuple(mask.shape)}")
    m = mask.expand(*shape)
    if m.dtype == torch.bool and not tracing():
        m = m.view(torch.uint8)
    row_broadcast = m.stride(2) == 0 or shape[2] == 1
    return m, row_broadcast


