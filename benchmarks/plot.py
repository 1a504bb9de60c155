"""Plots of benchmark results: time against sequence length, one panel per configuration.

Usage::

    python benchmarks/plot.py benchmarks/results/attention.json [more.json ...]

Reads a results JSON written by the benchmark scripts (``{"meta": ..., "configs": [...]}``, each
config with ``N`` and ``results: {impl: {"ms": ...}}``) and writes ``<stem>.png`` beside it:
median ms per implementation against N on log-log axes, one panel per combination of the other
configuration fields (head dim, mask, mode, ...), with the floor (max of the FLOP, byte and
exp floors the script recorded) as a dashed line. The title carries the device, versions and
date from ``meta``. The benchmark scripts call :func:`plot_results` after writing their tables
(``common.write_outputs``); it needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

#: config fields that are measurements or sizes, not facets
_NOT_FACETS = {"N", "results", "subjects", "fuser", "flops", "bytes", "exps", "floor_ms", "floor_flop_ms",
               "floor_byte_ms", "floor_exp_ms"}
_FLOORS = ("floor_ms", "floor_flop_ms", "floor_byte_ms", "floor_exp_ms")


def _facet(cfg: dict) -> tuple:
    return tuple((k, cfg[k]) for k in sorted(cfg) if k not in _NOT_FACETS and not isinstance(cfg[k], (dict, list)))


def plot_results(json_path: Path, out: Optional[Path] = None) -> Optional[Path]:
    """Write the plot of one results file; returns its path, or None when the file holds no
    per-N configurations (e.g. a tuning table) or nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    configs = [c for c in data.get("configs", []) if isinstance(c, dict) and "N" in c and "results" in c]
    if not configs:
        return None
    panels: dict[tuple, list] = {}
    for c in configs:
        panels.setdefault(_facet(c), []).append(c)
    impls = sorted({i for c in configs for i, r in c["results"].items() if isinstance(r, dict) and r.get("ms")})
    if not impls:
        return None
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = {i: plt.cm.tab10(k % 10) for k, i in enumerate(impls)}
    for ax, (facet, cs) in zip(axes.flat, panels.items()):
        cs = sorted(cs, key=lambda c: c["N"])
        for impl in impls:
            pts = [(c["N"], c["results"][impl]["ms"]) for c in cs
                   if isinstance(c["results"].get(impl), dict) and c["results"][impl].get("ms")]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=impl, color=colors[impl],
                        lw=2.2 if impl.startswith("fuser") else 1.2)
        floors = [(c["N"], max(c[f] for f in _FLOORS if c.get(f) is not None)) for c in cs
                  if any(c.get(f) is not None for f in _FLOORS)]
        if floors:
            ax.plot(*zip(*floors), ls="--", color="black", lw=1, label="floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(", ".join(f"{k}={v}" for k, v in facet), fontsize=8)
        ax.set_xlabel("N")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = next(iter(axes.flat)).get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    meta = data.get("meta", {})
    fig.suptitle(f"{json_path.stem}: {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
                 f"triton {meta.get('triton', '?')}, {meta.get('date', '?')}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.92, 0.95))
    out = Path(out) if out is not None else json_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    for p in paths:
        out = plot_results(Path(p))
        print(f"{p}: {out if out else 'no per-N configurations: no plot'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
