"""Attention benchmark: fuser against eager PyTorch, Inductor, SDPA and FlexAttention.

Usage (on a GPU; one process measures everything side by side)::

    python benchmarks/attention.py --out-dir "$OUT"         # full grid (H100: ~4 min of baselines + fuser)
    python benchmarks/attention.py --dims 128 --seqs 4096 8192 --out-dir "$OUT"
    python benchmarks/attention.py --impls eager inductor fuser fuser_kernels sdpa flex
    python benchmarks/attention.py --smoke                  # tiny sizes; runs on CPU (interpreter)

Implementations (``--impls``; default all but ``fuser_kernels``), all computing
softmax(q kᵀ · scale) v with scale = D^-0.5 on [B, H, N, D] tensors:

- ``eager``: plain PyTorch: ``s = q @ k.transpose(-2, -1) * scale``; causal via
  ``s.masked_fill(mask, float('-inf'))`` with a boolean ``triu`` mask built inside the function;
  ``torch.softmax(s.float(), -1).to(q.dtype) @ v``.
- ``inductor``: ``torch.compile`` of that same function (default backend).
- ``fuser``: ``torch.compile(..., backend="fuser")`` of that same function.
- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` (flash on an H100).
- ``flex``: ``torch.compile`` of ``flex_attention``, with a causal ``create_block_mask`` block
  mask when causal (block mask built outside the timed region, once per N). Skipped with a
  note where FlexAttention is unavailable.
- ``fuser_kernels`` (opt-in): as ``fuser``, but with ``fuser.plan = attention.impl=fuser``, so
  fuser's own kernels run even where its planner would hand the region to SDPA or Inductor.
  It gets its own ratio/error/target columns, headed ``kern``.

Modes (``--modes``): ``fwd`` = forward under ``torch.no_grad()``; ``fwdbwd`` = forward plus
``torch.autograd.grad(out, (q, k, v), grad_out)`` with a fixed random ``grad_out``, timed
together.

Compilation: one compiled function per (impl, mode, causal, D), reused across N, each a
separate code object so Dynamo caches never collide. ``--shapes dynamic`` (default) marks the
sequence dimension dynamic from the first call (``maybe_mark_dynamic``: one compile per
variant); ``auto`` leaves it to Dynamo's automatic dynamic shapes (static at the first N, one
recompile at the second, dynamic after); ``static`` compiles every N separately.

Flags: ``--dims`` (head dims, default 128 64), ``--seqs`` (default 1024 4096 8192 16384),
``--causal {0,1,both}``, ``--modes {fwd,fwdbwd,both}``, ``--dtype {bf16,fp16,fp32}``,
``--impls``, ``--batch``/``--heads`` (4, 16), ``--warmup``/``--rep`` (do_bench ms, 25/100),
``--shapes``, ``--budget-s`` (stop starting new measurements after this many seconds, default
540, so a 10-minute device call still writes its tables; 0 = no limit), ``--out`` (markdown
path; JSON written beside it), ``--out-dir`` (or env ``FUSER_BENCH_OUT_DIR``: also copy both
files there, e.g. ``$OUT``), ``--fuser-option key=value`` (``torch.compile`` options for the
fuser backend, e.g. ``fuser.autotune=1``), ``--peak-tflops``/``--peak-tbps`` (floors: 790 TFLOP/s
bf16 and 3.0 TB/s measured on the H100), ``--smoke``, ``--device``, ``--seed``.

Measurement per (configuration, impl): synchronize; a first call, timed with a host clock
(includes compilation) and checked against SDPA; one call to probe memory; then
``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``. Inputs: fresh
``torch.randn`` per configuration (seeded). Any exception is recorded (``OOM`` or
``err: ...``) and the run goes on. Results are rewritten after every configuration, so a run
cut short still leaves its tables.

Columns of the main table (printed last, and written to ``benchmarks/results/attention.md``):

- ``D, N, mask, mode``: head dim, sequence length, ``causal``/``none``, ``fwd``/``fwdbwd``.
- ``eager … flex``: median ms per impl (``OOM``, ``err``, ``skip``: see the details table).
  ``†`` on fuser: its kernels did not run (the region was not fused, or the planner chose
  another implementation, e.g. SDPA: then the fuser column times SDPA; see ``fuser_kernels``).
- ``floor ms (flop/byte)``: FLOPs / peak rate and bytes / bandwidth. FLOPs: forward
  4·B·H·N²·D, causal 4·B·H·D·N(N+1)/2; fwdbwd 3.5× forward. Bytes: q, k, v read and o written
  once (fwd); fwdbwd adds the backward's q, k, v, o, dO reads and dq, dk, dv writes.

Then, for fuser (and ``kern`` = fuser_kernels when selected):

- ``TFLOP/s``: FLOPs / its time.
- ``%floor``: the larger floor / its time.
- ``vs SDPA``, ``vs Flex``, ``vs Inductor``: other time / its time (> 1: fuser faster).
- ``rel err``: ‖fuser − sdpa‖ / ‖sdpa‖ in fp32 (fwd: output; fwdbwd: worst of output and
  dq, dk, dv), from the first call. Above 2e-2 (or NaN) it reads ``WRONG``, and so does its
  time cell.
- ``target``: shared/BENCHMARKS.md's target: fwd ≥ 0.9× SDPA, fwdbwd ≥ 0.75× SDPA, and faster
  than Flex; ``✓``, or ``✗`` with what was missed.

The details table has one row per (configuration, impl): ms, TFLOP/s, extra MiB (peak memory
allocated during one call, a separate untimed one after the first, minus what was allocated
before it: outputs, gradients and temporaries, not inputs), first call s (host time of the first call of that configuration, compilation
included; ``+k`` = graphs Dynamo compiled during it), rel err vs SDPA, and a note (fuser's plan,
errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMPLS = ("eager", "inductor", "fuser", "fuser_kernels", "sdpa", "flex")
DEFAULT_IMPLS = ("eager", "inductor", "fuser", "sdpa", "flex")
RUN_ORDER = ("sdpa", "fuser", "fuser_kernels", "flex", "inductor", "eager")  # sdpa first: the reference
SUBJECTS = {"fuser": "fuser", "fuser_kernels": "kern"}  # impls judged against the baselines, short label
WRONG_TOL = 2e-2
TARGET = {"fwd": 0.9, "fwdbwd": 0.75}  # fuser speed vs SDPA, from shared/BENCHMARKS.md
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=None, help="head dims (default 128 64)")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (default 1024 4096 8192 16384)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--modes", choices=("fwd", "fwdbwd", "both"), default="both")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                   help="default: eager inductor fuser sdpa flex (fuser_kernels is opt-in)")
    p.add_argument("--batch", type=int, default=None, help="default 4")
    p.add_argument("--heads", type=int, default=None, help="default 16")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warm-up ms (default 25)")
    p.add_argument("--rep", type=int, default=None, help="do_bench repetition ms (default 100)")
    p.add_argument("--shapes", choices=("dynamic", "auto", "static"), default="dynamic")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="start no new measurement after this many seconds (0: no limit)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown path (default benchmarks/results/attention.md; attention_smoke.md with --smoke)")
    p.add_argument("--out-dir", default=os.environ.get("FUSER_BENCH_OUT_DIR", ""),
                   help="also copy the .md and .json here (env FUSER_BENCH_OUT_DIR)")
    p.add_argument("--fuser-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for torch.compile(backend='fuser', options=...), repeatable")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-tbps", type=float, default=3.0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (B=1, H=2, D=16, N=64 128, fp32): an end-to-end check, also on CPU")
    a = p.parse_args(argv)
    small = a.smoke
    a.dims = a.dims or ([16] if small else [128, 64])
    a.seqs = a.seqs or ([64, 128] if small else [1024, 4096, 8192, 16384])
    a.dtype = a.dtype or ("fp32" if small else "bf16")
    a.batch = a.batch or (1 if small else 4)
    a.heads = a.heads or (2 if small else 16)
    a.warmup = a.warmup if a.warmup is not None else (1 if small else 25)
    a.rep = a.rep if a.rep is not None else (5 if small else 100)
    a.out = a.out or common.RESULTS_DIR / ("attention_smoke.md" if small else "attention.md")
    a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    a.mode_list = ["fwd", "fwdbwd"] if a.modes == "both" else [a.modes]
    a.impl_list = [i for i in RUN_ORDER if i in a.impls]
    a.fuser_options = dict(common.parse_option(s) for s in a.fuser_option)
    return a


# --------------------------------------------------------------------------------------------
# the implementations
# --------------------------------------------------------------------------------------------

def naive_attention(scale: float, causal: bool) -> Callable:
    """The plain PyTorch spelling that eager, Inductor and fuser all run."""
    import torch

    def attention_full(q, k, v):
        s = q @ k.transpose(-2, -1) * scale
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    def attention_causal(q, k, v):
        s = q @ k.transpose(-2, -1) * scale
        n_q, n_k = s.shape[-2], s.shape[-1]
        mask = torch.triu(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device), diagonal=1)
        s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    return attention_causal if causal else attention_full


def sdpa_attention(scale: float, causal: bool) -> Callable:
    import torch.nn.functional as F

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    return sdpa


def flex_available() -> Optional[str]:
    """``None`` if FlexAttention can be imported, else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def flex_function(scale: float) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    def flex(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)

    return flex


