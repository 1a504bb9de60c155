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

Measurement per (configuration, impl), by the driver in ``common.py``: synchronize; a first call, timed with a host clock
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
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMPLS = ("eager", "inductor", "fuser", "fuser_kernels", "sdpa", "flex")
DEFAULT_IMPLS = ("eager", "inductor", "fuser", "sdpa", "flex")
RUN_ORDER = ("sdpa", "fuser", "fuser_kernels", "flex", "inductor", "eager")  # sdpa first: the reference
SUBJECTS = {"fuser": "fuser", "fuser_kernels": "kern"}  # impls judged against the baselines, short label
WRONG_TOL = 2e-2
TARGET = {"fwd": 0.9, "fwdbwd": 0.75}  # fuser speed vs SDPA, from shared/BENCHMARKS.md


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
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                   help="default: eager inductor fuser sdpa flex (fuser_kernels is opt-in)")
    p.add_argument("--batch", type=int, default=None, help="default 4")
    p.add_argument("--heads", type=int, default=None, help="default 16")
    p.add_argument("--shapes", choices=("dynamic", "auto", "static"), default="dynamic")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-tbps", type=float, default=3.0)
    common.add_driver_args(p, budget_s=540.0, out_name="attention")
    a = p.parse_args(argv)
    small = a.smoke
    common.finish_driver_args(a, out_name="attention")
    a.dims = a.dims or ([16] if small else [128, 64])
    a.seqs = a.seqs or ([64, 128] if small else [1024, 4096, 8192, 16384])
    a.dtype = a.dtype or ("fp32" if small else "bf16")
    a.batch = a.batch or (1 if small else 4)
    a.heads = a.heads or (2 if small else 16)
    a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    a.mode_list = ["fwd", "fwdbwd"] if a.modes == "both" else [a.modes]
    a.impl_list = [i for i in RUN_ORDER if i in a.impls]
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


# --------------------------------------------------------------------------------------------
# the grid
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
    fwd = 4.0 * b * h * cfg.dim * common.visible_pairs(cfg.n, cfg.causal)
    return fwd * (3.5 if cfg.mode == "fwdbwd" else 1.0)


def min_bytes(cfg: Config, b: int, h: int, elt: int) -> float:
    tensors = 4 + (8 if cfg.mode == "fwdbwd" else 0)  # fwd q,k,v,o; bwd q,k,v,o,dO,dq,dk,dv
    return float(tensors * b * h * cfg.n * cfg.dim * elt)


