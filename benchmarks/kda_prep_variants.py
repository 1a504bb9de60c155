"""KDA chunked forward: kernel 1's two variants ("pairs", "strips") through the op a compiled loop runs.

Usage (a CUDA GPU; each variant in its own process, since the launch-config choice is cached per process)::

    python benchmarks/kda_prep_variants.py --dims 64 128 > "$OUT/kda_prep_variants.txt"

For each K = V in ``--dims`` and each variant: ``torch.ops.fuser.kda`` on FLA's ``[B, T, H, K]``
layout (B=1, T=4096, H=16; ``benchmarks/kda_plan_sweep.inputs``: bf16 q/k/v/beta, float32 gate, q, k
l2-normalised, g = -softplus(randn), beta = sigmoid(randn)); the plan ``plan=chunk;chunk=64``, float32 dots), forward under no_grad and
forward + backward (``torch.autograd.backward`` of o and the final state). Printed per row:
``wall us``: ``triton.testing.do_bench`` (median; host time included where the host is slower
than the GPU), and the device time per call with its kernels (``torch.profiler``, CUDA activity,
5 calls). The variant is forced by making the table row's first candidate that variant's
(``codegen/kda_chunk._TABLE``, key (sm90, K bucket, 4)); other GPUs: the ``cuda`` rows.
"""
from __future__ import annotations

import argparse
import subprocess
import sys


def child(prep: str, kd: int) -> None:
    import torch
    from triton.testing import do_bench

    from fuser.codegen import kda_chunk, launch
    from common import kernel_times_us
    from kda_plan_sweep import inputs
    from fuser.patterns import kda_ops  # noqa: F401  (registers torch.ops.fuser.kda)

    dev = torch.device("cuda")
    key = (launch.device_kind(dev), 64 if kd <= 64 else 128 if kd <= 128 else 256, 4)
    rows = kda_chunk._TABLE[key]
    chosen = [c for c in rows if c["prep"] == prep]
    kda_chunk._TABLE[key] = [chosen[0] if chosen else dict(rows[0], prep=prep)]
    torch.manual_seed(0)
    t, h = 4096, 16
    # [T, H, *] from the sweep's generator, as [1, T, H, *] (FLA's layout, B = 1)
    q, k, v, g, beta = (x.unsqueeze(0).requires_grad_() for x in inputs(t, h, kd, kd))
    do = torch.randn_like(v)

    def op():
        return torch.ops.fuser.kda(q, k, v, g, beta, None, [1, 1, 1, 1, 1], 0, t, kd ** -0.5, False, 1, v.dtype,
                                   True, torch.float32, "plan=chunk;chunk=64")

    def fwd():
        with torch.no_grad():
            return op()

    def fwdbwd():
        o, s = op()
        torch.autograd.backward((o, s), (do, torch.zeros_like(s)))

    for mode, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        f()
        torch.cuda.synchronize()
        wall = do_bench(f, warmup=25, rep=100) * 1e3
        per = kernel_times_us(f)
        top = ", ".join(f"{name[:40]} {us:.0f}" for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:6])
        print(f"| {kd} | {prep} | {mode} | {wall:.1f} | {sum(per.values()):.1f} | {top} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--child", nargs=2, metavar=("PREP", "K"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child[0], int(a.child[1]))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("kda_prep_variants: needs a CUDA GPU (the variants differ in compiled performance only; "
              "tests/codegen/test_kda_chunk.py checks both in the interpreter)", file=sys.stderr)
        return 2
    from fuser.codegen import kda_chunk

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| K | prep | mode | wall us | device us | kernels (us) |\n|---|---|---|---:|---:|---|", flush=True)
    rc = 0
    for kd in a.dims:
        for prep in kda_chunk.PREP_VARIANTS:
            rc |= subprocess.call([sys.executable, __file__, "--child", prep, str(kd)])
    return rc


if __name__ == "__main__":
    sys.exit(main())
