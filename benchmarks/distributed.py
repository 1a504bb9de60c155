"""Training steps of a Hugging Face Llama on several GPUs: fuser vs Inductor, under FSDP2 and DDP.

Usage (each (setting, backend) cell is its own process group of ``--world`` ranks)::

    python benchmarks/distributed.py --world 2 --out-dir "$OUT"    # two GPUs: ~4 cells x 1-2 min
    python benchmarks/distributed.py --world 1 --steps 6           # one GPU: the script's own check
    python benchmarks/distributed.py --smoke                       # CPU: gloo, 2 ranks, tiny Llama

What is measured (issue 12): transformers' ``LlamaForCausalLM`` built from a config (random
weights, no download): ``--layers`` 4, hidden 2048, intermediate 5632, 16 heads, 4 KV heads, vocab
32000, N=4096 (``--seq``), ``--batch`` 2 sequences per rank, bf16 parameters (``--dtype``), trained
``--steps`` steps (``loss = model(ids, labels=ids, use_cache=False).loss; loss.backward();
AdamW step; zero_grad``) on the same token rows for every backend (rank ``r``'s rows of step ``s``
come from a generator seeded with ``(seed, s, r)``).

Settings (``--settings``):

- ``fsdp2``: torchtitan's order, the README's code: each decoder layer compiled
  (``layer.compile(backend=..., fullgraph=True)``), then ``fully_shard`` on each layer and on the
  root (FSDP2 from ``torch.distributed.fsdp``; ``torch.distributed._composable.fsdp`` before 2.6).
- ``ddp``: ``torch.compile(DDP(model), backend=...)``: Dynamo's DDPOptimizer splits the graph at
  the gradient buckets and calls the backend once per piece.
- ``single``: ``torch.compile(model, backend=...)`` of the whole model with no wrapper, each rank
  on its own rows with no communication: the one-GPU number the other settings are held against
  (the whole model in one graph, so the causal mask is built inside it).

Backends (``--backends``): ``fuser`` (``backend="fuser"`` on ``attn_implementation="eager"``, the
written-out softmax attention), ``fuser_sdpa`` (fuser on HF's SDPA attention), ``inductor``
(the default backend on HF's SDPA attention: the baseline users have) and ``inductor_eager``
(Inductor on the eager attention).

Per cell: ``first step s`` (host time of step 0 to a synchronize after it: Dynamo, fuser's
pass, Inductor, AOTAutograd, the kernels' compiles and the step, the slowest rank), ``step ms``
(the median over steps 2.. of each rank's host time per step, synchronized, the slowest rank),
``peak GiB`` (``torch.cuda.max_memory_allocated`` over steps 2.., the largest rank's), the
losses (the mean over the ranks, per step), what fuser fused (rank 0's report of step 0:
regions fused, graphs, near-misses). ``speedup`` = inductor's step ms / this backend's
(issue 12's target for fuser: ≥ 1.2×, ✓/✗). ``loss Δ`` = the largest |loss − inductor's loss| over
the steps, relative to inductor's loss; above 2e-2 (bf16, fp16; 1e-4 fp32) reads WRONG (exit status 1): bf16
rounding moves a step's loss by a few 1e-3 between backends, the optimizer carries it on.

Flags: ``--world`` (default 2; ranks are GPUs 0..world-1, or CPU processes with ``--device cpu``),
``--settings``, ``--backends``, ``--steps`` (default 8; at least 3), ``--layers``, ``--hidden``,
``--intermediate``, ``--heads``, ``--kv-heads``, ``--vocab``, ``--batch``, ``--seq``,
``--dtype``, ``--lr``, ``--child-timeout`` (s, default 420), ``--profile`` (rank 0 profiles one
step after the timed ones with ``torch.profiler`` and the parent writes the top kernels by device
time of every cell to ``distributed_profile.txt`` beside the results), ``--budget-s`` (default 1500), ``--out``,
``--out-dir``, ``--fuser-option key=value``, ``--device``, ``--seed``, ``--smoke`` (world 2 on
the CPU: gloo, 1 layer, hidden 64, N=32, fp32, 3 steps; fuser's kernels in Triton's
interpreter). Results: ``benchmarks/results/distributed.md`` (+ ``.json``, and ``.png``: the loss
curves, one panel per setting).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SETTINGS = ("fsdp2", "ddp", "single")
#: kernels per cell in the ``--profile`` table
PROFILE_ROWS = 30
#: backend name -> (torch.compile backend, attn_implementation)
BACKENDS = {"fuser": ("fuser", "eager"), "fuser_sdpa": ("fuser", "sdpa"), "inductor": ("inductor", "sdpa"),
            "inductor_eager": ("inductor", "eager")}
DEFAULT_BACKENDS = ("fuser", "inductor")
#: issue 12's target: fuser's step at least this many times faster than Inductor's (HF SDPA)
TARGET_SPEEDUP = 1.2
#: loss Δ (relative to inductor's loss) above which a row reads WRONG
WRONG_TOL = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-4}
#: steps 0 and 1 compile and warm up; the timings and the peak memory are of the later steps
WARM_STEPS = 2
RESULT_FILE = "result.json"
#: the Llama's sizes (common.add_llama_args): issue 12's, and a tiny one for --smoke
LLAMA = {"layers": 4, "hidden": 2048, "intermediate": 5632, "heads": 16, "kv_heads": 4, "vocab": 32000, "seq": 4096}
LLAMA_SMOKE = {"layers": 1, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 128, "seq": 32}


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs) per cell (default 2)")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    p.add_argument("--backends", nargs="+", choices=tuple(BACKENDS), default=list(DEFAULT_BACKENDS))
    p.add_argument("--steps", type=int, default=None, help="training steps per cell (default 8; 3 with --smoke)")
    common.add_llama_args(p, LLAMA, LLAMA_SMOKE)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--child-timeout", type=float, default=420.0, help="seconds per cell (default 420)")
    p.add_argument("--profile", action="store_true",
                   help="profile one extra step of rank 0 per cell (torch.profiler; top kernels by device time)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one cell (JSON spec)
    common.add_driver_args(p, budget_s=1500.0, out_name="distributed")
    a = p.parse_args(argv)
    small = a.smoke
    common.finish_driver_args(a, out_name="distributed")
    a.steps = a.steps or (3 if small else 8)
    common.finish_llama_args(a, LLAMA, LLAMA_SMOKE)
    a.dtype = a.dtype or ("fp32" if small else "bf16")
    if a.steps <= WARM_STEPS:
        p.error(f"--steps must be above {WARM_STEPS} (steps 0..{WARM_STEPS - 1} compile and warm up)")
    if a.world < 1:
        p.error("--world must be at least 1")
    return a


# --------------------------------------------------------------------------------------------
# one cell: `world` ranks, in their own processes
# --------------------------------------------------------------------------------------------

def _tokens(spec: dict, step: int, rank: int, device):
    """Rank ``rank``'s token rows of step ``step``: the same for every backend and setting."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)


