"""Hugging Face transformers models built from tiny configs with random weights (no download),
with eager and with SDPA attention: every layer's attention is fused, logits and gradients
match eager."""

from __future__ import annotations

import pytest
import torch

import fuser

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _llama(attn="eager"):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(attn="eager"):
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("build,gqa", [(_llama, 2), (_gpt2, 1)], ids=["llama", "gpt2"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "attention_mask"])
def test_hf_model_fused_and_matches_eager(build, gqa, with_mask, attn):
    """Both attention implementations: the written-out softmax (eager) and transformers'
    default, F.scaled_dot_product_attention (sdpa)."""
    torch.manual_seed(0)
    model = build(attn).train()
    ids = torch.randint(0, 64, (2, 20))
    kw = {"use_cache": False}
    if with_mask:
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[1, -3:] = 0  # right padding on the second sequence
        kw["attention_mask"] = mask

    def run(m):
        return m(ids, **kw).logits

    rep = fuser.explain(run, model)
    assert len(rep.fused) == 2, str(rep)  # every layer
    for m in rep.fused:
        assert m.summary["gqa_group"] == gqa
        assert m.summary["causal"] == ("none" if with_mask else "top_left")
        assert (m.summary["softmax"] == "scaled_dot_product_attention") == (attn == "sdpa")
    compiled = torch.compile(run, backend="fuser")
    out_f = compiled(model)
    loss_f = out_f.float().logsumexp(-1).mean()
    gf = torch.autograd.grad(loss_f, list(model.parameters()))
    out_e = run(model)
    ge = torch.autograd.grad(out_e.float().logsumexp(-1).mean(), list(model.parameters()))
    # right padding under a causal mask leaves every query some visible key: all rows compare
    assert _rel(out_f, out_e) < 1e-4
    assert max(_rel(a, b) for a, b in zip(gf, ge) if b.norm() > 0) < 1e-3


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "attention_mask"])
def test_per_layer_compile_gets_the_causal_mask_as_data_and_skips_on_its_values(with_mask):
    """Each decoder layer compiled on its own (torchtitan's and FSDP2's order): transformers builds
    the causal mask outside the layer, so the compiled graph receives it as a plain tensor
    (``causal=none``, an additive data mask). fuser fuses it with the kernels that test the mask's
    values at run time (the mask-rows kernel in explain()'s kernels) and skip the key tiles it
    hides above the diagonal; logits and gradients equal eager's, right padding included."""
    from fuser import report

    torch.manual_seed(0)
    model = _llama("eager").train()
    ids = torch.randint(0, 64, (2, 40))
    kw = {"use_cache": False}
    if with_mask:
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, -7:] = 0
        kw["attention_mask"] = mask
    want = model(ids, **kw).logits
    ge = torch.autograd.grad(want.float().logsumexp(-1).mean(), list(model.parameters()))
    torch._dynamo.reset()
    with report.collecting() as rep:
        for layer in model.model.layers:
            layer.compile(backend="fuser", fullgraph=True)
        got = model(ids, **kw).logits
    gf = torch.autograd.grad(got.float().logsumexp(-1).mean(), list(model.parameters()))
    assert rep.fused and not rep.rejected, str(rep)  # each layer's graph (or one, reused)
    for m in rep.fused:
        assert m.summary["causal"] == "none" and m.summary["mask"].startswith("additive"), m.summary
        assert any(k.name.startswith("attention_mask_rows_maskadd") for k in m.kernels), [k.name for k in m.kernels]
    assert "run-time test of its values" in " ".join(str(rep).split()), str(rep)  # (the report wraps lines)
    assert _rel(got, want) < 1e-4
    assert max(_rel(a, b) for a, b in zip(gf, ge) if b.norm() > 0) < 1e-3