def causal_block_mask(n: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, n, n, device=device)


def fuser_options(args, force_kernels: bool) -> Optional[dict]:
    """``torch.compile`` options for the fuser backend: ``--fuser-option`` values, and for
    ``fuser_kernels`` a forced ``attention.impl=fuser`` plan (first, so that it wins)."""
    opts = dict(args.fuser_options)
    if force_kernels:
        user_plan = opts.get("fuser.plan")
        if isinstance(user_plan, dict):
            opts["fuser.plan"] = {**user_plan, "attention.impl": "fuser"}
        else:
            opts["fuser.plan"] = "attention.impl=fuser" + (f",{user_plan}" if user_plan else "")
    return opts or None


@dataclasses.dataclass
class Variant:
    """One implementation for one (mode, causal, D): a callable ``fn(q, k, v)`` built per N
    by ``bind(n)``, plus what is known about how it compiled (fuser's plan)."""

    impl: str
    bind: Callable[[int], Callable]
    note: str = ""
    unavailable: Optional[str] = None


def build_variants(args, mode: str, causal: bool, dim: int, device: str) -> dict[str, Variant]:
    """A fresh compiled function per impl for this (mode, causal, D), reused across N."""
    import torch

    scale = 1.0 / math.sqrt(dim)
    tag = f"{mode}_{'causal' if causal else 'full'}_d{dim}"
    dynamic = False if args.shapes == "static" else None
    naive = naive_attention(scale, causal)
    variants: dict[str, Variant] = {}
    for impl in args.impl_list:
        if impl == "eager":
            variants[impl] = Variant(impl, lambda n, f=naive: f)
        elif impl == "sdpa":
            f = sdpa_attention(scale, causal)
            variants[impl] = Variant(impl, lambda n, f=f: f)
        elif impl in ("inductor", "fuser", "fuser_kernels"):
            kw: dict[str, Any] = {"dynamic": dynamic}
            if impl != "inductor":
                kw["backend"] = "fuser"
                kw["options"] = fuser_options(args, force_kernels=impl == "fuser_kernels")
            f = torch.compile(common.fresh_function(naive, f"{impl}_{tag}"), **kw)
            variants[impl] = Variant(impl, lambda n, f=f: f)
        elif impl == "flex":
            why = flex_available()
            if why:
                variants[impl] = Variant(impl, lambda n: None, unavailable=why)
                continue
            f = torch.compile(common.fresh_function(flex_function(scale), f"flex_{tag}"), dynamic=dynamic)
            masks: dict[int, Any] = {}

            def bind(n, f=f, masks=masks):
                if causal and n not in masks:
                    masks.clear()
                    masks[n] = causal_block_mask(n, device)
                bm = masks.get(n)
                return lambda q, k, v: f(q, k, v, bm)

            variants[impl] = Variant(impl, bind)
    return variants


