"""Autotuning reports its progress through the ``fuser`` logger at INFO, as Inductor's
max-autotune does: what is tuned and how many configs, progress while it runs long, and the
winner with its time, the runners-up and the time taken (``codegen.launch.autotune``)."""

from __future__ import annotations

import logging

import pytest

from fuser.codegen import launch


@pytest.fixture
def fresh_tuning(tmp_path, monkeypatch):
    """An empty autotuning cache (memory and disk) for the test."""
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "_tune_mem", {})


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fuser" and r.levelno == logging.INFO]


def test_autotune_logs_what_is_tuned_and_the_winner(fresh_tuning, caplog):
    times = {16: 0.4, 32: 0.1, 64: 0.2}
    candidates = [{"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": 64}, {"BLOCK": 128}]
    ran = []

    def run(cfg):
        if cfg["BLOCK"] == 128:
            raise RuntimeError("out of shared memory")  # a config that cannot run here
        ran.append(cfg["BLOCK"])
        return times[cfg["BLOCK"]]

    with caplog.at_level(logging.INFO, logger="fuser"):
        best = launch.autotune("test_kernel[N=8]", candidates, run, timer=lambda fn: fn())
    assert best == {"BLOCK": 32} and ran == [16, 32, 64]
    start, end = _messages(caplog)
    assert "autotuning test_kernel[N=8]" in start and "4 configs" in start and "autotune.json" in start
    assert "test_kernel[N=8] -> {'BLOCK': 32} (0.1000 ms)" in end
    assert "3 configs timed, 1 failed" in end
    # the runners-up in order, with their speed relative to the winner
    assert end.index("{'BLOCK': 32} 0.1000 ms (100%)") < end.index("{'BLOCK': 64} 0.2000 ms (50%)") \
        < end.index("{'BLOCK': 16} 0.4000 ms (25%)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fuser"):  # the winner is remembered: nothing is timed
        assert launch.autotune("test_kernel[N=8]", candidates, run, timer=lambda fn: fn()) == {"BLOCK": 32}
    assert _messages(caplog) == [] and ran == [16, 32, 64]


def test_long_autotuning_reports_progress(fresh_tuning, caplog, monkeypatch):
    monkeypatch.setattr(launch, "AUTOTUNE_PROGRESS_S", 0.0)  # every config counts as "long"
    candidates = [{"BLOCK": b} for b in (16, 32, 64)]
    with caplog.at_level(logging.INFO, logger="fuser"):
        launch.autotune("slow_kernel", candidates, lambda cfg: 1.0 / cfg["BLOCK"], timer=lambda fn: fn())
    progress = [m for m in _messages(caplog) if "configs timed in" in m and "best so far" in m]
    assert [m.split(": ")[2].split(" configs")[0] for m in progress] == ["1/3", "2/3"]
    assert "best so far 0.0312 ms" in progress[1]  # 1/32


def test_autotune_where_no_config_runs_says_so(fresh_tuning, caplog):
    def run(cfg):
        raise RuntimeError("no")

    with caplog.at_level(logging.INFO, logger="fuser"):
        best = launch.autotune("broken_kernel", [{"BLOCK": 16}, {"BLOCK": 32}], run, timer=lambda fn: fn())
    assert best == {"BLOCK": 16}
    assert any("none of the 2 configs ran here" in m for m in _messages(caplog))
