"""H2O heavy-hitter scores in a Hugging Face Llama, compiled with ``backend="fuser"``.

H2O (Zhang et al., NeurIPS 2023) keeps, in each layer's KV cache, the keys that have received
the most attention so far: every attention call adds the column sums of its probabilities,
``attn_weights.sum(0).sum(1)`` (over the batch, then over the queries: one score per head and
key), to the layer's accumulated score. Written in eager PyTorch that materialises P, a
``[B, H, Nq, Nk]`` tensor, per layer; fuser recognises the softmax, ``P V`` and the column sums
as one region and runs two Triton kernels instead (the attention forward, then a column pass).

This is transformers' own ``LlamaForCausalLM`` (``transformers`` 5.x), with its attention
swapped the way transformers provides for it: an attention function registered under a name
(``AttentionInterface.register``) and selected with ``config._attn_implementation``. The function
is transformers' ``eager_attention_forward`` (``repeat_kv`` GQA, the softmax in float32 cast back
to the input dtype, dropout) plus the H2O score, and it returns no attention weights. A mask
function is registered under the same name (``AttentionMaskInterface.register``).

What a real model needs for the region to be fused (what this example does):

* **The mask.** transformers' own ``eager`` mask is ``torch.where(allowed, 0, finfo(dtype).min)``
  built from ``arange`` comparisons inside the compiled graph: fuser proves it causal, with a
  finite fill (``finfo.min`` added); the H2O kernels take it (two_kernel: the attention forward
  and the column pass skip the tiles above the diagonal when a run-time bound proves their
  weights are exactly 0, and visit them otherwise) — ``--mask eager`` runs it, ``explain()``
  shows ``causal_fill=-3.40282e+38 (add)``. With a padding ``attention_mask`` the same eager mask
  depends on that input: it is data, an additive mask the kernels load, and it is fused too. The
  default here is transformers' ``sdpa_mask`` (True where a key is visible) with
  ``allow_is_causal_skip=False``, applied with ``masked_fill(~mask, -inf)``. (Without
  ``allow_is_causal_skip=False``, ``sdpa_mask`` returns None for an unpadded prefill run eagerly
  — SDPA would then use ``is_causal`` — so an eager attention function would silently attend to
  the future, while the same code traced by Dynamo builds the mask.) A 4-D additive mask passed
  in by the caller (``finfo.min`` where hidden) is fused too: it is data, loaded by the kernels.
* **No attention weights returned** (``output_attentions`` off): P used anywhere else than
  ``P V`` and the score would have to exist.
* **``torch.no_grad()``**: the fused H2O op has no backward yet.

Run::

    python examples/h2o_llama.py                # prefill + decode steps; compares to eager
    python examples/h2o_llama.py --mask eager   # transformers' own finfo.min eager mask

On a CUDA GPU it runs a larger model in bfloat16; without one, a tiny model in float32 with
fuser's kernels in Triton's interpreter (``options={"fuser.interpret": True}``; slow, exact).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import fuser

try:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.llama.modeling_llama import repeat_kv
except ImportError as exc:  # pragma: no cover - the example needs transformers 5.x
    raise SystemExit(f"this example needs transformers 5.x ({exc})")


def h2o_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' ``eager_attention_forward`` with the H2O score: the column sums of the
    attention probabilities, summed over the batch and the queries (``[heads, keys]``), added
    to the layer's accumulated score ``module.hh_score`` (its keys are the first of the new
    ones: the cache only grows here). Returns no attention weights."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # True where the key is visible (sdpa_mask)
            attn_weights = attn_weights.masked_fill(~attention_mask, float("-inf"))
        else:  # an additive float mask (transformers' eager mask, or one passed in)
            attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)

    score = attn_weights.sum(0).sum(1)  # H2O's reference spelling: batch, then queries
    if module.hh_score is not None:
        score[:, : module.hh_score.shape[-1]] += module.hh_score
    module.hh_score = score

    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


def h2o_mask(*args, **kwargs):
    """transformers' boolean ``sdpa_mask`` (True = visible), never skipped: eager and compiled
    runs both get the causal mask."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register("h2o", h2o_attention)
AttentionMaskInterface.register("h2o", h2o_mask)
AttentionInterface.register("h2o_eager_mask", h2o_attention)
AttentionMaskInterface.register("h2o_eager_mask", eager_mask)


def setup(mask: str):
    """The model, its prompt and the compile options for this machine."""
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device, dtype, options = "cuda", torch.bfloat16, None
        sizes = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=4)
        batch, prompt = 2, 512
    else:
        device, dtype, options = "cpu", torch.float32, {"fuser.interpret": True}
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
        batch, prompt = 2, 20
    config = LlamaConfig(vocab_size=256, max_position_embeddings=4096, **sizes)
    config._attn_implementation = "h2o" if mask == "bool" else "h2o_eager_mask"
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    for layer in model.model.layers:
        layer.self_attn.hh_score = None  # the H2O score accumulated so far (none yet)
    ids = torch.randint(0, config.vocab_size, (batch, prompt), device=device)
    return model, ids, options, dtype


def generate(model: nn.Module, ids: torch.Tensor, next_tokens: torch.Tensor):
    """A prefill of ``ids`` and one decode step per column of ``next_tokens`` (given, so that
    eager and compiled runs see the same tokens), with a KV cache. Returns every step's logits
    and each layer's accumulated H2O score."""
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.hh_score = None
    cache = DynamicCache(config=model.config)
    logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits]
    for t in range(next_tokens.shape[1]):
        logits.append(model(input_ids=next_tokens[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    return logits, [layer.self_attn.hh_score for layer in layers]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in float64 (Frobenius norms)."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mask", choices=("bool", "eager"), default="bool",
                    help="bool: sdpa_mask applied with -inf (fused); eager: transformers' finfo.min eager mask "
                         "(built in the graph: a causal mask with a finite fill, fused too)")
    ap.add_argument("--decode-steps", type=int, default=2)
    args = ap.parse_args(argv)
    model, ids, options, dtype = setup(args.mask)
    with torch.no_grad():
        # eager first: the reference, and the decode tokens both runs are fed
        first = model(input_ids=ids).logits[:, -1:].argmax(-1)
        tokens = torch.cat([first, torch.randint(0, 256, (ids.shape[0], max(args.decode_steps - 1, 0)),
                                                 device=ids.device)], 1)[:, : args.decode_steps]
        want_logits, want_scores = generate(model, ids, tokens)
        want_scores = [s.clone() for s in want_scores]
        report = fuser.explain(generate, model, ids, tokens, options=options)
    got_logits, got_scores = report.output
    print(report)

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    errs = [rel_err(g, w) for g, w in zip(got_scores, want_scores)]
    lerrs = [rel_err(g, w) for g, w in zip(got_logits, want_logits)]
    n_layers = len(model.model.layers)
    calls = n_layers * (1 + args.decode_steps)
    fused = [m for m in report.fused if m.pattern == "h2o"]
    print(f"\nH2O scores [heads, keys] per layer after the prefill and {args.decode_steps} decode steps: "
          f"relative error to eager {max(errs):.2e}; logits {max(lerrs):.2e} (tolerance {tol:g})")
    print(f"h2o regions fused: {len(fused)} of {calls} attention calls "
          f"({n_layers} layers x {1 + args.decode_steps} steps)")
    if max(errs + lerrs) > tol:
        print("MISMATCH: fuser's results differ from eager's beyond the tolerance", file=sys.stderr)
        return 1
    if args.mask == "bool" and len(fused) != calls:
        print("expected every attention call to be fused", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
