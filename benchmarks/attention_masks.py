"""Masked attention benchmark: the mask spellings model code writes, fuser against eager,
Inductor, SDPA and FlexAttention.

Usage (on a GPU; one process measures everything side by side)::

    python benchmarks/attention_masks.py --out-dir "$OUT"        # H100: ~4 min
    python benchmarks/attention_masks.py --masks window --seqs 8192 --modes fwd
    python benchmarks/attention_masks.py --smoke                 # tiny sizes; CPU (interpreter)

Masks (``--masks``), each written in plain PyTorch the way models write it, on ``[B, H, N, D]``
tensors with scale ``D^-0.5`` (``i`` = query index, ``j`` = key index, from ``torch.arange``):

- ``window``: a causal sliding window of ``--window`` keys (Mistral, Gemma local layers):
  ``keep = (j <= i) & (j > i - W)``; ``s.masked_fill(~keep, -inf)``. fuser evaluates the
  predicate per tile and skips tiles outside the band.
- ``hf_causal``: transformers' eager spelling of causal attention: an additive float32 bias
  ``zeros(N, N).masked_fill(j > i, finfo(float32).min)`` added to the scores. A finite fill:
  every row has a visible key, so this equals causal attention (SDPA's ``is_causal``).
- ``prefix``: a prefix-LM mask over the first ``--prefix`` keys: ``keep = (j <= i) | (j < P)``.

Implementations: ``eager`` (that function), ``inductor`` and ``fuser`` (``torch.compile`` of it,
default backend / ``backend="fuser"``), ``sdpa`` (``F.scaled_dot_product_attention`` with
``is_causal`` for ``hf_causal`` and a dense boolean ``[N, N]`` mask otherwise: the memory-
efficient kernel, as flash takes no mask), ``flex`` (``flex_attention`` compiled, with a
``create_block_mask`` block mask of the same predicate, built once per N outside the timed
region). Modes: ``fwd`` (under ``no_grad``) and ``fwdbwd`` (forward plus
``autograd.grad(out, (q, k, v), grad_out)``).

Columns: median ms per impl (``triton.testing.do_bench``, L2 flushed); ``floor`` = max(FLOPs /
``--peak-tflops``, bytes / ``--peak-tbps``) with FLOPs counted over the visible (i, j) pairs
only (forward 4·B·H·D·pairs, fwdbwd 3.5×) and bytes = q, k, v, out (fwd; plus dout, dq, dk, dv
and the LSE in fwdbwd) read or written once; ``fuser % floor``; ``vs best`` = the fastest
baseline's time / fuser's (> 1: fuser is faster); ``err`` = fuser's relative error against
FlexAttention on float32 copies of the inputs (eager in float64 with ``--smoke``; forward output, or
out and the three gradients); ``plan`` = what fuser
did (``fused: <plan>`` or why not). Results: ``benchmarks/results/attention_masks.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MASKS = ("window", "hf_causal", "prefix")
IMPLS = ("eager", "inductor", "fuser", "sdpa", "flex")
BASELINES = ("eager", "inductor", "sdpa", "flex")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="default 4096 8192")
    p.add_argument("--dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--batch", type=int, default=None, help="default 2")
    p.add_argument("--heads", type=int, default=None, help="default 16")
    p.add_argument("--window", type=int, default=None, help="sliding-window keys (default 1024)")
    p.add_argument("--prefix", type=int, default=None, help="prefix-LM keys (default 1024)")
    p.add_argument("--modes", choices=("fwd", "fwdbwd", "both"), default="both")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rep", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no new measurement after this many seconds (0: no limit)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-tbps", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--out-dir", default="")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 sizes; runs on CPU (interpreter)")
    a = p.parse_args(argv)
    s = a.smoke
    a.seqs = a.seqs or ([48, 80] if s else [4096, 8192])
    a.dim = a.dim or (16 if s else 128)
    a.batch = a.batch or (1 if s else 2)
    a.heads = a.heads or (2 if s else 16)
    a.window = a.window or (16 if s else 1024)
    a.prefix = a.prefix or (20 if s else 1024)
    a.warmup = a.warmup if a.warmup is not None else (1 if s else 25)
    a.rep = a.rep if a.rep is not None else (3 if s else 100)
    a.out = a.out or common.RESULTS_DIR / ("attention_masks_smoke.md" if s else "attention_masks.md")
    a.mode_list = ["fwd", "fwdbwd"] if a.modes == "both" else [a.modes]
    return a


# --------------------------------------------------------------------------------------------
# the spellings
# --------------------------------------------------------------------------------------------

def naive(mask: str, scale: float, window: int, prefix: int) -> Callable:
    """The plain PyTorch function eager, Inductor and fuser run for ``mask``."""
    import torch

    def window_attention(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        keep = (j <= i) & (j > i - window)
        s = (q @ k.transpose(-2, -1)) * scale
        s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    def hf_causal_attention(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        bias = torch.zeros(n, n, device=q.device).masked_fill(j > i, torch.finfo(torch.float32).min)
        s = (q @ k.transpose(-2, -1)) * scale + bias
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    def prefix_attention(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        keep = (j <= i) | (j < prefix)
        s = (q @ k.transpose(-2, -1)) * scale
        s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    return {"window": window_attention, "hf_causal": hf_causal_attention, "prefix": prefix_attention}[mask]


def keep_fn(mask: str, window: int, prefix: int) -> Callable:
    """``keep(i, j)`` on index tensors: FlexAttention's mask_mod body and the dense mask."""
    if mask == "window":
        return lambda i, j: (j <= i) & (j > i - window)
    if mask == "hf_causal":
        return lambda i, j: j <= i
    return lambda i, j: (j <= i) | (j < prefix)


