"""benchmarks/plot.py: a results file gets its plot (needs matplotlib, the ``bench`` extra)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_plot_results(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from plot import plot_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    configs = [{"D": 64, "N": n, "mode": "fwd", "floor_ms": n * 1e-4,
                "results": {"fuser": {"ms": n * 2e-4}, "sdpa": {"ms": n * 1.5e-4}, "flex": {"status": "OOM"}}}
               for n in (1024, 2048, 4096)]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"meta": {"device": "test"}, "configs": configs}))
    png = plot_results(src)
    assert png == tmp_path / "bench.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a file without per-N configurations (a tuning table) gets no plot
    other = tmp_path / "tune.json"
    other.write_text(json.dumps({"meta": {}, "groups": []}))
    assert plot_results(other) is None and not (tmp_path / "tune.png").exists()
