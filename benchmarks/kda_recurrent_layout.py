"""KDA recurrent kernel: does holding the state tile transposed pay? A layout experiment.

    python benchmarks/kda_recurrent_layout.py [--shapes 2,8,256,8192 32,64,128,128 ...] [--out FILE.md]
    TRITON_INTERPRET=1 python benchmarks/kda_recurrent_layout.py --smoke    # CPU: the kernels checked, untimed

``codegen/templates/kda_recurrent.py.jinja`` (registers variant) keeps each program's state as a
``[BLOCK_K, BLOCK_V]`` tile, so Triton spreads the keys over warps and the two reductions over the
keys that every token needs (``v̂ = Sᵀ k``, ``o = Sᵀ q``) cross warps through shared memory. Held
transposed, ``[BLOCK_V, BLOCK_K]``, the keys run along a warp's lanes and, at one warp, each
reduction is a few shuffles. This script times the two layouts as two small kernels written alike
(the template's hand pipelining, contiguous ``[N, T, *]`` inputs, no initial state, the final
state stored), every (BLOCK_V, num_warps) in the grid, against the template's kernel at the config
fuser picks (``codegen/kda_recurrent.forward``), each output checked against it. Device µs by
``triton.testing.do_bench_cudagraph`` (median). A development aid: the layout is not in fuser
until a config key carries it and ``REGISTERS_MODEL`` has measured rows for it.
"""
import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fuser.codegen import kda_recurrent  # noqa: E402


@triton.jit(do_not_specialize=["T"])
def kda_layout(Q, K, V, G, Beta, O, HT, T, scale,
               K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
               VK: tl.constexpr):
    """One program: BLOCK_V value columns of row n, the state tile [BLOCK_V, BLOCK_K] (VK) or
    [BLOCK_K, BLOCK_V]; q, k, g [N, T, K_DIM], v, o [N, T, V_DIM], beta [N, T] contiguous; HT
    [N, K_DIM, V_DIM] float32. The two layouts differ only where VK is tested."""
    pid_v = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    v_ok = offs_v < V_DIM
    k_ok = offs_k < K_DIM
    if VK:
        s = tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32)
    else:
        s = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    Qn = Q + n * T * K_DIM
    Kn = K + n * T * K_DIM
    Gn = G + n * T * K_DIM
    Vn = V + n * T * V_DIM
    On = O + n * T * V_DIM
    Bn = Beta + n * T
    zero_v = offs_v * 0
    # token t + 1's vectors are loaded while token t is computed, as in the template
    k = tl.load(Kn + offs_k, mask=k_ok & (offs_k * 0 < T), other=0.0)
    g = tl.load(Gn + offs_k, mask=k_ok & (offs_k * 0 < T), other=0.0)
    q = tl.load(Qn + offs_k, mask=k_ok & (offs_k * 0 < T), other=0.0)
    v = tl.load(Vn + offs_v, mask=v_ok & (zero_v < T), other=0.0)
    b = tl.load(Bn + zero_v, mask=v_ok & (zero_v < T), other=0.0)
    for t in range(0, T):
        kgo = k_ok & (offs_k * 0 + (t + 1) < T)
        vgo = v_ok & (zero_v + (t + 1) < T)
        k_n = tl.load(Kn + (t + 1) * K_DIM + offs_k, mask=kgo, other=0.0)
        g_n = tl.load(Gn + (t + 1) * K_DIM + offs_k, mask=kgo, other=0.0)
        q_n = tl.load(Qn + (t + 1) * K_DIM + offs_k, mask=kgo, other=0.0)
        v_n = tl.load(Vn + (t + 1) * V_DIM + offs_v, mask=vgo, other=0.0)
        b_n = tl.load(Bn + (t + 1) + zero_v, mask=vgo, other=0.0)
        kf = k.to(tl.float32)
        if VK:
            s = s * tl.exp(g.to(tl.float32))[None, :]
            v_hat = tl.sum(s * kf[None, :], axis=1)
            s = s + (b.to(tl.float32) * (v.to(tl.float32) - v_hat))[:, None] * kf[None, :]
            o = tl.sum(s * (q.to(tl.float32) * scale)[None, :], axis=1)
        else:
            s = s * tl.exp(g.to(tl.float32))[:, None]
            v_hat = tl.sum(s * kf[:, None], axis=0)
            s = s + kf[:, None] * (b.to(tl.float32) * (v.to(tl.float32) - v_hat))[None, :]
            o = tl.sum(s * (q.to(tl.float32) * scale)[:, None], axis=0)
        tl.store(On + t * V_DIM + offs_v, o.to(O.dtype.element_ty), mask=v_ok)
        k, g, q, v, b = k_n, g_n, q_n, v_n, b_n
    Hn = HT + n * (K_DIM * V_DIM) + offs_k[:, None] * V_DIM + offs_v[None, :]
    if VK:
        tl.store(Hn, tl.trans(s), mask=k_ok[:, None] & v_ok[None, :])
    else:
        tl.store(Hn, s, mask=k_ok[:, None] & v_ok[None, :])