# --------------------------------------------------------------------------------------------
# one configuration
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    dim: int
    n: int
    causal: bool
    mode: str

    @property
    def label(self) -> str:
        return f"D={self.dim} N={self.n} {'causal' if self.causal else 'none'} {self.mode}"


def flops(cfg: Config, b: int, h: int) -> float:
    pairs = cfg.n * (cfg.n + 1) / 2 if cfg.causal else cfg.n * cfg.n
    fwd = 4.0 * b * h * cfg.dim * pairs
    return fwd * (3.5 if cfg.mode == "fwdbwd" else 1.0)


def min_bytes(cfg: Config, b: int, h: int, elt: int) -> float:
    tensors = 4 + (8 if cfg.mode == "fwdbwd" else 0)  # fwd q,k,v,o; bwd q,k,v,o,dO,dq,dk,dv
    return float(tensors * b * h * cfg.n * cfg.dim * elt)


def make_inputs(args, cfg: Config, dtype, device: str, seed: int):
    import torch

    torch.manual_seed(seed)
    grad = cfg.mode == "fwdbwd"
    shape = (args.batch, args.heads, cfg.n, cfg.dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=grad) for _ in range(3))
    if args.shapes == "dynamic":
        for t in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(t, 2)
    grad_out = torch.randn(shape, dtype=dtype, device=device) if grad else None
    return q, k, v, grad_out


