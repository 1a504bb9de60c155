"""The benchmark scripts end to end on the CPU (Triton's interpreter): tiny shapes, one or two
configurations each, a subprocess per script as on the device machine. Each test takes well
under a minute; ``-m "not bench"`` leaves them out."""

from __future__ import annotations

import json
import os
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

pytestmark = pytest.mark.bench


def run_script(name: str, tmp_path: Path, *args: str) -> tuple[str, dict]:
    """Run ``benchmarks/<name>.py --smoke --device cpu ... --out tmp/<name>.md``; returns the
    markdown written and the JSON beside it."""
    out = tmp_path / f"{name}.md"
    cmd = [sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--device", "cpu", "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out.read_text(), json.loads(out.with_suffix(".json").read_text())


def records(data: dict, impl: str) -> list[dict]:
    return [c["results"][impl] for c in data["configs"] if impl in c["results"]]


def assert_measured(recs: list[dict], tol: float = 1e-4) -> None:
    assert recs
    for r in recs:
        assert r["status"] == "ok" and r["ms"] > 0, r
        assert r["rel_err"] is not None and r["rel_err"] <= tol, r


def test_attention_smoke(tmp_path):
    md, data = run_script("attention", tmp_path, "--seqs", "64", "--causal", "1", "--impls", "eager", "fuser", "sdpa")
    assert data["complete"] and len(data["configs"]) == 2  # fwd, fwdbwd
    header = next(line for line in md.splitlines() if line.startswith("|  D"))
    assert [h.strip() for h in header.split("|")[1:9]] == ["D", "N", "mask", "mode", "eager", "fuser", "sdpa",
                                                           "floor ms (flop/byte)"]
    assert "## Details" in md and "- status: complete" in md
    assert_measured(records(data, "fuser"))
    assert all(r["note"].startswith("fused: fuser") for r in records(data, "fuser"))


def test_attention_kl_smoke(tmp_path):
    md, data = run_script("attention_kl", tmp_path, "--seqs", "64", "--causal", "1", "--impls", "eager", "fuser")
    assert data["complete"] and [c["mode"] for c in data["configs"]] == ["fwd", "fwdbwd"]
    assert "fuser rel err loss / grads" in md and "fp32 reference:" in md
    fz = records(data, "fuser")
    assert_measured(fz)
    assert all(r["fused"] and r["plan"].startswith("fuser[") for r in fz)
    assert fz[1]["rel_err_grads"] is not None


def test_config_sweep_attention_families_smoke(tmp_path):
    md, data = run_script("tune_attention_kl", tmp_path, "--families", "attn_fwd", "fwd_nostats", "--causal", "both")
    groups = {(g["family"], g["causal"]): g for g in data["groups"]}
    assert data["complete"] and set(groups) == {(f, c) for f in ("attn_fwd", "fwd_nostats") for c in (False, True)}
    for (fam, _), g in groups.items():
        assert [r["status"] for r in g["results"]] == ["ok", "ok"], g["results"]
        assert all(r["rel_diff"] <= 1e-3 and not r["wrong"] for r in g["results"])
        if fam == "attn_fwd":  # SDPA timed on the same inputs and checked against the default config
            assert g["sdpa"]["status"] == "ok" and g["sdpa"]["ms"] > 0 and g["sdpa"]["rel_diff"] <= 1e-5
        else:
            assert "sdpa" not in g
    assert "best vs SDPA" in md and "SDPA " in md


def test_attention_masks_smoke(tmp_path):
    md, data = run_script("attention_masks", tmp_path, "--masks", "window", "--seqs", "48", "--impls", "eager", "fuser")
    assert data["complete"] and len(data["configs"]) == 2
    assert "| mask   | N  | mode   | eager | inductor | fuser | sdpa | flex | floor" in md
    assert_measured(records(data, "fuser"))


def test_h2o_smoke(tmp_path):
    md, data = run_script("h2o", tmp_path, "--n", "64", "--causal", "1", "--gqa", "--impls", "eager", "fuser",
                          "plans", "sdpa")
    assert data["complete"] and [(c["N"], c["kv_heads"]) for c in data["configs"]] == [(64, 2), (128, 1)]
    assert "FlashTensor" in md and "regret" in md and "fuser err O / score" in md
    for impl in ("fuser", "two_kernel", "eager"):
        recs = records(data, impl)
        assert_measured(recs)
        assert all(r["rel_err_score"] is not None for r in recs)
    # the planner's choice (whichever the cost model ranks first at these toy shapes) is one of the
    # forced rows, so its regret is measured, not read off the compiled call
    for c in data["configs"]:
        p = c["planner"]
        assert p["plan"].startswith("fuser[") and p["fused"], p
        assert p["chosen"] in c["results"] and p["chosen_from"] == "forced" and math.isfinite(p["regret"]), p
    assert all(r["rel_err_score"] is None for r in records(data, "sdpa"))  # O only


def test_budget_keeps_a_partial_table(tmp_path):
    md, data = run_script("h2o", tmp_path, "--n", "64", "--causal", "0", "--budget-s", "0.001")
    assert "time budget" in md
    assert all(r["status"] == "skip" for c in data["configs"] for r in c["results"].values())


def test_h2o_picks_up_the_plans_when_they_land(tmp_path, monkeypatch):
    """With ``PLANS``, ``CACHE_LAYOUTS``, ``diagonal_count`` and ``workspace_bytes`` in
    ``codegen/h2o.py`` (stubbed here around the two-kernel forward), the script forces every plan,
    sweeps diag_cache over K and layouts (``causal`` only in causal configurations), reports
    workspaces and draws the sweep plot."""
    pytest.importorskip("matplotlib")
    import torch

    from fuser.codegen import h2o as real

    calls = []

    def forward(q, k, v=None, *, scale, causal="none", plan="two_kernel", diagonals=0, cache="balanced", **kw):
        calls.append((plan, diagonals, cache))
        return real.forward(q, k, v, scale=scale, causal=causal, **kw)

    fake = types.SimpleNamespace(
        PLANS=("two_kernel", "one_kernel", "diag_cache"), CACHE_LAYOUTS=("balanced", "causal"), forward=forward,
        diagonal_count=lambda q, k, causal: 3,
        workspace_bytes=lambda q, k, causal, plan, diagonals, cache: 2**20 * (diagonals or 0))
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as setup_environment would; restored afterwards
    import h2o as bench

    monkeypatch.setattr(bench, "kernels", lambda: fake)
    out = tmp_path / "h2o.md"
    rc = bench.main(["--smoke", "--device", "cpu", "--n", "64", "--impls", "plans", "fuser", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.with_suffix(".json").read_text())
    for c in data["configs"]:
        names = set(c["results"])
        layouts = ["balanced", "causal"] if c["causal"] else ["balanced"]
        want = {"two_kernel", "one_kernel", "fuser"} | {f"diag_cache K={k} {lay}" for k in (0, 1, 2, 3) for lay in layouts}
        assert names == want, names
        r = c["results"]["diag_cache K=2 balanced"]
        assert r["status"] == "ok" and r["diagonals"] == 2 and r["workspace_mib"] == 2.0
        assert math.isfinite(c["planner"]["regret"])
    assert ("diag_cache", 3, "causal") in calls and ("one_kernel", 0, "balanced") in calls
    assert "diag_cache best" in out.read_text()
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    torch._dynamo.reset()


def test_kda_smoke(tmp_path):
    """Passes whether or not the KDA kernels exist yet: the rows of a missing kernel module read
    ``unavailable``; whatever exists is measured and must be right."""
    md, data = run_script("kda", tmp_path, "--impls", "eager", "fuser", "fuser_op", "fuser_recurrent", "fuser_chunk",
                          "fla_recurrent", "fla_chunk")
    assert data["complete"] and [c["mode"] for c in data["configs"]] == ["fwd", "fwdbwd"]
    assert "fuser err o / state / grads" in md and "float64 references:" in md and "floor ms" in md
    eager = records(data, "eager")
    assert_measured(eager)
    assert eager[0]["rel_err_state"] is not None and eager[1]["rel_err_grads"] is not None
    # the compiled loop runs whether fuser fused it or left it to Inductor; either way it is right
    assert_measured(records(data, "fuser"))
    for impl in ("fuser_op", "fuser[recurrent]", "fuser[chunk]"):
        recs = records(data, impl)
        assert len(recs) == 2, impl
        for r in recs:
            assert r["status"] in ("ok", "unavailable"), r
            if r["status"] == "ok":
                assert_measured([r])
    assert all(r["status"] in ("unavailable", "skip") for impl in ("fla_recurrent", "fla_chunk")
               for r in records(data, impl))  # FLA needs a GPU; fused_recurrent_kda has no backward


def test_kda_timing_flag_names_device_time_and_a_failed_capture():
    """``benchmarks/kda.py --timing cudagraph``: every impl but the [cg] rows is timed by CUDA-graph
    replay (the legend says so), and a row whose calls could not be captured says what it was timed
    with instead."""
    sys.path.insert(0, str(BENCH))
    try:
        import common
        import kda
    finally:
        sys.path.remove(str(BENCH))
    a = kda.parse_args(["--smoke", "--timing", "cudagraph", "--cudagraphs"])
    bench = kda.KDABenchmark(a)
    impls = bench.implementations(("smoke", "fwd"))
    assert {n: i.timing for n, i in impls.items() if "[cg]" not in n} and all(
        i.timing == "cudagraph" for n, i in impls.items() if "[cg]" not in n)
    assert all(i.timing == "events" for n, i in impls.items() if "[cg]" in n)
    assert "do_bench_cudagraph" in bench.legend() and "do_bench warmup" not in bench.legend()
    assert "do_bench warmup" in kda.KDABenchmark(kda.parse_args(["--smoke"])).legend()
    rec = {"note": "fused", "status": "ok", "timing": "events (CUDA graph capture failed: sync)"}
    assert common.note_cell(rec) == "fused; timed with events (CUDA graph capture failed: sync)"
    assert common.note_cell({**rec, "timing": "cudagraph"}) == "fused"


def test_kda_plan_sweep_rereads_a_measured_run(tmp_path):
    # the committed H100 sweep re-evaluated with this checkout's cost model (no GPU needed): every
    # shape gets the three estimates and a pick, and the pick's regret is stated
    runs = ROOT / "benchmarks" / "results" / "kda_plan_sweep.json"
    out = tmp_path / "sweep.md"
    r = subprocess.run([sys.executable, str(BENCH / "kda_plan_sweep.py"), "--from-json", str(runs), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["summary"]["shapes"] == len(data["rows"]) == 164
    assert data["summary"]["regret_max"] >= 1.0
    text = out.read_text()
    assert "estimates: re-evaluated" in text and "| pick" in text
    # --measure needs a GPU: a clear error, not a traceback
    r = subprocess.run([sys.executable, str(BENCH / "kda_plan_sweep.py"), "--measure"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0 and "--measure needs a CUDA GPU" in r.stderr



def _gpu_only_script(name: str, *args: str):
    """Run ``benchmarks/<name>.py args`` with no GPU visible: it must refuse, naming the need;
    then the script imported as a module (for its grids and fits)."""
    import importlib

    r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr, r.stderr[-500:]
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def test_kda_parallel_configs_checks_every_config_against_float64():
    """``benchmarks/kda_parallel_configs.py --smoke``: every config it times, in the interpreter,
    against the float64 recurrence; without a GPU the timing run refuses."""
    r = subprocess.run([sys.executable, str(BENCH / "kda_parallel_configs.py"), "--smoke"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    mod = _gpu_only_script("kda_parallel_configs")
    assert r.stdout.count(", state ") == len(mod.CONFIGS)


def test_kda_chunk_configs_needs_a_gpu_and_tries_blocks_within_k():
    """benchmarks/kda_chunk_configs.py measures on the GPU only (a clear error without one); its
    grids stay within the problem's K."""
    kda_chunk_configs = _gpu_only_script("kda_chunk_configs", "--dims", "64")
    for kernel in ("k1", "k2"):
        assert all(c[0] <= 64 for c in kda_chunk_configs.grid(kernel, 64))
        assert len(kda_chunk_configs.grid(kernel, 128)) > len(kda_chunk_configs.grid(kernel, 64)) > 0

def test_kda_recurrent_configs_fit_is_the_committed_model(tmp_path):
    """benchmarks/kda_recurrent_configs.py: --measure needs a GPU (a clear error without one); its
    grid stays under 128 state elements a thread; fitting the committed measurements
    (results/kda_recurrent_configs*.json: the kv layout's, the vk layout's) gives codegen/kda_recurrent.REGISTERS_MODEL (3 significant
    digits), whose picks are within 8% of the measured fastest at every shape."""
    krc = _gpu_only_script("kda_recurrent_configs", "--measure")
    from fuser.codegen import kda_recurrent

    for k in krc.KS:
        k_pad = 1 << (k - 1).bit_length()
        assert krc.configs(k) and all(k_pad * bv <= 128 * 32 * w for bv, w, _ in krc.configs(k))
        assert all(w == 1 for _, w, lay in krc.configs(k, ("kv", "vk")) if lay == "vk")
    rows = [r for f in sorted((BENCH / "results").glob("kda_recurrent_configs*.json"))
            for r in json.loads(f.read_text())["rows"]]
    model = krc.fit(rows, 132)
    got = {k_pad: {} for k_pad in kda_recurrent.REGISTERS_MODEL}
    for (k_pad, bv, w, lay), row in model.items():
        got[k_pad][(bv, w, lay)] = tuple(float(f"{x:.3g}") for x in row[:3])
    assert got == kda_recurrent.REGISTERS_MODEL
    picks = krc.picks(rows, model, 132)
    assert len(picks) >= 100 and max(p["regret"] for p in picks) < 1.1


def test_overhead_dynamic_batch_smoke(tmp_path):
    """--dynamic-batch: the compiled impls' batch dim is symbolic (KDA at --batch), the rows say so,
    and fuser still fuses (the chunk plan forced) and matches eager."""
    md, data = run_script("overhead", tmp_path, "--ops", "kda", "--modes", "default", "--dynamic-batch",
                          "--batch", "2", "--fuser-option", "fuser.plan=kda.plan=chunk")
    assert data["complete"] and "B=2 T=4 H=2 K=V=8 fp32 (B dynamic)" in md
    (c,) = data["configs"]
    f = c["results"]["fuser"]
    assert f["status"] == "ok" and f["fused"] and "chunk" in f["note"], f
    assert_measured(list(c["results"].values()))


def test_overhead_dynamic_batch_needs_two_rows():
    r = subprocess.run([sys.executable, str(BENCH / "overhead.py"), "--smoke", "--dynamic-batch"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "--batch >= 2" in r.stderr


def test_overhead_smoke(tmp_path):
    """Every op in both modes: the default rows measured (host µs per call, checked against eager,
    fuser's op fused, its compile phases reported); the CUDA-graph rows skipped on the CPU."""
    md, data = run_script("overhead", tmp_path)
    assert data["complete"]
    assert [(c["op"], c["mode"]) for c in data["configs"]] == [
        (op, mode) for op in ("attention", "attention_kl", "kda", "empty") for mode in ("default", "reduce-overhead")]
    assert "| op " in md and "fuser − inductor µs" in md and "fuser compile ms" in md
    for c in data["configs"]:
        recs = c["results"]
        if c["mode"] == "reduce-overhead":
            assert set(recs) == {"inductor", "fuser"}
            assert all(r["status"] == "skip" and "CUDA graphs" in r["note"] for r in recs.values())
            continue
        want = {"eager", "inductor", "fuser"} | ({"sdpa"} if c["op"] == "attention" else set())
        assert set(recs) == want, recs
        assert_measured(list(recs.values()))
        for r in recs.values():
            assert r["host_us"] > 0 and r["ms"] == pytest.approx(r["host_us"] / 1e3) and r["calls"] == 3
            assert r["host_solo_us"] > 0  # the interleaved re-measurement replaced the one-at-a-time time
        f = recs["fuser"]
        assert f["fuser_compile_ms"] > 0 and f["inductor_compile_ms"] > 0
        if c["op"] == "empty":
            assert f["fused"] is None and "nothing to fuse" in f["note"]
        else:
            assert f["fused"] is True and f["note"].startswith("fused: fuser"), f


def test_compile_time_smoke(tmp_path):
    """The tiny HF Llama prefill compiled with fuser in two processes, the first with empty
    caches and the second reusing them (Inductor's rows are the same child with another backend,
    left out here to keep the test short: a cold Inductor compile on the CPU is ~20 s)."""
    pytest.importorskip("transformers")
    md, data = run_script("compile_time", tmp_path, "--backends", "fuser", "--cache-root", str(tmp_path / "caches"))
    assert data["complete"] and [(c["workload"], c["cache"]) for c in data["configs"]] == [("prefill", "cold"),
                                                                                          ("prefill", "warm")]
    assert "fuser first call s" in md and "fuser's compile phases" in md
    cold, warm = (c["results"]["fuser"] for c in data["configs"])
    for r in (cold, warm):
        assert r["status"] == "ok" and r["first_call_s"] > 0 and r["ms"] == pytest.approx(r["first_call_s"] * 1e3), r
        assert r["fused"] == r["matches"] == 1 and r["rel_err"] <= 1e-4, r
        assert r["fuser_compile_s"] > 0 and set(r["phases_ms"]) >= {"canonicalise", "match[attention]", "plan"}
    assert cold["cache_dirs"] == warm["cache_dirs"]
    # the warm process hits Inductor's FX-graph cache and AOTAutograd's: fuser's cache key
    # (backend._cache_key_pass) is the same in every process
    assert cold["cache_counters"]["fx_miss"] >= 1, cold["cache_counters"]
    hits = warm["cache_counters"]
    assert hits["aot_hit"] >= 1 and hits["fx_miss"] == hits["aot_miss"] == 0, hits
    assert hits["fx_bypass"] == hits["aot_bypass"] == 0, hits
    assert "caches hit/miss/bypass" in md
    # where the first call went: torch's timed phases, and fuser's fit checks (none on the CPU:
    # interpreted kernels have no shared-memory limit to check)
    assert "Where the first call goes" in md and cold["dynamo_phases_s"], cold
    assert cold["fit_checks"]["compiles"] == 0 and set(cold["fit_checks"]) >= {"asked", "disk", "wait_s"}
    assert cold["access_analysis"]["calls"] == 0  # the CPU keeps the opaque ops: nothing for Inductor to analyse
    kernels = Path(cold["cache_dirs"]["FUSER_CACHE_DIR"]) / "kernels"
    assert any(kernels.glob("attention_fwd*.py"))  # the child wrote fuser's kernels there, not elsewhere
    assert any(Path(cold["cache_dirs"]["TORCHINDUCTOR_CACHE_DIR"]).iterdir())


def test_pass_phases_smoke(tmp_path):
    """fuser's pass alone on the tiny Llama training graph: every rep fuses the attention and
    reports its phases; the later reps pay no template compile."""
    pytest.importorskip("transformers")
    md, data = run_script("pass_phases", tmp_path, "--profile", "5")
    reps = data["reps"]
    assert len(reps) == 2 and all(r["fused"] == 1 and r["wall_ms"] > 0 for r in reps)
    assert {"canonicalise", "static masks", "match[attention]", "plan", "render"} <= set(reps[0]["phases"])
    assert sum(reps[1]["phases"].values()) <= reps[1]["wall_ms"] * 1.05
    assert "| rep | wall | fused |" in md and "cProfile of rep 0" in md and data["meta"]["command"]


def test_distributed_smoke(tmp_path):
    """The tiny HF Llama trained 3 steps on 2 gloo ranks under FSDP2 (per-layer compile), DDP and
    the whole model compiled on each rank, fuser and Inductor each in its own process group: fuser
    fuses the layer's attention in every setting and its losses follow Inductor's (fp32); the
    tables, the loss-curve data and (``--profile``) every cell's profile are there."""
    pytest.importorskip("transformers")
    md, data = run_script("distributed", tmp_path, "--profile")
    assert data["complete"] and [c["setting"] for c in data["configs"]] == ["fsdp2", "ddp", "single"]
    assert data["plot"]["kind"] == "curves" and data["plot"]["field"] == "losses"
    assert "speedup vs inductor" in md and "loss Δ vs inductor" in md and "losses per step" in md
    for c in data["configs"]:
        fz, ind = c["results"]["fuser"], c["results"]["inductor"]
        for r in (fz, ind):
            assert r["status"] == "ok" and len(r["losses"]) == 3 and r["step_ms"] > 0 and r["first_step_s"] > 0, r
            assert len(r["step_ms_ranks"]) == 2
        assert fz["fused"] == fz["matches"] == 1 and fz["graphs"] >= 1, fz
        assert fz["loss_delta"] is not None and fz["loss_delta"] <= 1e-4 and not fz["wrong"], fz
        assert ind["fused"] is None  # Inductor's rows carry no fuser report
    # a layer compiled on its own receives the model's causal mask as data; the whole model
    # (DDP, one piece here) builds it in the graph, where it is read as causal
    fsdp2, ddp, single = (c["results"]["fuser"] for c in data["configs"])
    assert fsdp2["masks"] == ["causal=none mask=additive"] and ddp["masks"] == ["causal=top_left mask=none"], \
        (fsdp2["masks"], ddp["masks"])
    assert single["masks"] == ["causal=top_left mask=none"], single["masks"]
    profile = (tmp_path / "distributed_profile.txt").read_text()
    for cell in ("fsdp2 fuser", "fsdp2 inductor", "ddp fuser", "ddp inductor", "single fuser", "single inductor"):
        assert f"=== {cell} (rank 0" in profile, cell
    assert "Self CPU" in profile and "aten::" in profile
    assert not any("profile" in r for c in data["configs"] for r in c["results"].values())  # not in the JSON


def test_distributed_refuses_more_ranks_than_gpus(tmp_path):
    """On a GPU machine with fewer GPUs than --world the script stops with a clear message;
    on a CPU-only one --device cuda is refused the same way (no CUDA device)."""
    out = tmp_path / "d.md"
    r = subprocess.run([sys.executable, str(BENCH / "distributed.py"), "--device", "cuda", "--world", "64",
                        "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and ("only" in r.stderr or "no CUDA device" in r.stderr), r.stderr[-2000:]


def test_kda_save_needs_a_gpu():
    """benchmarks/kda_save.py measures the two ``save`` plans on the GPU only (a clear error
    without one); the plans it compares are kda_ops' own."""
    from fuser.patterns import kda_ops

    mod = _gpu_only_script("kda_save", "--dims", "64")
    assert callable(mod.rows) and kda_ops.SAVES == ("inputs", "workspaces")


def test_kda_prep_variants_needs_a_gpu():
    """benchmarks/kda_prep_variants.py compares kernel 1's variants on the GPU only (a clear error
    without one); the variants it forces are kda_chunk's."""
    from fuser.codegen import kda_chunk

    mod = _gpu_only_script("kda_prep_variants", "--dims", "64")
    assert callable(mod.child) and set(kda_chunk.PREP_VARIANTS) == {"pairs", "strips"}
