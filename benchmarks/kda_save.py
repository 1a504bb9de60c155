"""KDA forward + backward with the forward's workspaces kept for the backward, against recomputing them.

``torch.ops.fuser.kda`` (plan ``save=inputs``: the backward recomputes G, A_kk, A_qk, M, W, U, Kd
from q, k, v, g, beta) against ``torch.ops.fuser.kda_save`` (``save=workspaces``: the backward reads
the chunked forward's workspaces; ``fuser.plan`` ``kda.save=workspaces``) on FLA's ``[B, T, H, K]``
layout at B=1, T=4096, H=16, K = V in ``--dims``, bf16 inputs, for both dots dtypes. Per row:
``do_bench`` wall time of forward + backward (autograd through the op), the device time of its
kernels (profiler, 5 calls), the peak memory above the inputs during one forward + backward, and
the largest relative difference of the gradients from the ``save=inputs`` path.

    python benchmarks/kda_save.py --dims 64 128 256 --out benchmarks/results/kda_save.md
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def rows(kd: int, dots: str):
    import torch
    from triton.testing import do_bench

    from common import extra_mib, kernel_times_us
    from fuser.patterns import kda_ops  # noqa: F401  (registers the ops)
    from kda_plan_sweep import inputs

    torch.manual_seed(0)
    t, h = 4096, 16
    q, k, v, g, beta = (x.unsqueeze(0).requires_grad_() for x in inputs(t, h, kd, kd))
    do = torch.randn_like(v)
    base = f"plan=chunk;chunk=64;dots={dots}"

    def step(save):
        args = (q, k, v, g, beta, None, [1, 1, 1, 1, 1], 0, t, kd ** -0.5, False, 1, v.dtype, True, torch.float32)
        if save == "workspaces":
            o, s, *_ = torch.ops.fuser.kda_save(*args, base + ";save=workspaces")
        else:
            o, s = torch.ops.fuser.kda(*args, base)
        return torch.autograd.grad((o, s), (q, k, v, g, beta), (do, torch.zeros_like(s)))

    ref = step("inputs")
    for save in ("inputs", "workspaces"):
        got = step(save)
        diff = max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got, ref))
        del got
        peak = extra_mib(lambda: step(save), "cuda")
        wall = do_bench(lambda: step(save), warmup=25, rep=100) * 1e3
        per = kernel_times_us(lambda: step(save))
        top = ", ".join(f"{name[:24]} {us:.0f}" for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:7])
        yield (f"| {kd} | {dots} | {save} | {wall:.0f} | {sum(per.values()):.0f} | {peak:.0f} | {diff:.1e} | "
               f"{top} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dots", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("kda_save: needs a CUDA GPU (it measures compiled kernels; tests/codegen/test_kda_bwd.py checks the "
              "backward on saved workspaces in the interpreter)", file=sys.stderr)
        return 2
    import triton

    head = [f"# KDA forward + backward: workspaces kept vs recomputed ({datetime.date.today()})", "",
            f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}, Triton {triton.__version__}, "
            f"Python {platform.python_version()}",
            f"- command: `python benchmarks/kda_save.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
            "- B=1, T=4096, H=16, K=V, bf16 q/k/v/beta, fp32 g, chunk 64; fwd+bwd through autograd on the op; "
            "wall = do_bench median, device = sum of kernel times (profiler), peak = max allocated above the "
            "inputs in one step (MiB), diff = max relative difference of the five gradients from save=inputs", "",
            "| K=V | dots | save | wall µs | device µs | peak MiB | diff | kernels (device µs) |",
            "|---:|---|---|---:|---:|---:|---:|---|"]
    lines = list(head)
    print("\n".join(head), flush=True)
    for kd in a.dims:
        for dots in a.dots:
            for line in rows(kd, dots):
                print(line, flush=True)
                lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
