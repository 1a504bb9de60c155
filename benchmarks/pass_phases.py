"""fuser's pass alone on a Hugging Face Llama training graph: its compile phases and a profile.

Usage::

    python benchmarks/pass_phases.py --device cuda --seq 4096 --out "$OUT/pass_phases.md"   # GPU, ~1 min
    python benchmarks/pass_phases.py --smoke --device cpu --out /tmp/pass_phases.md          # CPU, interpreter

What is measured (issue 11, "where fuser's own compile time goes"): the graph Dynamo captures for
one training step of transformers' ``LlamaForCausalLM`` (``--layers`` 4, hidden 1024,
intermediate 2816, 16 heads, 4 KV heads, vocab 32000, ``attn_implementation="eager"``: the
``compile_time.py`` model; B=2, N=``--seq``; bf16 on CUDA, fp32 on the CPU, where fuser's kernels
are Triton's interpreter's and ``TRITON_INTERPRET=1`` is set for it), captured once by a
backend that only keeps it (the captured graph also runs once eagerly, so the device's kernels
for the mask's ops are loaded before the pass runs, unlike in a first call: ``compile_time.py``
reports the phases as a first call sees them). Then ``fuser.passes.apply`` runs ``--reps`` times,
each on a fresh copy of the graph, in one process: ``rep 0`` pays what a process pays once (Jinja
compiles the templates unless its bytecode cache in ``FUSER_CACHE_DIR`` has them; sympy's lazy
imports, which Inductor's own compile triggers anyway when fuser does not), the later reps are
the pass's steady cost. Each rep's phases (``fuser.report.CompileTimes``, ms, exclusive) and wall
time; ``--profile TOP`` adds cProfile's TOP functions by cumulative time of rep 0 and rep 1 to the
markdown.

Output: ``--out`` markdown (device, versions, date, command, a table of reps x phases) and the
JSON beside it. ``--smoke``: 1 layer, hidden 64, 4 heads, 2 KV heads, vocab 128, N=64, 2 reps.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="TOP")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="benchmarks/results/pass_phases.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import transformers

    from fuser import options as options_mod
    from fuser import passes

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    if args.smoke:
        args.layers, args.seq, args.reps = 1, 64, 2
        sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=128)
    else:
        sizes = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                     vocab_size=32000)
    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(args.seq, 128), **sizes)
    cfg._attn_implementation = "eager"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(args.device, dtype).train()
    ids = torch.randint(0, sizes["vocab_size"], (args.batch, args.seq), device=args.device)
    captured = []

    def keep(gm, example_inputs):
        captured.append((copy.deepcopy(gm), list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep)(ids, labels=ids, use_cache=False).loss.backward()
    gm, example_inputs = captured[0]
    opts, _ = options_mod.resolve({}, None)
    rows, profiles = [], []
    for rep in range(args.reps):
        g = copy.deepcopy(gm)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        result = passes.apply(g, example_inputs, opts, grad_enabled=True)
        prof.disable()
        wall = (time.perf_counter() - t0) * 1e3
        rows.append({"rep": rep, "wall_ms": wall, "fused": sum(m.fused for m in result.matches),
                     "phases": dict(result.times.phases)})
        print(f"rep {rep}: wall {wall:.1f} ms, fused {rows[-1]['fused']}: {result.times.text()}", flush=True)
        if args.profile and rep < 2:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.profile)
            profiles.append((rep, s.getvalue()))

    meta = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "graph_nodes": len(gm.graph.nodes),
    }
    names = list(rows[0]["phases"])
    lines = ["# fuser's pass alone on a Llama training graph: compile phases", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", f"Llama {args.layers} layers, B={args.batch}, N={args.seq}, {str(dtype).replace('torch.', '')}, "
              f"on {args.device}; phases in ms (exclusive; `fuser.report.CompileTimes`). Docstring of "
              "benchmarks/pass_phases.py for what each rep includes.", ""]
    lines.append("| rep | wall | fused | " + " | ".join(names) + " |")
    lines.append("|---:|---:|---:|" + "---:|" * len(names))
    for r in rows:
        lines.append(f"| {r['rep']} | {r['wall_ms']:.1f} | {r['fused']} | "
                     + " | ".join(f"{r['phases'].get(n, 0.0):.1f}" for n in names) + " |")
    for rep, text in profiles:
        lines += ["", f"## cProfile of rep {rep} (top {args.profile} by cumulative time)", "", "```", text.strip(), "```"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "reps": rows}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