def run(q, k, v, g, beta, scale, bv, warps, layout):
    """One launch of the ``layout`` kernel (``"kv"`` or ``"vk"``) on ``[N, T, *]`` contiguous inputs:
    ``(o [N, T, V] in v's dtype, final state [N, K, V] float32)``."""
    n, t, kd = q.shape
    vd = v.shape[-1]
    o = torch.empty_like(v)
    ht = torch.empty(n, kd, vd, device=q.device, dtype=torch.float32)
    if layout not in ("kv", "vk"):
        raise ValueError(f"layout must be 'kv' or 'vk', got {layout!r}")
    kda_layout[(triton.cdiv(vd, bv), n)](q, k, v, g, beta, o, ht, t, scale, K_DIM=kd, V_DIM=vd,
                                         BLOCK_K=triton.next_power_of_2(kd), BLOCK_V=bv, VK=layout == "vk",
                                         num_warps=warps)
    return o, ht


def smoke() -> None:
    """Both layouts equal the template's kernel (CPU tensors, Triton's interpreter), K and V not
    powers of two, two value blocks."""
    torch.manual_seed(0)
    n, t, kd, vd = 2, 5, 12, 20
    q, k = (F.normalize(torch.randn(n, t, kd), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(n, t, vd), -F.softplus(torch.randn(n, t, kd)), torch.rand(n, t)
    ref_o, ref_s = kda_recurrent.forward(q, k, v, g, beta, scale=kd ** -0.5, output_final_state=True)
    for layout in ("kv", "vk"):
        o, s = run(q, k, v, g, beta, kd ** -0.5, 16, 1, layout)
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)
    print("smoke: kv and vk equal the template's kernel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2,8,256,8192", "2,8,512,16384", "2,64,256,8192", "32,64,128,128"],
                    help="N,T,K,V (N = batch x heads)")
    ap.add_argument("--block-v", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--smoke", action="store_true",
                    help="check both layouts against the template's kernel at a ragged tiny shape on the CPU "
                         "(run with TRITON_INTERPRET=1); nothing timed")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kda_recurrent_layout.py needs a CUDA GPU (--smoke checks its kernels on the CPU)")
    torch.manual_seed(0)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16 q/k/v/beta, "
             "g float32; device µs (do_bench_cudagraph median)", "",
             "| N | T | K | V | template (fuser's config) | best kv | best vk | vk / kv |", "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, t, kd, vd = (int(x) for x in shape.split(","))
        q, k = (F.normalize(torch.randn(n, t, kd, device="cuda"), dim=-1).bfloat16() for _ in range(2))
        v = torch.randn(n, t, vd, device="cuda").bfloat16()
        g = -F.softplus(torch.randn(n, t, kd, device="cuda"))
        beta = torch.rand(n, t, device="cuda").bfloat16()
        scale = kd ** -0.5
        ref_o, ref_s = kda_recurrent.forward(q, k, v, g, beta, scale=scale, output_final_state=True)
        cfg = kda_recurrent.choose_config(k_dim=kd, v_dim=vd, dtype=q.dtype, device=q.device, n_rows=n)
        base = triton.testing.do_bench_cudagraph(
            lambda: kda_recurrent.forward(q, k, v, g, beta, scale=scale, output_final_state=True), rep=30) * 1e3
        best: dict = {}
        for bv, warps, layout in itertools.product(args.block_v, args.warps, ("kv", "vk")):
            per_thread = bv * triton.next_power_of_2(kd) // (32 * warps)
            if not 4 <= per_thread <= 128:  # past 128 state elements a thread the tile spills
                continue
            o, s = run(q, k, v, g, beta, scale, bv, warps, layout)
            eo = ((o.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            es = ((s - ref_s).norm() / ref_s.norm()).item()
            us = triton.testing.do_bench_cudagraph(lambda: run(q, k, v, g, beta, scale, bv, warps, layout), rep=30) * 1e3
            ok = eo < 1e-2 and es < 1e-4
            print(f"N={n} T={t} K={kd} V={vd} {layout} {bv}/{warps}: {us:.1f} µs{'' if ok else ' WRONG'}", flush=True)
            if ok and (layout not in best or us < best[layout][0]):
                best[layout] = (us, bv, warps)
        kv, vk = best.get("kv"), best.get("vk")
        cell = lambda b: f"{b[0]:.1f} ({b[1]}/{b[2]})" if b else "—"  # noqa: E731
        ratio = f"{kv[0] / vk[0]:.2f}x" if kv and vk else "—"
        lines.append(f"| {n} | {t} | {kd} | {vd} | {base:.1f} ({cfg['BLOCK_V']}/{cfg['num_warps']}) | {cell(kv)} | "
                     f"{cell(vk)} | {ratio} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
