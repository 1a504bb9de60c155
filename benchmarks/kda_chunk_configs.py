"""Launch configs of the chunked KDA forward (``codegen/kda_chunk.py``) at the training shapes.

What it answers: which ``(BLOCK_K, BLOCK_V, num_warps, num_stages)`` of kernel 2 (the scan over
chunks) and ``(BLOCK_K1, BLOCK_V1, num_warps1, num_stages1)`` of kernel 1 (the intra-chunk prep)
run fastest, for the dots' dtype given (``--dots``, default float32: the default), and which do
not run at all.

Measurement (GPU only): ``kda_chunk.forward`` on ``[B·H, T, K]`` inputs (bf16 q, k
l2-normalised, v, beta = sigmoid; g = −softplus(randn) in fp32; the final state returned), each
config three calls captured in one CUDA graph, the replay timed by CUDA events (median of five;
``kda_plan_sweep.device_us``): device µs per call of both kernels, no host time. One kernel's keys
vary at a time from the table's first row that fits in shared memory
(``kda_chunk.candidate_configs``: what a call runs), so a row's time differs from the default's by
that kernel alone. Every config's o and final state are compared with the default config's
(``err``: the larger relative difference; a config computing something else reads WRONG above
1e-4). A config that does not fit in shared memory is reported so; a config
that faults (an illegal memory access loses the CUDA context) is reported as ``fault``: every part
runs in a worker process, restarted after a fault past the configs it has done (that is how
``kda_chunk.faulting_config``'s list was found; the configs it now refuses are reported as
refused, not launched).

Usage::

    python benchmarks/kda_chunk_configs.py --dims 64 128 256 --budget-s 120 --out "$OUT/kda_chunk_configs.md"
    python benchmarks/kda_chunk_configs.py --defaults-only --dims 64 128 256     # the table's first fitting rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

KEYS = {"k2": ("BLOCK_K", "BLOCK_V", "num_warps", "num_stages"),
        "k1": ("BLOCK_K1", "BLOCK_V1", "num_warps1", "num_stages1")}


def grid(kernel: str, kd: int) -> list[tuple]:
    """The configs of one kernel tried at K = V = ``kd`` (blocks no wider than K)."""
    if kernel == "k2":
        out = [(bk, bv, w, s) for s in (2, 1, 3) for bv in (16, 32, 64) for bk in (64, 128) for w in (4, 8)]
    else:
        out = [(bk, bv, w, s) for bk in (16, 32, 64) for bv in (32, 64, 128) for w in (4, 8) for s in (2, 1)]
    return [c for c in out if c[0] <= max(64, kd) and c[1] <= max(32, kd)]


def worker(kd: int, kernel: str, dots: str, heads: int, t: int, done: set, budget_s: float,
           defaults_only: bool = False) -> None:
    """Measure ``kernel``'s configs at K = V = ``kd`` not in ``done``, a JSON line each (printed
    before the launch as ``{"trying": ...}``, so that the parent knows which one faulted)."""
    import functools

    import torch

    from fuser.codegen import kda_chunk, launch
    from kda_plan_sweep import device_us, inputs

    start = time.perf_counter()
    torch.manual_seed(0)
    q, k, v, g, beta = inputs(heads, t, kd, kd)
    dt = kda_chunk.workspace_dtype(dots)
    call = functools.partial(kda_chunk.forward, q, k, v, g, beta, scale=kd ** -0.5, output_final_state=True,
                             dots=dots)
    # the base every variation starts from: the table's first candidate that fits (what a call runs)
    default = None
    for cand in kda_chunk.candidate_configs(k_dim=kd, v_dim=kd, dtype=dt, device=q.device):
        try:
            o0, s0 = call(config=cand)
        except launch.ConfigDoesNotFit:
            continue
        default = cand
        break
    if default is None:
        print(json.dumps({"config": "default", "error": "no row of the table fits"}), flush=True)
        return
    o0, s0 = o0.float(), s0.clone()

    def run(cfg):
        o, s = call(config=cfg)
        torch.cuda.synchronize()
        err = max(((o.float() - o0).norm() / o0.norm()).item(), ((s - s0).norm() / s0.norm()).item())
        return device_us(functools.partial(call, config=cfg), reps=3), err

    if "default" not in done:
        print(json.dumps({"trying": "default"}), flush=True)
        try:
            us, err = run(default)
            print(json.dumps({"config": "default", "cfg": default, "us": round(us, 1), "err": err}), flush=True)
        except Exception as exc:  # noqa: BLE001 - e.g. does not fit: the table's later rows ran above
            print(json.dumps({"config": "default", "cfg": default, "error": common.short_error(exc, 160)}), flush=True)
    for c in grid(kernel, kd) if not defaults_only else ():
        name = "/".join(map(str, c))
        if name in done:
            continue
        if time.perf_counter() - start > budget_s:
            print(json.dumps({"budget": True}), flush=True)
            return
        cfg = dict(default, **dict(zip(KEYS[kernel], c)))
        why = kda_chunk.faulting_config(cfg, kd, dt, q.device)
        if why:
            print(json.dumps({"config": name, "error": f"refused by kda_chunk.faulting_config: {why}"}), flush=True)
            continue
        print(json.dumps({"trying": name}), flush=True)
        try:
            us, err = run(cfg)
            print(json.dumps({"config": name, "us": round(us, 1), "err": err}), flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded; a lost context ends this worker below
            msg = common.short_error(exc, 160)
            print(json.dumps({"config": name, "error": msg}), flush=True)
            if common.context_broken(msg):
                return


def run_part(kd: int, kernel: str, a) -> list[dict]:
    """One (K, kernel) part in worker processes, restarted past a fault."""
    done: dict[str, dict] = {}
    start = time.perf_counter()
    while time.perf_counter() - start < a.budget_s:
        cmd = [sys.executable, __file__, "--worker", str(kd), kernel, "--dots", a.dots, "--heads", str(a.heads),
               "--t", str(a.t), "--budget-s", str(max(1.0, a.budget_s - (time.perf_counter() - start))),
               "--done", json.dumps(sorted(done))] + (["--defaults-only"] if a.defaults_only else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.budget_s + 240)
        trying, finished, faulted = None, False, False
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if "trying" in rec:
                trying = rec["trying"]
            elif "budget" in rec:
                finished = True
            else:
                done[rec["config"]] = rec
                if "error" in rec and common.context_broken(rec["error"]):
                    rec["fault"] = faulted = True
                trying = None
        if trying is not None:  # the process died in that config's launch
            done[trying] = {"config": trying, "error": f"worker exited {proc.returncode} in this config",
                            "fault": True}
            faulted = True
        if not faulted:
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
            break
        if finished:
            break
    return [dict(r, K=kd, kernel=kernel) for r in done.values()]


def _cfg_text(cfg: dict) -> str:
    return " | ".join("/".join(str(cfg[k]) for k in KEYS[kernel]) for kernel in ("k2", "k1"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256], help="K = V values")
    p.add_argument("--kernels", nargs="+", choices=("k1", "k2"), default=["k1", "k2"])
    p.add_argument("--dots", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--heads", type=int, default=16, help="B·H value heads (default %(default)s)")
    p.add_argument("--t", type=int, default=4096, help="T (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=120.0, help="seconds per (K, kernel) part")
    p.add_argument("--defaults-only", action="store_true", help="only the table's first fitting row at each K")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kda_chunk_configs.md")
    p.add_argument("--worker", nargs=2, metavar=("K", "KERNEL"), help=argparse.SUPPRESS)
    p.add_argument("--done", default="[]", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    common.setup_environment()
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: the configs are the GPU's (the interpreter has its own)")
    if a.worker:
        worker(int(a.worker[0]), a.worker[1], a.dots, a.heads, a.t, set(json.loads(a.done)), a.budget_s,
               a.defaults_only)
        return 0
    rows = []
    for kd in a.dims:
        for kernel in (a.kernels[:1] if a.defaults_only else a.kernels):
            part = run_part(kd, kernel, a)
            rows += [r for r in part if r["config"] != "default" or not any(
                x["K"] == kd and x["config"] == "default" for x in rows)]
            for r in part:
                print(json.dumps(r), flush=True)
    meta = common.env_header("cuda")
    table = []
    for r in rows:
        base = next((x.get("us") for x in rows if x["K"] == r["K"] and x["config"] == "default"), None)
        status = ("fault: " + r["error"] if r.get("fault") else r["error"] if "error" in r
                  else "WRONG" if r.get("err", 0) > 1e-4 else "ok")
        table.append([r["K"], "both (table's first fitting row)" if r["config"] == "default" else r["kernel"],
                      _cfg_text(r["cfg"]) if r["config"] == "default" else r["config"],
                      common.fmt_num(r.get("us"), 1), common.fmt_ratio(common.ratio(base, r.get("us"))),
                      common.fmt_err(r.get("err")), status])
    legend = (f"B·H = {a.heads}, T = {a.t}, K = V, bf16 inputs, g fp32, dots {a.dots}. µs = device time per call of "
              "both kernels (CUDA-graph replay); vs default = default µs / this µs (> 1: faster); err = relative "
              "difference of o / final state to the default config's (the larger). Config = BLOCK_K/BLOCK_V/"
              "num_warps/num_stages of kernel 2 (k2) or BLOCK_K1/BLOCK_V1/num_warps1/num_stages1 of kernel 1 (k1), "
              "the other kernel at the default. Method: docstring of benchmarks/kda_chunk_configs.py.")
    md = (common.header_md("KDA chunked forward: launch configs at the training shapes", meta) + "\n" + legend
          + "\n\n" + common.md_table(["K", "kernel", "config", "µs", "vs default", "err", "status"], table) + "\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
