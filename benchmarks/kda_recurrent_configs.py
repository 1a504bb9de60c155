"""Launch configs of the recurrent KDA kernel in registers (``codegen/kda_recurrent.py``), per shape.

What it answers: for each ``(BLOCK_V, num_warps, STATE_LAYOUT)`` of the registers variant at each padded K,
how long does a call take as the number of programs (``N · cdiv(V, BLOCK_V)``) and the tokens
(T) grow, and which config is fastest where? Its fit is the table
``codegen/kda_recurrent.REGISTERS_MODEL`` that :func:`kda_recurrent.choose_config` picks from.

Measurement (``--measure``, GPU only): ``kda_recurrent.forward`` with ``config={"VARIANT":
"registers", "BLOCK_V": bv, "num_warps": w, "STATE_LAYOUT": layout}`` (``--layouts``: ``kv`` the
tile ``[K_pad, BLOCK_V]``, ``vk`` transposed, at one warp only: more warps split the keys over warps
again, 1.4-4× slower in ``results/kda_recurrent_layout.md``) on ``[N, T, K]`` inputs (``kda_plan_sweep.inputs``:
bf16 q, k l2-normalised, v, beta = sigmoid; g = −softplus(randn) in fp32; the final state
returned, no initial state), calls captured in one CUDA graph, the replay timed by CUDA events
(median of five; ``kda_plan_sweep.device_us``): device µs per call, no host time. Every config's o
and final state are compared with BLOCK_V 8 / 1 warp's (layout kv) (``err_o``, ``err_state``: relative
differences; the sums over K may round differently with the warps; above 1e-5 for the float32
state or 4e-3 for the bf16 o — a rounding flip of a few elements — the run says WRONG).

Fit (always; from ``--measure`` or ``--from-json``): per ``(K_pad, BLOCK_V, num_warps, layout)`` the waves
model of ``kda_recurrent.estimate_us``::

    µs = fixed + T · per_token · max(1, programs / (resident · SMs))

``resident`` on a grid, ``fixed`` and ``per_token`` by least squares on the relative error; the
table printed is what ``REGISTERS_MODEL`` holds (a config the model misses by more than
:data:`MAX_FIT_ERROR` somewhere — one that spills — is left out). Then, per shape, the measured
fastest config, the one the fitted model picks (as ``kda_recurrent.candidate_configs`` orders them: by a token's
time at that N and V, then the fixed part) and their ratio (``regret``), and the old default's time.

Usage::

    python benchmarks/kda_recurrent_configs.py --measure --budget-s 300 --out "$OUT/kda_recurrent_configs.md"
    python benchmarks/kda_recurrent_configs.py --from-json benchmarks/results/kda_recurrent_configs.json
    # one GPU run per group of K (each within a time budget), fitted together:
    python benchmarks/kda_recurrent_configs.py --measure --ks 512 1024 --out /tmp/large.md
    python benchmarks/kda_recurrent_configs.py --from-json /tmp/small.json /tmp/large.json --out results.md
    # the transposed tile's rows, fitted with the committed kv rows (same shapes, same inputs):
    python benchmarks/kda_recurrent_configs.py --measure --layouts vk --out /tmp/vk.md
    python benchmarks/kda_recurrent_configs.py --from-json benchmarks/results/kda_recurrent_configs.json /tmp/vk.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

KS = (64, 128, 256, 512, 1024)
BLOCK_VS = (8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
LAYOUTS = ("kv", "vk")
#: ``REGISTER_TILE_MAX`` of ``codegen/kda_recurrent`` (kept here so the grid reads without torch).
TILE_MAX = 16384


#: State elements per thread above which a config spills (measured: K=256, BLOCK_V 32, 1 warp — 256
#: a thread — ran 1055 µs where 4 warps ran 47 at N=2, T=8, V=16384): not tried.
MAX_PER_THREAD = 128
#: A config whose fit is worse than this somewhere is left out of the table (it runs in a regime the
#: model does not describe — K=512, BLOCK_V 16, 2 warps spills: 8.5 ms where 4 warps take 0.30).
MAX_FIT_ERROR = 0.3


def configs(k: int, layouts=("kv",)) -> list[tuple[int, int, str]]:
    """``(BLOCK_V, num_warps, layout)`` tried at K: tiles ``K_pad · BLOCK_V`` ≤ 16384 float32 and at
    most :data:`MAX_PER_THREAD` of them a thread; the ``vk`` layout at one warp only."""
    k_pad = 1 << max(2, (k - 1).bit_length())
    return [(bv, w, lay) for lay in layouts for bv in BLOCK_VS for w in WARPS
            if k_pad * bv <= TILE_MAX and k_pad * bv <= MAX_PER_THREAD * 32 * w and (lay == "kv" or w == 1)]


def shapes(k: int) -> list[tuple[int, int, int, int]]:
    """``(N, T, K, V)``: N ∈ {2, 16}, V ∈ {128, 1024, 8192, 16384}, T ∈ {8, 64}, and T = 256 where
    ``N · V`` ≤ 16384 (few programs: the latency of a token, not the waves, is the time)."""
    out = []
    for n in (2, 16):
        for v in (128, 1024, 8192, 16384):
            for t in (8, 64, 256):
                if t == 256 and n * v > 16384:
                    continue
                out.append((n, t, k, v))
    return out


def measure(ks, budget_s: float, layouts=("kv",)) -> list[dict]:
    """Device µs of every config at every shape of :func:`shapes` (until ``budget_s``)."""
    import torch

    from fuser.codegen import kda_recurrent
    from kda_plan_sweep import device_us, inputs

    rows, start = [], time.perf_counter()
    torch.manual_seed(0)
    for k in ks:
        for n, t, _, v in shapes(k):
            if time.perf_counter() - start > budget_s:
                print(f"time budget of {budget_s:g} s reached", flush=True)
                return rows
            q, kk, vv, g, beta = inputs(n, t, k, v)
            call = functools.partial(kda_recurrent.forward, q, kk, vv, g, beta, scale=k ** -0.5,
                                     output_final_state=True)
            o, st = call(config={"VARIANT": "registers", "BLOCK_V": 8, "num_warps": 1, "STATE_LAYOUT": "kv"})
            ref = (o.float(), st.clone())
            for bv, w, lay in configs(k, layouts):
                cfg = {"VARIANT": "registers", "BLOCK_V": bv, "num_warps": w, "STATE_LAYOUT": lay}
                row = {"N": n, "T": t, "K": k, "V": v, "BLOCK_V": bv, "num_warps": w, "layout": lay}
                try:
                    o, s = call(config=cfg)
                    torch.cuda.synchronize()
                    row["err_o"] = ((o.float() - ref[0]).norm() / ref[0].norm()).item()
                    row["err_state"] = ((s - ref[1]).norm() / ref[1].norm()).item()
                    # a slow config (thousands of waves) gets fewer calls in its graph
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    call(config=cfg)
                    b.record()
                    torch.cuda.synchronize()
                    first = a.elapsed_time(b) * 1e3
                    reps = 10 if first < 200 else 3 if first < 3000 else 1
                    row["us"] = round(device_us(functools.partial(call, config=cfg), reps=reps), 2)
                except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                    row["error"] = common.short_error(exc, 160)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del q, kk, vv, g, beta
            torch.cuda.empty_cache()
    return rows


def _model_us(params, n: int, t: int, v: int, bv: int, sms: int) -> float:
    """``fixed + T · token step`` (``kda_recurrent.registers_token_us``: the codegen's formula)."""
    from fuser.codegen import kda_recurrent

    return params[1] + t * kda_recurrent.registers_token_us(params, block_v=bv, n_rows=n, v_dim=v, sm_count=sms)


def fit(rows: list[dict], sms: int) -> dict:
    """``{(K_pad, BLOCK_V, num_warps, layout): (resident, fixed_us, per_token_us, median |err|, worst |err|)}``
    (rows without a layout, from before it existed, are ``"kv"``)."""
    groups: dict = {}
    for r in rows:
        if r.get("us") is None:
            continue
        k_pad = 1 << max(2, (r["K"] - 1).bit_length())
        groups.setdefault((k_pad, r["BLOCK_V"], r["num_warps"], r.get("layout", "kv")), []).append(r)
    out = {}
    grid = [round(0.25 * 1.1 ** i, 3) for i in range(60)]  # 0.25 … ~70 resident programs per SM
    for key, rs in sorted(groups.items()):
        best = None
        for resident in grid:
            # µs / measured = fixed / m + token · (T · waves) / m: least squares on the relative error
            a = [1.0 / r["us"] for r in rs]
            b = [r["T"] * max(1.0, r["N"] * -(-r["V"] // key[1]) / (resident * sms)) / r["us"] for r in rs]
            saa, sab, sbb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b)), sum(y * y for y in b)
            sa, sb = sum(a), sum(b)
            det = saa * sbb - sab * sab
            if det <= 0:
                continue
            fixed = (sa * sbb - sb * sab) / det
            token = (saa * sb - sab * sa) / det
            if fixed < 0 or token <= 0:
                continue
            errs = [abs(_model_us((resident, fixed, token), r["N"], r["T"], r["V"], key[1], sms) / r["us"] - 1)
                    for r in rs]
            score = sum(e * e for e in errs)
            if best is None or score < best[0]:
                best = (score, resident, fixed, token, statistics.median(errs), max(errs))
        if best is not None and best[-1] <= MAX_FIT_ERROR:
            out[key] = tuple(round(x, 4) for x in best[1:])
        else:
            print(f"{key}: left out (no fit within {MAX_FIT_ERROR:.0%} of its times)", flush=True)
    return out


def picks(rows: list[dict], model: dict, sms: int) -> list[dict]:
    """Per shape: measured fastest, the model's pick, regret, and the old default (BLOCK_V 8 and the
    old table's warps: 1/2/1/4/8 at K_pad 64 … 1024)."""
    from fuser.codegen import kda_recurrent

    old_warps = {64: 1, 128: 2, 256: 1, 512: 4, 1024: 8}
    by_shape: dict = {}
    for r in rows:
        if r.get("us") is not None:
            by_shape.setdefault((r["N"], r["T"], r["K"], r["V"]), {})[
                (r["BLOCK_V"], r["num_warps"], r.get("layout", "kv"))] = r["us"]
    out = []
    for (n, t, k, v), times in sorted(by_shape.items()):
        k_pad = 1 << max(2, (k - 1).bit_length())
        est = {c: _model_us(model[(k_pad, *c)][:3], n, t, v, c[0], sms) for c in times if (k_pad, *c) in model}
        # the codegen's order (kda_recurrent._registers_order): a token's time, then the fixed part
        order = {c: (kda_recurrent.registers_token_us(model[(k_pad, *c)][:3], block_v=c[0], n_rows=n, v_dim=v,
                                                      sm_count=sms), model[(k_pad, *c)][1]) for c in est}
        fastest = min(times, key=times.get)
        pick = min(order, key=order.get) if order else None
        old = times.get((8, old_warps.get(k_pad, 1), "kv"))
        out.append({"N": n, "T": t, "K": k, "V": v, "fastest": fastest, "fastest_us": times[fastest],
                    "pick": pick, "pick_us": times.get(pick), "pick_est_us": est.get(pick),
                    "regret": times[pick] / times[fastest] if pick else None, "old_us": old,
                    "speedup_vs_old": old / times[pick] if (old and pick) else None})
    return out


def _name(cfg: tuple) -> str:
    """``BLOCK_V/num_warps``, `` vk`` added for the transposed tile."""
    bv, w, lay = cfg
    return f"{bv}/{w}" + (" vk" if lay == "vk" else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="measure on the GPU (else --from-json)")
    p.add_argument("--ks", type=int, nargs="+", default=list(KS), help="K values (default %(default)s)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["kv"],
                   help="state-tile layouts to measure (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this many seconds")
    p.add_argument("--from-json", type=Path, nargs="+",
                   help="JSON of earlier --measure runs (their rows together, e.g. one run per K)")
    p.add_argument("--sms", type=int, default=None, help="SM count for the fit (default: the GPU's, else 132)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kda_recurrent_configs.md")
    a = p.parse_args(argv)
    common.setup_environment()
    import torch

    if a.measure:
        if not torch.cuda.is_available():
            p.error("--measure needs a CUDA GPU: the configs are the GPU's")
        meta = common.env_header("cuda")
        rows = measure(a.ks, a.budget_s, tuple(a.layouts))
    elif a.from_json:
        runs = [json.loads(f.read_text()) for f in a.from_json]
        meta, rows = runs[0]["meta"], [r for run in runs for r in run["rows"]]
    else:
        p.error("give --measure (GPU) or --from-json")
    sms = a.sms or (torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132)
    model = fit(rows, sms)
    chosen = picks(rows, model, sms)
    wrong = [r for r in rows if r.get("err_state", 0) > 1e-5 or r.get("err_o", 0) > 4e-3]
    print("REGISTERS_MODEL {K_pad: {(BLOCK_V, num_warps, layout): (resident, fixed_us, per_token_us)}}  # median/worst |err|")
    for key, (res, fixed, tok, med, worst) in model.items():
        print(f"    {key[0]}: {key[1:]}: ({res:.3g}, {fixed:.3g}, {tok:.3g}),  # {med:.0%} / {worst:.0%}")
    fit_table = [[*key, res, fixed, tok, f"{med:.0%}", f"{worst:.0%}"] for key, (res, fixed, tok, med, worst)
                 in model.items()]
    pick_table = [[r["N"], r["T"], r["K"], r["V"], _name(r["fastest"]), common.fmt_num(r["fastest_us"], 1),
                   _name(r["pick"]) if r["pick"] else "—", common.fmt_num(r["pick_us"], 1),
                   common.fmt_num(r["pick_est_us"], 1), f"{r['regret']:.2f}" if r["regret"] else "—",
                   common.fmt_num(r["old_us"], 1), common.fmt_ratio(r["speedup_vs_old"])] for r in chosen]
    regrets = [r["regret"] for r in chosen if r["regret"]]
    gains = [r["speedup_vs_old"] for r in chosen if r["speedup_vs_old"]]
    summary = (f"{len(chosen)} shapes, {len(rows)} measurements; the fitted model's pick: regret mean "
               f"{statistics.mean(regrets):.3f}, worst {max(regrets):.2f}; against the old default (BLOCK_V 8): "
               f"median {statistics.median(gains):.2f}×, best {max(gains):.2f}×, worst {min(gains):.2f}×"
               if regrets and gains else "no complete shape")
    if wrong:
        summary += (f"; WRONG: {len(wrong)} runs differ from BLOCK_V 8 / 1 warp's (final state by more than 1e-5 "
                    f"or o by more than 4e-3, bf16 rounding)")
    print(summary)
    legend = ("Device µs per call (CUDA-graph replay), bf16 inputs, g fp32, the final state returned. Config = "
              "BLOCK_V/num_warps of the registers variant (vk: the state tile transposed). Fit: µs = fixed + T · per_token · max(1, N · cdiv(V, "
              f"BLOCK_V) / (resident · {sms} SMs)), least squares on the relative error; |err| = the fit's relative "
              "error over the config's shapes. regret = measured µs of the pick / the fastest's; old = BLOCK_V 8 at "
              "the old table's warps (1/2/1/4/8 at K_pad 64 … 1024); gain = old / pick. Method: docstring of "
              "benchmarks/kda_recurrent_configs.py.")
    md = (common.header_md("KDA recurrent kernel: launch configs per shape", meta) + "\n" + legend + "\n\n"
          + summary + "\n\n## Picks\n\n"
          + common.md_table(["N", "T", "K", "V", "fastest", "µs", "pick", "µs", "est µs", "regret", "old µs", "gain"],
                            pick_table)
          + "\n\n## Fit per config\n\n"
          + common.md_table(["K_pad", "BLOCK_V", "warps", "layout", "resident/SM", "fixed µs", "µs/token", "median |err|",
                             "worst |err|"], fit_table) + "\n")
    if a.measure or a.out != common.RESULTS_DIR / "kda_recurrent_configs.md":
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(md)
        if a.measure or (a.from_json and len(a.from_json) > 1):  # the rows fitted, together
            a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=0))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
