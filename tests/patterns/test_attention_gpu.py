"""Attention through torch.compile on the GPU: bf16/fp16 at real sizes, the planner's choices,
real models. Marked ``gpu``: skipped without CUDA, run on the device machine."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

import fuser

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {"fuser.plan": "attention.impl=fuser"}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def causal_attn(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    hide = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(hide, float("-inf")).float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,d", [(1000, 64), (2048, 128)])
def test_compiled_causal_fwd_bwd_matches_float64(dtype, n, d):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    out = torch.compile(causal_attn, backend="fuser", options=KERNELS)(q, k, v)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = causal_attn(*ref_in)
    g = torch.randn_like(ref)
    assert _rel(out, ref) < 2e-2
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g.to(dtype)), torch.autograd.grad(ref, ref_in, g)):
        assert not torch.isnan(a).any() and _rel(a, b) < 3e-2


def test_planner_uses_sdpa_for_plain_causal_and_fuser_for_padding_masks():
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(4, 1, 1, 4096, device="cuda") > 0.1

    def padded(q, k, v, keep):
        s = q @ k.transpose(-2, -1) * 0.088
        return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v

    with torch.no_grad():
        rep = fuser.explain(causal_attn, q, k, v)
        assert [m.plan.name for m in rep.matches] == ["sdpa"], str(rep)
        assert _rel(rep.output, causal_attn(q, k, v)) < 1e-2
        rep = fuser.explain(padded, q, k, v, keep)
        assert [m.plan.name for m in rep.matches] == ["fuser"], str(rep)
        assert _rel(rep.output, padded(q.float(), k.float(), v.float(), keep)) < 2e-2


def test_example_model_bf16_training_step():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, max_seq=512).cuda()
    idx = torch.randint(0, 256, (2, 512), device="cuda")
    ref_out = model(idx)
    ref_g = torch.autograd.grad(ref_out.float().logsumexp(-1).mean(), list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fuser", options=KERNELS)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = compiled(idx)
    g = torch.autograd.grad(out.float().logsumexp(-1).mean(), list(model.parameters()))
    assert _rel(out, ref_out) < 3e-2
    assert max(_rel(a, b) for a, b in zip(g, ref_g) if b.norm() > 0) < 6e-2


def test_hf_llama_bf16_dynamic():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fuser", dynamic=True, options=KERNELS)
    with torch.no_grad():
        for n in (300, 517):
            ids = torch.randint(0, 128, (2, n), device="cuda")
            assert _rel(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits) < 3e-2


def test_autotune_times_candidates_and_caches_winners(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path))
    from fuser.codegen import launch

    monkeypatch.setattr(launch, "_tune_mem", {})
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1500, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    rep = fuser.explain(causal_attn, q, k, v, options={"fuser.autotune": True, "fuser.plan": "attention.impl=fuser"})
    assert rep.fused[0].plan.name == "fuser[backward=autotune]", str(rep)
    out = rep.output
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = causal_attn(*ref_in)
    g = torch.randn_like(ref)
    assert _rel(out, ref) < 2e-2
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g.to(out.dtype)), torch.autograd.grad(ref, ref_in, g)):
        assert _rel(a, b) < 3e-2
    tuned = json.loads((tmp_path / "autotune.json").read_text())
    assert any(key.startswith("attention.fwd|") for key in tuned) and any(key.startswith("attention.bwd|") for key in tuned)
    assert any("bwd_mode" in cfg for key, cfg in tuned.items() if key.startswith("attention.bwd|"))


DYN_VARIANTS = {
    # KV cache and prefill: bottom-right causal with transformers' finite fill added (finfo.min),
    # no mask tensor: the tile-skipping flag depends on Nk - Nq, which may be negative
    "bottom_right_fill": ("bottom_right", "none", None, (-math.inf, torch.finfo(torch.float32).min, "add")),
    # a padding mask [B, 1, 1, Nk] (bool, keep) at top-left causal
    "padding_causal": ("top_left", "bool_keep", "bool", (-math.inf, -math.inf, "replace")),
    # an additive [B, 1, Nq, Nk] mask: the mask-skipping flag tested at diagonal Nk - Nq
    "additive": ("none", "additive", "float", (-math.inf, -math.inf, "replace")),
}


@pytest.mark.parametrize("variant", list(DYN_VARIANTS))
def test_dynamic_lengths_launch_the_kernels_from_inductor(variant):
    # lengths marked dynamic (as after a recompile for a new length): the op's forward and backward
    # are traced with symbolic Nq, Nk and batch, launched by Inductor's wrapper (no opaque fuser op
    # left), and lengths with Nq < Nk, Nq = Nk and Nq > Nk all match float64 from one graph; traced
    # at multiples of 16 and run at lengths that are not (a length's divisibility must not be baked in)
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from fuser.patterns.attention_reference import reference

    causal, mask_kind, mask_of, (mask_fill, causal_fill, causal_fill_mode) = DYN_VARIANTS[variant]
    plan = "backward=two_kernel;autotune=0"
    fills = (mask_fill, causal_fill, causal_fill_mode, "", [], -math.inf, "replace")

    def attn(q, k, v, mask):
        return torch.ops.fuser.attention(q, k, v, mask, 0.125, causal, mask_kind, True, plan, *fills)[0]

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(attn, backend="fuser")
    codes = []
    for step, (b, nq, nk) in enumerate(((2, 128, 256), (3, 257, 257), (2, 300, 120), (4, 1000, 1700))):
        torch.manual_seed(step)
        q = torch.randn(b, 4, nq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, 2, nk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        mask = None
        if mask_of == "bool":
            mask = torch.rand(b, 1, 1, nk, device="cuda") > 0.2
            mask[..., 0] = True  # every row keeps key 0 at top-left causal
        elif mask_of == "float":
            mask = torch.where(torch.rand(b, 1, nq, nk, device="cuda") > 0.3, 0.0, -1e4)
        if step == 0:
            for t, dims in ((q, (0, 2)), (k, (0, 2)), (v, (0, 2)), (mask, (0, 2, 3) if mask_of == "float" else (0, 3))):
                if t is not None:
                    for d in dims:
                        torch._dynamo.mark_dynamic(t, d)
        g = torch.randn(b, 4, nq, 64, device="cuda", dtype=torch.bfloat16)

        def run():
            out = f(q, k, v, mask)
            return out, torch.autograd.grad(out, (q, k, v), g)

        if step == 0:  # the compile: forward and backward code
            (out, grads), got = run_and_get_code(run)
            codes += got
        else:
            out, grads = run()
        ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref, _ = reference(*ref_in, scale=0.125, causal=causal, mask=mask, mask_kind=mask_kind,
                           mask_fill=mask_fill, causal_fill=causal_fill, causal_fill_mode=causal_fill_mode)
        assert not torch.isnan(out).any() and _rel(out, ref) < 1e-2, (variant, b, nq, nk)
        for a, r in zip(grads, torch.autograd.grad(ref, ref_in, g.double())):
            assert not torch.isnan(a).any() and _rel(a, r) < 2e-2, (variant, b, nq, nk)
    code = "\n".join(codes)
    assert "torch.ops.fuser" not in code, code  # no opaque op: Inductor launches the kernels
    assert all(f"def {name}" in code for name in ("attention_fwd_kernel", "attention_bwd_dkdv", "attention_bwd_dq")), code
    assert counters["stats"]["unique_graphs"] <= 1, dict(counters["stats"])
