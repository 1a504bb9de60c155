"""Two experiments on the registers recurrent kernel's sums over the keys (not kept; results in
``benchmarks/results/kda_recurrent_reductions.md``), and where its time goes at the kernel-blog shape.

The committed kernel (``codegen/templates/kda_recurrent.py.jinja``, layout ``vk`` at one warp) holds
its state tile ``[BLOCK_V, K_pad]`` with the keys along the warp's 32 lanes: each token's two sums over
the keys (``v̂ = Sᵀk`` and ``o = Sᵀq``) are in-thread reduction trees plus five shuffle levels per value
row (160 shuffles a warp per token at BLOCK_V 16). Tried here, each with its own copy of the kernel:

- ``split4``: the tile as ``[KO, RV, LV, KI]`` (key ``ko·KI + ki``, value ``rv·LV + lv``): the key
  vectors are loaded ``[KO, 1, LV, KI]`` through a stride-0 axis, so Triton's coalesced layout puts
  lanes over values as well as keys and the tile follows it (checked in the TTGIR): 24 shuffles a
  token instead of 160, at the price of each lane loading and exponentiating its keys' vectors
  (replicated over the value lanes);
- ``chain``: the tile as ``K_pad / 32`` separate ``[BLOCK_V, 32]`` tiles (source generated per K_pad,
  unrolled), so the sums over the keys are chains of multiply-adds across the tiles (one op per
  element) and one 32-lane reduction per row, instead of Triton's in-thread trees (720 floating-point
  instructions a thread per token instead of 816 in the PTX);
- a decomposition of the committed kernel's time at N=2, K=256, V=8192: T = 1 … 32, with and
  without the final state.

Usage (GPU; ``cpu`` checks both kernels against ``codegen/kda_recurrent.forward`` in Triton's
interpreter)::

    python benchmarks/kda_recurrent_reductions.py OUT.json
    TRITON_INTERPRET=1 python benchmarks/kda_recurrent_reductions.py cpu
"""
import importlib.util
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fuser.codegen import kda_recurrent  # noqa: E402


@triton.jit(do_not_specialize=["T"])
def kda_split4(Q, K, V, G, Beta, O, HT, T, scale,
               K_DIM: tl.constexpr, V_DIM: tl.constexpr, KO: tl.constexpr, KI: tl.constexpr,
               RV: tl.constexpr, LV: tl.constexpr, STORE: tl.constexpr):
    """State tile [KO, RV, LV, KI]: key ko * KI + ki, value column rv * LV + lv of the block. The key
    vectors are loaded [KO, 1, LV, KI] (a stride-0 axis over LV), so their coalesced layout puts lanes
    over LV and the tile follows it: each lane holds KI contiguous keys, lanes split over keys and values."""
    BLOCK_V: tl.constexpr = RV * LV
    pid_v = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_v2 = pid_v * BLOCK_V + tl.arange(0, RV)[:, None] * LV + tl.arange(0, LV)[None, :]   # [RV, LV]
    v_ok2 = offs_v2 < V_DIM
    offs_k4 = (tl.arange(0, KO)[:, None, None, None] * KI + tl.arange(0, KI)[None, None, None, :]
               + (tl.arange(0, LV) * 0)[None, None, :, None])                                  # [KO, 1, LV, KI]
    k_ok4 = offs_k4 < K_DIM
    s = tl.zeros([KO, RV, LV, KI], dtype=tl.float32)
    Qn = Q + n * T * K_DIM
    Kn = K + n * T * K_DIM
    Gn = G + n * T * K_DIM
    Vn = V + n * T * V_DIM
    On = O + n * T * V_DIM
    Bn = Beta + n * T
    zv = offs_v2 * 0
    zk = offs_k4 * 0
    k = tl.load(Kn + offs_k4, mask=k_ok4 & (zk < T), other=0.0)
    g = tl.load(Gn + offs_k4, mask=k_ok4 & (zk < T), other=0.0)
    q = tl.load(Qn + offs_k4, mask=k_ok4 & (zk < T), other=0.0)
    v = tl.load(Vn + offs_v2, mask=v_ok2 & (zv < T), other=0.0)
    b = tl.load(Bn + zv, mask=v_ok2 & (zv < T), other=0.0)
    for t in range(0, T):
        kgo = k_ok4 & (zk + (t + 1) < T)
        vgo = v_ok2 & (zv + (t + 1) < T)
        k_n = tl.load(Kn + (t + 1) * K_DIM + offs_k4, mask=kgo, other=0.0)
        g_n = tl.load(Gn + (t + 1) * K_DIM + offs_k4, mask=kgo, other=0.0)
        q_n = tl.load(Qn + (t + 1) * K_DIM + offs_k4, mask=kgo, other=0.0)
        v_n = tl.load(Vn + (t + 1) * V_DIM + offs_v2, mask=vgo, other=0.0)
        b_n = tl.load(Bn + (t + 1) + zv, mask=vgo, other=0.0)
        kf = k.to(tl.float32)
        s = s * tl.exp(g.to(tl.float32))
        v_hat = tl.sum(tl.sum(s * kf, axis=0), axis=2)  # [RV, LV]
        u = b.to(tl.float32) * (v.to(tl.float32) - v_hat)
        s = s + kf * u[None, :, :, None]
        o = tl.sum(tl.sum(s * (q.to(tl.float32) * scale), axis=0), axis=2)
        tl.store(On + t * V_DIM + offs_v2, o.to(O.dtype.element_ty), mask=v_ok2)
        k, g, q, v, b = k_n, g_n, q_n, v_n, b_n
    if STORE:
        Hn = HT + n * (K_DIM * V_DIM)
        tl.store(Hn + offs_k4 * V_DIM + offs_v2[None, :, :, None], s, mask=k_ok4 & v_ok2[None, :, :, None])