def make_runner(fn: Callable, mode: str, q, k, v, grad_out) -> Callable[[], tuple]:
    """The timed region: forward (no_grad), or forward + backward to q, k, v."""
    import torch

    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return (fn(q, k, v),)
        return run_fwd

    def run_fwdbwd():
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        return (out.detach(), *grads)
    return run_fwdbwd


def run_config(args, cfg: Config, variants: dict[str, Variant], dtype, device: str, seed: int,
               state: dict) -> dict[str, dict]:
    """Measure every impl on one configuration; returns impl -> result record."""
    import torch

    q, k, v, grad_out = make_inputs(args, cfg, dtype, device, seed)
    ref: dict[str, Any] = {"out": None}
    records: dict[str, dict] = {}

    def reference() -> Optional[tuple]:
        if ref["out"] is None and "sdpa_failed" not in ref:
            try:  # sdpa not timed (or failed): compute the reference untimed
                ref["out"] = make_runner(sdpa_attention(1.0 / math.sqrt(cfg.dim), cfg.causal),
                                         cfg.mode, q, k, v, grad_out)()
            except Exception:  # noqa: BLE001
                ref["sdpa_failed"] = True
                common.free_memory(device, collect=True)
        return ref["out"]

    for impl, var in variants.items():
        rec = {"impl": impl, "status": "ok", "ms": None, "extra_mib": None, "first_call_s": None,
               "graphs_compiled": None, "rel_err": None, "note": var.note, "error": None}
        records[impl] = rec
        if var.unavailable:
            rec.update(status="skip", note="unavailable", error=var.unavailable)
            continue
        if state.get("broken"):
            rec.update(status="skip", note="CUDA context broken by an earlier error")
            continue
        if args.budget_s and common.elapsed_s() > args.budget_s:
            rec.update(status="skip", note=f"time budget ({args.budget_s:.0f} s) spent")
            state["budget_hit"] = True
            continue

        def check(out, impl=impl):
            if impl == "sdpa":
                ref["out"] = out
                return 0.0
            r = reference()
            return None if r is None else common.rel_err(out, r)

        collector = common.fuser_collector() if impl in SUBJECTS else None
        try:
            fn = var.bind(cfg.n)
        except Exception as exc:  # noqa: BLE001 - e.g. create_block_mask failing
            rec.update(status=common.short_error(exc), error=common.describe_error(exc))
            common.free_memory(device, collect=True)
            continue
        runner = make_runner(fn, cfg.mode, q, k, v, grad_out)
        m = common.measure(runner, device, args.warmup, args.rep, check=check,
                           on_first=collector)
        if impl in SUBJECTS and m.first_context is not None:
            desc = common.describe_fuser(m.first_context)
            if desc:
                var.note = desc
            rec["note"] = var.note
        rec.update(status=m.status, ms=m.ms, extra_mib=m.extra_mib, first_call_s=m.first_call_s,
                   graphs_compiled=m.graphs_compiled, rel_err=m.check, error=m.error)
        if m.error and common.context_broken(m.error):
            state["broken"] = True
        print(f"  {cfg.label:<32} {impl:<9} {m.status if not m.ok else common.fmt_ms(m.ms) + ' ms':>12}"
              f"  first call {m.first_call_s or 0:7.2f} s  {rec['note'] or ''}", flush=True)
    del q, k, v, grad_out
    ref.clear()
    common.free_memory(device)
    return records


