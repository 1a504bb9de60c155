"""The README's promises that a test can hold: its sample report is what the quickstart prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import quickstart  # noqa: E402


def _normalise(text: str) -> str:
    """The report modulo kernel paths and hashes, numbers and line wrapping."""
    text = re.sub(r"\S*/kernels/(\w+?)_[0-9a-f]{16}\.py", r"<cache>/kernels/\1_<hash>.py", text)
    text = re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "<n>", text)
    return " ".join(text.split())


def _readme_sample() -> str:
    with open(quickstart.README) as f:
        doc = f.read()
    m = re.search(re.escape(quickstart.BEGIN) + r"\n```\n(.*?)```\n" + re.escape(quickstart.END), doc, re.S)
    assert m, f"README.md has no report sample between {quickstart.BEGIN!r} and {quickstart.END!r}"
    return m.group(1)


def test_normalise_keeps_what_matters():
    a = "kernel k: /x/kernels/attention_fwd_interp_c999ac8b2d95cda9.py est.  0.0272 ms\n   q=q_1"
    b = "kernel k: ~/.cache/fuser/kernels/attention_fwd_interp_0123456789abcdef.py est. 1.5e-05 ms q=q_1"
    assert _normalise(a) == _normalise(b)
    assert _normalise(a) != _normalise(a.replace("attention_fwd", "attention_bwd"))
    assert _normalise(a) != _normalise(a.replace("q=q_1", "q=q"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the README's sample is the CPU (interpreter) report")
def test_readme_report_sample_is_what_the_quickstart_prints():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--print-report"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = _normalise(r.stdout), _normalise(_readme_sample())
    assert got == want, (
        "README.md's report sample differs from what `python examples/quickstart.py --print-report` prints; "
        "run `python examples/quickstart.py --update-readme` (on a machine without a GPU) and review the diff.\n"
        f"printed:\n{r.stdout}"
    )
