"""Profile one attention configuration compiled with fuser: where the time goes, host and GPU.

    python benchmarks/profile_attention.py --n 1024 --d 128 --causal 1 [--plan attention.impl=fuser]

Prints do_bench medians (fuser, SDPA), then torch.profiler's top operations by CPU and by CUDA
time over 20 calls, and the path of Inductor's generated wrapper for the compiled graph.
Meant for short device runs when a benchmark row looks wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402,F401


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--plan", default="attention.impl=fuser")
    ap.add_argument("--dynamic", type=int, default=1)
    args = ap.parse_args()
    import triton.testing

    scale = args.d ** -0.5

    def attn(q, k, v):
        s = q @ k.transpose(-2, -1) * scale
        if args.causal:
            n_q, n_k = s.shape[-2], s.shape[-1]
            s = s.masked_fill(torch.triu(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device), 1), float("-inf"))
        return torch.softmax(s.float(), -1).to(q.dtype) @ v

    q, k, v = (torch.randn(args.b, args.h, args.n, args.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.dynamic:
        for x in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(x, 2)
    f = torch.compile(attn, backend="fuser", options={"fuser.plan": args.plan} if args.plan else None)
    with torch.no_grad():
        f(q, k, v)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(args.causal), scale=scale)  # noqa: E731
        print(f"fuser ({args.plan or 'planner'}): {triton.testing.do_bench(lambda: f(q, k, v), return_mode='median'):.4f} ms")
        print(f"sdpa: {triton.testing.do_bench(sdpa, return_mode='median'):.4f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f(q, k, v)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