def visible_pairs(mask: str, n: int, window: int, prefix: int) -> int:
    """The number of (i, j) pairs ``mask`` keeps at length ``n`` (for the FLOP count)."""
    if mask == "hf_causal":
        return n * (n + 1) // 2
    if mask == "window":
        w = min(window, n)
        return w * (w + 1) // 2 + (n - w) * w
    p = min(prefix, n)
    return n * (n + 1) // 2 + sum(max(0, p - (i + 1)) for i in range(n))


def flex_available() -> Optional[str]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------

def build(impl: str, mask: str, a, n: int, device: str, scale: float) -> Callable:
    """The function ``(q, k, v) -> out`` of ``impl`` at length ``n``."""
    import torch
    import torch.nn.functional as F

    keep = keep_fn(mask, a.window, a.prefix)
    if impl in ("eager", "inductor", "fuser"):
        fn = common.fresh_function(naive(mask, scale, a.window, a.prefix), f"{impl}_{mask}")
        if impl == "eager":
            return fn
        torch._dynamo.reset()
        kw = {"backend": "fuser"} if impl == "fuser" else {}
        return torch.compile(fn, dynamic=False, **kw)
    if impl == "sdpa":
        if mask == "hf_causal":
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        idx = torch.arange(n, device=device)
        dense = keep(idx[:, None], idx[None, :])
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(lambda b, h, i, j: keep(i, j), None, None, n, n, device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=scale)


def runner(fn: Callable, mode: str, q, k, v, dout) -> Callable[[], Any]:
    import torch

    if mode == "fwd":
        def run():
            with torch.no_grad():
                return (fn(q, k, v),)
        return run

    def run():
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))
    return run


