"""KDA single-chunk parallel form: device time of its launch configs at short-sequence shapes.

    python benchmarks/kda_parallel_configs.py [--shapes 2,8,256,8192 ...] [--configs NAME ...] [--out FILE.md]
    TRITON_INTERPRET=1 python benchmarks/kda_parallel_configs.py --smoke    # CPU: every config checked, untimed

``codegen/kda_parallel.forward`` runs the single-chunk WY form (T ≤ 64) as up to four kernels:
prep (the Gram matrices split over K, ``GRAM_TILE`` pairwise terms a step, ``GRAM_STEPS`` steps a
program), reduce (the Gram partials summed, when more than ``REDUCE_OVER`` elements), solve and
state. This script times, at each ``(N, T, K, V)`` shape, the table's default config (what fuser
runs) and every config of :data:`CONFIGS` (overrides of the default), on ``[N, T, *]`` inputs
(bf16 q, k l2-normalised, v, beta = sigmoid; g = −softplus(randn) in fp32; no initial state; the
final state returned). Device µs per call: ten calls captured in one CUDA graph, replay timed by
events, median of five (``kda_plan_sweep.device_us``). Every config's o and final state are compared with the default's
(relative difference; the float64 reference is ``--smoke``'s and the tests').
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: Configs timed (overrides of the table's default): the Gram split (steps a program, tile), the
#: reduce launch, the state kernel's value tiles and prefetch.
CONFIGS = {
    "dk": {"GRAM_DK": True},
    "dk steps8": {"GRAM_DK": True, "GRAM_STEPS": 8},
    "dk steps2": {"GRAM_DK": True, "GRAM_STEPS": 2},
    "dk tile4096": {"GRAM_DK": True, "GRAM_TILE": 4096},
    "dk tile4096 steps2": {"GRAM_DK": True, "GRAM_TILE": 4096, "GRAM_STEPS": 2},
    "dk vtiles4 stages3": {"GRAM_DK": True, "V_TILES": 4, "num_stages": 3},
    "steps1": {"GRAM_STEPS": 1},
    "steps2": {"GRAM_STEPS": 2},
    "steps1 tile1024": {"GRAM_STEPS": 1, "GRAM_TILE": 1024},
    "steps2 tile1024": {"GRAM_STEPS": 2, "GRAM_TILE": 1024},
    "steps1 tile512": {"GRAM_STEPS": 1, "GRAM_TILE": 512},
    "tile4096 steps1": {"GRAM_STEPS": 1, "GRAM_TILE": 4096},
    "steps1 warps_prep2": {"GRAM_STEPS": 1, "WARPS_PREP": 2},
    "vtiles4 stages3": {"V_TILES": 4, "num_stages": 3},
    "steps1 vtiles4 stages3": {"GRAM_STEPS": 1, "V_TILES": 4, "num_stages": 3},
    "steps2 vtiles4 stages3": {"GRAM_STEPS": 2, "V_TILES": 4, "num_stages": 3},
    "solve bvs64": {"BLOCK_VS": 64},
    "steps1 bvs64 vtiles4 stages3": {"GRAM_STEPS": 1, "BLOCK_VS": 64, "V_TILES": 4, "num_stages": 3},
    # the one-launch kernel (T <= 16): key block BLOCK_KF, value block BLOCK_VF, warps; "split": the
    # split kernels where the table's default is the one launch (K <= 64, V <= 128)
    "split": {"FUSED": False},
    "fused kf64 vf64": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 64},
    "fused kf64 vf32": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 32},
    "fused kf32 vf32": {"FUSED": True, "BLOCK_KF": 32, "BLOCK_VF": 32},
    "fused kf64 vf128": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 128},
    "fused kf32 vf64": {"FUSED": True, "BLOCK_KF": 32, "BLOCK_VF": 64},
    "fused kf128 vf64": {"FUSED": True, "BLOCK_KF": 128, "BLOCK_VF": 64},
    "fused kf128 vf128 w8": {"FUSED": True, "BLOCK_KF": 128, "BLOCK_VF": 128, "WARPS_FUSED": 8},
    "fused kf64 vf64 w8": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 64, "WARPS_FUSED": 8},
    "fused kf64 vf32 w2": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 32, "WARPS_FUSED": 2},
    "fused kf64 vf64 stages1": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 64, "num_stages": 1},
    "fused kf64 vf64 stages3": {"FUSED": True, "BLOCK_KF": 64, "BLOCK_VF": 64, "num_stages": 3},
}

#: Default shapes (N, T, K, V): the kernel blogs' four (B=1, H=2, T=8), then more heads and T=16.
SHAPES = [(2, 8, 256, 8192), (2, 8, 512, 16384), (2, 8, 8192, 1024), (2, 8, 16384, 1024), (16, 8, 256, 1024),
          (2, 16, 256, 8192), (2, 16, 8192, 1024), (16, 16, 1024, 1024)]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def smoke() -> None:
    """In Triton's interpreter: every config at a ragged shape (K = 300: several Gram programs and
    partials) against the float64 recurrence; raises on a mismatch."""
    import torch
    import torch.nn.functional as F

    from fuser.codegen import kda_parallel
    from fuser.patterns.kda_reference import recurrent

    torch.manual_seed(0)
    n, t, kd, vd = 2, 7, 300, 72
    q = F.normalize(torch.randn(n, t, kd), dim=-1)
    k = F.normalize(torch.randn(n, t, kd), dim=-1)
    v = torch.randn(n, t, vd)
    g = -F.softplus(torch.randn(n, t, kd))
    beta = torch.sigmoid(torch.randn(n, t))
    bthk = [x.double().transpose(0, 1)[None] for x in (q, k, v, g, beta)]  # the reference's [B, T, H, *]
    ro, rs = recurrent(*bthk, scale=0.3, output_final_state=True)
    ro, rs = ro[0].transpose(0, 1), rs[0]
    for name, cfg in CONFIGS.items():
        o, s = kda_parallel.forward(q, k, v, g, beta, scale=0.3, output_final_state=True, config=cfg)
        eo, es = rel(o, ro), rel(s, rs)
        print(f"{name}: o {eo:.1e}, state {es:.1e}")
        if not (eo < 1e-4 and es < 1e-4):
            raise SystemExit(f"{name} differs from the float64 reference: o {eo:.1e}, state {es:.1e}")


def measure(shapes, names, budget_s: float, h0: bool = False) -> list[dict]:
    """Device µs of the default and of every named config at every shape (until ``budget_s``);
    ``h0``: with a float32 initial state ``[N, K, V]`` (randn · 0.1)."""
    import torch

    from fuser.codegen import kda_parallel
    from kda_plan_sweep import device_us, inputs

    rows, start = [], time.perf_counter()
    torch.manual_seed(0)
    for n, t, kd, vd in shapes:
        if time.perf_counter() - start > budget_s:
            print(f"time budget of {budget_s:g} s reached", flush=True)
            break
        q, k, v, g, beta = inputs(n, t, kd, vd)
        s0 = 0.1 * torch.randn(n, kd, vd, device=q.device) if h0 else None
        default = kda_parallel.choose_config(k_dim=kd, v_dim=vd, dtype=q.dtype, device=q.device, n_rows=n, t_len=t)
        row = {"N": n, "T": t, "K": kd, "V": vd, "default_cfg": default, "us": {}, "err": {}}
        ref = None
        for name in ["default", *names]:
            call = functools.partial(kda_parallel.forward, q, k, v, g, beta, scale=kd ** -0.5, output_final_state=True,
                                     initial_state=s0, config=CONFIGS.get(name))
            try:
                o, s = call()
                if ref is None:
                    ref = (o, s)
                row["us"][name] = round(device_us(call), 2)
                row["err"][name] = max(rel(o, ref[0]), rel(s, ref[1]))
            except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                row["us"][name] = None
                row["err"][name] = common.short_error(exc, 120)
        print(json.dumps({k: v for k, v in row.items() if k != "default_cfg"}), flush=True)
        rows.append(row)
        del q, k, v, g, beta, s0
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="check every config in the interpreter, untimed")
    p.add_argument("--shapes", nargs="+", help="N,T,K,V shapes (default: SHAPES)")
    p.add_argument("--configs", nargs="+", help="names of CONFIGS to time (default: all)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this many seconds")
    p.add_argument("--h0", action="store_true", help="with an initial state (float32 [N, K, V])")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kda_parallel_configs.md")
    a = p.parse_args(argv)
    unknown = [n for n in a.configs or () if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {sorted(CONFIGS)}")
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        smoke()
        return 0
    common.setup_environment()
    import torch

    if not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU (--smoke checks the configs on the CPU)")
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    names = a.configs or list(CONFIGS)
    rows = measure(shapes, names, a.budget_s, h0=a.h0)
    headers = ["N", "T", "K", "V", *[f"{n} µs" for n in ["default", *names]], "best", "default / best",
               "worst rel. diff"]
    table = []
    for r in rows:
        timed = {k: v for k, v in r["us"].items() if v is not None}
        best = min(timed, key=timed.get) if timed else None
        diffs = [e for e in r["err"].values() if isinstance(e, float)]
        table.append([r["N"], r["T"], r["K"], r["V"],
                      *[common.fmt_num(r["us"].get(n), 1) if r["us"].get(n) is not None else "err"
                        for n in ["default", *names]],
                      best or "—", f"{r['us']['default'] / timed[best]:.2f}" if best and r["us"].get("default") else "—",
                      f"{max(diffs):.1e}" if diffs else "—"])
    meta = common.env_header("cuda")
    legend = ("Device µs per call (CUDA-graph replay, no host time) of codegen/kda_parallel.forward on [N, T, *] bf16 "
              "inputs, g fp32, " + ("a float32 h0" if a.h0 else "no h0") + ", the final state returned. "
              "default = the table's config (what fuser runs); the other columns override it (CONFIGS in the "
              "script). worst rel. diff = the largest relative difference of o or the final state from the "
              "default's. Method: docstring of benchmarks/kda_parallel_configs.py.")
    errors = [f"N={r['N']} T={r['T']} K={r['K']} V={r['V']} {n}: {e}" for r in rows for n, e in r["err"].items()
              if isinstance(e, str)]
    md = common.header_md("KDA parallel form: launch configs at short-sequence shapes", meta)
    md += "\n\n" + legend + "\n\n" + common.md_table(headers, table) + "\n"
    if errors:
        md += "\n## Errors\n\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
