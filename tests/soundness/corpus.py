"""Minimal programs of the failure classes the fuzzer found (issue 8), as specs.

Each :class:`Case` is the minimal program of one failure class: shrunk by
``python -m tests.soundness.fuzz`` from a failing random program (the ``.json`` next to each
``_min.py`` it writes holds the spec), or, for the classes the issue lists that the random
runs reached less often, written directly in the grammar. ``render(case.spec).source`` is the
program; ``test_fuzz.py::test_known_failure`` runs each one against eager.
"""

from __future__ import annotations

import dataclasses

from .grammar import Spec
from .kda_grammar import KDASpec


@dataclasses.dataclass(frozen=True)
class Case:
    """A failure class: a short ``name``, what goes wrong (``note``), and its minimal ``spec``."""

    name: str
    note: str
    spec: Spec
    #: a failure class found and reported whose fix belongs elsewhere: the test is a strict xfail
    #: with this reason (remove it with the fix)
    xfail: str = ""


_TRAIN = dict(grad="train", grad_inputs=("q", "k", "v"))

CASES = [
    # -- in-place writes between the scores and P V: the fused op reads the written tensor
    Case("inplace_q_inside", "q.add_(1) after the softmax, before P V: fuser uses the new q",
         Spec(calls=((4, 4),), inplace=(("inside_late", "q", "add_"),))),
    Case("inplace_v_inside_gqa", "v.add_(1) after the softmax: fuser reads v un-repeated, after the write",
         Spec(group=2, gqa="repeat_interleave", inplace=(("inside_late", "v", "add_"),))),
    Case("inplace_mask_inside", "keep.fill_(True) after the mask was applied: fuser reads the written mask",
         Spec(mask="padding", polarity="keep", mask_apply="where", empty_row=True, batch=2,
              inplace=(("inside_late", "mask", "fill_"),))),
    Case("inplace_kl_inside", "attention-KL: q2.mul_(2) after the scores: fuser uses the new q2",
         Spec(pattern="attention_kl", inplace=(("inside", "q2", "mul_"),))),
    Case("inplace_mul_before_counted_as_scale", "k.mul_(2) before the scores: fuser takes it for a scale factor of 2 "
         "AND reads the written k (factor applied twice)",
         Spec(inplace=(("before", "k", "mul_"),))),
    Case("inplace_mul_before_kl", "attention-KL: k1.mul_(2) before the teacher's scores, the same (scale1=2 reported)",
         Spec(pattern="attention_kl", inplace=(("before", "k1", "mul_"),), calls=((3, 3),))),
    # -- masks broadcasting beyond q's batch/heads
    Case("mask_beyond_heads_static", "a static mask expanded to 2 heads when q has 1: RuntimeError (expand); at N=1 a wrong output shape",
         Spec(mask="prefix", mask_shape="beyond_heads")),
    Case("mask_beyond_heads_data", "a data mask with 2 heads when q has 1: RuntimeError (expand) at run time",
         Spec(mask="data_bool", mask_shape="beyond_heads")),
    Case("mask_beyond_batch_data", "a data bias with batch 2 when q has batch 1: RuntimeError (expand)",
         Spec(mask="data_bias", mask_shape="beyond_batch")),
    # -- in-place writes after the region on tensors the fused backward saves
    Case("inplace_out_after_train", "o.mul_(2) after the region in training: compile fails (saved tensor written)",
         Spec(inplace=(("after", "out", "mul_"),), **_TRAIN)),
    Case("inplace_q_after_train", "q.add_(1) after the region, only q needs grad (eager saves k, not q): compile fails",
         Spec(inplace=(("after", "q", "add_"),), grad="train", grad_inputs=("q",))),
    Case("inplace_kl_teacher_after", "attention-KL: q1.add_(1) after the loss, teacher without grad: compile fails",
         Spec(pattern="attention_kl", inplace=(("after", "q1", "add_"),), grad="train", grad_inputs=("q2", "k2"))),
    # -- grad modes
    Case("no_grad_block_softmax", "softmax under torch.no_grad(): fuser returns a gradient for k (eager: None)",
         Spec(no_grad_block="softmax", grad="train", grad_inputs=("k", "v"))),
    # -- dynamic shapes
    Case("window_dynamic", "sliding window (w=32) first compiled at N=30 (dynamic=True): classified causal, wrong at N=48",
         Spec(mask="window", window=32, builder="arange", calls=((30, 30), (48, 48)), dynamic=True)),
    Case("window_automatic_dynamic", "sliding window, automatic dynamic: dynamic graph compiled at N=31, wrong at N=48",
         Spec(mask="window", window=32, builder="arange", calls=((30, 30), (31, 31), (48, 48)), dynamic=None)),
    Case("prefix_lm_dynamic", "prefix-LM (j <= i) | (j < 40) first compiled at N=30: all-visible, wrong at N=48",
         Spec(mask="prefix", prefix=40, builder="arange", calls=((30, 30), (48, 48)), dynamic=True)),
    Case("head_dim_257_dynamic", "head dim 257 under dynamic=True: fused anyway, ValueError at run time",
         Spec(head_dim=257, head_dim_v=257, dynamic=True, calls=((4, 4),))),
    Case("scale_from_length_recompiles", "scale q.size(-2) ** -0.5 under dynamic=True: a recompile per length",
         Spec(scale="pow_n", dynamic=True, calls=((16, 16), (24, 24)))),
    # -- values assumed constant
    Case("data_mask_named_buffers", "an argument named cache_buffers_mask is evaluated as a constant buffer",
         Spec(mask="data_bool", mask_name="cache_buffers_mask", data_values="visible_first", calls=((16, 16), (16, 16)))),
    Case("param_in_rel_buffers_train", "a learned bias in a submodule named rel_buffers: no gradient for it",
         Spec(mask="param_bias", module_name="rel_buffers", data_values="visible_first", grad="train",
              grad_inputs=("q",), between="param_bias_update", calls=((16, 16), (16, 16)))),
    Case("param_in_rel_buffers_update", "... and its update between calls is not seen (inference)",
         Spec(mask="param_bias", module_name="rel_buffers", data_values="visible_first", grad="no_grad",
              grad_inputs=("q",), between="param_bias_update", calls=((16, 16), (16, 16)))),
    Case("temperature_buffer_baked", "scores / self.temp (0-dim buffer), temp.fill_(0.5) between calls: not seen",
         Spec(scale="buffer_temp", between="temp_fill", calls=((16, 16), (16, 16)))),
    # -- finite fills
    Case("finite_fill_above_scores", "masked_fill(hide, -1e4) with scores around -2e4: the hidden keys win in eager",
         Spec(mask="causal_tl", fill="-1e4", shift=-20000.0)),
    Case("additive_finite_causal_nq_gt_nk", "additive finfo.min bottom-right causal mask, Nq > Nk: fuser 0, eager uniform",
         Spec(mask="causal_br", mask_apply="additive", fill="finfo_min", calls=((24, 8),))),
    # -- found by the long run after the issue-8 fixes
    Case("shift_before_finite_fill", "s - 40000 then where(keep, s, -3e4): the shift was dropped as "
         "softmax-invariant, but the fill replaces only the hidden scores",
         Spec(mask="causal_tl", fill="-1e4", shift=35.0, **_TRAIN)),
    Case("learned_temperature_only_grad", "a learned temperature is the only tensor that needs grad: the fused "
         "op stored no LSE and its backward failed",
         Spec(scale="param_temp", calls=((4, 4),))),
    Case("learned_temperature_q_written_inside", "a learned temperature, then q.mul_(2) between the softmax and "
         "P V: the scale applied to q saved q for its gradient, and the write broke the backward's trace",
         Spec(scale="param_temp", calls=((4, 4),), inplace=(("inside_late", "q", "mul_"),))),
    Case("nomax_softmax_row_underflows", "exp(s) / exp(s).sum() with a row filled by -3e4: eager 0/0 = NaN, fuser "
         "the softmax's value (documented); the oracle subtracts the max there",
         Spec(calls=((2, 2),), softmax="hand_nomax", mask="data_bool", fill="-3e4", empty_row=True)),
    # -- the oracle's own mistake, kept so it stays fixed: eager's log(softmax) is NaN (0 * log 0
    #    on the visible keys, which a -100 fill outweighs by e^19900); the limit oracle replaced
    #    the finite fill by -1e300 and so hid the keys that carry all the mass (fuser: 0, right)
    Case("kl_limit_oracle_keeps_finite_fill", "attention-KL, log(softmax), scores ~-2e4 with padding filled "
         "by -100: the limit must keep the fill",
         Spec(pattern="attention_kl", batch=2, calls=((16, 40),), shift=-20000.0, mask="padding", fill="-100",
              kl_spelling="kl_probs_log")),
    # -- H2O: a query row with no visible key is NaN in eager's softmax, so is every column sum of
    #    its (batch, head); fuser skipped the row (issue 9, fuzzer seed 23000310)
    Case("h2o_bottom_right_rows_without_keys", "H2O, bottom-right causal with Nq > Nk: the first rows see no key, "
         "eager's scores are NaN, fuser summed the other rows",
         Spec(seed=23000310, calls=((8, 7),), mask="causal_br", score="sum")),
    Case("h2o_data_mask_row_without_keys", "H2O, scores only, a boolean data mask hiding every key of one row: "
         "eager's scores of that (batch, head) are NaN",
         Spec(batch=2, calls=((6, 9),), mask="data_bool", empty_row=True, score="score_only")),
    # -- KDA loops (python -m tests.soundness.fuzz --pattern kda)
    Case("kda_buffer_symbolic_time_axis", "KDA loop recompiled under dynamic=True at a second length: Dynamo gives "
         "v its own time symbol, o = zeros(v.shape) may outlast the loop; the pattern took the example's length "
         "and the pass's shape check failed the rewrite (internal error)",
         KDASpec(steps=(8, 2), dynamic=True, assembly="zeros")),
    Case("kda_chunk_half_inputs", "KDA, float16 inputs upcast to a float32 state, the chunk plan forced: its dots "
         "took bfloat16 operands, 1.8e-2 max relative error where eager's float32 loop has 2e-4 (T=8); fixed: "
         "float32 workspaces (codegen/kda_chunk.workspace_dtype)",
         KDASpec(dtype="float16", plan="chunk", steps=(8,), upcast="step", batch=2, heads=2, key_dim=12,
                 value_dim=10)),
]
