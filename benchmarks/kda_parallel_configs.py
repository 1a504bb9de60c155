"""KDA single-chunk parallel form: its launch configs' device times, split kernels against one launch.

    python benchmarks/kda_parallel_configs.py [--shapes 2,8,256,8192 16,16,128,1024 ...] [--out FILE.md]
    TRITON_INTERPRET=1 python benchmarks/kda_parallel_configs.py --smoke    # CPU: every config checked, untimed

``codegen/kda_parallel.forward`` runs the single-chunk WY form (T ≤ 64) either as up to four
kernels (prep: the Gram matrices split over K; reduce; solve; state) or, with the ``ONE_LAUNCH``
config, as one fused kernel in which every program sums the Gram matrices over all K itself. This
script times, at each ``(N, T, K, V)`` shape, the table's default config (what fuser runs), the
split kernels' default and every fused config of :data:`FUSED` (value columns per program
``BLOCK_VS``, state tile rows ``BLOCK_K``, warps), on ``[N, T, *]`` inputs (bf16 q, k
l2-normalised, v, beta = sigmoid; g = −softplus(randn) in fp32; no initial state; the final state
returned). Device µs per call: ten calls captured in one CUDA graph, replay timed by events,
median of five (``kda_plan_sweep.device_us``). Every config's o and final state are compared with
the split default's (relative error; the float64 reference is ``--smoke``'s and the tests').
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

#: The fused configs timed: (BLOCK_VS, BLOCK_K, num_warps).
FUSED = [(32, 32, 4), (64, 32, 4), (128, 32, 4), (64, 64, 4), (32, 32, 2), (64, 32, 8), (128, 32, 8), (128, 64, 8)]

#: Default shapes (N, T, K, V): the kernel blogs' four (B=1, H=2, T=8), then short sequences with
#: small K (where one launch should pay) and longer ones (where the Gram sums grow as T²).
SHAPES = [(2, 8, 256, 8192), (2, 8, 512, 16384), (2, 8, 8192, 1024), (2, 8, 1024, 1024), (16, 8, 64, 128),
          (16, 8, 128, 1024), (16, 8, 256, 1024), (2, 16, 256, 8192), (16, 16, 128, 128), (16, 16, 256, 1024),
          (2, 32, 256, 8192), (16, 32, 128, 1024), (2, 64, 256, 8192)]


def configs() -> dict:
    """Name → config overrides: the split kernels' default and every :data:`FUSED` row."""
    out = {"split": {"ONE_LAUNCH": False}}
    for bvs, bk, warps in FUSED:
        out[f"one bvs{bvs} bk{bk} w{warps}"] = {"ONE_LAUNCH": True, "BLOCK_VS": bvs, "BLOCK_K": bk, "num_warps": warps}
    return out


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def smoke() -> None:
    """In Triton's interpreter: every config (small blocks kept as given) at a ragged shape against
    the float64 recurrence; raises on a mismatch."""
    import torch
    import torch.nn.functional as F

    from fuser.codegen import kda_parallel
    from fuser.patterns.kda_reference import recurrent

    torch.manual_seed(0)
    n, t, kd, vd = 2, 7, 40, 72
    q = F.normalize(torch.randn(n, t, kd), dim=-1)
    k = F.normalize(torch.randn(n, t, kd), dim=-1)
    v = torch.randn(n, t, vd)
    g = -F.softplus(torch.randn(n, t, kd))
    beta = torch.sigmoid(torch.randn(n, t))
    bthk = [x.double().transpose(0, 1)[None] for x in (q, k, v, g, beta)]  # the reference's [B, T, H, *]
    ro, rs = recurrent(*bthk, scale=0.3, output_final_state=True)
    ro, rs = ro[0].transpose(0, 1), rs[0]
    for name, cfg in configs().items():
        o, s = kda_parallel.forward(q, k, v, g, beta, scale=0.3, output_final_state=True,
                                    config=dict(cfg, DOT_PRECISION="ieee"))
        eo, es = rel(o, ro), rel(s, rs)
        print(f"{name}: o {eo:.1e}, state {es:.1e}")
        if not (eo < 1e-4 and es < 1e-4):
            raise SystemExit(f"{name} differs from the float64 reference: o {eo:.1e}, state {es:.1e}")


def measure(shapes, budget_s: float) -> list[dict]:
    """Device µs of every config at every shape (until ``budget_s``)."""
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
        default = kda_parallel.choose_config(k_dim=kd, v_dim=vd, dtype=q.dtype, device=q.device, n_rows=n, t_len=t)
        row = {"N": n, "T": t, "K": kd, "V": vd, "default": "one" if default["ONE_LAUNCH"] else "split",
               "default_cfg": {key: default[key] for key in ("BLOCK_VS", "BLOCK_K", "num_warps")}, "us": {}, "err": {}}
        ref = None
        for name, cfg in [("default", None), *configs().items()]:
            call = functools.partial(kda_parallel.forward, q, k, v, g, beta, scale=kd ** -0.5, output_final_state=True,
                                     config=cfg)
            try:
                o, s = call()
                if name == "split":
                    ref = (o, s)
                row["us"][name] = round(device_us(call), 2)
                if ref is not None:
                    row["err"][name] = max(rel(o, ref[0]), rel(s, ref[1]))
            except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                row["us"][name] = None
                row["err"][name] = common.short_error(exc, 120)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, g, beta
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="check every config in the interpreter, untimed")
    p.add_argument("--shapes", nargs="+", help="N,T,K,V shapes (default: SHAPES)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this many seconds")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kda_parallel_configs.md")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        smoke()
        return 0
    common.setup_environment()
    import torch

    if not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU (--smoke checks the configs on the CPU)")
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    rows = measure(shapes, a.budget_s)
    names = ["default", *configs()]
    headers = ["N", "T", "K", "V", "default (config)", *[f"{n} µs" for n in names], "best", "default / best",
               "worst rel. diff"]
    table = []
    for r in rows:
        timed = {k: v for k, v in r["us"].items() if v is not None and k != "default"}
        best = min(timed, key=timed.get) if timed else None
        diffs = [e for e in r["err"].values() if isinstance(e, float)]
        table.append([r["N"], r["T"], r["K"], r["V"], f"{r['default']} {r['default_cfg']}",
                      *[common.fmt_num(r["us"].get(n), 1) if r["us"].get(n) is not None else "err" for n in names],
                      best or "—", f"{r['us']['default'] / timed[best]:.2f}" if best and r["us"].get("default") else "—",
                      f"{max(diffs):.1e}" if diffs else "—"])
    meta = common.env_header("cuda")
    legend = ("Device µs per call (CUDA-graph replay, no host time) of codegen/kda_parallel.forward on [N, T, *] bf16 "
              "inputs, g fp32, no h0, the final state returned. default = the table's config (what fuser runs); "
              "split = the four-kernel form's default; one bvsB bkK wW = the fused kernel, BLOCK_VS B, BLOCK_K K, W warps. "
              "worst rel. diff = the largest relative difference of o or the final state from the split form's. "
              "Method: docstring of benchmarks/kda_parallel_configs.py.")
    errors = [f"N={r['N']} T={r['T']} K={r['K']} V={r['V']} {n}: {e}" for r in rows for n, e in r["err"].items()
              if isinstance(e, str)]
    md = common.header_md("KDA parallel form: launch configs, split kernels against one launch", meta)
    md += "\n" + legend + "\n\n" + common.md_table(headers, table) + "\n"
    if errors:
        md += "\n## Errors\n\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
