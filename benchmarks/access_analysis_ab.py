"""First call with and without fuser's memo of Inductor's access analysis (issue 11).

Usage (on a GPU; one process per measurement, cold caches each)::

    for m in on off on off; do python benchmarks/access_analysis_ab.py --memo $m; done

Four attention layers (B=2, N=4096, 16 heads of 128, bf16; projections by matmul, the softmax
attention written out, a residual), forward + backward of the sum, compiled with
``backend="fuser"`` and ``attention.impl=fuser`` (fuser's kernels, launched by Inductor) with fresh
``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` and ``FUSER_CACHE_DIR``. Prints the first call's
host time (to a synchronize after it), how many times torch's own analysis ran and its seconds,
and ``launch.access_analysis_stats()``. ``--memo off`` sends every ask to torch's analysis (what
happens without ``launch._memoize_access_analysis``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memo", choices=("on", "off"), default="on")
    a = p.parse_args()
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FUSER_CACHE_DIR"):
        os.environ[var] = tempfile.mkdtemp(prefix="fuser-ab-")
    import torch
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    import fuser  # noqa: F401  (the backend)
    from fuser.codegen import launch

    if a.memo == "off":
        launch._access_key = lambda *args: None
    launch._memoize_access_analysis()
    wrapped = getattr(tkw, launch.access_analysis_stats()["wrapped"][0])
    spent = {"runs": 0, "s": 0.0}

    def timed(*args, _torch=wrapped.__wrapped__):
        t0 = time.perf_counter()
        try:
            return _torch(*args)
        finally:
            spent["runs"] += 1
            spent["s"] += time.perf_counter() - t0

    wrapped.__defaults__ = (timed,)  # the memo's call of torch's analysis, timed

    def layer(x, w):
        q, k, v = [(x @ w[i]).view(2, 4096, 16, 128).transpose(1, 2) for i in range(3)]
        o = torch.softmax(q @ k.mT * 128 ** -0.5, -1) @ v
        return x + o.transpose(1, 2).reshape(2, 4096, 2048)

    def model(x, ws):
        for w in ws:
            x = layer(x, w)
        return x

    x = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(3, 2048, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    f = torch.compile(model, backend="fuser", options={"fuser.plan": "attention.impl=fuser"})
    t0 = time.perf_counter()
    f(x, ws).sum().backward()
    torch.cuda.synchronize()
    print(f"memo {a.memo}: first call {time.perf_counter() - t0:.2f} s; torch's analysis ran {spent['runs']} times, "
          f"{spent['s']:.2f} s; {launch.access_analysis_stats()}", flush=True)


if __name__ == "__main__":
    main()