class AttentionBenchmark(common.Benchmark):
    """Attention on ``[B, H, N, D]``: groups (mode, causal, D) over N; the check is against SDPA
    (its own first call's output, or an untimed SDPA call when it is not measured)."""

    title = "fuser attention benchmark"
    name = "attention"

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"attention benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}, "
                f"CUDA {m['cuda']}; B={a.batch} H={a.heads} dtype={a.dtype} dims={a.dims} "
                f"seqs={a.seqs} causal={a.causals} modes={a.mode_list} impls={a.impl_list} "
                f"shapes={a.shapes}")

    def groups(self):
        a = self.args
        return [((mode, causal, dim), [Config(dim, n, causal, mode) for n in a.seqs])
                for mode in a.mode_list for causal in a.causals for dim in a.dims]

    def implementations(self, group) -> dict[str, common.Impl]:
        """A fresh compiled function per impl for this (mode, causal, D), reused across N."""
        import torch

        a = self.args
        mode, causal, dim = group
        scale = 1.0 / math.sqrt(dim)
        tag = f"{mode}_{'causal' if causal else 'full'}_d{dim}"
        dynamic = False if a.shapes == "static" else None

        def timed(f):
            return lambda run: common.runner(f, run.inputs[:3], mode, run.inputs[:3], run.inputs[3])

        impls: dict[str, common.Impl] = {}
        for impl in a.impl_list:
            if impl == "eager":
                impls[impl] = common.Impl(timed(naive_attention(scale, causal)))
            elif impl == "sdpa":
                impls[impl] = common.Impl(timed(sdpa_attention(scale, causal)))
            elif impl in ("inductor", "fuser", "fuser_kernels"):
                kw: dict[str, Any] = {"dynamic": dynamic}
                if impl != "inductor":
                    kw["backend"] = "fuser"
                    kw["options"] = fuser_options(a, force_kernels=impl == "fuser_kernels")
                f = torch.compile(common.fresh_function(naive_attention(scale, causal), f"{impl}_{tag}"), **kw)
                impls[impl] = common.Impl(timed(f), report=impl in SUBJECTS)
            elif impl == "flex":
                why = common.flex_available()
                if why:
                    impls[impl] = common.Impl(lambda run, why=why: f"unavailable: {why}")
                    continue
                f = torch.compile(common.fresh_function(flex_function(scale), f"flex_{tag}"), dynamic=dynamic)
                masks: dict[int, Any] = {}

                def bind(run, f=f, masks=masks):
                    n = run.cfg.n
                    if causal and n not in masks:
                        masks.clear()
                        masks[n] = causal_block_mask(n, self.device)
                    bm = masks.get(n)
                    return timed(lambda q, k, v: f(q, k, v, bm))(run)

                impls[impl] = common.Impl(bind)
        return impls

    def inputs(self, cfg: Config):
        import torch

        a = self.args
        grad = cfg.mode == "fwdbwd"
        shape = (a.batch, a.heads, cfg.n, cfg.dim)
        q, k, v = (torch.randn(shape, dtype=self.dtype, device=self.device, requires_grad=grad) for _ in range(3))
        if a.shapes == "dynamic":
            for t in (q, k, v):
                torch._dynamo.maybe_mark_dynamic(t, 2)
        grad_out = torch.randn(shape, dtype=self.dtype, device=self.device) if grad else None
        return q, k, v, grad_out

    def reference(self, run: common.ConfigRun):
        """SDPA's output; when SDPA is measured its first call sets it (:meth:`check`)."""
        if "sdpa" in self.args.impl_list:
            return None
        cfg = run.cfg
        q, k, v, grad_out = run.inputs
        return common.runner(sdpa_attention(1.0 / math.sqrt(cfg.dim), cfg.causal), (q, k, v), cfg.mode,
                             (q, k, v), grad_out)()

    def check(self, run: common.ConfigRun, out):
        if run.impl == "sdpa":
            run.ref = out
            return 0.0
        return None if run.ref is None else common.rel_err(out, run.ref)

    # -- derived numbers and tables ------------------------------------------------------
    def summarize(self, cfg: Config, records: dict[str, dict]) -> dict:
        """Config-level numbers: FLOPs, floors, TFLOP/s per impl, and for each subject (fuser,
        fuser_kernels) its ratios to the baselines, its error against SDPA and the target."""
        a = self.args
        elt = self.dtype.itemsize
        fl = flops(cfg, a.batch, a.heads)
        by = min_bytes(cfg, a.batch, a.heads, elt)
        floor_flop = common.floor_ms(fl, a.peak_tflops)
        floor_byte = common.floor_ms(by, a.peak_tbps)
        for r in records.values():
            r["tflops"] = fl / (r["ms"] * 1e-3) / 1e12 if r.get("ms") else None
        s = {"D": cfg.dim, "N": cfg.n, "causal": cfg.causal, "mode": cfg.mode, "flops": fl, "bytes": by,
             "floor_flop_ms": floor_flop, "floor_byte_ms": floor_byte, "subjects": {}}
        for subj in SUBJECTS:
            if subj not in records:
                continue
            f = common.ok_ms(records, subj)
            err = records[subj].get("rel_err")
            d = {"ms": f,
                 "pct_floor": 100.0 * max(floor_flop, floor_byte) / f if f else None,
                 "vs_sdpa": common.ratio(common.ok_ms(records, "sdpa"), f),
                 "vs_flex": common.ratio(common.ok_ms(records, "flex"), f),
                 "vs_inductor": common.ratio(common.ok_ms(records, "inductor"), f),
                 "rel_err": err, "wrong": err is not None and not (err <= WRONG_TOL),
                 "fused": "NOT fused" not in (records[subj].get("note") or "")}
            d["target"] = target_cell(cfg.mode, d, f is not None)
            s["subjects"][subj] = d
        return s

    def main_table(self) -> str:
        a = self.args
        impls = [i for i in IMPLS if i in a.impl_list]
        subjects = [x for x in SUBJECTS if x in a.impl_list]
        headers = ["D", "N", "mask", "mode"] + impls + ["floor ms (flop/byte)"]
        for subj in subjects:
            lab = SUBJECTS[subj]
            headers += [f"{lab} TFLOP/s", f"{lab} %floor", f"{lab} vs SDPA", f"{lab} vs Flex",
                        f"{lab} vs Inductor", f"{lab} rel err", f"{lab} target"]
        body = []
        for cfg, recs, s in self.rows:
            row = ([cfg.dim, cfg.n, common.mask_label(cfg.causal), cfg.mode]
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

    def details_table(self) -> str:
        headers = ["D", "N", "mask", "mode", "impl", "ms", "TFLOP/s", "extra MiB", "first call s",
                   "rel err vs SDPA", "note"]
        body = []
        for cfg, recs, _ in self.rows:
            for impl in IMPLS:
                r = recs.get(impl)
                if r is None:
                    continue
                err = r["rel_err"]
                err_cell = common.fmt_err(err)
                if impl in SUBJECTS and err is not None and not (err <= WRONG_TOL):
                    err_cell = "WRONG " + err_cell
                body.append([cfg.dim, cfg.n, common.mask_label(cfg.causal), cfg.mode, impl,
                             common.fmt_ms(r["ms"]), common.fmt_sig(r.get("tflops")),
                             common.fmt_num(r["extra_mib"], 0), common.first_call_cell(r), err_cell,
                             common.note_cell(r)])
        return common.md_table(headers, body, "rrlll" + "r" * 5 + "l")

    def legend(self) -> str:
        a = self.args
        return (
            f"B={a.batch}, H={a.heads}, dtype={a.dtype}, shapes={a.shapes}, "
            f"do_bench warmup={a.warmup} ms rep={a.rep} ms (median). Times in ms. "
            f"Floors: FLOPs / {a.peak_tflops:g} TFLOP/s and bytes / {a.peak_tbps:g} TB/s. "
            "Ratios: other time / fuser time (>1: fuser faster). rel err vs SDPA in fp32; "
            f"fuser above {WRONG_TOL:g} reads WRONG. † fuser's own kernels did not run (see details). "
            "kern = fuser_kernels (fuser with attention.impl=fuser forced). "
            "target: ≥0.9× SDPA fwd, ≥0.75× SDPA fwd+bwd, faster than Flex. "
            "Column meanings: docstring of benchmarks/attention.py.")

    def wrong(self) -> list[str]:
        return [f"{subj} at {cfg.label}" for cfg, _, s in self.rows for subj, d in s["subjects"].items()
                if d["wrong"]]

    def final_lines(self) -> list[str]:
        lines = super().final_lines()
        wrong = self.wrong()
        if wrong:
            lines.append(f"!!! fuser WRONG (rel err > {WRONG_TOL:g} vs SDPA) on: " + "; ".join(wrong))
        return lines


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
    subj = summary["subjects"].get(impl)
    return common.time_cell(r, wrong=bool(subj and subj["wrong"]), unfused=bool(subj and not subj["fused"]))


def main(argv: Optional[list[str]] = None) -> int:
    return AttentionBenchmark(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