# --------------------------------------------------------------------------------------------
# derived numbers and tables
# --------------------------------------------------------------------------------------------

def summarize(args, cfg: Config, records: dict[str, dict], elt: int) -> dict:
    """Config-level numbers: FLOPs, floors, TFLOP/s per impl, and for each subject (fuser,
    fuser_kernels) its ratios to the baselines, its error against SDPA and the target."""
    fl = flops(cfg, args.batch, args.heads)
    by = min_bytes(cfg, args.batch, args.heads, elt)
    floor_flop = fl / (args.peak_tflops * 1e12) * 1e3
    floor_byte = by / (args.peak_tbps * 1e12) * 1e3
    for r in records.values():
        r["tflops"] = fl / (r["ms"] * 1e-3) / 1e12 if r.get("ms") else None

    def ms(impl):
        r = records.get(impl)
        return r["ms"] if r and r["status"] == "ok" else None

    s = {"D": cfg.dim, "N": cfg.n, "causal": cfg.causal, "mode": cfg.mode, "flops": fl, "bytes": by,
         "floor_flop_ms": floor_flop, "floor_byte_ms": floor_byte, "subjects": {}}
    for subj in SUBJECTS:
        if subj not in records:
            continue
        f = ms(subj)
        err = records[subj].get("rel_err")
        d = {"ms": f,
             "pct_floor": 100.0 * max(floor_flop, floor_byte) / f if f else None,
             "vs_sdpa": ms("sdpa") / f if (f and ms("sdpa")) else None,
             "vs_flex": ms("flex") / f if (f and ms("flex")) else None,
             "vs_inductor": ms("inductor") / f if (f and ms("inductor")) else None,
             "rel_err": err, "wrong": err is not None and not (err <= WRONG_TOL),
             "fused": "NOT fused" not in (records[subj].get("note") or "")}
        d["target"] = target_cell(cfg.mode, d, f is not None)
        s["subjects"][subj] = d
    return s


def target_cell(mode: str, d: dict, have_time: bool) -> str:
    if d["wrong"]:
        return "✗ WRONG"
    if not have_time or (d["vs_sdpa"] is None and d["vs_flex"] is None):
        return "—"
    missed = []
    if d["vs_sdpa"] is not None and d["vs_sdpa"] < TARGET[mode]:
        missed.append(f"SDPA<{TARGET[mode]}")
    if d["vs_flex"] is not None and d["vs_flex"] <= 1.0:
        missed.append("Flex")
    return "✗ " + ",".join(missed) if missed else "✓"


