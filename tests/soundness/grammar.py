"""A small grammar of attention and attention-KL programs, rendered to real Python source.

A program is described by a :class:`Spec`: a flat, frozen record of choices (spelling of
``Q Kᵀ`` and ``P V``, softmax form, scale, mask and how it is built and applied, GQA, in-place
writes, grad mode, sizes and the sequence of calls, dtype, dynamic shapes, ...). Every field
has a *simplest* default, so a failing program can be shrunk by resetting fields one at a
time (:mod:`.minimise`). :func:`sample` draws a spec from a ``random.Random``; :func:`render`
turns it into a :class:`Program`: the source text of a self-contained Python module that
defines

- ``program(...)`` (a function) or ``Program`` (an ``nn.Module``, when buffers or parameters
  are needed),
- ``make_inputs(n_q, n_k, seed, dtype, call)``: the input tensors of call number ``call``, seeded,
- ``between_calls(m)`` (modules only, optional): a state change between two calls,
- ``CALLS`` (the ``(n_q, n_k)`` of each call), ``DYNAMIC``, ``DTYPE``, ``GRAD``, ``GRAD_INPUTS``.

The runner executes exactly that text, so a failure prints a program that can be pasted and
run as it is. Rendering is deterministic: the same spec gives the same source.
"""

from __future__ import annotations

import dataclasses
import random
import re
import textwrap
from typing import Optional

# --------------------------------------------------------------------------------------------
# Choices
# --------------------------------------------------------------------------------------------

PATTERNS = ("attention", "attention_kl")
#: H2O heavy-hitter scores read from the attention probabilities P (attention programs only):
#: ``"none"``; column sums ``P.sum(-2)`` or ``torch.sum(P, -2)`` returned next to ``O`` (as one
#: flat tensor, ``torch.cat``); ``"score_only"``: the column sums alone (no ``P V``)
SCORES = ("none", "sum", "torch_sum", "score_only")
QK_FORMS = ("@", "matmul", "method", "einsum", "einsum_ellipsis", "bmm")
KT_FORMS = ("transpose", "mT", "permute")
PV_FORMS = ("@", "matmul", "einsum")
SOFTMAX_FORMS = ("F.softmax", "torch.softmax", "method", "f32", "float_type_as",
                 "hand_amax", "hand_max", "hand_amax_detach", "hand_nomax")
P_THROUGH = ("none", "dropout0", "dropout_eval", "contiguous", "cast")
SCALES = ("none", "number", "sqrt_d", "pow_d", "pow_n", "full", "buffer_temp", "param_temp", "negative")
SCALE_ON = ("scores", "q", "both", "after_mask")
MASKS = ("none", "causal_tl", "causal_br", "window", "prefix", "padding", "data_bool", "data_bias",
         "param_bias", "buffer_bias")
