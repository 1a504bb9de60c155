"""The README's guide to training stacks runs as written: the Python blocks of its
checkpointing, selective-checkpointing and compiled-autograd subsections, in order, in one
namespace (a later block uses what an earlier one defined), each checked for what its text
promises."""

from __future__ import annotations

import os
import re

import pytest
import torch

import fuser
from fuser import report
from fuser.codegen import attention as attention_kernels
from fuser.codegen import launch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
SECTION = "### Using fuser with DDP / FSDP2 / TP / CP / checkpointing / HF Trainer"
SUBSECTIONS = ("#### Activation checkpointing", "#### Selective activation checkpointing", "#### Compiled autograd")


def _blocks() -> dict:
    """{subsection heading: [its ```python blocks]} for the subsections above."""
    with open(README) as f:
        text = f.read()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text[text.index(SECTION):]
    section = section[:section.index("\n### ", 1)] if "\n### " in section[1:] else section
    out = {}
    for head in SUBSECTIONS:
        assert head in section, f"README.md's {SECTION!r} has no subsection {head!r}"
        body = section[section.index(head) + len(head):]
        body = body[:body.index("\n#### ")] if "\n#### " in body else body
        out[head] = re.findall(r"```python\n(.*?)```", body, re.S)
        assert out[head], f"no python block under {head!r}"
    return out


@pytest.fixture
def forwards(monkeypatch):
    """Counts the fused attention's forward kernel launches."""
    count = [0]
    orig = attention_kernels.forward

    def counting(*args, **kwargs):
        count[0] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "forward", counting)
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", False)
    return count


@torch._dynamo.config.patch(compiled_autograd=False)  # not monkeypatch: see test_checkpoint's note
def test_readme_training_guide_runs(forwards, capsys):
    blocks = _blocks()
    ns: dict = {"__name__": "readme"}
    torch._dynamo.reset()

    with report.collecting() as rep:
        for code in blocks[SUBSECTIONS[0]]:
            exec(compile(code, "README.md", "exec"), ns)
    printed = capsys.readouterr().out
    assert "inside torch.utils.checkpoint" in printed, printed
    # compiled(x) + backward: forward and its recomputation; then explain() runs it once more
    assert forwards[0] == 3
    # the compile before explain() (explain collects its own report)
    assert [m.pattern for m in rep.fused] == ["attention"] and not rep.rejected, str(rep)

    forwards[0] = 0
    torch._dynamo.reset()
    with report.collecting() as rep:
        for code in blocks[SUBSECTIONS[1]]:
            exec(compile(code, "README.md", "exec"), ns)
    assert torch.ops.fuser.attention.default in ns["save"]
    assert [m.pattern for m in rep.fused] == ["attention"], str(rep)
    assert forwards[0] == 1  # saved by the policy: not run again in the backward

    forwards[0] = 0
    torch._dynamo.reset()
    with report.collecting() as rep:
        for code in blocks[SUBSECTIONS[2]]:
            exec(compile(code, "README.md", "exec"), ns)
    assert rep.graphs == 2 and [m.pattern for m in rep.fused] == ["attention"], str(rep)
    assert forwards[0] == 2
    assert not torch._dynamo.config.compiled_autograd
