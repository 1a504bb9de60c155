"""The README's guide to training stacks runs as written: the Python blocks of its
checkpointing, selective-checkpointing and compiled-autograd subsections, in order, in one
namespace (a later block uses what an earlier one defined), and its HF Trainer block on a tiny
Llama, each checked for what its text promises."""

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


def _blocks(subsections=SUBSECTIONS) -> dict:
    """{subsection heading: [its ```python blocks]} for ``subsections`` of the guide."""
    with open(README) as f:
        text = f.read()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text[text.index(SECTION):]
    section = section[:section.index("\n### ", 1)] if "\n### " in section[1:] else section
    out = {}
    for head in subsections:
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


def _hf_trainer_run(tmp_path, code: str, name: str, dataset: list):
    """Runs ``code`` (the README's HF Trainer block, or it without fuser) in ``tmp_path``; returns
    (the Trainer's logged losses, the trained model, what fuser fused meanwhile)."""
    ns: dict = {"__name__": "readme", "name": name, "dataset": dataset}
    torch._dynamo.reset()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with report.collecting() as rep:
            exec(compile(code, "README.md", "exec"), ns)
    finally:
        os.chdir(cwd)
    state = ns["trainer"].state
    assert state.global_step == 2, state.global_step
    losses = [h["train_loss"] for h in state.log_history if "train_loss" in h]  # the run's mean loss
    return losses, ns["model"], rep


@pytest.mark.slow
@torch._dynamo.config.patch(compiled_autograd=False)
def test_readme_hf_trainer_block_runs(tmp_path, monkeypatch):
    """The README's HF Trainer block as written, on a tiny Llama saved to a folder (``name``) and
    a few token rows (``dataset``): both layers' attentions fused, and the Trainer's losses and
    the trained weights equal to the same block without the ``model.compile`` line; and the
    refusal the text describes for ``torch_compile_backend="fuser"``."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("FUSER_INTERPRET", "1")
    (code,) = _blocks(("#### HF Trainer",))["#### HF Trainer"]
    compile_line = 'model.compile(backend="fuser")'
    assert compile_line in code

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    name = str(tmp_path / "tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(name)
    rows = torch.randint(0, cfg.vocab_size, (16, 12), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": r, "labels": r} for r in rows]

    losses, model, rep = _hf_trainer_run(tmp_path, code, name, dataset)
    assert [m.pattern for m in rep.fused] == ["attention", "attention"] and not rep.rejected, str(rep)
    assert len(losses) == 1, losses
    want_losses, want_model, _ = _hf_trainer_run(tmp_path, code.replace(compile_line, "pass"), name, dataset)
    torch.testing.assert_close(losses, want_losses, rtol=1e-4, atol=1e-5)
    for (pname, a), b in zip(model.named_parameters(), want_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=pname)

    bad = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), torch_compile_backend="fuser",
                                         report_to=[])
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        transformers.Trainer(model=want_model, args=bad, train_dataset=dataset)