def main(argv=None) -> int:
    a = parse_args(argv)
    common.setup_environment(force_cpu=a.smoke)
    import torch

    import fuser  # registers backend="fuser" (an installed fuser also does, by entry point)

    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if device == "cpu":
        fuser.interpret = True
    dtype = torch.float32 if a.smoke else torch.bfloat16
    meta = common.env_header(device)
    flex_missing = flex_available()
    collecting = common.fuser_collector()
    rows, data = [], []
    scale = a.dim ** -0.5
    elt = torch.finfo(dtype).bits // 8
    for mask in a.masks:
        for n in a.seqs:
            gen = torch.Generator().manual_seed(n)
            shape = (a.batch, a.heads, n, a.dim)
            q, k, v, dout = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            for mode in a.mode_list:
                recs: dict[str, dict] = {}
                ref = None
                # the reference: Flex on float32 copies on the GPU, eager in float64 on the CPU
                ref_impl, ref_dt = ("flex", torch.float32) if device == "cuda" else ("eager", torch.float64)
                if ref_impl != "flex" or flex_missing is None:
                    qr, kr, vr = (t.detach().to(ref_dt).requires_grad_(True) for t in (q, k, v))
                    ref = runner(build(ref_impl, mask, a, n, device, scale), mode, qr, kr, vr, dout.to(ref_dt))()
                    ref = tuple(x.detach() for x in ref)
                    del qr, kr, vr
                for impl in a.impls:
                    rec = {"status": "ok", "ms": None, "note": "", "err": None}
                    recs[impl] = rec
                    if impl == "flex" and flex_missing:
                        rec.update(status="skip", note=flex_missing)
                        continue
                    if a.budget_s and common.elapsed_s() > a.budget_s:
                        rec.update(status="skip", note="time budget spent")
                        continue
                    if device == "cpu" and impl in ("flex", "sdpa", "inductor"):
                        rec.update(status="skip", note="GPU only in this script")
                        continue
                    try:
                        fn = build(impl, mask, a, n, device, scale)
                    except Exception as exc:  # noqa: BLE001
                        rec.update(status=common.short_error(exc), note=common.describe_error(exc))
                        continue
                    chk = (lambda out: common.rel_err(out, ref)) if ref is not None else None
                    m = common.measure(runner(fn, mode, q, k, v, dout), device, a.warmup, a.rep, check=chk,
                                       on_first=collecting if impl == "fuser" else None)
                    rec.update(status=m.status, ms=m.ms, err=m.check, first_call_s=m.first_call_s,
                               note=common.describe_fuser(m.first_context) if impl == "fuser" else (m.error or ""))
                    if m.error:
                        rec["note"] = m.error[:300]
                    print(f"  {mask:<9} N={n:<6} {mode:<6} {impl:<8} "
                          f"{common.fmt_ms(m.ms) + ' ms' if m.ok else m.status:>12}  {rec['note']}", flush=True)
                pairs = visible_pairs(mask, n, a.window, a.prefix)
                flops = 4.0 * a.batch * a.heads * a.dim * pairs * (3.5 if mode == "fwdbwd" else 1.0)
                tensors = 4 if mode == "fwd" else 8
                nbytes = a.batch * a.heads * n * (tensors * a.dim * elt + (4 if mode == "fwdbwd" else 0))
                floor = max(flops / (a.peak_tflops * 1e12), nbytes / (a.peak_tbps * 1e12)) * 1e3
                f = recs.get("fuser", {}).get("ms")
                best = min((recs[b]["ms"] for b in BASELINES if b in recs and recs[b].get("ms")), default=None)
                best_name = next((b for b in BASELINES if b in recs and recs[b].get("ms") == best), "-")
                rows.append([mask, n, mode] + [common.fmt_ms(recs[i]["ms"]) if i in recs and recs[i]["ms"]
                                               else (recs[i]["status"] if i in recs else "-") for i in IMPLS]
                            + [common.fmt_ms(floor), f"{100 * floor / f:.0f}%" if f else "-",
                               f"{best / f:.2f}× ({best_name})" if f and best else "-",
                               common.fmt_err(recs.get("fuser", {}).get("err")), recs.get("fuser", {}).get("note", "")])
                data.append({"mask": mask, "N": n, "mode": mode, "floor_ms": floor, "flops": flops, "bytes": nbytes,
                             "results": recs})
                md = "\n".join([
                    common.header_md("Masked attention: fuser vs eager, Inductor, SDPA, FlexAttention", meta),
                    f"- B={a.batch}, H={a.heads}, D={a.dim}, dtype={str(dtype).replace('torch.', '')}, "
                    f"window={a.window}, prefix={a.prefix}",
                    "", __doc__.split("Columns:")[1].strip().split("Results:")[0].strip(), "",
                    common.md_table(["mask", "N", "mode", *IMPLS, "floor", "fuser % floor", "vs best", "err", "plan"],
                                    rows)])
                common.write_outputs(a.out, md, {"meta": meta, "args": {k: str(v) for k, v in vars(a).items()},
                                                 "configs": data, "complete": False}, a.out_dir or None)
            del q, k, v, dout
            common.free_memory(device)
    common.write_outputs(a.out, md, {"meta": meta, "args": {k: str(v) for k, v in vars(a).items()},
                                     "configs": data, "complete": True}, a.out_dir or None)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
