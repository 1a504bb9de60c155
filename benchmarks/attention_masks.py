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
- ``hf_causal_data``: the same bias built once outside the compiled function and passed to it
  as an input ``[1, 1, N, N]``, the way a decoder layer compiled on its own (FSDP2 per-layer
  compile) receives transformers' mask: fuser cannot read its values at compile time and tests
  them on every call (``codegen.attention.mask_tiles_skippable``) before skipping the tiles above
  the diagonal.
- ``prefix``: a prefix-LM mask over the first ``--prefix`` keys: ``keep = (j <= i) | (j < P)``.

Implementations: ``eager`` (that function), ``inductor`` and ``fuser`` (``torch.compile`` of it,
default backend / ``backend="fuser"``), ``sdpa`` (``F.scaled_dot_product_attention`` with
``is_causal`` for ``hf_causal`` and ``hf_causal_data`` and a dense boolean ``[N, N]`` mask otherwise: the memory-
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
import dataclasses
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MASKS = ("window", "hf_causal", "hf_causal_data", "prefix")
#: the masks that reach the compiled function as an input tensor (the bias of :func:`causal_bias`)
DATA_MASKS = ("hf_causal_data",)
IMPLS = ("eager", "inductor", "fuser", "sdpa", "flex")
BASELINES = ("eager", "inductor", "sdpa", "flex")
TITLE = "Masked attention: fuser vs eager, Inductor, SDPA, FlexAttention"


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
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-tbps", type=float, default=3.0)
    common.add_driver_args(p, budget_s=480.0, out_name="attention_masks")
    a = p.parse_args(argv)
    s = a.smoke
    common.finish_driver_args(a, out_name="attention_masks", smoke_rep=3)
    if s and a.device == "auto":
        a.device = "cpu"  # the smoke run is the CPU (interpreter) check, on a GPU machine too
    a.seqs = a.seqs or ([48, 80] if s else [4096, 8192])
    a.dim = a.dim or (16 if s else 128)
    a.batch = a.batch or (1 if s else 2)
    a.heads = a.heads or (2 if s else 16)
    a.window = a.window or (16 if s else 1024)
    a.prefix = a.prefix or (20 if s else 1024)
    a.dtype = a.dtype or ("fp32" if s else "bf16")
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
        bias = causal_bias(q.shape[-2], q.device)  # built inside the compiled function
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

    def hf_causal_data_attention(q, k, v, bias):
        s = (q @ k.transpose(-2, -1)) * scale + bias
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    return {"window": window_attention, "hf_causal": hf_causal_attention, "hf_causal_data": hf_causal_data_attention,
            "prefix": prefix_attention}[mask]


def causal_bias(n: int, device: str):
    """transformers' additive causal mask ``[1, 1, n, n]`` float32: 0 where ``j <= i``, else
    ``finfo(float32).min``."""
    import torch

    idx = torch.arange(n, device=device)
    bias = torch.zeros(n, n, device=device).masked_fill(idx[None, :] > idx[:, None], torch.finfo(torch.float32).min)
    return bias[None, None]


def keep_fn(mask: str, window: int, prefix: int) -> Callable:
    """``keep(i, j)`` on index tensors: FlexAttention's mask_mod body and the dense mask."""
    if mask == "window":
        return lambda i, j: (j <= i) & (j > i - window)
    if mask in ("hf_causal", "hf_causal_data"):
        return lambda i, j: j <= i
    return lambda i, j: (j <= i) | (j < prefix)


def visible_pairs(mask: str, n: int, window: int, prefix: int) -> int:
    """The number of (i, j) pairs ``mask`` keeps at length ``n`` (for the FLOP count)."""
    if mask in ("hf_causal", "hf_causal_data"):
        return n * (n + 1) // 2
    if mask == "window":
        w = min(window, n)
        return w * (w + 1) // 2 + (n - w) * w
    p = min(prefix, n)
    return n * (n + 1) // 2 + sum(max(0, p - (i + 1)) for i in range(n))


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
        if impl != "eager":
            torch._dynamo.reset()
            kw = {"backend": "fuser", "options": dict(a.fuser_options) or None} if impl == "fuser" else {}
            fn = torch.compile(fn, dynamic=False, **kw)
        if mask in DATA_MASKS:
            bias = causal_bias(n, device)
            return lambda q, k, v, fn=fn: fn(q, k, v, bias)
        return fn
    if impl == "sdpa":
        if mask in ("hf_causal", "hf_causal_data"):
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        idx = torch.arange(n, device=device)
        dense = keep(idx[:, None], idx[None, :])
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(lambda b, h, i, j: keep(i, j), None, None, n, n, device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=scale)


@dataclasses.dataclass
class Config:
    mask: str
    n: int
    mode: str

    @property
    def label(self) -> str:
        return f"{self.mask} N={self.n} {self.mode}"


class MasksBenchmark(common.Benchmark):
    """Masked attention: every (mask, N, mode) compiled afresh (static shapes); the reference is
    FlexAttention on float32 copies on the GPU, eager in float64 on the CPU."""

    title = TITLE
    name = "masked attention"

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"masked attention benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}; "
                f"B={a.batch} H={a.heads} D={a.dim} dtype={a.dtype} masks={a.masks} seqs={a.seqs} "
                f"modes={a.mode_list} impls={a.impls}")

    def groups(self):
        a = self.args
        return [(mask, [Config(mask, n, mode) for n in a.seqs for mode in a.mode_list]) for mask in a.masks]

    def implementations(self, mask) -> dict[str, common.Impl]:
        flex_missing = common.flex_available()
        impls = {}
        for impl in self.args.impls:
            def bind(run, impl=impl):
                if impl == "flex" and flex_missing:
                    return flex_missing
                if self.device == "cpu" and impl in ("flex", "sdpa", "inductor"):
                    return "GPU only in this script"
                fn = build(impl, mask, self.args, run.cfg.n, self.device, self.args.dim ** -0.5)
                q, k, v, dout = run.inputs
                return common.runner(fn, (q, k, v), run.cfg.mode, (q, k, v), dout)
            impls[impl] = common.Impl(bind, report=impl == "fuser")
        return impls

    def inputs(self, cfg: Config):
        """q, k, v (requiring grad) and dout, the same for every mode and mask at one N."""
        import torch

        a = self.args
        gen = torch.Generator().manual_seed(cfg.n)
        shape = (a.batch, a.heads, cfg.n, a.dim)
        q, k, v, dout = (torch.randn(shape, generator=gen).to(self.device, self.dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        return q, k, v, dout

    def reference(self, run: common.ConfigRun):
        """FlexAttention on float32 copies on the GPU, eager in float64 on the CPU."""
        import torch

        cfg = run.cfg
        ref_impl, ref_dt = ("flex", torch.float32) if self.device == "cuda" else ("eager", torch.float64)
        if ref_impl == "flex" and common.flex_available():
            return None
        q, k, v, dout = run.inputs
        qr, kr, vr = (t.detach().to(ref_dt).requires_grad_(True) for t in (q, k, v))
        fn = build(ref_impl, cfg.mask, self.args, cfg.n, self.device, self.args.dim ** -0.5)
        return tuple(x.detach() for x in common.runner(fn, (qr, kr, vr), cfg.mode, (qr, kr, vr), dout.to(ref_dt))())

    def summarize(self, cfg: Config, recs: dict[str, dict]) -> dict:
        a = self.args
        pairs = visible_pairs(cfg.mask, cfg.n, a.window, a.prefix)
        flops = 4.0 * a.batch * a.heads * a.dim * pairs * (3.5 if cfg.mode == "fwdbwd" else 1.0)
        tensors = 4 if cfg.mode == "fwd" else 8
        elt = self.dtype.itemsize
        nbytes = a.batch * a.heads * cfg.n * (tensors * a.dim * elt + (4 if cfg.mode == "fwdbwd" else 0))
        floor = max(common.floor_ms(flops, a.peak_tflops), common.floor_ms(nbytes, a.peak_tbps))
        return {"mask": cfg.mask, "N": cfg.n, "mode": cfg.mode, "floor_ms": floor, "flops": flops, "bytes": nbytes}

    def main_table(self) -> str:
        rows = []
        for cfg, recs, s in self.rows:
            f = common.ok_ms(recs, "fuser")
            times = {b: common.ok_ms(recs, b) for b in BASELINES}
            best = min((t for t in times.values() if t), default=None)
            best_name = next((b for b in BASELINES if best and times[b] == best), "-")
            fuser = recs.get("fuser", {})
            rows.append([cfg.mask, cfg.n, cfg.mode]
                        + [common.fmt_ms(recs[i]["ms"]) if i in recs and recs[i]["ms"]
                           else (recs[i]["status"] if i in recs else "-") for i in IMPLS]
                        + [common.fmt_ms(s["floor_ms"]), f"{100 * s['floor_ms'] / f:.0f}%" if f else "-",
                           f"{best / f:.2f}× ({best_name})" if f and best else "-",
                           common.fmt_err(fuser.get("rel_err")), common.note_cell(fuser) if fuser else ""])
        return common.md_table(["mask", "N", "mode", *IMPLS, "floor", "fuser % floor", "vs best", "err", "plan"], rows)

    def legend(self) -> str:
        a = self.args
        return (f"- B={a.batch}, H={a.heads}, D={a.dim}, dtype={common.DTYPES[a.dtype]}, "
                f"window={a.window}, prefix={a.prefix}")

    def render(self, done: bool) -> tuple[str, str, str]:
        """This benchmark's layout: header, sizes, the column meanings, one table (+ errors)."""
        errors = self.errors()
        main = self.main_table()
        parts = [common.header_md(TITLE, self.meta), self.legend(), *self.notes(), "",
                 __doc__.split("Columns:")[1].strip().split("Results:")[0].strip(), "", main]
        if errors:
            parts += ["", "## Errors", "", errors]
        return "\n".join(parts), ("## Errors\n\n" + errors) if errors else "", main


def main(argv=None) -> int:
    return MasksBenchmark(parse_args(argv)).main()


if __name__ == "__main__":
    raise SystemExit(main())