def impl_cell(r: Optional[dict], summary: dict, impl: str) -> str:
    if r is None:
        return "—"
    subj = summary["subjects"].get(impl)
    if r["status"] != "ok":
        cell = r["status"].split(":")[0]
        return cell + " WRONG" if subj and subj["wrong"] else cell
    cell = common.fmt_ms(r["ms"])
    if subj:
        if subj["wrong"]:
            cell += " WRONG"
        if not subj["fused"]:
            cell += " †"
    return cell


def main_table(args, rows: list[tuple[Config, dict, dict]]) -> str:
    impls = [i for i in IMPLS if i in args.impl_list]
    subjects = [x for x in SUBJECTS if x in args.impl_list]
    headers = ["D", "N", "mask", "mode"] + impls + ["floor ms (flop/byte)"]
    for subj in subjects:
        lab = SUBJECTS[subj]
        headers += [f"{lab} TFLOP/s", f"{lab} %floor", f"{lab} vs SDPA", f"{lab} vs Flex",
                    f"{lab} vs Inductor", f"{lab} rel err", f"{lab} target"]
    body = []
    for cfg, recs, s in rows:
        row = ([cfg.dim, cfg.n, "causal" if cfg.causal else "none", cfg.mode]
               + [impl_cell(recs.get(i), s, i) for i in impls]
               + [f"{common.fmt_ms(s['floor_flop_ms'])} / {common.fmt_ms(s['floor_byte_ms'])}"])
        for subj in subjects:
            d = s["subjects"].get(subj)
            if d is None:
                row += ["—"] * 7
                continue
            err = common.fmt_err(d["rel_err"])
            row += [common.fmt_sig(recs[subj].get("tflops")),
                    common.fmt_sig(d["pct_floor"]) + ("%" if d["pct_floor"] else ""),
                    common.fmt_ratio(d["vs_sdpa"]), common.fmt_ratio(d["vs_flex"]),
                    common.fmt_ratio(d["vs_inductor"]), ("WRONG " + err) if d["wrong"] else err,
                    d["target"]]
        body.append(row)
    align = "rrll" + "r" * (len(impls) + 1) + "rrrrrrl" * len(subjects)
    return common.md_table(headers, body, align)


def details_table(rows: list[tuple[Config, dict, dict]]) -> str:
    headers = ["D", "N", "mask", "mode", "impl", "ms", "TFLOP/s", "extra MiB", "first call s",
               "rel err vs SDPA", "note"]
    body = []
    for cfg, recs, _ in rows:
        for impl in IMPLS:
            r = recs.get(impl)
            if r is None:
                continue
            err = r["rel_err"]
            err_cell = common.fmt_err(err)
            if impl in SUBJECTS and err is not None and not (err <= WRONG_TOL):
                err_cell = "WRONG " + err_cell
            body.append([cfg.dim, cfg.n, "causal" if cfg.causal else "none", cfg.mode, impl,
                         common.fmt_ms(r["ms"]), common.fmt_sig(r.get("tflops")),
                         common.fmt_num(r["extra_mib"], 0), common.first_call_cell(r), err_cell,
                         common.note_cell(r)])
    return common.md_table(headers, body, "rrlll" + "r" * 5 + "l")


def errors_section(rows: list[tuple[Config, dict, dict]]) -> str:
    return "\n".join(common.error_lines(rows))


