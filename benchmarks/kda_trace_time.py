"""How long Dynamo itself takes to capture the unrolled KDA loop (issue 10, part A).

Users write Kimi Delta Attention as a Python loop over tokens; ``torch.compile`` unrolls it into T
copies of one step before any backend (fuser's pass or Inductor) sees the graph. This script times
that capture alone: the first call of ``torch.compile(fn, backend=<a backend that returns the graph
unchanged>)`` minus an eager call, for two spellings (the kernel blogs' loop and FLA's
``naive_recurrent_kda``-style loop, written here from its math) at several T, and counts the graph's
nodes. No GPU needed: capture is host work (shapes are small so the eager part is negligible).

    python benchmarks/kda_trace_time.py                 # T = 64, 256, 1024
    python benchmarks/kda_trace_time.py --t 64 128 --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def blog_loop(q, k, v, g, beta):
    """The kernel blogs' spelling: [B, H, T, K] inputs, einsum read-out, o written by index."""
    b, h, t_len, kd = q.shape
    s = q.new_zeros(b, h, kd, v.shape[-1], dtype=torch.float32)
    o = torch.empty_like(v)
    for t in range(t_len):
        s = s * g[:, :, t][..., None].exp()
        v_hat = (k[:, :, t][..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, :, t][..., None] * k[:, :, t], v[:, :, t] - v_hat)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t] * kd ** -0.5, s)
    return o, s


def fla_loop(q, k, v, g, beta):
    """FLA's naive reference spelling: [B, T, H, K] inputs, fp32 upcast, q/k repeated to the value
    heads, o preallocated with zeros and written by index."""
    dtype = v.dtype
    group = v.shape[2] // q.shape[2]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q.repeat_interleave(group, dim=2) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(group, dim=2)
    s = q.new_zeros(q.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(q.shape[1]):
        q_i, k_i, v_i, g_i, b_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        s = s * g_i[..., None].exp()
        s = s + torch.einsum("bhk,bhv->bhkv", b_i[..., None] * k_i, v_i - (k_i[..., None] * s).sum(-2))
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q_i, s)
    return o.to(dtype), s


def inputs(spelling: str, t_len: int, b=1, h=2, kd=16, vd=16):
    gen = torch.Generator().manual_seed(t_len)
    if spelling == "blog":
        shape_k, shape_v, shape_b = (b, h, t_len, kd), (b, h, t_len, vd), (b, h, t_len)
    else:
        shape_k, shape_v, shape_b = (b, t_len, h, kd), (b, t_len, h, vd), (b, t_len, h)
    q = torch.randn(shape_k, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(shape_k, generator=gen), dim=-1)
    v = torch.randn(shape_v, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(shape_k, generator=gen))
    beta = torch.rand(shape_b, generator=gen)
    return q, k, v, g, beta


def capture(fn, args) -> dict:
    """First-call time of ``fn`` under a pass-through backend, minus one eager call; graph size."""
    nodes = []

    def passthrough(gm, example_inputs):
        nodes.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    t0 = time.perf_counter()
    fn(*args)
    eager_s = time.perf_counter() - t0
    compiled = torch.compile(fn, backend=passthrough, fullgraph=True)
    t0 = time.perf_counter()
    compiled(*args)
    first_s = time.perf_counter() - t0
    torch._dynamo.reset()
    return {"capture_s": first_s - eager_s, "eager_s": eager_s, "graphs": len(nodes), "nodes": sum(nodes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, nargs="+", default=[64, 256, 1024], help="sequence lengths")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kda_trace_time.md"))
    args = ap.parse_args(argv)
    common.raise_recompile_limit()
    meta = common.env_header("cpu")
    rows, data = [], []
    for spelling, fn in (("blog", blog_loop), ("fla_naive", fla_loop)):
        for t_len in args.t:
            r = capture(fn, inputs(spelling, t_len))
            r.update(spelling=spelling, T=t_len)
            data.append(r)
            rows.append([spelling, t_len, r["graphs"], r["nodes"], f"{r['capture_s']:.2f}",
                         f"{1e3 * r['capture_s'] / t_len:.1f}"])
            print(rows[-1], flush=True)
    md = common.header_md("Dynamo capture time of the unrolled KDA loop", meta)
    md += ("\nFirst call under `torch.compile(fullgraph=True)` with a backend that returns the captured graph "
           "unchanged, minus one eager call: Dynamo's tracing alone (no fuser pass, no Inductor). "
           "B=1, H=2, K=V=16, float32, CPU.\n\n")
    md += common.md_table(["spelling", "T", "graphs", "graph nodes", "capture s", "ms per token"], rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(md + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": data}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
