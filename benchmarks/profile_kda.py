"""Profile one KDA configuration: where a call's time goes, host and GPU, for each way to run it.

    python benchmarks/profile_kda.py --t 8 --h 2 --k 256 --v 8192 [--impls fuser fuser_cg fla] [--trace DIR]

For the blog loop of ``benchmarks/kda.py`` (``kda_loop``) on bf16 inputs at one (B, T, H, K, V),
and for each implementation asked for (``fuser``: ``torch.compile(loop, backend="fuser")``;
``fuser_cg``: the same with ``mode="reduce-overhead"``, ``cudagraph_mark_step_begin()`` before
each call; ``inductor`` and ``inductor_cg`` likewise with the default backend; ``fla``: FLA's
``fused_recurrent_kda``; ``kernel``: the kernel module of the plan fuser chose, called directly
on ``[B·H, T, *]`` inputs), prints:

- ``events``: ``do_bench`` median (what ``benchmarks/kda.py`` reports: the GPU time between two
  events around a call, which includes the host's launch time where the host is slower);
- ``device``: ``do_bench_cudagraph`` median where the calls can be captured (GPU time alone);
- ``host``: wall µs per call of 200 back-to-back calls, one synchronisation at the end (the
  throughput a host-bound caller sees);
- ``profile``: torch.profiler's top operations by self CPU time over 20 calls, and the GPU
  kernels with their times (``--trace DIR`` also writes a Chrome trace per implementation).

A development aid for short device runs when a benchmark row looks wrong (the reduce-overhead
rows of ``benchmarks/results/kda_blog6.md`` were slower than the default mode's): timings here
are not results tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402,F401
import kda  # noqa: E402  (benchmarks/kda.py: the loop, its inputs)

IMPLS = ("fuser", "fuser_cg", "inductor", "inductor_cg", "fla", "kernel")


def build(name: str, bench, cfg, inp):
    """A no-argument callable running ``name`` once on ``inp`` (the ``_cg`` ones mark a CUDA-graph step first)."""
    scale = cfg.kd ** -0.5
    if name in ("fuser", "fuser_cg", "inductor", "inductor_cg"):
        fn = kda.common.fresh_function(kda.kda_loop, f"kda_profile_{name}")
        kw = {"dynamic": False}
        if name.endswith("_cg"):
            kw["mode"] = "reduce-overhead"
        if name.startswith("fuser"):
            kw["backend"] = "fuser"
        compiled = torch.compile(fn, **kw)
        step = torch.compiler.cudagraph_mark_step_begin if name.endswith("_cg") else None

        def call():
            if step is not None:
                step()
            return compiled(*inp.args)
        return call
    if name == "fla":
        ops, why = kda.fla_ops()
        if ops is None:
            raise RuntimeError(why)
        return lambda: ops.fused_recurrent_kda(*inp.args, scale=scale, initial_state=None, output_final_state=True)
    if name == "kernel":
        plan, _, note = kda.planner_choice(inp, cfg, inp.v.dtype)
        from fuser.patterns import kda_ops

        mod, why = kda.optional_module(f"fuser.codegen.kda_{kda_ops.parse_plan(plan)['plan']}", "forward")
        if mod is None:
            raise RuntimeError(why)
        print(f"kernel: {mod.__name__} ({note})")
        q, k, v, g, beta, _ = bench.flat_inputs(types.SimpleNamespace(inputs=inp))  # [B·H, T, *]
        return lambda: mod.forward(q, k, v, g, beta, scale=scale, output_final_state=True, out_dtype=inp.v.dtype)
    raise ValueError(f"unknown implementation {name}; one of {IMPLS}")


def host_us(call, n: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--t", type=int, default=8)
    ap.add_argument("--h", type=int, default=2)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--v", type=int, default=8192)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=["fuser", "fuser_cg", "fla", "kernel"])
    ap.add_argument("--trace", default=None, help="write a Chrome trace per implementation into this folder")
    args = ap.parse_args()
    import triton.testing

    bench = kda.KDABenchmark(kda.parse_args(["--dtype", "bf16", "--device", "cuda"]))
    if bench.setup() is not None:
        raise SystemExit("no CUDA device")
    cfg = kda.Config("profile", args.b, args.t, args.h, args.k, args.v)
    inp = bench.inputs(cfg)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"B={cfg.b} T={cfg.t} H={cfg.h} K={cfg.kd} V={cfg.vd} bf16, state float32")
    with torch.no_grad():
        for name in args.impls:
            try:
                call = build(name, bench, cfg, inp)
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                print(f"\n== {name}: first call {time.perf_counter() - t0:.2f} s", flush=True)
                for _ in range(3):
                    call()
                ev = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                print(f"   events {ev * 1e3:.1f} µs; host {host_us(call):.1f} µs/call", flush=True)
                try:
                    if name.endswith("_cg"):
                        raise RuntimeError("its calls replay a CUDA graph of their own")
                    dev = f"{triton.testing.do_bench_cudagraph(call, rep=50, return_mode='median') * 1e3:.1f} µs"
                except Exception as exc:  # noqa: BLE001 - capture refused (e.g. a graph inside a graph)
                    dev = f"not capturable ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
                print(f"   device {dev}", flush=True)
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(20):
                        call()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=6))
                if args.trace:
                    os.makedirs(args.trace, exist_ok=True)
                    prof.export_chrome_trace(os.path.join(args.trace, f"kda_{name}.json"))
            except Exception as exc:  # noqa: BLE001 - report and go on to the next
                print(f"\n== {name}: failed: {type(exc).__name__}: {exc}")
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
