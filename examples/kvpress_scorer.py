"""kvpress-style KV-cache scorers (ObservedAttention, SnapKV) compiled with ``backend="fuser"``.

KV-cache compression at prefill ranks the keys of a layer by the attention they receive and
keeps the best. kvpress (NVIDIA) does it with presses; two of them read the attention
probabilities ``P = softmax(Q Kᵀ / √d + causal mask)``:

* **ObservedAttention** (H2O's score at prefill): the mean attention a key receives from the
  queries that can see it, ``P.sum(2) / arange(n, 0, -1)`` (key j is seen by the n − j queries
  after it), averaged over the query heads that share a kv head.
* **SnapKV**: the attention of an observation window — the last ``w`` queries — on the keys
  before it, ``P[..., -w:, :-w].mean(-2)``, smoothed by an average pool. kvpress computes it
  either from the eager attention weights (``snapkv_from_attentions``) or from the window's
  queries alone with a bottom-right causal mask (``snapkv_window_attention``).

Written this way, eager PyTorch materialises P (``[B, H, N, N]``, or ``[B, H, w, N]``); fuser
recognises the softmax, the sum over the queries (and ``P V`` where the layer's output is
computed too) and runs its H2O kernels instead: the score is a column sum of P computed from the
attention forward's statistics, and what follows (the division, the window, the pooling, the
GQA mean, the top-k) stays ordinary PyTorch on the small ``[B, H, N]`` tensor. For the window,
fuser slices q (softmax rows are independent) and takes the causal mask of those rows as
bottom-right.

The window's mask is built as kvpress builds it, ``torch.ones_like(attn_weights) * -inf`` made
causal by ``triu``: ``ones_like`` reads the scores' shape, dtype and device, never their values,
so fuser evaluates the mask from the sizes alone, finds it is the window's bottom-right causal
mask, and skips the hidden tiles instead of loading a ``[B, H, w, N]`` mask (``explain()``:
``causal=bottom_right, mask=none``).

Run::

    python examples/kvpress_scorer.py

On a CUDA GPU it scores a 4096-token prefill in bfloat16; without one, a short one in float32
with fuser's kernels in Triton's interpreter (``options={"fuser.interpret": True}``).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import fuser


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, Hkv, N, D]`` -> ``[B, Hkv·n_rep, N, D]`` (transformers' ``repeat_kv``)."""
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def causal_attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The eager attention weights of a causal prefill (transformers' eager attention: the
    softmax in float32, cast back to the input dtype), k repeated for GQA."""
    n = q.shape[2]
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)


def observed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The layer's output and kvpress' ObservedAttention scores ``[B, Hkv, N]``."""
    attentions = causal_attention_weights(q, k)
    out = torch.matmul(attentions, repeat_kv(v, q.shape[1] // v.shape[1]))
    b, h_kv, n, _ = k.shape
    scores = attentions.sum(2)
    scores = scores / torch.arange(n, 0, -1, device=q.device).to(scores.dtype)  # causal mean
    scores = scores.view(b, h_kv, -1, n).mean(2)  # GQA: the query heads of a kv head averaged
    return out, scores


def _snapkv_finish(scores: torch.Tensor, h_kv: int, window: int, kernel_size: int) -> torch.Tensor:
    """SnapKV after the window's mean: pooled, averaged over each kv head's query heads, the
    window's own keys given the maximum so that they are kept."""
    b, h, n = scores.shape
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(b, h_kv, h // h_kv, n).mean(2)
    return torch.cat([scores, scores.amax().expand(b, h_kv, window)], dim=-1)


def snapkv_from_attentions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 8,
                           kernel_size: int = 5):
    """SnapKV from the eager attention weights (kvpress, ``attentions`` given): the layer's
    output and the scores ``[B, Hkv, N]``."""
    attentions = causal_attention_weights(q, k)
    out = torch.matmul(attentions, repeat_kv(v, q.shape[1] // v.shape[1]))
    scores = attentions[..., -window:, :-window].mean(dim=-2)
    return out, _snapkv_finish(scores, k.shape[1], window, kernel_size)


def snapkv_window_attention(q: torch.Tensor, k: torch.Tensor, window: int = 8, kernel_size: int = 5):
    """SnapKV from the window's queries alone (kvpress' ``compute_window_attention``): score
    only, ``[B, Hkv, N]``."""
    n = k.shape[2]
    keys = repeat_kv(k, q.shape[1] // k.shape[1])
    attn = torch.matmul(q[:, :, -window:], keys.transpose(2, 3)) / math.sqrt(q.shape[-1])
    mask = torch.ones_like(attn) * float("-inf")  # kvpress' spelling: reads attn's shape only
    attn += torch.triu(mask, diagonal=n - window + 1)  # bottom-right causal
    attn = torch.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
    scores = attn[..., :-window].mean(dim=-2)
    return _snapkv_finish(scores, k.shape[1], window, kernel_size)


def compress(k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor, ratio: float):
    """kvpress' ScorerPress: keep the ``1 - ratio`` best-scored keys and values of each kv head."""
    keep = int(k.shape[2] * (1 - ratio))
    idx = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    idx = idx[..., None].expand(-1, -1, -1, k.shape[-1])
    return k.gather(2, idx), v.gather(2, idx)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in float64 (Frobenius norms)."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def main() -> int:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device, dtype, options = "cuda", torch.bfloat16, None
        b, hq, hkv, n, d, window = 1, 32, 8, 4096, 128, 64
    else:
        device, dtype, options = "cpu", torch.float32, {"fuser.interpret": True}
        b, hq, hkv, n, d, window = 1, 4, 2, 48, 16, 8
    q = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    k, v = (torch.randn(b, hkv, n, d, device=device, dtype=dtype) for _ in range(2))
    # the reference: eager on the inputs in float64 (the softmax in float32, as written); in
    # bfloat16 eager rounds P before the sums, fuser sums float32 P
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    scorers = [
        ("ObservedAttention (causal mean)", observed_attention, (q, k, v)),
        ("SnapKV from the attentions", lambda q, k, v: snapkv_from_attentions(q, k, v, window), (q, k, v)),
        ("SnapKV window attention (score only)", lambda q, k: snapkv_window_attention(q, k, window), (q, k)),
    ]
    failed = False
    with torch.no_grad():
        for name, fn, args in scorers:
            report = fuser.explain(fn, *args, options=options)
            got = report.output if isinstance(report.output, tuple) else (report.output,)
            want = fn(*(a.double() for a in args))
            want = want if isinstance(want, tuple) else (want,)
            errs = [rel_err(g, w) for g, w in zip(got, want)]
            # found as h2o: fused, or left to Inductor because the planner estimates it faster
            # (a window of a few queries: P is [B, H, w, N], small enough to materialise)
            found = [m for m in report.matches if m.pattern == "h2o"]
            fused = [m for m in found if m.fused]
            print(f"== {name}")
            print(report)
            print(f"   h2o matched: {len(found)}, fused: {len(fused)}; relative error to eager on float64 inputs: "
                  + ", ".join(f"{e:.2e}" for e in errs) + f" (tolerance {tol:g})\n")
            failed |= not found or max(errs) > tol
            if name.startswith("SnapKV window"):
                k2, _ = compress(k, v, got[0], ratio=0.5)
                print(f"   compressed the cache with these scores: {n} -> {k2.shape[2]} keys per kv head\n")
    if failed:
        print("MISMATCH or not found: see above", file=sys.stderr)
        return 1
    print("every scorer was found (h2o) and matches eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