STATIC_MASKS = ("causal_tl", "causal_br", "window", "prefix")
BUILDERS = ("tril", "arange", "buffer", "buffer_float")
MASK_APPLY = ("masked_fill", "masked_fill_", "where", "additive")
#: fill values and their source text (``{s}``: the scores variable)
FILLS = {
    "-inf": 'float("-inf")',
    "finfo_min": "torch.finfo({s}.dtype).min",
    "-1e4": "-1e4",
    "-3e4": "-30000.0",
    "-1e9": "-1e9",
    "-100": "-100.0",
    "-5": "-5.0",
    # only in the runner's oracle variants (see Program.variant): never sampled
    "-1e300": "-1e300",
}
#: fills at or below fuser's "hides the key" threshold (-1e4)
HIDING_FILLS = ("-inf", "finfo_min", "-1e4", "-3e4", "-1e9")
MASK_SHAPES = ("2d", "4d", "batch", "bhnn", "beyond_batch", "beyond_heads")
GQA_FORMS = ("none", "repeat_interleave", "repeat_kv")
GRAD_MODES = ("none", "train", "no_grad")
NO_GRAD_BLOCKS = ("none", "mask", "scores", "softmax", "pv")
DETACH = ("none", "q", "k", "v", "scores", "p")
POSITIONS = ("before", "inside", "inside_late", "after")
ATTN_TARGETS = ("q", "k", "v", "mask", "s", "out")
KL_TARGETS = ("q1", "k1", "q2", "k2", "mask", "out")
OPS = ("mul_", "add_")
BETWEEN = ("none", "temp_fill", "param_temp_update", "param_bias_update", "mask_buffer_fill")
KL_SPELLINGS = ("kl_log_target", "kl_probs", "kl_probs_log", "logsoftmax_diff", "log_p")
KL_REDUCTIONS = ("batchmean", "sum", "mean", "rows", "rows_mean", "all_sum", "all_mean")
#: softmax forms pinned to float32 -> the same function at the input's dtype
GENERIC_SOFTMAX = {"f32": "F.softmax", "float_type_as": "F.softmax"}
#: spellings of the KL terms with log(softmax) -> the same function through log_softmax
STABLE_KL = {"kl_probs_log": "kl_probs", "log_p": "logsoftmax_diff"}
KL_TEACHER = ("trainable", "no_grad", "detach")
DATA_MASK_NAMES = ("mask", "attn_mask", "key_padding_mask", "cache_buffers_mask")
BUFFER_NAMES = ("causal_mask", "bias", "tril")
MODULE_NAMES = ("rel", "pos_bias", "rel_buffers")
BUFFER_N = 64  # registered buffers are BUFFER_N x BUFFER_N and sliced to the call's sizes
LENGTHS = (1, 2, 3, 5, 8, 13, 16, 17, 24, 30, 31, 32, 33, 40, 47, 48)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One program. Each field's default is its simplest choice (what :mod:`.minimise`
    resets it to); :func:`normalize` makes combinations consistent.

    Sizes: ``batch``, ``kv_heads``, ``group`` (GQA: q has ``kv_heads * group`` heads),
    ``head_dim`` (D; the teacher's for attention-KL), ``head_dim_v`` (Dv; the student's D for
    attention-KL), ``calls`` (``(n_q, n_k)`` of each call, in order), ``dynamic`` (True,
    False, or None for automatic dynamic shapes), ``dtype`` (``"float32"``/``"float16"``),
    ``layout`` (``"bhnd"`` or ``"bnhd"`` inputs), ``magnitude`` (q and k are multiplied by it:
    large scores), ``shift`` (a constant added to every score).

    Spelling: ``qk`` (``@``, ``torch.matmul``, ``Tensor.matmul``, einsum, bmm on 3-D views),
    ``kt`` (how Kᵀ is written), ``pv``, ``softmax``, ``p_through`` (between P and P V),
    ``out_post`` (a layout change of the output).

    Scale: ``scale`` (form), ``scale_value`` (for numbers), ``scale_on`` (scores, q, q and k,
    or scores after the mask).

    Mask: ``mask`` (what is hidden), ``builder`` (tril/triu, arange comparisons, a registered
    bool or float buffer), ``polarity`` (``"hide"`` or ``"keep"`` boolean), ``mask_apply``,
    ``fill``, ``mask_shape`` (broadcasting, incl. beyond q's batch/heads), ``window``,
    ``prefix``, ``empty_row`` (data masks: one query row sees no key), ``data_values``
    (``"visible_first"``: a data mask hides nothing at the first call, a learned bias starts at
    zero; ``"causal"``: a data mask with a causal mask's values, as transformers passes it to a
    block compiled on its own — bottom-right, hidden above the diagonal (``finfo.min`` for a
    bias) — and at later calls sometimes changed: keys at the right hidden (padding), an entry
    above the diagonal visible, an entry on or below it hidden or biased; the values fuser's
    run-time mask test reads), ``mask_name`` (argument
    or buffer name), ``module_name`` (submodule holding a learned bias).

    Gradients: ``grad`` (``"none"``: no input requires grad; ``"train"``; ``"no_grad"``: inputs
    require grad but the calls run under ``torch.no_grad()``), ``grad_inputs``,
    ``no_grad_block`` (a ``with torch.no_grad():`` around part of the region), ``detach``.

    Side effects: ``inplace`` (``(position, target, op)`` writes), ``between`` (a state change
    of the module between calls).

    Attention-KL: ``kl_spelling``, ``kl_reduction``, ``kl_teacher`` (trainable, under
    ``torch.no_grad()``, or ``.detach()``), ``kl_zeroing`` (terms zeroed by the mask),
    ``kl_factor`` (a ``T**2``-style factor), ``kl_mask_sides`` (``"both"`` or ``"student"``),
    ``gqa_side``.

    ``seed``: seeds the inputs (not shrunk).
    """

    pattern: str = "attention"
    seed: int = 0
    # sizes and calls
    batch: int = 1
    kv_heads: int = 1
    group: int = 1
    head_dim: int = 8
    head_dim_v: int = 8
    calls: tuple = ((16, 16),)
    dynamic: Optional[bool] = False
    dtype: str = "float32"
    layout: str = "bhnd"
    magnitude: float = 1.0
    shift: float = 0.0
    # spelling
    qk: str = "@"
    kt: str = "transpose"
    pv: str = "@"
    softmax: str = "torch.softmax"
    p_through: str = "none"
    out_post: str = "none"
    # scale
    scale: str = "none"
    scale_value: float = 0.25
    scale_on: str = "scores"
    # mask
    mask: str = "none"
    builder: str = "tril"
    polarity: str = "hide"
    mask_apply: str = "masked_fill"
    fill: str = "-inf"
    mask_shape: str = "2d"
    window: int = 8
    prefix: int = 8
    empty_row: bool = False
    data_values: str = "random"
    mask_name: str = "mask"
    module_name: str = "rel"
    gqa: str = "none"
    # gradients
    grad: str = "none"
    grad_inputs: tuple = ()
    no_grad_block: str = "none"
    detach: str = "none"
    # side effects
    inplace: tuple = ()
    between: str = "none"
    # attention-KL
    kl_spelling: str = "kl_log_target"
    kl_reduction: str = "batchmean"
    kl_teacher: str = "trainable"
    kl_zeroing: bool = False
    kl_factor: bool = False
    kl_mask_sides: str = "both"
    gqa_side: str = "both"
    # H2O
    score: str = "none"

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def is_kl(self) -> bool:
        return self.pattern == "attention_kl"

    @property
    def needs_module(self) -> bool:
        return (
            self.scale in ("buffer_temp", "param_temp")
            or (self.mask in STATIC_MASKS and self.builder in ("buffer", "buffer_float"))
            or self.mask in ("param_bias", "buffer_bias")
        )

    def features(self) -> dict:
        """The fields that differ from their defaults (a compact description)."""
        base = Spec(pattern=self.pattern, seed=self.seed)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("pattern", "seed") and getattr(self, f.name) != getattr(base, f.name)}


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

def _maybe(rng: random.Random, p: float, value, default):
    return value if rng.random() < p else default


def _data_values(u: float) -> str:
    """``Spec.data_values`` from one uniform draw (one draw whatever the outcome, so the fields
    drawn after it are the same as when it had two outcomes)."""
    return "visible_first" if u < 0.3 else "causal" if u < 0.55 else "random"


def sample(rng: random.Random, seed: int = 0) -> Spec:
    """Draw a random program. Each feature is non-default with a moderate probability, so
    most programs combine a few adversarial features with an otherwise fusable attention."""
    kl = rng.random() < 0.3
    dtype = "float16" if rng.random() < 0.15 else "float32"
    dynamic = rng.choice([True, False, None])
    mask = rng.choice(MASKS[1:]) if rng.random() < 0.75 else "none"
    # sizes: small and ragged; window/prefix masks are often called first at a length where
    # they look causal or all-visible
    big_d = rng.random() < 0.03
    d = 257 if big_d else rng.choice([4, 8, 8, 16, 5])
    dv = rng.choice([d, d, 8, 16]) if not big_d else d
    ncalls = {None: 2, True: rng.choice([1, 2]), False: rng.choice([1, 1, 2])}[dynamic]
    calls = []
    for _ in range(ncalls):
        nq = rng.choice(LENGTHS)
        nk = nq if rng.random() < 0.6 else rng.choice(LENGTHS)
        calls.append((nq, nk))
    window = rng.choice([4, 8, 16, 32])
    prefix = rng.choice([4, 8, 24, 40])
    if mask in ("window", "prefix") and rng.random() < 0.5:
        w = window if mask == "window" else prefix
        small = rng.choice([n for n in LENGTHS if n <= w] or [1])
        large = rng.choice([n for n in LENGTHS if n > w] or [48])
        calls = [(small, small), (large, large)]
        if dynamic is None:  # automatic dynamic: the dynamic graph is compiled at the 2nd call
            calls.insert(1, (max(1, small - 1), max(1, small - 1)) if small > 2 else (small + 1, small + 1))
    if mask == "causal_br" and rng.random() < 0.5:  # rows with no visible key when n_q > n_k
        calls = [(max(nq, nk) + 5, min(nq, nk)) for nq, nk in calls]
    if big_d:
        calls = [(min(a, 8), min(b, 8)) for a, b in calls]
    if len(calls) == 2 and calls[0] == calls[1] and rng.random() < 0.7:
        calls[1] = (calls[0][0] + 7, calls[0][1] + 7)

    grad = rng.choice(["none", "train", "train", "no_grad"])
    names = ("q1", "k1", "q2", "k2") if kl else ("q", "k", "v")
    if kl:
        grad_inputs = tuple(n for n in names if rng.random() < (0.8 if n in ("q2", "k2") else 0.4))
    else:
        grad_inputs = tuple(n for n in names if rng.random() < 0.75)
    if mask == "data_bias" and rng.random() < 0.2:
        grad_inputs += ("mask",)

    inplace = []
    if rng.random() < 0.3:
        for _ in range(rng.choice([1, 1, 2])):
            targets = KL_TARGETS if kl else ATTN_TARGETS
            inplace.append((rng.choice(POSITIONS), rng.choice(targets), rng.choice(OPS)))
    scale = rng.choice(SCALES) if rng.random() < 0.85 else "none"
    spec = Spec(
        pattern="attention_kl" if kl else "attention",
        seed=seed,
        batch=rng.choice([1, 2]),
        kv_heads=rng.choice([1, 2]),
        group=rng.choice([1, 2]),
        head_dim=d,
        head_dim_v=dv,
        calls=tuple(calls),
        dynamic=dynamic,
        dtype=dtype,
        layout=_maybe(rng, 0.15, "bnhd", "bhnd"),
        magnitude=_maybe(rng, 0.1, rng.choice([8.0, 30.0]), 1.0),
        shift=_maybe(rng, 0.08, rng.choice([-20000.0, 5.0]), 0.0),
        qk=rng.choice(QK_FORMS),
        kt=rng.choice(KT_FORMS),
        pv=rng.choice(PV_FORMS),
        softmax=rng.choice(SOFTMAX_FORMS),
        p_through=_maybe(rng, 0.15, rng.choice(P_THROUGH[1:]), "none"),
        out_post=_maybe(rng, 0.15, "transpose_reshape", "none"),
        scale=scale,
        scale_value=rng.choice([0.125, 0.25, 0.35, 0.5, 2.0]),
        scale_on=rng.choice(["scores", "scores", "q", "both", "after_mask"]),
        mask=mask,
        builder=rng.choice(BUILDERS),
        polarity=rng.choice(["hide", "keep"]),
        mask_apply=rng.choice(MASK_APPLY),
        fill=rng.choice(["-inf", "-inf", "finfo_min", "finfo_min", "-1e4", "-3e4", "-1e9", "-100", "-5"]),
        mask_shape=rng.choice(["2d", "2d", "4d", "batch", "bhnn", "beyond_batch", "beyond_heads"]),
        window=window,
        prefix=prefix,
        empty_row=rng.random() < 0.25,
        mask_name=rng.choice(DATA_MASK_NAMES),
        module_name=rng.choice(MODULE_NAMES),
        gqa=rng.choice(["none", "repeat_interleave", "repeat_kv"]),
        grad=grad,
        grad_inputs=grad_inputs,
        no_grad_block=_maybe(rng, 0.15, rng.choice(NO_GRAD_BLOCKS[1:]), "none"),
        detach=_maybe(rng, 0.1, rng.choice(DETACH[1:]), "none"),
        inplace=tuple(inplace),
        between=_maybe(rng, 0.5, rng.choice(BETWEEN[1:]), "none"),
        kl_spelling=rng.choice(KL_SPELLINGS),
        kl_reduction=rng.choice(KL_REDUCTIONS),
        kl_teacher=rng.choice(KL_TEACHER),
        kl_zeroing=rng.random() < 0.3,
        kl_factor=rng.random() < 0.2,
        kl_mask_sides=_maybe(rng, 0.1, "student", "both"),
        gqa_side=rng.choice(["both", "teacher", "student"]),
        data_values=_data_values(rng.random()),
        score=_maybe(rng, 0.25, rng.choice(SCORES[1:]), "none"),
    )
    # make the combinations that have hidden bugs before more likely than independent draws
    # would: state changes of the module the program reads, finite fills below the scores
    between = {"buffer_temp": "temp_fill", "param_temp": "param_temp_update"}.get(spec.scale)
    if spec.mask == "param_bias":
        between = "param_bias_update"
    if spec.mask in STATIC_MASKS and spec.builder.startswith("buffer") and rng.random() < 0.5:
        between = "mask_buffer_fill"
    if between and rng.random() < 0.6:
        spec = dataclasses.replace(spec, between=between)
    if spec.score != "none" and rng.random() < 0.7:  # the H2O op is for inference: make it fusable
        spec = dataclasses.replace(spec, grad=rng.choice(["none", "no_grad"]))
    if spec.fill in ("-1e4", "-3e4") and spec.dtype == "float32" and rng.random() < 0.35:
        spec = dataclasses.replace(spec, shift=rng.choice([-20000.0, -40000.0]))
    return normalize(spec)


def normalize(spec: Spec) -> Spec:
    """Make a spec consistent: drop choices that do not apply (and reset them to their
    defaults, so that equal programs have equal specs), and adjust the ones that conflict.
    Idempotent (applied to a fixed point)."""
    if spec.pattern == "kda":
        from .kda_grammar import normalize as normalize_kda

        return normalize_kda(spec)
    for _ in range(4):
        new = _normalize_once(spec)
        if new == spec:
            return new
        spec = new
    return spec


def _normalize_once(spec: Spec) -> Spec:
    d = Spec(pattern=spec.pattern, seed=spec.seed)  # defaults
    r = dataclasses.asdict(spec)
    kl = spec.is_kl
    mask = r["mask"]

    if r["dtype"] == "float16":
        r["magnitude"], r["shift"] = 1.0, 0.0
        if r["fill"] == "-1e9":
            r["fill"] = "finfo_min"  # -1e9 overflows float16 (eager rejects the program)
    if r["softmax"] == "hand_nomax" and not kl:
        r["magnitude"], r["shift"] = 1.0, 0.0  # exp without the max overflows: eager is NaN by itself
    if r["group"] == 1 or r["gqa"] == "none":
        r["group"], r["gqa"] = 1, "none"
    # 3-D (bmm) programs: only masks that broadcast over [B*H, Nq, Nk]
    if r["qk"] == "bmm" and (kl or mask in ("padding", "param_bias", "buffer_bias")):
        r["qk"] = "@"
    if r["qk"] == "bmm":
        if mask != "none":
            r["mask_shape"] = "2d"
        r["pv"] = "bmm"
    elif r["pv"] == "bmm":
        r["pv"] = d.pv
    if r["qk"] in ("einsum", "einsum_ellipsis", "bmm"):
        r["kt"] = d.kt  # K is not transposed by hand
    # masks
    if mask == "none":
        for f in ("builder", "polarity", "mask_apply", "fill", "mask_shape", "window", "prefix",
                  "empty_row", "data_values", "mask_name", "module_name"):
            r[f] = getattr(d, f)
    else:
        if mask not in STATIC_MASKS:
            r["builder"] = d.builder
        if mask == "causal_br" and r["builder"] in ("buffer", "buffer_float"):
            r["builder"] = "tril"  # a buffer slice [:n_q, :n_k] cannot express j <= i + n_k - n_q
        if mask != "window":
            r["window"] = d.window
        if mask != "prefix":
            r["prefix"] = d.prefix
        if mask in ("data_bias", "param_bias", "buffer_bias"):
            r["polarity"], r["mask_apply"], r["fill"] = d.polarity, "additive", d.fill
        if mask in ("padding", "param_bias", "buffer_bias"):
            r["mask_shape"] = d.mask_shape
        if mask not in ("data_bool", "padding"):
            r["empty_row"] = False
        if mask not in ("data_bool", "data_bias", "param_bias") or (
                len(r["calls"]) < 2 and r["data_values"] == "visible_first"):
            r["data_values"] = d.data_values
        if r["data_values"] == "causal" and mask not in ("data_bool", "data_bias"):
            r["data_values"] = d.data_values
        if mask not in ("data_bool", "data_bias") and not (mask in STATIC_MASKS and r["builder"].startswith("buffer")):
            r["mask_name"] = d.mask_name
        if mask in STATIC_MASKS and r["builder"].startswith("buffer") and r["mask_name"] not in BUFFER_NAMES:
            r["mask_name"] = BUFFER_NAMES[len(r["mask_name"]) % len(BUFFER_NAMES)]
        if mask in ("data_bool", "data_bias") and r["mask_name"] not in DATA_MASK_NAMES:
            r["mask_name"] = DATA_MASK_NAMES[len(r["mask_name"]) % len(DATA_MASK_NAMES)]
        if mask != "param_bias":
            r["module_name"] = d.module_name
        if r["mask_shape"] == "beyond_batch":
            r["batch"] = 1
        if r["mask_shape"] == "beyond_heads":
            r["kv_heads"], r["group"], r["gqa"] = 1, 1, "none"
        if r["mask_shape"].startswith("beyond") and r["mask_apply"] == "masked_fill_":
            r["mask_apply"] = "masked_fill"  # an in-place fill cannot broadcast the scores
        if kl and r["mask_shape"].startswith("beyond"):
            r["mask_shape"] = "4d"
    if r["fill"] not in FILLS:
        r["fill"] = d.fill
    # scale
    if r["scale"] == "none":
        r["scale_value"], r["scale_on"] = d.scale_value, d.scale_on
    elif r["scale"] not in ("number", "negative", "full"):
        r["scale_value"] = d.scale_value
    if r["scale"] != "none" and r["scale_on"] == "after_mask" and mask == "none":
        r["scale_on"] = "scores"
    if r["scale"] in ("buffer_temp", "param_temp") and r["scale_on"] in ("q", "both"):
        r["scale_on"] = "scores"
    # gradients
    names = ("q1", "k1", "q2", "k2") if kl else ("q", "k", "v")
    if mask == "data_bias":
        names += ("mask",)
    if r["grad"] == "none":
        r["grad_inputs"] = ()
    else:
        r["grad_inputs"] = tuple(n for n in names if n in r["grad_inputs"])
    if kl:
        r["no_grad_block"], r["detach"], r["p_through"], r["out_post"], r["softmax"] = (
            d.no_grad_block, d.detach, d.p_through, d.out_post, d.softmax)
        r["pv"] = d.pv
        if r["kl_spelling"] in ("logsoftmax_diff", "log_p") and r["kl_reduction"] in ("batchmean", "sum", "mean"):
            r["kl_reduction"] = {"batchmean": "rows_mean", "sum": "all_sum", "mean": "all_mean"}[r["kl_reduction"]]
        if r["kl_reduction"] in ("batchmean", "sum", "mean") or mask in ("none", "data_bias", "param_bias", "buffer_bias"):
            r["kl_zeroing"] = False
        if mask == "none":
            r["kl_mask_sides"] = d.kl_mask_sides
        if r["group"] == 1:
            r["gqa_side"] = d.gqa_side
    if kl:
        r["score"] = d.score
    else:
        for f in ("kl_spelling", "kl_reduction", "kl_teacher", "kl_zeroing", "kl_factor", "kl_mask_sides", "gqa_side"):
            r[f] = getattr(d, f)
        if r["no_grad_block"] == "mask" and mask in ("none", "data_bool", "data_bias"):
            r["no_grad_block"] = "none"
    # in-place writes
    keep = []
    targets = KL_TARGETS if kl else ATTN_TARGETS
    for pos, tgt, op in r["inplace"]:
        if tgt not in targets or pos not in POSITIONS or op not in OPS + ("fill_",):
            continue
        if tgt == "mask" and mask == "none":
            continue
        if tgt == "out" and pos != "after":
            pos = "after"
        if tgt == "s" and pos in ("before", "inside"):
            pos = "inside_late"
        if kl and pos == "inside_late":
            pos = "inside"
        if tgt == "mask" and mask in ("param_bias",):
            continue  # a parameter slice cannot be written in place under autograd
        item = (pos, tgt, op if tgt != "mask" else "fill_")
        if item not in keep:
            keep.append(item)
    r["inplace"] = tuple(keep)
    # state changes between calls
    b = r["between"]
    if len(r["calls"]) < 2 or not (
        (b == "temp_fill" and r["scale"] == "buffer_temp")
        or (b == "param_temp_update" and r["scale"] == "param_temp")
        or (b == "param_bias_update" and mask == "param_bias")
        or (b == "mask_buffer_fill" and mask in STATIC_MASKS and r["builder"].startswith("buffer"))
    ):
        r["between"] = "none"
    if r["head_dim"] > 64:
        r["dtype"] = "float32"
    r["calls"] = tuple(tuple(c) for c in r["calls"])
    r["inplace"] = tuple(tuple(c) for c in r["inplace"])
    r["grad_inputs"] = tuple(r["grad_inputs"])
    return Spec(**r)


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

class _Lines:
    """Indented source lines."""

    def __init__(self, indent: int):
        self.lines: list[str] = []
        self.indent = indent

    def __call__(self, text: str) -> None:
        for line in text.split("\n"):
            self.lines.append("    " * self.indent + line if line else "")


@dataclasses.dataclass
class Program:
    """A rendered program: its ``source`` (a complete module), the ``spec`` it came from, and
    what the runner needs to know about it.

    Attributes:
        spec: the :class:`Spec`.
        source: Python source of a module (see the module docstring for what it defines).
        entry: ``"program"`` (a function) or ``"Program"`` (an ``nn.Module`` class).
        input_names: the call's arguments, in order.
        float_inputs: those that are floating-point tensors.
        hides_rows: the program can have query rows whose keys are all hidden by a fill the
            runner's NaN rule applies to (see :mod:`.runner`).
        documented_fill: the mask is a ``masked_fill``/``where`` with a *finite* fill that
            fuser treats as hiding the key: on fully hidden rows fuser documents 0 where eager
            gives a uniform average (README, Limits).
        mask_buffer: the module reads a mask from a registered buffer (README: assumed
            constant; mutating it between calls is a documented limit).
    """

    spec: Spec
    source: str
    entry: str
    input_names: tuple
    float_inputs: tuple
    hides_rows: bool
    documented_fill: bool
    mask_buffer: bool

    def variant(self, fill: Optional[str] = None, stable: bool = False, with_max: bool = False) -> "Program":
        """The program as the runner's float64 oracles run it: a softmax pinned to float32
        (``dtype=torch.float32``, ``.float()``) is written without the pin (the same function,
        in float64). With ``fill``, every mask fill is replaced by it (``"-inf"`` finds fully
        hidden rows, ``"-1e300"`` gives eager's finite limit). With ``stable``, attention-KL's
        ``log(softmax(s))`` is written ``log_softmax(s)``: the same function, without eager's
        ``0 * log(0) = NaN`` where a probability underflows. With ``with_max``, a hand-written
        softmax without the max (``exp(s) / exp(s).sum()``) subtracts it: the same function,
        without eager's ``0 / 0`` where every ``exp`` of a row underflows."""
        if self.spec.pattern == "kda":  # float64 where the program pins float32; nothing else varies
            from .kda_grammar import render as render_kda

            return render_kda(self.spec, oracle=True, _normalize=False)
        spec = dataclasses.replace(self.spec, softmax=GENERIC_SOFTMAX.get(self.spec.softmax, self.spec.softmax))
        if fill is not None and spec.mask != "none":
            spec = dataclasses.replace(spec, fill=fill)
        if stable:
            spec = dataclasses.replace(spec, kl_spelling=STABLE_KL.get(spec.kl_spelling, spec.kl_spelling))
        if with_max and spec.softmax == "hand_nomax":
            spec = dataclasses.replace(spec, softmax="hand_max")
        return render(spec, _normalize=False)


def _fill(spec: Spec, s: str) -> str:
    return FILLS[spec.fill].format(s=s)


def _scale_factor(spec: Spec, ref: str, dtype_of: str) -> tuple[str, str]:
    """(operator, operand) of the scale: ``x = x <op> <operand>``."""
    v = spec.scale_value
    return {
        "number": ("*", repr(v)) if v < 1 else ("/", repr(1 / v)),
        "negative": ("*", repr(-v)),
        "sqrt_d": ("/", f"math.sqrt({ref}.size(-1))"),
        "pow_d": ("*", f"{ref}.size(-1) ** -0.5"),
        "pow_n": ("*", f"{ref}.size(-2) ** -0.5"),
        "full": ("*", f"torch.full([], {v!r}, dtype={dtype_of}.dtype, device={dtype_of}.device)"),
        "buffer_temp": ("/", "self.temp"),
        "param_temp": ("/", "self.temperature"),
    }[spec.scale]


def _kt(spec: Spec, k: str) -> str:
    return {"transpose": f"{k}.transpose(-2, -1)", "mT": f"{k}.mT", "permute": f"{k}.permute(0, 1, 3, 2)"}[spec.kt]


def _qk(spec: Spec, q: str, k: str) -> str:
    if spec.qk == "einsum":
        return f'torch.einsum("bhqd,bhkd->bhqk", {q}, {k})'
    if spec.qk == "einsum_ellipsis":
        return f'torch.einsum("...qd,...kd->...qk", {q}, {k})'
    if spec.qk == "bmm":
        return f"torch.bmm({q}.reshape(b_ * h_, n_q, -1), {k}.reshape(b_ * h_, n_k, -1).transpose(1, 2))"
    kt = _kt(spec, k)
    return {"@": f"{q} @ {kt}", "matmul": f"torch.matmul({q}, {kt})", "method": f"{q}.matmul({kt})"}[spec.qk]


def _pv(spec: Spec, p: str, v: str) -> str:
    if spec.pv == "bmm":
        return f"torch.bmm({p}, {v}.reshape(b_ * h_, n_k, -1)).view(b_, h_, n_q, -1)"
    return {"@": f"{p} @ {v}", "matmul": f"torch.matmul({p}, {v})",
            "einsum": f'torch.einsum("bhqk,bhkd->bhqd", {p}, {v})'}[spec.pv]


def _softmax(spec: Spec, L: _Lines, s: str, p: str, form: Optional[str] = None, like: str = "v") -> None:
    form = form or spec.softmax
    if form == "F.softmax":
        L(f"{p} = F.softmax({s}, dim=-1)")
    elif form == "torch.softmax":
        L(f"{p} = torch.softmax({s}, -1)")
    elif form == "method":
        L(f"{p} = {s}.softmax(dim=-1)")
    elif form == "f32":
        L(f"{p} = F.softmax({s}, dim=-1, dtype=torch.float32).to({like}.dtype)")
    elif form == "float_type_as":
        L(f"{p} = F.softmax({s}.float(), dim=-1).type_as({like})")
    else:
        m = {
            "hand_amax": f"{s}.amax(dim=-1, keepdim=True)",
            "hand_max": f"{s}.max(dim=-1, keepdim=True).values",
            "hand_amax_detach": f"torch.amax({s}, -1, keepdim=True).detach()",
        }.get(form)
        L(f"e = torch.exp({s} - {m})" if m else f"e = {s}.exp()")
        L(f"{p} = e / e.sum(dim=-1, keepdim=True)")


def _mask_vars(spec: Spec) -> tuple[Optional[str], str]:
    """(variable, kind) of the mask a program builds: kind ``hide``/``keep`` (bool) or ``bias``."""
    if spec.mask == "none":
        return None, ""
    if spec.mask in ("data_bias", "param_bias", "buffer_bias"):
        return (spec.mask_name if spec.mask == "data_bias" else "bias"), "bias"
    if spec.mask == "data_bool":
        return spec.mask_name, spec.polarity
    return spec.polarity, spec.polarity  # a variable named hide or keep


def _build_mask(spec: Spec, L: _Lines, ref: str = "q") -> None:
    """Lines that build the mask variable (static masks, padding, learned/buffer biases)."""
    m = spec.mask
    dev = f"device={ref}.device"
    var, kind = _mask_vars(spec)
    if m in STATIC_MASKS:
        formula = {
            "causal_tl": "j <= i", "causal_br": "j <= i + (n_k - n_q)",
            "window": f"(j <= i) & (j > i - {spec.window})", "prefix": f"(j <= i) | (j < {spec.prefix})",
        }[m]
        hide_formula = {"causal_tl": "j > i", "causal_br": "j > i + (n_k - n_q)"}.get(m)
        if spec.builder == "arange":
            L(f"i = torch.arange(n_q, {dev})[:, None]")
            L(f"j = torch.arange(n_k, {dev})[None, :]")
            if kind == "hide" and hide_formula:
                L(f"hide = {hide_formula}")
            else:
                L(f"keep = {formula}")
        elif spec.builder == "tril":
            ones = f"torch.ones(n_q, n_k, dtype=torch.bool, {dev})"
            if m == "causal_tl":
                L(f"hide = {ones}.triu(1)" if kind == "hide" else f"keep = {ones}.tril()")
            elif m == "causal_br":
                L(f"hide = {ones}.triu(n_k - n_q + 1)" if kind == "hide" else f"keep = {ones}.tril(n_k - n_q)")
            elif m == "window":
                L(f"ones = {ones}")
                L(f"keep = ones.tril() & ~ones.tril(-{spec.window})")
            else:
                L(f"keep = {ones}.tril() | (torch.arange(n_k, {dev}) < {spec.prefix})")
        elif spec.builder == "buffer":
            L(f"keep = self.{spec.mask_name}[:n_q, :n_k]")
        else:  # buffer_float: GPT-2's registered float tril, [1, 1, N, N]
            L(f"keep = self.{spec.mask_name}[:, :, :n_q, :n_k].bool()")
        built = "hide" if (kind == "hide" and spec.builder in ("arange", "tril") and hide_formula) else "keep"
        shape = spec.mask_shape
        if spec.builder == "buffer_float":
            shape_expr = {"2d": f"{built}[0, 0]", "4d": None}.get(shape, "")
        else:
            shape_expr = {"2d": None, "4d": f"{built}[None, None]"}.get(shape, "")
        if shape_expr == "":
            base = built if spec.builder != "buffer_float" else f"{built}[0, 0]"
            shape_expr = {
                "batch": f"{base}.expand({ref}.size(0), 1, n_q, n_k)",
                "bhnn": f"{base}.expand({ref}.size(0), {ref}.size(1), n_q, n_k)",
                "beyond_batch": f"{base}.expand(2, 1, n_q, n_k)",
                "beyond_heads": f"{base}.expand(1, 2, n_q, n_k)",
            }[shape]
        if shape_expr:
            L(f"{built} = {shape_expr}")
        if kind == "hide" and built == "keep":
            L("hide = ~keep")
    elif m == "padding":
        L(f"keep = (torch.arange(n_k, {dev})[None, :] < lengths[:, None])[:, None, None, :]")
        if kind == "hide":
            L("hide = ~keep")
    elif m == "param_bias":
        L(f"bias = self.{spec.module_name}.bias[:, :n_q, :n_k]")
    elif m == "buffer_bias":
        L("bias = self.rel_bias[:, :n_q, :n_k]")


def _apply_mask(spec: Spec, L: _Lines, s: str) -> None:
    """Lines applying the mask variable to the scores ``s``."""
    var, kind = _mask_vars(spec)
    if var is None:
        return
    if kind == "bias":
        L(f"{s} = {s} + {var}")
        return
    fill = _fill(spec, s)
    hide = var if kind == "hide" else f"~{var}"
    a = spec.mask_apply
    if a == "masked_fill":
        L(f"{s} = {s}.masked_fill({hide}, {fill})")
    elif a == "masked_fill_":
        L(f"{s}.masked_fill_({hide}, {fill})")
    elif a == "where":
        if kind == "hide":
            L(f"{s} = torch.where({var}, {fill}, {s})")
        else:
            L(f"{s} = torch.where({var}, {s}, {fill})")
    else:  # additive
        if kind == "hide":
            L(f"{s} = {s} + torch.zeros_like({var}, dtype={s}.dtype).masked_fill({var}, {fill})")
        else:
            L(f"{s} = {s} + torch.where({var}, torch.tensor(0.0, dtype={s}.dtype), {fill})")


def _inplace(spec: Spec, L: _Lines, pos: str, names: dict) -> None:
    for p, tgt, op in spec.inplace:
        if p != pos:
            continue
        if tgt == "mask":
            var, kind = _mask_vars(spec)
            L(f"{var}.zero_()" if kind == "bias" else f"{var}.fill_({kind == 'keep'})")
        else:
            x = names.get(tgt, tgt)
            L(f"{x}.{op}({'2.0' if op == 'mul_' else '1.0'})")


def _input_names(spec: Spec) -> tuple:
    names = ("q1", "k1", "q2", "k2") if spec.is_kl else ("q", "k", "v")
    if spec.mask in ("data_bool", "data_bias"):
        names += (spec.mask_name,)
    if spec.mask == "padding":
        names += ("lengths",)
    return names


def _prologue(spec: Spec, L: _Lines, tensors: tuple) -> None:
    """Clones of inputs written in place while requiring grad; layout transposes."""
    written = {t for _, t, _ in spec.inplace}
    for x in tensors:
        if spec.grad == "train" and x in written and x in spec.grad_inputs:
            L(f"{x} = {x}.clone()  # written in place below")
    if spec.mask in ("data_bool", "data_bias") and "mask" in written and spec.grad == "train" and "mask" in spec.grad_inputs:
        L(f"{spec.mask_name} = {spec.mask_name}.clone()  # written in place below")
    if spec.layout == "bnhd":
        L(", ".join(tensors) + " = " + ", ".join(f"{x}.transpose(1, 2)" for x in tensors))


def _render_attention(spec: Spec, indent: int) -> _Lines:
    L = _Lines(indent)
    _prologue(spec, L, ("q", "k", "v"))
    L("n_q, n_k = q.size(-2), k.size(-2)")
    nogmask = spec.no_grad_block == "mask"
    if spec.mask != "none":
        if nogmask:
            L("with torch.no_grad():")
            L.indent += 1
        _build_mask(spec, L)
        if nogmask:
            L.indent -= 1
    _inplace(spec, L, "before", {})
    kk, vv = "k", "v"
    if spec.gqa == "repeat_interleave":
        L(f"k_rep = k.repeat_interleave({spec.group}, dim=1)")
        L(f"v_rep = v.repeat_interleave({spec.group}, dim=1)")
        kk, vv = "k_rep", "v_rep"
    elif spec.gqa == "repeat_kv":
        L(f"k_rep, v_rep = repeat_kv(k, {spec.group}), repeat_kv(v, {spec.group})")
        kk, vv = "k_rep", "v_rep"
    qq = "q"
    if spec.scale != "none" and spec.scale_on in ("q", "both"):
        op, f = _scale_factor(spec, "q", "q")
        L(f"qs = q {op} {f}")
        qq = "qs"
        if spec.scale_on == "both":
            L(f"ks = {kk} {op} {f}")
            kk = "ks"
    if spec.detach == "q":
        L(f"{qq} = {qq}.detach()" if qq != "q" else "qd = q.detach()")
        qq = qq if qq != "q" else "qd"
    if spec.detach == "k":
        L(f"kd = {kk}.detach()")
        kk = "kd"
    if spec.detach == "v":
        L(f"vd = {vv}.detach()")
        vv = "vd"
    if spec.qk == "bmm":
        L("b_, h_ = q.size(0), q.size(1)")
    nog = spec.no_grad_block == "scores"
    if nog:
        L("with torch.no_grad():")
        L.indent += 1
    L(f"s = {_qk(spec, qq, kk)}")
    if spec.scale != "none" and spec.scale_on == "scores":
        op, f = _scale_factor(spec, "q", "s")
        L(f"s = s {op} {f}")
    if spec.shift:
        L(f"s = s {'-' if spec.shift < 0 else '+'} {abs(spec.shift)!r}")
    _apply_mask(spec, L, "s")
    if spec.scale != "none" and spec.scale_on == "after_mask":
        op, f = _scale_factor(spec, "q", "s")
        L(f"s = s {op} {f}")
    if spec.detach == "scores":
        L("s = s.detach()")
    if nog:
        L.indent -= 1
    _inplace(spec, L, "inside", {"s": "s"})
    nog = spec.no_grad_block == "softmax"
    if nog:
        L("with torch.no_grad():")
        L.indent += 1
    _softmax(spec, L, "s", "p")
    if nog:
        L.indent -= 1
    if spec.detach == "p":
        L("p = p.detach()")
    if spec.p_through == "dropout0":
        L("p = F.dropout(p, p=0.0)")
    elif spec.p_through == "dropout_eval":
        L("p = F.dropout(p, p=0.1, training=False)")
    elif spec.p_through == "contiguous":
        L("p = p.contiguous()")
    elif spec.p_through == "cast":
        L(f"p = p.to({vv}.dtype)")
    _inplace(spec, L, "inside_late", {"s": "s"})
    if spec.score in ("sum", "score_only"):
        L("sc = p.sum(-2)")
    elif spec.score == "torch_sum":
        L("sc = torch.sum(p, dim=-2)")
    nog = spec.no_grad_block == "pv"
    if nog:
        L("with torch.no_grad():")
        L.indent += 1
    L(f"o = {_pv(spec, 'p', vv)}")
    if nog:
        L.indent -= 1
    if spec.out_post == "transpose_reshape":
        L("o = o.transpose(1, 2).reshape(o.size(0), o.size(2), -1)")
    _inplace(spec, L, "after", {"out": "o", "s": "s"})
    if spec.score == "none":
        L("return o")
    elif spec.score == "score_only":
        L("return sc")  # o is dead code: the graph holds the column sums alone
    else:
        L("return torch.cat([o.flatten(), sc.flatten()])")
    return L


def _render_kl(spec: Spec, indent: int) -> _Lines:
    L = _Lines(indent)
    _prologue(spec, L, ("q1", "k1", "q2", "k2"))
    L("n_q, n_k = q1.size(-2), k1.size(-2)")
    if spec.mask != "none":
        _build_mask(spec, L, ref="q1")
    _inplace(spec, L, "before", {})
    names = {}
    for side in ("1", "2"):
        k = f"k{side}"
        if spec.gqa != "none" and spec.gqa_side in ("both", {"1": "teacher", "2": "student"}[side]):
            expr = (f"k{side}.repeat_interleave({spec.group}, dim=1)" if spec.gqa == "repeat_interleave"
                    else f"repeat_kv(k{side}, {spec.group})")
            L(f"k{side}_rep = {expr}")
            k = f"k{side}_rep"
        names[side] = k
    for side in ("1", "2"):
        teacher = side == "1"
        q, k, s = f"q{side}", names[side], f"s{side}"
        nog = teacher and spec.kl_teacher == "no_grad"
        if nog:
            L("with torch.no_grad():")
            L.indent += 1
        if spec.scale != "none" and spec.scale_on in ("q", "both"):
            op, f = _scale_factor(spec if teacher else dataclasses.replace(spec, scale_value=spec.scale_value * 2), q, q)
            L(f"{q}s = {q} {op} {f}")
            q = f"{q}s"
            if spec.scale_on == "both":
                L(f"{k}s = {k} {op} {f}")
                k = f"{k}s"
        L(f"{s} = {_qk(spec, q, k)}")
        sc = spec if teacher else dataclasses.replace(spec, scale_value=spec.scale_value * 2)
        if spec.scale != "none" and spec.scale_on == "scores":
            op, f = _scale_factor(sc, f"q{side}", s)
            L(f"{s} = {s} {op} {f}")
        if spec.shift:
            L(f"{s} = {s} {'-' if spec.shift < 0 else '+'} {abs(spec.shift)!r}")
        if spec.kl_mask_sides == "both" or not teacher:
            _apply_mask(spec, L, s)
        if spec.scale != "none" and spec.scale_on == "after_mask":
            op, f = _scale_factor(sc, f"q{side}", s)
            L(f"{s} = {s} {op} {f}")
        if teacher and spec.kl_teacher == "detach":
            L(f"{s} = {s}.detach()")
        if nog:
            L.indent -= 1
    _inplace(spec, L, "inside", {})
    sp, red = spec.kl_spelling, spec.kl_reduction
    kl_red = red if red in ("batchmean", "sum", "mean") else "none"
    if sp == "kl_log_target":
        L(f'kl = F.kl_div(F.log_softmax(s2, dim=-1), F.log_softmax(s1, dim=-1), reduction="{kl_red}", log_target=True)')
    elif sp == "kl_probs":
        L(f'kl = F.kl_div(F.log_softmax(s2, -1), F.softmax(s1, -1), reduction="{kl_red}")')
    elif sp == "kl_probs_log":
        L(f'kl = F.kl_div(torch.log(F.softmax(s2, -1)), s1.softmax(-1), reduction="{kl_red}")')
    elif sp == "logsoftmax_diff":
        L("kl = F.softmax(s1, -1) * (F.log_softmax(s1, -1) - F.log_softmax(s2, -1))")
    else:
        L("p1, p2 = s1.softmax(-1), s2.softmax(-1)")
        L("kl = p1 * (torch.log(p1) - torch.log(p2))")
    if spec.kl_zeroing:
        var, kind = _mask_vars(spec)
        if kind == "hide":
            L(f"kl = kl.masked_fill({var}, 0.0)")
        else:
            L(f"kl = torch.where({var}, kl, 0.0)")
    if kl_red != "none":
        L("loss = kl")
    else:
        L({"rows": "loss = kl.sum(-1)", "rows_mean": "loss = kl.sum(-1).mean()",
           "all_sum": "loss = kl.sum()", "all_mean": "loss = kl.mean()"}[red])
    if spec.kl_factor:
        L("loss = loss * 2.0 ** 2")
    _inplace(spec, L, "after", {"out": "loss"})
    L("return loss")
    return L


def _render_init(spec: Spec) -> list[str]:
    out = ["super().__init__()"]
    if spec.mask in ("param_bias", "buffer_bias"):
        out.append("g = torch.Generator().manual_seed(0)")
    if spec.scale == "buffer_temp":
        out.append('self.register_buffer("temp", torch.tensor(2.0))')
    if spec.scale == "param_temp":
        out.append("self.temperature = nn.Parameter(torch.tensor(1.5))")
    if spec.mask in STATIC_MASKS and spec.builder.startswith("buffer"):
        n = BUFFER_N
        formula = {"causal_tl": "j <= i", "window": f"(j <= i) & (j > i - {spec.window})",
                   "prefix": f"(j <= i) | (j < {spec.prefix})"}[spec.mask]
        out.append(f"i, j = torch.arange({n})[:, None], torch.arange({n})[None, :]")
        if spec.builder == "buffer":
            out.append(f'self.register_buffer("{spec.mask_name}", {formula})')
        else:
            out.append(f'self.register_buffer("{spec.mask_name}", ({formula}).float().view(1, 1, {n}, {n}))')
    if spec.mask == "param_bias":
        out.append(f"self.{spec.module_name} = nn.Module()")
        init = (f"torch.zeros({spec.heads}, {BUFFER_N}, {BUFFER_N})" if spec.data_values == "visible_first"
                else f"0.5 * torch.randn({spec.heads}, {BUFFER_N}, {BUFFER_N}, generator=g)")
        out.append(f"self.{spec.module_name}.bias = nn.Parameter({init})")
    if spec.mask == "buffer_bias":
        out.append(f'self.register_buffer("rel_bias", 0.5 * torch.randn({spec.heads}, {BUFFER_N}, {BUFFER_N}, generator=g))')
    return out


def _shape_src(spec: Spec, name: str) -> str:
    b, h, hk = spec.batch, spec.heads, spec.kv_heads
    kl = spec.is_kl

    def bh(heads, n, d):
        return f"({b}, {n}, {heads}, {d})" if spec.layout == "bnhd" else f"({b}, {heads}, {n}, {d})"

    if kl:
        hk1 = hk if spec.gqa_side in ("both", "teacher") else h
        hk2 = hk if spec.gqa_side in ("both", "student") else h
        if spec.group == 1:
            hk1 = hk2 = h
        return {"q1": bh(h, "n_q", spec.head_dim), "k1": bh(hk1, "n_k", spec.head_dim),
                "q2": bh(h, "n_q", spec.head_dim_v), "k2": bh(hk2, "n_k", spec.head_dim_v)}[name]
    return {"q": bh(h, "n_q", spec.head_dim), "k": bh(hk, "n_k", spec.head_dim),
            "v": bh(hk, "n_k", spec.head_dim_v)}[name]


def _mask_input_shape(spec: Spec) -> str:
    b, h = spec.batch, spec.heads
    return {"2d": "(n_q, n_k)", "4d": "(1, 1, n_q, n_k)", "batch": f"({b}, 1, n_q, n_k)",
            "bhnn": f"({b}, {h}, n_q, n_k)", "beyond_batch": f"(2, {h}, n_q, n_k)",
            "beyond_heads": f"({b}, 2, n_q, n_k)"}[spec.mask_shape]


def _render_inputs(spec: Spec) -> list[str]:
    out = ["g = torch.Generator().manual_seed(seed)"]
    tensors = ("q1", "k1", "q2", "k2") if spec.is_kl else ("q", "k", "v")
    for x in tensors:
        mag = spec.magnitude if x[0] in "qk" else 1.0
        scale = f" * {mag!r}" if mag != 1.0 else ""
        out.append(f"{x} = (torch.randn({_shape_src(spec, x)}, generator=g, dtype=torch.float64){scale}).to(dtype)")
    if spec.mask in ("data_bool", "data_bias") and spec.data_values == "causal":
        out += _render_causal_data_mask(spec)
    elif spec.mask == "data_bool":
        cmp = "<" if spec.polarity == "hide" else ">="
        out.append(f"{spec.mask_name} = torch.rand({_mask_input_shape(spec)}, generator=g) {cmp} 0.3")
        if spec.empty_row:
            out.append(f"{spec.mask_name}[..., 0, :] = {spec.polarity == 'hide'}  # query row 0 sees no key")
        if spec.data_values == "visible_first":
            out.append("if call == 0:  # the first call's mask hides nothing")
            out.append(f"    {spec.mask_name}.fill_({spec.polarity == 'keep'})")
    elif spec.mask == "data_bias":
        out.append(f"{spec.mask_name} = torch.randn({_mask_input_shape(spec)}, generator=g, dtype=torch.float64).to(dtype)")
        if spec.data_values == "visible_first":
            out.append("if call == 0:  # the first call's bias is zero")
            out.append(f"    {spec.mask_name}.zero_()")
    if spec.mask == "padding":
        out.append(f"lengths = torch.randint(1, n_k + 1, ({spec.batch},), generator=g)")
        if spec.empty_row:
            out.append("lengths[0] = 0  # batch row 0 sees no key")
    out.append("return {" + ", ".join(f'"{n}": {n}' for n in _input_names(spec)) + "}")
    return out


def _render_causal_data_mask(spec: Spec) -> list[str]:
    """``data_values="causal"``: the statements building a causal mask's values as an input
    (bool: what ``polarity`` says; bias: 0 visible, ``finfo(dtype).min`` hidden), changed at
    later calls by one draw of ``g``."""
    name = spec.mask_name
    out = ["keep = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)  # bottom-right causal",
           "change = 0 if call == 0 else int(torch.randint(0, 5, (), generator=g))",
           "i = int(torch.randint(0, n_q, (), generator=g))",
           "above = i + n_k - n_q + 1 < n_k  # row i has a key above its diagonal",
           "j = int(torch.randint(max(i + n_k - n_q + 1, 0), n_k, (), generator=g)) if above else 0",
           "j_below = int(torch.randint(0, max(min(i + n_k - n_q, n_k - 1), 0) + 1, (), generator=g))",
           "if change == 1:  # right padding: the last keys hidden",
           "    keep[:, n_k - max(1, n_k // 5):] = False",
           "elif change == 2 and above:  # a key above the diagonal visible",
           "    keep[i, j] = True",
           "elif change == 3:  # a key on or below the diagonal hidden",
           "    keep[i, j_below] = False"]
    if spec.mask == "data_bool":
        keep_or_hide = "keep" if spec.polarity == "keep" else "~keep"
        out.append(f"{name} = ({keep_or_hide}).expand({_mask_input_shape(spec)}).clone()")
    else:
        out += [f"{name} = torch.zeros({_mask_input_shape(spec)}, dtype=torch.float64)"
                ".masked_fill(~keep, torch.finfo(dtype).min).to(dtype)",
                "if change == 4:  # a bias on or below the diagonal",
                f"    {name}[..., i, j_below] = 2.0"]
    return out


def _between(spec: Spec) -> Optional[str]:
    return {
        "temp_fill": "m.temp.fill_(0.5)",
        "param_temp_update": "with torch.no_grad():\n    m.temperature.mul_(0.5)",
        "param_bias_update": (f"with torch.no_grad():  # an optimizer step\n"
                              f"    b = m.{spec.module_name}.bias\n"
                              f"    b.add_(0.5 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))"),
        "mask_buffer_fill": f"m.{spec.mask_name}.fill_(1)",
    }.get(spec.between)


REPEAT_KV = '''
def repeat_kv(x, n):
    """[B, Hkv, N, D] -> [B, Hkv * n, N, D] (transformers' repeat_kv)."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)
'''


def render(spec: Spec, _normalize: bool = True) -> Program:
    """The :class:`Program` of ``spec`` (normalised first); a KDA spec's by :mod:`.kda_grammar`."""
    if spec.pattern == "kda":
        from .kda_grammar import render as render_kda

        return render_kda(spec, _normalize=_normalize)
    if _normalize:
        spec = normalize(spec)
    names = _input_names(spec)
    body = (_render_kl if spec.is_kl else _render_attention)(spec, 2 if spec.needs_module else 1)
    sizes = [i for i, line in enumerate(body.lines) if line.strip().startswith("n_q, n_k = ")]
    if sizes and not any(re.search(r"\bn_[qk]\b", line) for i, line in enumerate(body.lines) if i != sizes[0]):
        del body.lines[sizes[0]]  # the sizes are not used
    feats = ", ".join(f"{k}={v!r}" for k, v in spec.features().items())
    head = [f"# fuzz program: {spec.pattern}, seed {spec.seed}", *textwrap.wrap(
        f"features: {feats or 'none (defaults)'}", 96, initial_indent="# ", subsequent_indent="#   ")]
    src = [*head, "import math", "", "import torch", "import torch.nn as nn", "import torch.nn.functional as F", ""]
    if spec.gqa == "repeat_kv":
        src += REPEAT_KV.strip("\n").split("\n") + [""]
    args = ", ".join(names)
    if spec.needs_module:
        entry = "Program"
        src += ["", "class Program(nn.Module):", "    def __init__(self):"]
        src += ["        " + line for line in _render_init(spec)]
        src += ["", f"    def forward(self, {args}):"]
        src += body.lines
    else:
        entry = "program"
        src += ["", f"def program({args}):"] + body.lines
    src += ["", "", "def make_inputs(n_q, n_k, seed, dtype=torch.float32, call=0):"]
    src += ["    " + line for line in _render_inputs(spec)]
    between = _between(spec)
    if between:
        src += ["", "", "def between_calls(m):", *("    " + line for line in between.split("\n"))]
    src += [
        "", "",
        f"CALLS = {list(spec.calls)!r}",
        f"DYNAMIC = {spec.dynamic!r}",
        f"DTYPE = torch.{spec.dtype}",
        f"GRAD = {spec.grad!r}  # none | train (GRAD_INPUTS require grad) | no_grad (they do, calls under torch.no_grad())",
        f"GRAD_INPUTS = {tuple(spec.mask_name if n == 'mask' else n for n in spec.grad_inputs)!r}",
    ]
    source = "\n".join(src) + "\n"
    tensors = ("q1", "k1", "q2", "k2") if spec.is_kl else ("q", "k", "v")
    floats = tensors + ((spec.mask_name,) if spec.mask == "data_bias" else ())
    return Program(
        spec=spec, source=source, entry=entry, input_names=names, float_inputs=floats,
        hides_rows=spec.mask not in ("none", "data_bias", "param_bias", "buffer_bias"),
        documented_fill=(spec.mask not in ("none", "data_bias", "param_bias", "buffer_bias")
                         and spec.mask_apply != "additive" and spec.fill in HIDING_FILLS and spec.fill != "-inf"),
        mask_buffer=spec.mask in STATIC_MASKS and spec.builder.startswith("buffer"),
    )