def _fuser_summary(rep) -> dict:
    fused = [m for m in rep.matches if m.fused]
    plans = sorted({f"{m.pattern}:{m.plan.name}" for m in fused if m.plan is not None})
    rejected = sorted({r.reason.split(";")[0][:120] for r in rep.rejected})
    # how the attention's mask reached the graph: causal from indices, or a data mask (a block
    # compiled on its own receives the model's causal mask as a tensor)
    masks = sorted({f"causal={m.summary.get('causal')} mask={str(m.summary.get('mask')).split(' ')[0]}"
                    for m in fused if "causal" in m.summary})
    return {"fused": len(fused), "matches": len(rep.matches), "graphs": rep.graphs, "plans": plans,
            "rejected": rejected, "masks": masks}


def train_rank(rank: int, world: int, spec: dict) -> dict:
    """What one rank does: build, wrap and compile the model, train ``spec["steps"]`` steps."""
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, common.DTYPES[spec["dtype"]])
    compiler, attn = BACKENDS[spec["backend"]]
    kw: dict[str, Any] = {}
    fuser = None
    if compiler == "fuser":
        import fuser
        import fuser.report  # noqa: F401

        opts = dict(spec["fuser_options"])
        if not cuda:
            opts.setdefault("fuser.interpret", True)
        kw = {"backend": "fuser", "options": opts or None}
    torch.manual_seed(spec["seed"])  # the same weights on every rank and for every backend
    model = transformers.LlamaForCausalLM(common.llama_config(spec, attn)).to(device, dtype)
    model.train()
    if spec["setting"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = torch.compile(DDP(model, device_ids=[rank] if cuda else None), **kw)
    elif spec["setting"] == "single":
        run = torch.compile(model, **kw)
    else:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            layer.compile(fullgraph=True, **kw)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = model
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    losses, times, out = [], [], {}

    def step_once(step: int):
        ids = _tokens(spec, step, rank, device)
        loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for step in range(spec["steps"]):
        if step == WARM_STEPS and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        common.synchronize(spec["device"])
        t0 = time.perf_counter()
        ctx = fuser.report.collecting() if (fuser is not None and step == 0) else contextlib.nullcontext()
        with ctx as rep:
            loss = step_once(step)
        common.synchronize(spec["device"])
        times.append(time.perf_counter() - t0)
        if rep is not None:
            out.update(_fuser_summary(rep))
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    out.update(losses=losses, first_step_s=times[0], step_ms=statistics.median(times[WARM_STEPS:]) * 1e3,
               peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None)
    if spec.get("profile"):
        # one more step (after the timed ones: the timings and the peak are not disturbed), every rank
        # steps so the collectives match; rank 0's table is reported
        out["profile"] = _profile_step(lambda: step_once(spec["steps"]), cuda) if rank == 0 else None
        if rank != 0:
            step_once(spec["steps"])
    return out


def _profile_step(step, cuda: bool) -> str:
    """``torch.profiler``'s table of one call of ``step``: the :data:`PROFILE_ROWS` ops and kernels
    with the most self device time (CPU time without a GPU), and the step's total."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        common.synchronize("cuda" if cuda else "cpu")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=PROFILE_ROWS, max_name_column_width=90)


def _rank_main(rank: int, world: int, spec: dict, store: str, result_dir: str) -> None:
    """One rank's process (``torch.multiprocessing.spawn``): the process group, :func:`train_rank`,
    and rank 0 writes every rank's result to ``result_dir``."""
    common.setup_environment(force_cpu=spec["device"] == "cpu")
    import torch
    import torch.distributed as dist

    if spec["device"] == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if spec["device"] == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    try:
        try:
            mine = {"ok": True, **train_rank(rank, world, spec)}
        except Exception as exc:  # noqa: BLE001 - reported by rank 0 as the cell's error
            mine = {"ok": False, "error": f"rank {rank}: {common.describe_error(exc)}",
                    "traceback": traceback.format_exc()[-3000:]}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(result_dir, RESULT_FILE).write_text(json.dumps(gathered, default=str))
    finally:
        dist.destroy_process_group()
    # the results are written: leave without the interpreter's teardown, where a C++ thread of
    # torch's (gloo, Inductor) sometimes ends the process with SIGABRT ("terminate called without
    # an active exception"), which spawn reports as the cell failing
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def child_main(spec_json: str) -> int:
    """One cell: spawn ``spec["world"]`` ranks and merge their results into one line on stdout."""
    import torch.multiprocessing as mp

    spec = json.loads(spec_json)
    with tempfile.TemporaryDirectory(prefix="fuser-distributed-") as d:
        mp.spawn(_rank_main, args=(spec["world"], spec, os.path.join(d, "store"), d), nprocs=spec["world"],
                 join=True)
        ranks = json.loads(Path(d, RESULT_FILE).read_text())
    failed = [r for r in ranks if not r["ok"]]
    if failed:
        result = {"status": "err: " + failed[0]["error"].splitlines()[0][:80], "error": failed[0]["error"],
                  "traceback": failed[0].get("traceback")}
    else:
        peaks = [r["peak_gib"] for r in ranks if r.get("peak_gib") is not None]
        result = {key: ranks[0].get(key) for key in ("fused", "matches", "graphs", "plans", "rejected", "masks",
                                                    "profile")}
        result.update(status="ok", losses=ranks[0]["losses"], first_step_s=max(r["first_step_s"] for r in ranks),
                      step_ms=max(r["step_ms"] for r in ranks), peak_gib=max(peaks) if peaks else None,
                      peak_gib_ranks=peaks, step_ms_ranks=[r["step_ms"] for r in ranks])
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)
    return 0


