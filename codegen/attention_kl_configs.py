"""Launch-config tables of the attention-KL kernels (``codegen/attention_kl.py``), best first.

Keyed by (device kind, head-dim bucket, dtype size in bytes); :func:`candidate_configs` picks the
list for one problem kind. How the entries were ordered (measured on an H100 for 16-bit inputs,
compile-checked only for fp32 and pre-Hopper GPUs) is written above the tables; re-order them
with ``benchmarks/tune_attention_kl.py``.
"""

from __future__ import annotations

import torch

from . import launch
from .launch import device_kind

__all__ = ["candidate_configs"]




def _fwd(bm, bn, w, s):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


def _bwd(m1, n1, m2, n2, w, s):
    return {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2, "num_warps": w, "num_stages": s}


# Interpreter: small tiles keep the CPU interpreter fast and still exercise several full and
# boundary tiles per row at test sizes.
_INTERP_FWD = [_fwd(32, 16, 4, 1), _fwd(16, 32, 4, 1), _fwd(16, 16, 4, 1)]
_INTERP_BWD = [_bwd(16, 32, 32, 16, 4, 1), _bwd(32, 16, 16, 32, 4, 1)]

# GPU tables, best first. sm90 16-bit entries (head-dim buckets 64, 128, 256) are ordered by
# measurement: benchmarks/tune_attention_kl.py on an H100 80GB HBM3 (torch 2.11, Triton 3.6,
# 2026-11-21; B=1, H=16, N=8192, D1 = D2 = the bucket, bf16, causal and not; every candidate
# of its grid timed; results in benchmarks/results/tune_attention_kl_d{64,128,256}.md).
# Measured then (ms, N=8192, D=64 / 128 / 256): forward 0.92 / 1.49 / 2.93, causal
# 0.52 / 0.86 / 1.79; frozen-teacher backward two_kernel 2.31 / 4.01 / 7.64 (causal
# 1.41 / 2.05 / 3.76), atomic_dq 2.60 / 3.71 / 10.7; both sides two_kernel 3.32 / 5.14 / 23.9
# (causal 1.82 / 2.60 / 10.7). The first entries of the former untimed tables were 1.0-4x
# slower. A hand-pipelined forward loop (next tile's products issued before this tile's
# update) was also timed at D=64 and 128 and was slower in every config.
# The fp32 entries and the "cuda" (pre-Hopper) entries are NOT TIMED: compiled for sm_90a
# with ptxas (no spills for the variants they serve, within 227 KB of shared memory), ordered
# by analogy with the attention tables. Head-dim bucket = max(next_pow2(D1), next_pow2(D2)).
_FWD_TABLE = {
    # 16-bit
    ("sm90", 64, 2): [_fwd(64, 64, 4, 3), _fwd(64, 64, 4, 2), _fwd(128, 64, 4, 4), _fwd(128, 64, 8, 3)],
    ("sm90", 128, 2): [_fwd(128, 64, 8, 4), _fwd(128, 32, 8, 3), _fwd(128, 64, 8, 3), _fwd(128, 64, 4, 2),
                       _fwd(64, 64, 4, 2)],
    ("sm90", 256, 2): [_fwd(128, 32, 8, 3), _fwd(64, 64, 4, 2), _fwd(128, 32, 4, 3), _fwd(64, 32, 4, 3)],
    # fp32 ("ieee" dots run on CUDA cores; larger tiles spill)
    ("sm90", 64, 4): [_fwd(32, 32, 4, 2), _fwd(32, 32, 4, 1), _fwd(16, 32, 4, 2)],
    ("sm90", 128, 4): [_fwd(32, 32, 4, 2), _fwd(16, 32, 4, 2), _fwd(32, 16, 4, 2)],
    ("sm90", 256, 4): [_fwd(16, 32, 4, 1), _fwd(32, 16, 4, 1), _fwd(16, 16, 4, 1)],
    # other CUDA GPUs (Ampere/Ada: 99..163 KB shared memory): conservative, not checked
    ("cuda", 64, 2): [_fwd(64, 64, 4, 3), _fwd(128, 32, 4, 3), _fwd(64, 32, 4, 2)],
    ("cuda", 128, 2): [_fwd(64, 64, 4, 2), _fwd(64, 32, 4, 3), _fwd(32, 32, 4, 2)],
    ("cuda", 256, 2): [_fwd(32, 32, 4, 2), _fwd(32, 32, 4, 1), _fwd(16, 32, 4, 1)],
    ("cuda", 64, 4): [_fwd(32, 32, 4, 2), _fwd(32, 32, 4, 1)],
    ("cuda", 128, 4): [_fwd(32, 32, 4, 2), _fwd(16, 32, 4, 2)],
    ("cuda", 256, 4): [_fwd(16, 32, 4, 1), _fwd(16, 16, 4, 1)],
}

# Causal forward: smaller query blocks balance the triangle (as measured for attention).
# Keys missing here fall back to _FWD_TABLE.
_FWD_CAUSAL_TABLE = {
    ("sm90", 64, 2): [_fwd(64, 64, 4, 3), _fwd(64, 64, 4, 2), _fwd(64, 128, 4, 3)],
    ("sm90", 128, 2): [_fwd(64, 128, 4, 3), _fwd(128, 64, 8, 3), _fwd(128, 64, 8, 4), _fwd(64, 64, 4, 2)],
    ("sm90", 256, 2): [_fwd(64, 32, 4, 3), _fwd(64, 32, 4, 4), _fwd(128, 32, 4, 3), _fwd(64, 64, 4, 2)],
}

