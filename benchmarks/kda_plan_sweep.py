"""KDA plans' device times over a grid of short-sequence shapes, against the planner's estimates.

What it answers: for the fused KDA op's plans (``patterns/kda_plans.py``: the recurrent kernel,
the single-chunk parallel form, the chunked WY form), does the cost model pick the plan that
runs fastest, and how far is each estimate from the measured time?

Measurement (``--measure``, GPU only): each plan's forward launcher
(``codegen/kda_recurrent.forward``, ``kda_parallel.forward``, ``kda_chunk.forward``) on
``[N, T, *]`` inputs (bf16 q, k l2-normalised, v, beta = sigmoid; g = −softplus(randn) in fp32;
the final state returned, no initial state), ten calls captured in one CUDA graph, the replay
timed with CUDA events (median of five): device time per call in µs, no host time. A plan that
does not take a shape (parallel past T = 64, chunk past K = 256) is left out; an error is kept
in the JSON.

Comparison (always; from ``--measure``'s results or ``--from-json``): ``kda_plans.candidates``
on ``kda_plans.stand_in_match`` at each shape, on the device's own model (or, without a GPU, the
H100's: the estimates take the GPU's launch configs), each measured time plus the model's
launch cost (``launch_us`` per kernel launch, as in the estimates). ``regret`` = measured time of
the picked plan over the fastest measured one (1.00: the right pick); the same again as the
planner sees a graph replayed from CUDA graphs (no launch cost, ``Options.cuda_graphs``).

Usage::

    python benchmarks/kda_plan_sweep.py --measure --plans recurrent parallel chunk --budget-s 300
    python benchmarks/kda_plan_sweep.py --from-json benchmarks/results/kda_plan_sweep.json
    # one GPU run per plan (each within a time budget), then their rows in one table:
    python benchmarks/kda_plan_sweep.py --measure --plans chunk --out /tmp/chunk.md
    python benchmarks/kda_plan_sweep.py --from-json /tmp/rp.json /tmp/chunk.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PLANS = ("recurrent", "parallel", "chunk")
#: The candidates' names in ``kda_plans.candidates``, and their kernel launches (the estimates' count).
CANDIDATE = {"recurrent": "fuser[recurrent]", "parallel": "fuser[parallel]", "chunk": "fuser[chunk C=64]"}
LAUNCHES = {"recurrent": 1, "parallel": 4, "chunk": 2}


def grid(plans) -> list[tuple]:
    """``(N, T, K, V)`` shapes: N ∈ {2, 16}, T ∈ {8, 16, 32, 64}, K ∈ {64 … 1024}, V ∈ {128 … 16384}
    (state ≤ 1 GiB), and four large-K ones for the streamed recurrent variant."""
    out = []
    ks = (64, 128, 256, 512, 1024) if plans != ["chunk"] else (64, 128, 256)
    for n in (2, 16):
        for k in ks:
            for v in (128, 1024, 8192, 16384):
                for t in (8, 16, 32, 64):
                    if n * k * v * 4 <= 2 ** 30:
                        out.append((n, t, k, v))
    if "recurrent" in plans:
        out += [(2, 8, 8192, 1024), (2, 16, 8192, 1024), (2, 8, 2048, 1024), (2, 8, 4096, 4096)]
    return out


def device_us(fn, reps: int = 10) -> float:
    """Device µs per call of ``fn``: ``reps`` calls in one CUDA graph, replay timed by events."""
    import torch

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def inputs(n: int, t: int, k: int, v: int, device: str = "cuda") -> tuple:
    """``(q, k, v, g, beta)`` on ``[N, T, *]`` from the global RNG: bf16 q, k l2-normalised over
    K, v ``randn``, beta ``sigmoid(randn)``; g ``−softplus(randn)`` in fp32."""
    import torch
    import torch.nn.functional as F

    q = F.normalize(torch.randn(n, t, k, device=device), dim=-1).bfloat16()
    kk = F.normalize(torch.randn(n, t, k, device=device), dim=-1).bfloat16()
    vv = torch.randn(n, t, v, device=device).bfloat16()
    g = -F.softplus(torch.randn(n, t, k, device=device))
    beta = torch.sigmoid(torch.randn(n, t, device=device)).bfloat16()
    return q, kk, vv, g, beta


def measure(plans, budget_s: float, max_t: int = 64) -> list[dict]:
    """Device µs of each plan's launcher at each shape of :func:`grid` with ``T ≤ max_t`` (until
    ``budget_s``)."""
    import torch

    from fuser.codegen import kda_chunk, kda_parallel, kda_recurrent

    launchers = {"recurrent": kda_recurrent.forward, "parallel": kda_parallel.forward, "chunk": kda_chunk.forward}
    limits = {"parallel": lambda n, t, k, v: t <= kda_parallel.MAX_T, "chunk": lambda n, t, k, v: k <= kda_chunk.MAX_K}
    rows, start = [], time.perf_counter()
    torch.manual_seed(0)
    for n, t, k, v in grid(plans):
        if t > max_t:
            continue
        if time.perf_counter() - start > budget_s:
            print(f"time budget of {budget_s:g} s reached", flush=True)
            break
        q, kk, vv, g, beta = inputs(n, t, k, v)
        row = {"N": n, "T": t, "K": k, "V": v}
        for plan in plans:
            if plan in limits and not limits[plan](n, t, k, v):
                continue
            fwd = launchers[plan]
            try:
                call = functools.partial(fwd, q, kk, vv, g, beta, scale=k ** -0.5, output_final_state=True)
                row[plan] = round(device_us(call), 2)
            except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                row[plan + "_error"] = common.short_error(exc, 200)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, kk, vv, g, beta
        torch.cuda.empty_cache()
    return rows


def _as_on_an_h100() -> None:
    """Without a GPU: the launch tables and device model of an H100 for the estimates."""
    import torch

    from fuser.codegen import launch

    launch.device_properties = lambda index: {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": (9, 0)}
    torch.cuda.current_device = lambda: 0


def compare(rows: list[dict], cuda_graphs: bool = False) -> tuple[list[list], dict]:
    """Table rows (estimates and measured µs per plan, the pick, the fastest, regret) and a
    summary (mean and worst regret, the shapes picked badly, each model's relative errors).
    With ``cuda_graphs``, as the planner sees a graph replayed from CUDA graphs
    (``Options.cuda_graphs``: launches cost no host time, in the estimates and the measured times)."""
    import torch

    from fuser.codegen import launch
    from fuser.options import Options
    from fuser.patterns import kda_plans

    if not torch.cuda.is_available():
        _as_on_an_h100()
    model = kda_plans.cm.device_model(launch.gpu_name("cuda"), launch.sm_count("cuda"), cuda_graphs=cuda_graphs)
    ctx = types.SimpleNamespace(options=Options(cuda_graphs=cuda_graphs))
    table, regrets, bad, errors = [], [], [], {p: [] for p in PLANS}
    for r in rows:
        match = kda_plans.stand_in_match(r["N"], r["T"], r["K"], r["V"])
        est = {c.params["plan"]: c.estimate_ms * 1e3 for c in kda_plans.candidates(match, ctx)
               if c.params.get("impl") == "fuser"}
        meas = {p: r[p] + LAUNCHES[p] * model.launch_us for p in PLANS if r.get(p) is not None}
        for p in meas:
            if p in est:
                errors[p].append((est[p] - meas[p]) / meas[p])
        pick = min(est, key=est.get)
        best = min(meas, key=meas.get) if meas else None
        regret = meas[pick] / meas[best] if (best and pick in meas) else None
        if regret is not None:
            regrets.append(regret)
            if regret > 1.1:
                bad.append((r["N"], r["T"], r["K"], r["V"], pick, best, round(regret, 2)))
        cells = [r["N"], r["T"], r["K"], r["V"]]
        for p in PLANS:
            cells.append(common.fmt_num(r.get(p), 1) if r.get(p) is not None else "—")
            cells.append(common.fmt_num(est.get(p), 1) if p in est else "—")
        cells += [pick, best or "—", f"{regret:.2f}" if regret is not None else "not measured"]
        table.append(cells)
    summary = {
        "shapes": len(rows), "regret_mean": statistics.mean(regrets) if regrets else None,
        "regret_max": max(regrets) if regrets else None, "picked_over_1.1x": bad,
        "model_error": {p: {"median_abs": statistics.median(abs(e) for e in es), "min": min(es), "max": max(es)}
                        for p, es in errors.items() if es},
    }
    return table, summary


def _bad(summary: dict) -> str:
    return (", ".join(f"N={n} T={t} K={k} V={v} ({pk} over {b}, {rg}x)" for n, t, k, v, pk, b, rg in summary["picked_over_1.1x"])
            or "none")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="measure on the GPU (else --from-json)")
    p.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    p.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this many seconds")
    p.add_argument("--max-t", type=int, default=64, help="measure only the grid's shapes with T <= this")
    p.add_argument("--from-json", type=Path, nargs="+",
                   help="JSON of earlier --measure runs: their rows merged by shape (e.g. one run per plan)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kda_plan_sweep.md")
    a = p.parse_args(argv)
    common.setup_environment()
    import torch

    if a.measure:
        if not torch.cuda.is_available():
            p.error("--measure needs a CUDA GPU (or give --from-json)")
        rows = measure(a.plans, a.budget_s, a.max_t)
        meta = common.env_header("cuda")
    elif a.from_json:
        runs = [json.loads(path.read_text()) for path in a.from_json]
        merged: dict = {}
        for run in runs:
            for row in run["rows"]:
                merged.setdefault((row["N"], row["T"], row["K"], row["V"]), {}).update(row)
        rows = list(merged.values())
        meta = dict(runs[0]["meta"], command=" ; ".join(run["meta"]["command"] for run in runs))
        now = common.env_header("cpu")
        meta = dict(meta, estimates=f"re-evaluated {now['date']} by `{now['command']}` (this checkout's model)")
    else:
        p.error("give --measure or --from-json")
    table, summary = compare(rows)
    summary["cuda_graphs"] = compare(rows, cuda_graphs=True)[1]
    headers = ["N", "T", "K", "V"]
    for plan in PLANS:
        headers += [f"{plan} µs", f"{plan} est."]
    headers += ["pick", "fastest", "regret"]
    legend = (
        "Device µs per call (CUDA-graph replay, no host time) of each plan's forward launcher on [N, T, *] bf16 inputs, "
        "g fp32, the final state returned, no h0; est. = the planner's estimate (µs, launches included); the measured "
        "column adds the same launch cost before comparing. pick = the planner's choice, fastest = the measured one, "
        "regret = measured(pick) / measured(fastest). — : the plan does not take the shape or was not measured. "
        "Method: docstring of benchmarks/kda_plan_sweep.py.")
    err = "; ".join(f"{p}: median |error| {s['median_abs']:.0%}, from {s['min']:+.0%} to {s['max']:+.0%}"
                    for p, s in summary["model_error"].items())
    notes = [f"shapes: {summary['shapes']}; regret mean {summary['regret_mean']:.3f}, worst {summary['regret_max']:.2f}"
             if summary["regret_mean"] is not None else f"shapes: {summary['shapes']}",
             f"estimate vs measured: {err}",
             "picked more than 10% slower than the fastest: " + _bad(summary)]
    graphs = summary["cuda_graphs"]
    if graphs["regret_mean"] is not None:
        notes.append(f"replayed from CUDA graphs (mode=\"reduce-overhead\"; launches cost no host time, measured and "
                     f"estimated): regret mean {graphs['regret_mean']:.3f}, worst {graphs['regret_max']:.2f}; picked "
                     f"more than 10% slower than the fastest: {_bad(graphs)}")
    md = common.header_md("KDA plans: measured device time against the planner's estimates", meta)
    if meta.get("estimates"):
        md += f"\n- estimates: {meta['estimates']}"
    md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n\n" + legend + "\n\n" + common.md_table(headers, table) + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    print("\n".join(notes))
    print(f"wrote {a.out} and {a.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
