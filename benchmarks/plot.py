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

A results file may ask for another kind of plot with a top-level ``"plot"`` entry:

- ``{"kind": "sweep", "plan": P, "x": X, "series": S, "references": [R, ...], "xlabel": ...}``
  (``benchmarks/h2o.py``): one panel per configuration, time against the records' field ``X``
  for the records whose ``plan`` is ``P``, one line per value of their field ``S`` (e.g. the
  diag_cache plan's time against K, one line per cache layout), the records ``R`` as horizontal
  lines (e.g. two_kernel, one_kernel) and the floor dashed. Without any such record the
  default plot (time against N) is drawn instead.
- ``{"kind": "curves", "field": F, "xlabel": ..., "ylabel": ...}`` (``benchmarks/distributed.py``):
  one panel per configuration, each record's list ``F`` (e.g. the loss of every training step)
  against its index, one line per implementation.
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


def _floor(c: dict) -> Optional[float]:
    """The largest floor a configuration recorded, or None."""
    found = [c[f] for f in _FLOORS if c.get(f) is not None]
    return max(found) if found else None


def _grid(plt, n: int):
    """A figure of ``n`` panels, at most 4 a row: ``(fig, axes [rows, cols], rows)``."""
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    return fig, axes, rows


def _title(fig, json_path: Path, meta: dict) -> None:
    fig.suptitle(f"{json_path.stem}: {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
                 f"triton {meta.get('triton', '?')}, {meta.get('date', '?')}", fontsize=9)


def _swept(c: dict, spec: dict) -> list:
    """The records of configuration ``c`` that a ``"sweep"`` plot draws."""
    return [r for r in c["results"].values() if isinstance(r, dict) and r.get("plan") == spec.get("plan")
            and r.get("ms") and r.get(spec.get("x")) is not None]


def _configs(data: dict) -> list:
    return [c for c in data.get("configs", []) if isinstance(c, dict) and "N" in c and "results" in c]


def caption(json_path: Path) -> str:
    """What :func:`plot_results` draws for a results file, in words (the markdown's image text)."""
    data = json.loads(Path(json_path).read_text())
    spec = data.get("plot") or {}
    if spec.get("kind") == "sweep" and any(_swept(c, spec) for c in _configs(data)):
        return f"median ms against {spec.get('xlabel') or spec.get('x')}, one line per {spec.get('series')}"
    if spec.get("kind") == "curves":
        return f"{spec.get('ylabel') or spec.get('field')} against {spec.get('xlabel') or 'index'}, one line per implementation"
    return "median ms against N"


def _curves_plot(plt, configs: list, spec: dict, json_path: Path, meta: dict, out: Path) -> Optional[Path]:
    """The ``"curves"`` plot (see the module docstring); None when no record holds the list."""
    from matplotlib.ticker import MaxNLocator

    field = spec.get("field")

    def curves(c):
        return {i: r[field] for i, r in c["results"].items() if isinstance(r, dict) and r.get(field)}

    panels = [c for c in configs if curves(c)]
    if not panels:
        return None
    fig, axes, rows = _grid(plt, len(panels))
    impls = sorted({i for c in panels for i in curves(c)})
    colors = {i: plt.cm.tab10(k % 10) for k, i in enumerate(impls)}
    for ax, c in zip(axes.flat, panels):
        for impl, ys in curves(c).items():
            ax.plot(range(len(ys)), ys, marker="o", ms=3, label=impl, color=colors[impl],
                    lw=2.2 if impl.startswith("fuser") else 1.2, ls="-" if impl.startswith("fuser") else "--")
        ax.set_title(", ".join(f"{k}={v}" for k, v in _facet(c)) + f", N={c['N']}", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(spec.get("xlabel") or "index")
        ax.set_ylabel(spec.get("ylabel") or field)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = next(iter(axes.flat)).get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    _title(fig, json_path, meta)
    fig.tight_layout(rect=(0, 0, 0.9, 0.93))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _sweep_plot(plt, configs: list, spec: dict, json_path: Path, meta: dict, out: Path) -> Optional[Path]:
    """The ``"sweep"`` plot (see the module docstring); None when no record of the swept plan ran."""
    plan, x, series = spec.get("plan"), spec.get("x"), spec.get("series")

    def swept(c):
        return _swept(c, spec)

    panels = [c for c in configs if swept(c)]
    if not panels:
        return None
    fig, axes, rows = _grid(plt, len(panels))
    names = sorted({r.get(series) for c in panels for r in swept(c)}, key=str)
    refs = list(spec.get("references") or [])
    colors = {n: plt.cm.tab10(k % 10) for k, n in enumerate(names + refs)}
    for ax, c in zip(axes.flat, panels):
        for name in names:
            pts = sorted((r[x], r["ms"]) for r in swept(c) if r.get(series) == name)
            ax.plot(*zip(*pts), marker="o", ms=3, lw=1.8, label=f"{plan} {name}", color=colors[name])
        for ref in refs:
            r = c["results"].get(ref)
            if isinstance(r, dict) and r.get("ms"):
                ax.axhline(r["ms"], ls=":", lw=1.4, color=colors[ref], label=ref)
        floor = _floor(c)
        if floor is not None and floor > 0.01 * min(r["ms"] for r in swept(c)):  # else it only flattens the plot
            ax.axhline(floor, ls="--", lw=1, color="black", label="floor")
        ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_yscale("log")
        ks = sorted({r[x] for r in swept(c)})
        ax.set_xticks(ks, [str(k) for k in ks], fontsize=7)
        ax.set_title(", ".join(f"{k}={v}" for k, v in _facet(c)) + f", N={c['N']}", fontsize=8)
        ax.set_xlabel(spec.get("xlabel") or x)
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    _title(fig, json_path, meta)
    fig.tight_layout(rect=(0, 0.1 / rows, 1, 0.93))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_results(json_path: Path, out: Optional[Path] = None) -> Optional[Path]:
    """Write the plot of one results file; returns its path, or None when the file holds no
    per-N configurations (e.g. a tuning table) or nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    configs = _configs(data)
    if not configs:
        return None
    out = Path(out) if out is not None else json_path.with_suffix(".png")
    spec = data.get("plot") or {}
    if spec.get("kind") == "sweep":
        done = _sweep_plot(plt, configs, spec, json_path, data.get("meta", {}), out)
        if done is not None:
            return done
    if spec.get("kind") == "curves":
        return _curves_plot(plt, configs, spec, json_path, data.get("meta", {}), out)
    panels: dict[tuple, list] = {}
    for c in configs:
        panels.setdefault(_facet(c), []).append(c)
    impls = sorted({i for c in configs for i, r in c["results"].items() if isinstance(r, dict) and r.get("ms")})
    if not impls:
        return None
    fig, axes, rows = _grid(plt, len(panels))
    colors = {i: plt.cm.tab10(k % 10) for k, i in enumerate(impls)}
    for ax, (facet, cs) in zip(axes.flat, panels.items()):
        cs = sorted(cs, key=lambda c: c["N"])
        for impl in impls:
            pts = [(c["N"], c["results"][impl]["ms"]) for c in cs
                   if isinstance(c["results"].get(impl), dict) and c["results"][impl].get("ms")]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=impl, color=colors[impl],
                        lw=2.2 if impl.startswith("fuser") else 1.2)
        floors = [(c["N"], _floor(c)) for c in cs if _floor(c) is not None]
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
    _title(fig, json_path, data.get("meta", {}))
    fig.tight_layout(rect=(0, 0, 0.92, 0.95))
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