RESULT_TAG = "DISTRIBUTED_RESULT "


# --------------------------------------------------------------------------------------------
# the benchmark (the parent process)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    setting: str

    @property
    def label(self) -> str:
        return self.setting


class DistributedBenchmark(common.Benchmark):
    """Groups: one per setting; implementations: the backends. Every cell is a child process
    that spawns the ranks (``--child``)."""

    title = "fuser distributed training benchmark"
    name = "distributed"
    label_width = 8
    needs_fuser = False  # the parent compiles nothing

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"distributed benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; "
                f"world={a.world} settings={a.settings} backends={a.backends}; {self.shape()}")

    def shape(self) -> str:
        a = self.args
        return (f"Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}, {a.heads} heads / "
                f"{a.kv_heads} KV, vocab {a.vocab}, B={a.batch} per rank, N={a.seq}, {a.dtype}, world {a.world}, "
                f"{a.steps} steps, AdamW lr {a.lr:g}")

    def groups(self):
        return [(s, [Config(s)]) for s in SETTINGS if s in self.args.settings]

    def implementations(self, group) -> dict[str, common.Impl]:
        return {b: common.Impl(lambda run: None) for b in BACKENDS if b in self.args.backends}

    def inputs(self, cfg):
        return None

    def new_record(self, impl: str, run) -> dict:
        return {**super().new_record(impl, run), "losses": None, "step_ms": None, "peak_gib": None,
                "peak_gib_ranks": None, "step_ms_ranks": None, "fused": None, "matches": None, "graphs": None,
                "plans": None, "rejected": None, "masks": None, "loss_delta": None, "wrong": False, "process_s": None}

    def setup(self) -> Optional[int]:
        self.profiles: dict[str, str] = {}
        status = super().setup()
        if status is not None:
            return status
        import torch

        if self.device == "cuda" and torch.cuda.device_count() < self.args.world:
            print(f"--world {self.args.world}: only {torch.cuda.device_count()} GPU(s) here", file=sys.stderr)
            return 2
        return None

    def measure_impl(self, run, name, impl) -> Optional[dict]:
        """One cell in a child process: skipped (budget, no transformers) or measured."""
        a, cfg = self.args, run.cfg
        rec = self.new_record(name, run)
        why = self.skip_reason()
        if why is None and importlib.util.find_spec("transformers") is None:
            why = "transformers is not installed (pip install transformers): no HF Llama to train"
        if why is not None:
            rec.update(status="skip", note=why)
            return rec
        spec = {"setting": cfg.setting, "backend": name, "world": a.world, "device": self.device, "dtype": a.dtype,
                "seed": a.seed, "steps": a.steps, "layers": a.layers, "hidden": a.hidden,
                "intermediate": a.intermediate, "heads": a.heads, "kv_heads": a.kv_heads, "vocab": a.vocab,
                "batch": a.batch, "seq": a.seq, "lr": a.lr, "fuser_options": a.fuser_options, "profile": a.profile}
        env = common.child_env()
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the device machines' rule)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.child_timeout,
                               cwd=str(common.REPO_ROOT))
            result, failure = common.child_outcome(r.returncode, r.stdout, r.stderr, RESULT_TAG)
            if result is None:
                rec.update(failure)
            else:
                profile = result.pop("profile", None)
                if profile:
                    self.profiles[f"{cfg.setting} {name}"] = profile
                rec.update(result)
                if rec.get("fused") is not None:
                    rec["note"] = (f"fused {rec['fused']} of {rec['matches']} ({', '.join(rec['plans']) or '-'}; "
                                   f"{', '.join(rec.get('masks') or []) or '-'}); {rec['graphs']} graphs"
                                   + (f"; declined: {'; '.join(rec['rejected'])}" if rec["rejected"] else ""))
        except subprocess.TimeoutExpired:
            rec.update(status=f"timeout ({a.child_timeout:.0f} s)", error=f"cell timed out after {a.child_timeout:.0f} s")
        rec["process_s"] = time.perf_counter() - t0
        rec["first_call_s"] = rec.get("first_step_s")
        rec["ms"] = rec.get("step_ms")
        self.progress(run, name, rec)
        return rec

    def write(self, done: bool) -> list[Path]:
        """The results, and with ``--profile`` the cells' profiles in ``<stem>_profile.txt``."""
        written = super().write(done)
        if self.profiles:
            text = "\n\n".join(f"=== {cell} (rank 0, one step after the timed ones) ===\n{table}"
                                for cell, table in self.profiles.items())
            path = Path(self.args.out).with_name(Path(self.args.out).stem + "_profile.txt")
            path.write_text(f"{self.shape()}\n\n{text}\n")
            written.append(path)
            if self.args.out_dir:
                copy = Path(self.args.out_dir) / path.name
                if copy.resolve() != path.resolve():
                    copy.write_text(path.read_text())
                    written.append(copy)
        return written

    def progress(self, run, name, rec) -> None:
        if rec["status"] != "ok":
            print(f"  {run.cfg.label:<{self.label_width}} {name:<14} {rec['status']}  {rec.get('error') or ''}"[:2000],
                  flush=True)
            return
        print(f"  {run.cfg.label:<{self.label_width}} {name:<14} first step {rec['first_step_s']:7.2f} s  "
              f"step {rec['step_ms']:8.1f} ms  peak {common.fmt_num(rec['peak_gib'], 2) if rec['peak_gib'] else '—'} GiB"
              f"  losses {' '.join(f'{x:.4f}' for x in rec['losses'])}  {rec['note']}", flush=True)

    def summarize(self, cfg: Config, records: dict) -> dict:
        base = records.get("inductor")
        base_ok = base is not None and base.get("status") == "ok"
        for r in records.values():
            if r.get("status") == "ok" and base_ok and r is not base:
                r["loss_delta"] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(r["losses"], base["losses"]))
                r["wrong"] = not (r["loss_delta"] <= WRONG_TOL[self.args.dtype])
                r["speedup"] = common.ratio(base["step_ms"], r["step_ms"])
        return {"N": self.args.seq, "setting": cfg.setting, "world": self.args.world}

    def main_table(self) -> str:
        headers = ["setting", "backend", "attention", "fused", "first step s", "step ms", "speedup vs inductor",
                   "peak GiB / GPU", "loss Δ vs inductor", "final loss"]
        body = []
        for cfg, recs, _ in self.rows:
            for name, r in recs.items():
                ok = r["status"] == "ok"
                sp = r.get("speedup")
                mark = "" if sp is None or not name.startswith("fuser") else (" ✓" if sp >= TARGET_SPEEDUP else " ✗")
                body.append([cfg.setting, name, BACKENDS[name][1],
                             f"{r['fused']} of {r['matches']}" if r.get("fused") is not None else "—",
                             f"{r['first_step_s']:.1f}" if ok else r["status"].split(":")[0],
                             common.fmt_ms(r["step_ms"]) if ok else "—",
                             (common.fmt_ratio(sp) + mark) if sp is not None else "—",
                             common.fmt_num(r["peak_gib"], 2) if r.get("peak_gib") is not None else "—",
                             (("WRONG " if r.get("wrong") else "") + common.fmt_err(r["loss_delta"]))
                             if r.get("loss_delta") is not None else "—",
                             f"{r['losses'][-1]:.4f}" if ok else "—"])
        return common.md_table(headers, body, "llll" + "r" * 6)

    def details_table(self) -> str:
        headers = ["setting", "backend", "losses per step", "step ms per rank", "peak GiB per rank", "cell s", "note"]
        body = []
        for cfg, recs, _ in self.rows:
            for name, r in recs.items():
                body.append([cfg.setting, name,
                             " ".join(f"{x:.4f}" for x in r["losses"]) if r.get("losses") else "—",
                             " / ".join(common.fmt_ms(x) for x in r["step_ms_ranks"]) if r.get("step_ms_ranks") else "—",
                             " / ".join(common.fmt_num(x, 2) for x in r["peak_gib_ranks"])
                             if r.get("peak_gib_ranks") else "—",
                             f"{r['process_s']:.0f}" if r.get("process_s") else "—", common.note_cell(r)])
        return common.md_table(headers, body, "lll" + "r" * 3 + "l")

    def to_json(self, done: bool) -> dict:
        data = super().to_json(done)
        data["plot"] = {"kind": "curves", "field": "losses", "xlabel": "step", "ylabel": "loss (mean over ranks)"}
        return data

    def legend(self) -> str:
        a = self.args
        return (
            f"{self.shape()}. fsdp2 = each decoder layer compiled (fullgraph) then fully_shard'ed, and the root; "
            "ddp = torch.compile(DDP(model)) (DDPOptimizer: one backend call per bucket piece). attention = "
            "attn_implementation. first step s = step 0 to a synchronize (compiles included; slowest rank). "
            f"step ms = median host time of steps {WARM_STEPS}.. (synchronized; slowest rank). speedup = inductor's "
            f"step ms / this one's (fuser's target ≥ {TARGET_SPEEDUP:g}×: ✓/✗). peak GiB = max_memory_allocated over "
            f"those steps (largest rank). loss Δ = max over steps of |loss − inductor's| / inductor's (above "
            f"{WRONG_TOL[a.dtype]:g} reads WRONG). Columns: docstring of benchmarks/distributed.py.")

    def wrong(self) -> list[str]:
        return [f"{name} at {cfg.label}" for cfg, recs, _ in self.rows for name, r in recs.items() if r.get("wrong")]

    def final_lines(self) -> list[str]:
        lines = super().final_lines()
        if self.wrong():
            lines.append("!!! WRONG (loss off inductor's beyond the tolerance): " + "; ".join(self.wrong()))
        return lines


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a.child)
    if a.smoke and a.device == "auto":
        a.device = "cpu"
    return DistributedBenchmark(a).main()


if __name__ == "__main__":
    sys.exit(main())