def run_split4(q, k, v, g, beta, scale, bv, ki, lv, warps=1, store=True, o=None, ht=None):
    n, t, kd = q.shape
    vd = v.shape[-1]
    o = torch.empty_like(v) if o is None else o
    ht = torch.empty(n, kd, vd, device=q.device, dtype=torch.float32) if ht is None else ht
    kp = triton.next_power_of_2(kd)
    kda_split4[(triton.cdiv(vd, bv), n)](q, k, v, g, beta, o, ht, t, scale, K_DIM=kd, V_DIM=vd, KO=kp // ki, KI=ki,
                                         RV=bv // lv, LV=lv, STORE=store, num_warps=warps)
    return o, ht


SRC = '''
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def kda_chain(Q, K, V, G, Beta, O, HT, T, scale,
              K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr, STORE: tl.constexpr):
    pid_v = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < V_DIM
    lane = tl.arange(0, 32)
    Qn = Q + n * T * K_DIM
    Kn = K + n * T * K_DIM
    Gn = G + n * T * K_DIM
    Vn = V + n * T * V_DIM
    On = O + n * T * V_DIM
    Bn = Beta + n * T
    zero_v = offs_v * 0
{init}
    Kt = Kn
    Gt = Gn
    Qt = Qn
    go = lane * 0 < T
    go_v = zero_v < T
{loads}
    v = tl.load(Vn + offs_v, mask=v_ok & go_v, other=0.0)
    b = tl.load(Bn + zero_v, mask=v_ok & go_v, other=0.0)
    for t in range(0, T):
        # token t + 1's vectors loaded while token t is computed
        Kt = Kn + (t + 1) * K_DIM
        Gt = Gn + (t + 1) * K_DIM
        Qt = Qn + (t + 1) * K_DIM
        go = lane * 0 + (t + 1) < T
        go_v = zero_v + (t + 1) < T
{loads_next}
        v_n = tl.load(Vn + (t + 1) * V_DIM + offs_v, mask=v_ok & go_v, other=0.0)
        b_n = tl.load(Bn + (t + 1) + zero_v, mask=v_ok & go_v, other=0.0)
        bf = b.to(tl.float32)
        vf = v.to(tl.float32)
{body}
        tl.store(On + t * V_DIM + offs_v, o.to(O.dtype.element_ty), mask=v_ok)
{rotate}
    if STORE:
        Hn = HT + n * (K_DIM * V_DIM)
{store}
'''


def source(k_pad: int) -> str:
    kt = k_pad // 32
    init = "\n".join(f"    s{j} = tl.zeros([BLOCK_V, 32], dtype=tl.float32)\n    ok{j} = {j * 32} + lane < K_DIM"
                     for j in range(kt))
    def loads(ind, suffix):
        out = []
        for j in range(kt):
            for x, ptr in (("kr", "Kt"), ("gr", "Gt"), ("qr", "Qt")):
                out.append(f"{ind}{x}{j}{suffix} = tl.load({ptr} + {j * 32} + lane, mask=ok{j} & go, other=0.0)")
        return "\n".join(out)
    rotate = "\n".join(f"        {x}{j} = {x}{j}_n" for j in range(kt) for x in ("kr", "gr", "qr")) + "\n        v = v_n\n        b = b_n"
    body = []
    for j in range(kt):
        body.append(f"        k{j} = kr{j}.to(tl.float32)")
        body.append(f"        d{j} = tl.exp(gr{j}.to(tl.float32))")
        body.append(f"        q{j} = qr{j}.to(tl.float32) * scale")
    for j in range(kt):
        body.append(f"        s{j} = s{j} * d{j}[None, :]")
    body.append("        acc = s0 * k0[None, :]")
    for j in range(1, kt):
        body.append(f"        acc += s{j} * k{j}[None, :]")
    body.append("        v_hat = tl.sum(acc, axis=1)")
    body.append("        u = bf * (vf - v_hat)")
    for j in range(kt):
        body.append(f"        s{j} += k{j}[None, :] * u[:, None]")
    body.append("        acc = s0 * q0[None, :]")
    for j in range(1, kt):
        body.append(f"        acc += s{j} * q{j}[None, :]")
    body.append("        o = tl.sum(acc, axis=1)")
    store = "\n".join(f"        tl.store(Hn + ({j * 32} + lane)[None, :] * V_DIM + offs_v[:, None], s{j}, "
                      f"mask=ok{j}[None, :] & v_ok[:, None])" for j in range(kt))
    return SRC.format(init=init, body="\n".join(body), store=store, loads=loads("    ", ""),
                      loads_next=loads("        ", "_n"), rotate=rotate)


_MODS = {}


def kernel(k_pad: int):
    if k_pad not in _MODS:
        d = os.path.join(tempfile.gettempdir(), "exp_chain")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"kda_chain_{k_pad}.py")
        open(path, "w").write(source(k_pad))
        spec = importlib.util.spec_from_file_location(f"kda_chain_{k_pad}", path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        _MODS[k_pad] = m.kda_chain
    return _MODS[k_pad]


def run_chain(q, k, v, g, beta, scale, bv, warps=1, store=True, o=None, ht=None):
    import torch
    n, t, kd = q.shape
    vd = v.shape[-1]
    o = torch.empty_like(v) if o is None else o
    ht = torch.empty(n, kd, vd, device=q.device, dtype=torch.float32) if ht is None else ht
    kp = max(32, triton.next_power_of_2(kd))
    kernel(kp)[(triton.cdiv(vd, bv), n)](q, k, v, g, beta, o, ht, t, scale, K_DIM=kd, V_DIM=vd, BLOCK_V=bv,
                                         STORE=store, num_warps=warps)
    return o, ht


def inputs(n, t, kd, vd, device):
    q = F.normalize(torch.randn(n, t, kd, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(n, t, kd, device=device), dim=-1).bfloat16()
    v = torch.randn(n, t, vd, device=device).bfloat16()
    g = -F.softplus(torch.randn(n, t, kd, device=device))
    beta = torch.rand(n, t, device=device).bfloat16()
    return q, k, v, g, beta


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_cpu():
    for (n, t, kd, vd, bv) in [(2, 5, 48, 40, 16), (1, 3, 64, 24, 8), (3, 4, 100, 33, 32)]:
        q, k, v, g, beta = inputs(n, t, kd, vd, "cpu")
        q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
        ro, rs = kda_recurrent.forward(q, k, v, g, beta, scale=kd ** -0.5, output_final_state=True)
        for name, run in (("split4", lambda: run_split4(q, k, v, g, beta, kd ** -0.5, bv, 2, 4)),
                          ("chain", lambda: run_chain(q, k, v, g, beta, kd ** -0.5, bv))):
            o, s = run()
            print(name, (n, t, kd, vd, bv), f"o {rel(o, ro):.1e} state {rel(s, rs):.1e}")


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def main_gpu(out):
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    rows = []
    shapes = [(2, 8, 256, 8192), (2, 64, 256, 8192), (2, 8, 512, 16384), (16, 8, 128, 1024)]
    for n, t, kd, vd in shapes:
        q, k, v, g, beta = inputs(n, t, kd, vd, "cuda")
        scale = kd ** -0.5
        ro, rs = kda_recurrent.forward(q, k, v, g, beta, scale=scale, output_final_state=True)
        cfg = kda_recurrent.choose_config(k_dim=kd, v_dim=vd, dtype=q.dtype, device=q.device, n_rows=n)
        base = bench(lambda: kda_recurrent.forward(q, k, v, g, beta, scale=scale, output_final_state=True))
        name = f"{cfg['STATE_LAYOUT']} {cfg['BLOCK_V']}/{cfg['num_warps']}"
        print(f"\nN={n} T={t} K={kd} V={vd}: fuser {name} {base:.1f} us", flush=True)
        rows.append(dict(n=n, t=t, k=kd, v=vd, impl="fuser", cfg=name, us=base))
        kp = triton.next_power_of_2(kd)
        for bv, ki, lv in ((8, 2, 4), (8, 4, 4), (8, 4, 2), (16, 2, 4), (16, 4, 4), (16, 2, 8), (32, 2, 8), (32, 4, 8)):
            per = bv * kp // 32
            if per > 128 or (32 // lv) > kp // ki * ki:
                continue
            try:
                o, s = run_split4(q, k, v, g, beta, scale, bv, ki, lv)
                eo, es = rel(o, ro), rel(s, rs)
                us = bench(lambda: run_split4(q, k, v, g, beta, scale, bv, ki, lv))
            except Exception as exc:
                print(f"  split4 bv{bv} ki{ki} lv{lv}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                continue
            flag = "" if eo < 1e-2 and es < 1e-4 else f" WRONG o {eo:.1e} s {es:.1e}"
            print(f"  split4 bv{bv:3d} ki{ki} lv{lv}: {us:7.1f} us  ({base / us:.2f}x){flag}", flush=True)
            rows.append(dict(n=n, t=t, k=kd, v=vd, impl="split4", bv=bv, ki=ki, lv=lv, us=us, err_o=eo, err_s=es))
        for bv in (8, 16, 32):
            if bv * kp // 32 > 128:
                continue
            try:
                o, s = run_chain(q, k, v, g, beta, scale, bv)
                eo, es = rel(o, ro), rel(s, rs)
                us = bench(lambda: run_chain(q, k, v, g, beta, scale, bv))
            except Exception as exc:
                print(f"  chain bv{bv}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                continue
            flag = "" if eo < 1e-2 and es < 1e-4 else f" WRONG o {eo:.1e} s {es:.1e}"
            print(f"  chain  bv{bv:3d}: {us:7.1f} us  ({base / us:.2f}x){flag}", flush=True)
            rows.append(dict(n=n, t=t, k=kd, v=vd, impl="chain", bv=bv, us=us, err_o=eo, err_s=es))
    # decomposition of the blog shape: T sweep, with and without the final state
    n, kd, vd = 2, 256, 8192
    print("\ndecomposition N=2 K=256 V=8192 (committed kernel; split4 16/2/4)", flush=True)
    for t in (1, 2, 4, 8, 16, 32):
        q, k, v, g, beta = inputs(n, t, kd, vd, "cuda")
        for final in (True, False):
            us = bench(lambda: kda_recurrent.forward(q, k, v, g, beta, scale=0.0625, output_final_state=final))
            us2 = bench(lambda: run_split4(q, k, v, g, beta, 0.0625, 16, 2, 4, store=final))
            us3 = bench(lambda: run_chain(q, k, v, g, beta, 0.0625, 16, store=final))
            print(f"  T={t:3d} final={final}: fuser {us:6.1f} us   split4 {us2:6.1f} us   chain16 {us3:6.1f} us", flush=True)
            rows.append(dict(n=n, t=t, k=kd, v=vd, impl="decomp", final=final, us=us, us_split4=us2, us_chain=us3))
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "cpu":
        check_cpu()
    else:
        main_gpu(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kda_recurrent_reductions.json")