def legend(args) -> str:
    return (
        f"B={args.batch}, H={args.heads}, dtype={args.dtype}, shapes={args.shapes}, "
        f"do_bench warmup={args.warmup} ms rep={args.rep} ms (median). Times in ms. "
        f"Floors: FLOPs / {args.peak_tflops:g} TFLOP/s and bytes / {args.peak_tbps:g} TB/s. "
        "Ratios: other time / fuser time (>1: fuser faster). rel err vs SDPA in fp32; "
        f"fuser above {WRONG_TOL:g} reads WRONG. † fuser's own kernels did not run (see details). "
        "kern = fuser_kernels (fuser with attention.impl=fuser forced). "
        "target: ≥0.9× SDPA fwd, ≥0.75× SDPA fwd+bwd, faster than Flex. "
        "Column meanings: docstring of benchmarks/attention.py.")


def render(args, meta: dict, rows, done: bool) -> tuple[str, str, str]:
    """(full markdown for the file, details+errors for stdout, main table)."""
    return common.report("fuser attention benchmark", meta, done, [], legend(args), main_table(args, rows),
                         details_table(rows), errors_section(rows))


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    force_cpu = args.device == "cpu"
    common.setup_environment(force_cpu=force_cpu)
    import torch

    device = "cuda" if (args.device != "cpu" and torch.cuda.is_available()) else "cpu"
    if args.device == "cuda" and device != "cuda":
        print("--device cuda: no CUDA device found", file=sys.stderr)
        return 2
    if any(i in SUBJECTS for i in args.impl_list):
        import fuser  # noqa: F401 - registers backend="fuser"
    warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")
    if args.shapes == "static":
        common.raise_recompile_limit(64)
    dtype = getattr(torch, DTYPES[args.dtype])
    elt = torch.empty((), dtype=dtype).element_size()
    meta = common.env_header(device)
    print(f"attention benchmark on {meta['device']}: torch {meta['torch']}, triton {meta['triton']}, "
          f"CUDA {meta['cuda']}; B={args.batch} H={args.heads} dtype={args.dtype} dims={args.dims} "
          f"seqs={args.seqs} causal={args.causals} modes={args.mode_list} impls={args.impl_list} "
          f"shapes={args.shapes}", flush=True)
    if device == "cpu":
        print("No GPU: CPU timing with a host clock; fuser's kernels run in Triton's interpreter. "
              "Numbers are for checking the script, not for reading.", flush=True)

    rows: list[tuple[Config, dict, dict]] = []
    state: dict[str, Any] = {}
    seed = args.seed
    for mode in args.mode_list:
        for causal in args.causals:
            for dim in args.dims:
                variants = build_variants(args, mode, causal, dim, device)
                for n in args.seqs:
                    cfg = Config(dim, n, causal, mode)
                    seed += 1
                    recs = run_config(args, cfg, variants, dtype, device, seed, state)
                    rows.append((cfg, recs, summarize(args, cfg, recs, elt)))
                    md, _, _ = render(args, meta, rows, done=False)
                    common.write_outputs(args.out, md, common.to_json(args, meta, rows, False), args.out_dir)
                del variants
                common.free_memory(device, collect=True)

    md, stdout, main_tbl = render(args, meta, rows, done=True)
    written = common.write_outputs(args.out, md, common.to_json(args, meta, rows, True), args.out_dir)
    wrong = [f"{subj} at {cfg.label}" for cfg, _, s in rows for subj, d in s["subjects"].items() if d["wrong"]]
    print("\n" + stdout + "\n")
    print("wrote " + ", ".join(str(p) for p in written))
    if state.get("budget_hit"):
        print(f"NOTE: time budget of {args.budget_s:.0f} s was spent; later measurements were skipped.")
    if state.get("broken"):
        print("NOTE: a CUDA error broke the context; later measurements were skipped.")
    if wrong:
        print(f"!!! fuser WRONG (rel err > {WRONG_TOL:g} vs SDPA) on: " + "; ".join(wrong))
    print(f"total {common.elapsed_s():.0f} s\n")
    print(f"## fuser attention benchmark — {meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']}\n\n{legend(args)}\n")
    print(main_tbl, flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