# Backward with a trainable teacher (dQ1, dK1 and dQ2, dK2).
_BWD_TABLE = {
    ("sm90", 64, 2): [_bwd(64, 64, 64, 64, 4, 3), _bwd(64, 64, 64, 64, 4, 2), _bwd(32, 64, 64, 32, 4, 3),
                      _bwd(64, 128, 128, 64, 8, 3)],
    ("sm90", 128, 2): [_bwd(64, 128, 128, 64, 8, 3), _bwd(32, 64, 64, 32, 4, 3), _bwd(32, 128, 128, 32, 8, 3),
                       _bwd(32, 128, 128, 32, 8, 2)],
    ("sm90", 256, 2): [_bwd(64, 64, 64, 64, 8, 2), _bwd(32, 64, 64, 32, 8, 3), _bwd(32, 64, 64, 32, 8, 2),
                       _bwd(32, 32, 32, 32, 8, 2)],
    ("sm90", 64, 4): [_bwd(16, 16, 16, 16, 4, 1), _bwd(16, 32, 32, 16, 4, 2)],
    ("sm90", 128, 4): [_bwd(16, 16, 16, 16, 4, 1), _bwd(16, 32, 32, 16, 4, 1)],
    ("sm90", 256, 4): [_bwd(16, 16, 16, 16, 4, 1)],
    ("cuda", 64, 2): [_bwd(32, 64, 64, 32, 4, 2), _bwd(16, 64, 64, 16, 4, 2)],
    ("cuda", 128, 2): [_bwd(16, 64, 64, 16, 4, 2), _bwd(16, 32, 32, 16, 4, 2)],
    ("cuda", 256, 2): [_bwd(16, 32, 32, 16, 4, 1), _bwd(16, 16, 16, 16, 4, 1)],
    ("cuda", 64, 4): [_bwd(16, 16, 16, 16, 4, 1), _bwd(16, 32, 32, 16, 4, 2)],
    ("cuda", 128, 4): [_bwd(16, 16, 16, 16, 4, 1)],
    ("cuda", 256, 4): [_bwd(16, 16, 16, 16, 4, 1)],
}

# Backward with a frozen teacher (dQ2, dK2 only: one dK accumulator, no dS1), both bwd modes.
# Keys missing here fall back to _BWD_TABLE.
_BWD_FROZEN_TABLE = {
    ("sm90", 64, 2): [_bwd(64, 64, 64, 64, 4, 3), _bwd(32, 64, 64, 32, 4, 2), _bwd(32, 64, 64, 32, 4, 3),
                      _bwd(64, 128, 128, 64, 8, 1)],
    ("sm90", 128, 2): [_bwd(64, 128, 128, 64, 8, 3), _bwd(64, 64, 64, 64, 4, 2), _bwd(32, 64, 64, 32, 4, 3),
                       _bwd(64, 128, 128, 64, 8, 2), _bwd(32, 128, 128, 32, 8, 2)],
    ("sm90", 256, 2): [_bwd(32, 128, 128, 32, 8, 3), _bwd(32, 128, 128, 32, 8, 2), _bwd(64, 128, 128, 64, 8, 1),
                       _bwd(32, 64, 64, 32, 8, 3)],
}

# Causal backward with a trainable teacher: smaller tiles balance the triangle. Keys missing
# here fall back to _BWD_TABLE.
_BWD_CAUSAL_TABLE = {
    ("sm90", 128, 2): [_bwd(32, 64, 64, 32, 4, 3), _bwd(64, 128, 128, 64, 8, 3), _bwd(32, 128, 128, 32, 8, 3)],
    ("sm90", 256, 2): [_bwd(32, 64, 64, 32, 8, 3), _bwd(64, 64, 64, 64, 8, 2), _bwd(32, 64, 64, 32, 8, 2)],
}


def _dim_bucket(head_dim1: int, head_dim2: int) -> int:
    width = max(launch.next_power_of_2(head_dim1), launch.next_power_of_2(head_dim2), 16)
    return 64 if width <= 64 else 128 if width <= 128 else 256


def candidate_configs(*, head_dim1: int, head_dim2: int, dtype: torch.dtype, device, causal="none",
                      kind: str = "fwd", teacher_grad: bool = True) -> list[dict]:
    """Launch configs for one problem kind, best first (the first is the default).

    Keys: fwd ``BLOCK_M, BLOCK_N, num_warps, num_stages`` (also used by the split-K forward);
    bwd ``BLOCK_M1, BLOCK_N1`` (dK kernel: BLOCK_N1 keys per program, BLOCK_M1 query rows per
    step), ``BLOCK_M2, BLOCK_N2`` (dQ kernel), ``num_warps, num_stages``; ``teacher_grad=False``
    picks the frozen-teacher backward's candidates; ``causal`` (a mode other than ``"none"``)
    the causal forward's, and the causal trainable-teacher backward's, where measured. Which
    entries were timed and which are compile-checked only: the comment above
    :data:`_FWD_TABLE`. Raises ``ValueError`` for an unknown ``kind``.
    """
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    dev = device_kind(device)
    if dev == "interpreter":
        return [dict(c) for c in (_INTERP_FWD if kind == "fwd" else _INTERP_BWD)]
    size = 4 if dtype == torch.float32 else 2
    key = (dev, _dim_bucket(head_dim1, head_dim2), size)
    if kind == "bwd":
        if not teacher_grad and key in _BWD_FROZEN_TABLE:
            return [dict(c) for c in _BWD_FROZEN_TABLE[key]]
        if teacher_grad and causal not in ("none", False) and key in _BWD_CAUSAL_TABLE:
            return [dict(c) for c in _BWD_CAUSAL_TABLE[key]]
        return [dict(c) for c in _BWD_TABLE[key]]
    if causal not in ("none", False) and key in _FWD_CAUSAL_TABLE:
        return [dict(c) for c in _FWD_CAUSAL_TABLE[key]]
    return [dict(c) for c in _FWD_TABLE[key]]
