"""The differential fuzzer's command line.

    FUSER_INTERPRET=1 python -m tests.soundness.fuzz --count 300 --seed 1 --out /tmp/fuzz

Generates ``--count`` programs from ``--seed`` (program ``i`` is :func:`program_spec` of
``(seed, i)``: the same pair always gives the same program), runs each compiled with
``backend="fuser"`` against eager (:mod:`.runner`), shrinks failing programs
(:mod:`.minimise`), writes them to ``--out/<class>/`` as runnable scripts, and prints a summary
table: programs, fused, declined, discarded, failures by class.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import time
import warnings
from typing import Callable, Iterable, Optional

from . import minimise as minimise_mod
from . import runner
from .grammar import Spec, render, sample


def program_spec(seed: int, index: int, pattern: Optional[str] = None) -> Spec:
    """Program ``index`` of the run seeded with ``seed`` (``pattern="kda"``: of the KDA
    generator, :mod:`.kda_grammar`; otherwise an attention or attention-KL program)."""
    return spec_from_seed(seed * 1_000_003 + index, pattern)


def spec_from_seed(program_seed: int, pattern: Optional[str] = None) -> Spec:
    """The program with this program seed (the number printed and written with each program);
    KDA programs come from their own generator (``pattern="kda"``)."""
    if pattern == "kda":
        from .kda_grammar import sample as sample_kda

        return sample_kda(random.Random(program_seed), seed=program_seed)
    return sample(random.Random(program_seed), seed=program_seed)


@dataclasses.dataclass
class Stats:
    """Counts over a run (see :meth:`table`)."""

    programs: int = 0
    fused: int = 0
    declined: int = 0
    unmatched: int = 0
    discarded: int = 0
    both_fail: int = 0
    passed: int = 0
    failed: int = 0
    by_class: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    allowed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    declines: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    discards: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    patterns: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seconds: float = 0.0

    def add(self, o: runner.Outcome) -> None:
        self.programs += 1
        self.seconds += o.seconds
        self.patterns[o.program.spec.pattern] += 1
        if o.status == "discard":
            self.discarded += 1
            self.discards[o.reason.split(":")[0][:80]] += 1
            return
        if o.fused:
            self.fused += 1
        elif o.declined:
            self.declined += 1
            for r in set(o.declined):
                self.declines[_short(r)] += 1
        else:
            self.unmatched += 1
        for a in set(o.allowed):
            self.allowed[a] += 1
        if o.status == "both_fail":
            self.both_fail += 1
        elif o.status == "fail":
            self.failed += 1
            self.by_class[o.kind] += 1
        else:
            self.passed += 1

    def table(self) -> str:
        ran = self.programs - self.discarded
        rows = [
            ("programs", self.programs, ", ".join(f"{k} {v}" for k, v in sorted(self.patterns.items()))),
            ("discarded (eager rejects)", self.discarded, ""),
            ("compared", ran, ""),
            ("  fused (>= 1 region)", self.fused, ""),
            ("  declined (near-miss or left to Inductor)", self.declined, ""),
            ("  not matched", self.unmatched, ""),
            ("passed", self.passed, ""),
            ("both fuser and Inductor fail", self.both_fail, "not counted against fuser"),
            ("FAILED", self.failed, ""),
        ]
        rows += [(f"  {k}", v, "") for k, v in sorted(self.by_class.items(), key=lambda kv: -kv[1])]
        w = max(len(r[0]) for r in rows)
        lines = [f"{name:<{w}}  {n:>5}  {note}".rstrip() for name, n, note in rows]
        if self.allowed:
            lines.append("allowed/documented differences seen: " + ", ".join(f"{k} {v}" for k, v in self.allowed.most_common()))
        if self.declines:
            lines.append("most frequent decline reasons:")
            lines += [f"  {v:>4}  {k}" for k, v in self.declines.most_common(8)]
        if self.discards:
            lines.append("discard reasons: " + "; ".join(f"{k} ({v})" for k, v in self.discards.most_common(5)))
        lines.append(f"time: {self.seconds:.0f} s")
        return "\n".join(lines)


def _short(reason: str) -> str:
    import re

    return re.sub(r"'[^']*'|\([^)]*\)|\d+(\.\d+)?", "…", reason)[:100]


def fuzz(specs: Iterable[Spec], *, out_dir: Optional[str] = None, minimise: bool = True,
         minimise_per_class: int = 2, minimise_runs: int = 40, backend: str = "fuser",
         confirm_backend: str = "inductor", log: Callable[[str], None] = print) -> tuple[Stats, list]:
    """Run ``specs``; return the stats and the failing outcomes (minimised where tried)."""
    stats = Stats()
    failures: list = []
    shrunk = collections.Counter()
    for n, spec in enumerate(specs):
        prog = render(spec)
        o = runner.run(prog, backend=backend, confirm_backend=confirm_backend)
        stats.add(o)
        state = o.status if o.status != "fail" else f"FAIL {o.kind}"
        fused = f"fused {o.fused}" if o.fused else ("declined" if o.declined else "unmatched")
        log(f"[{n:4d}] seed {spec.seed:<10d} {spec.pattern + ('+h2o' if spec.score != 'none' else ''):<16s} {state:<18s} {fused:<9s} {o.seconds:5.1f}s"
            + (f"  {o.failures[0]}" if o.failures else "")[:220])
        if o.status != "fail":
            continue
        if minimise and shrunk[o.kind] < minimise_per_class:
            shrunk[o.kind] += 1
            small = minimise_mod.minimise(o, max_runs=minimise_runs, log=log, backend=backend,
                                          confirm_backend=confirm_backend)
            o = dataclasses.replace(small, seconds=o.seconds, minimised_from=spec)
        failures.append(o)
        if out_dir:
            _write(out_dir, o)
    return stats, failures


def _write(out_dir: str, o: runner.Outcome) -> None:
    d = os.path.join(out_dir, o.kind)
    os.makedirs(d, exist_ok=True)
    orig = o.minimised_from
    name = f"seed{(orig or o.program.spec).seed}" + ("_min" if orig else "")
    with open(os.path.join(d, name + ".py"), "w") as f:
        f.write(runner.repro_script(o))
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump({"kind": o.kind, "failures": [str(x) for x in o.failures],
                   "spec": dataclasses.asdict(o.program.spec),
                   "original_spec": dataclasses.asdict(orig) if orig else None}, f, indent=1)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.soundness.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100, help="programs to generate (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    ap.add_argument("--start", type=int, default=0, help="first program index (to resume or re-run one)")
    ap.add_argument("--out", default=None, help="directory for failing programs (default: fuzz-failures-<seed>)")
    ap.add_argument("--no-minimise", action="store_true", help="report failing programs as generated")
    ap.add_argument("--minimise-per-class", type=int, default=2, help="failing programs shrunk per class (default 2)")
    ap.add_argument("--minimise-runs", type=int, default=40, help="runs allowed per shrink (default 40)")
    ap.add_argument("--program", type=int, nargs="+", default=None, metavar="PROGRAM_SEED",
                    help="run (and shrink) these programs, by the program seed printed for each")
    ap.add_argument("--pattern", choices=["attention", "attention_kl", "h2o", "kda"], default=None,
                    help="only this pattern (h2o: attention programs that also read column sums of P; kda: "
                         "KDA loops from their own generator, also for --program)")
    ap.add_argument("--fast", action="store_true",
                    help="run fuser's rewritten graphs through aot_eager instead of Inductor (~3x faster; "
                         "misses bugs in the interplay with Inductor)")
    ap.add_argument("--print-source", action="store_true", help="print each failing program's source")
    args = ap.parse_args(argv)
    os.environ.setdefault("FUSER_INTERPRET", "1")
    # anomaly-mode tracebacks from AOTAutograd's tracing of programs eager rejects, etc.
    warnings.filterwarnings("ignore")
    out = args.out or f"fuzz-failures-{args.seed}"

    def specs():
        if args.program:
            yield from (spec_from_seed(s, args.pattern) for s in args.program)
            return
        i = args.start
        made = 0
        while made < args.count:
            s = program_spec(args.seed, i, "kda" if args.pattern == "kda" else None)
            i += 1
            if args.pattern == "h2o" and s.score == "none":
                continue
            if args.pattern and args.pattern != "h2o" and s.pattern != args.pattern:
                continue
            made += 1
            yield s

    t0 = time.time()
    stats, failures = fuzz(
        specs(), out_dir=out, minimise=not args.no_minimise, minimise_per_class=args.minimise_per_class,
        minimise_runs=args.minimise_runs, backend="fuser_fast" if args.fast else "fuser",
        confirm_backend="aot_eager" if args.fast else "inductor",
    )
    print()
    print(stats.table())
    print(f"wall time: {time.time() - t0:.0f} s; failing programs written to {out}/" if failures else "")
    if args.print_source:
        for o in failures:
            print("\n" + "=" * 100)
            print(runner.format_failure(o))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
