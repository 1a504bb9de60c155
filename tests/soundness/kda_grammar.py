"""Random KDA programs: the delta-rule recurrence written as a Python loop over T tokens.

A program is described by a :class:`KDASpec` (flat and frozen, every field's default its
simplest choice, as :class:`.grammar.Spec` for attention); :func:`render` turns it into a
:class:`.grammar.Program` that the runner (:mod:`.runner`) executes exactly as it executes the
attention programs: ``program(q, k, v, g, beta[, h0])``, ``make_inputs(n_q, n_k, seed, dtype,
call)`` (``n_q`` is the loop length T), ``CALLS``, ``DYNAMIC``, ``DTYPE``, ``GRAD``,
``GRAD_INPUTS``.

The spellings are those the KDA pattern supports (``tests/patterns/test_kda.py``): the blog loop
(``[B, H, T, K]``, ``x[:, :, t]``), FLA's naive layout ``[B, T, H, K]`` with a float32 upcast
before the loop, ``[B, T, H, K]`` inputs transposed before the loop, ``x.select(d, t)`` and
``x[..., t, :]`` selections, the decay as ``g_t[..., None].exp()``, ``torch.exp(g_t).unsqueeze(-1)``
or ``g[:, t, ..., None].exp()``, v̂ and the read-out by broadcasting and ``.sum(-2)``, ``einsum``
or ``@``, the update by ``einsum`` or by broadcasting, the scale inside the read-out, on q before
the loop or after the contraction, the outputs written into a buffer (``empty_like``,
``zeros_like``, ``new_zeros``, float32) or stacked (any dim, also negative), l2-normalised q/k,
β through a sigmoid, a per-channel or scalar gate, an initial state or none, the final state
returned or not, grouped value heads, fp32 inputs or fp16 inputs upcast to an fp32 state.

The adversarial **mutations** (``mutation``) make a program that the pattern must decline or
still compute exactly: a different scale at one step, a missing decay at one step, an
intermediate state read outside the loop, an input written in place inside the loop (or before
or after it), the state updated in place, the output buffer read mid-loop, a grad-mode switch
inside the loop, the loop run backwards, another time index for v, β or the gate computed
inside the loop, transposed outer products / read-outs / v̂ / gates (K == V, so that the shapes
still agree), the read-out of the state before its update, v̂ from the state before its decay,
a damping of the state at one step, the output written after the loop, o_t read twice, negative
time indices (``x[:, t - T]``: the same steps) and indices that wrap around zero
(``range(-m, T - m)``: the last m steps first). The
**values** can be adversarial too: gates of exactly 0, very negative (−1e4) or −inf, β of 0,
1 or a mix, unnormalised keys.

The oracle renders the same program with float64 where the program pins float32
(:func:`render` with ``oracle=True``): ``.float()`` becomes ``.double()``, ``torch.float32``
``torch.float64``.
"""

from __future__ import annotations

import dataclasses
import random
import textwrap
from typing import Optional

LAYOUTS = ("bhtk", "bthk", "transpose")
SELECTS = ("index", "select", "ellipsis")
UPCASTS = ("none", "step", "before")
DECAYS = ("index", "unsqueeze", "inline")
VHATS = ("bcast", "einsum", "matmul")
UPDATES = ("einsum", "bcast", "bcast_k")
READOUTS = ("einsum", "bcast", "matmul")
SCALES = ("none", "inside", "before", "after")
ASSEMBLIES = ("empty", "zeros", "new_zeros", "zeros_f32", "stack")
SETITEMS = ("index", "ellipsis")
GATES = ("channel", "scalar")
H0S = ("none", "input", "zeros")
GATE_VALUES = ("normal", "zero", "small", "very_negative", "neg_inf")
BETA_VALUES = ("rand", "zero", "one", "mixed")
K_VALUES = ("unit", "raw")
GRAD_MODES = ("none", "train", "no_grad")
INPUT_NAMES = ("q", "k", "v", "g", "beta", "h0")
#: mutations that need K == V (a transposed product must have the state's shape)
SQUARE_MUTATIONS = ("transpose_update", "readout_wrong_axis", "vhat_wrong_axis", "gate_on_v")
#: mutations that need the outputs in a buffer
BUFFER_MUTATIONS = ("buffer_read", "out_write_after", "write_after")
MUTATIONS = ("none", "scale_at_t", "skip_decay_at_t", "state_read", "input_write_inside", "input_write_before",
             "input_write_after", "state_inplace", "buffer_read", "grad_switch", "reversed", "shifted_v",
             "beta_inside", "gate_inside", "transpose_update", "readout_wrong_axis", "vhat_wrong_axis", "gate_on_v",
             "readout_before_update", "undecayed_vhat", "damping", "out_write_after", "write_after",
             "readout_reused", "negative_index", "wrap_index")
#: the state's dtype in the program: float32 (``fp32``), or the inputs' own dtype (``input``:
#: a half-precision state rounded every step when the inputs are float16)
STATE_DTYPES = ("fp32", "input")
#: the KDA plan the fuser run forces (``FUSER_PLAN`` in the program; ``auto``: the planner's
#: choice, which at these lengths is mostly ``recurrent``)
PLANS = ("auto", "recurrent", "chunk", "parallel")


@dataclasses.dataclass(frozen=True)
class KDASpec:
    """One KDA program (see the module docstring). Sizes: ``batch``, ``heads`` (of q and k),
    ``group`` (value heads per q/k head: q and k ``repeat_interleave``d), ``key_dim`` (K),
    ``value_dim`` (V), ``steps`` (the loop length T of each call, in order), ``dtype``
    (``float32``/``float16``), ``dynamic``. ``mutation_step``: the step a mutation applies at;
    ``target``: the input a mutation writes in place."""

    pattern: str = "kda"
    seed: int = 0
    batch: int = 1
    heads: int = 1
    group: int = 1
    key_dim: int = 4
    value_dim: int = 4
    steps: tuple = (4,)
    dtype: str = "float32"
    dynamic: Optional[bool] = False
    layout: str = "bhtk"
    select: str = "index"
    upcast: str = "none"
    decay: str = "index"
    vhat: str = "bcast"
    update: str = "einsum"
    readout: str = "einsum"
    scale: str = "none"
    scale_value: float = 0.5
    assembly: str = "empty"
    setitem: str = "index"
    stack_dim: int = 1
    l2norm: bool = False
    sigmoid_beta: bool = False
    gate: str = "channel"
    h0: str = "none"
    state_out: bool = False
    state_dtype: str = "fp32"
    gate_values: str = "normal"
    beta_values: str = "rand"
    k_values: str = "unit"
    grad: str = "none"
    grad_inputs: tuple = ()
    mutation: str = "none"
    mutation_step: int = 1
    target: str = "v"
    plan: str = "auto"

    # what the runner and the fuzzer's log ask of every spec
    is_kl = False
    softmax = "none"
    score = "none"
    mask = "none"
    fill = "-inf"

    @property
    def calls(self) -> tuple:
        return tuple((t, t) for t in self.steps)

    @property
    def value_heads(self) -> int:
        return self.heads * self.group

    def features(self) -> dict:
        base = KDASpec(seed=self.seed)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("pattern", "seed") and getattr(self, f.name) != getattr(base, f.name)}


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

def sample(rng: random.Random, seed: int = 0) -> KDASpec:
    """A random KDA program: a supported spelling, and with probability ~0.45 a mutation."""
    dtype = "float16" if rng.random() < 0.2 else "float32"
    t = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 11, 12])
    steps = [t]
    r = rng.random()
    if r < 0.12:
        steps.append(t)  # the same length again, new values
    elif r < 0.2:
        steps.append(rng.choice([2, 3, 5, 7, 10]))
    # unit K or V (rare): the pattern cannot tell a unit key dim from β's shape; it must decline
    kd = 1 if rng.random() < 0.05 else rng.choice([3, 5, 6, 12, 12])
    vd = 1 if rng.random() < 0.05 else rng.choice([5, 7, 10, 3, kd])
    grad = rng.choice(["none", "none", "train", "no_grad"])
    grad_inputs = tuple(n for n in INPUT_NAMES if rng.random() < 0.6)
    mutation = rng.choice(MUTATIONS[1:]) if rng.random() < 0.45 else "none"
    layout = rng.choice(LAYOUTS)
    spec = KDASpec(
        seed=seed,
        batch=rng.choice([1, 2, 2]),
        heads=rng.choice([1, 2, 2, 3]),
        group=rng.choice([1, 1, 1, 2]),
        key_dim=kd,
        value_dim=vd,
        steps=tuple(steps),
        dtype=dtype,
        dynamic=rng.choice([False, False, None, True]),
        layout=layout,
        select=rng.choice(SELECTS),
        upcast=rng.choice(UPCASTS),
        decay=rng.choice(DECAYS),
        vhat=rng.choice(VHATS),
        update=rng.choice(UPDATES),
        readout=rng.choice(READOUTS),
        scale=rng.choice(SCALES),
        scale_value=rng.choice([0.5, 0.25, 0.3, kd ** -0.5, 2.0]),
        assembly=rng.choice(ASSEMBLIES),
        setitem=rng.choice(SETITEMS),
        stack_dim=rng.choice([1, 2, 0, 3, -1, -2, -3]),
        l2norm=rng.random() < 0.3,
        sigmoid_beta=rng.random() < 0.3,
        gate=rng.choice(["channel", "channel", "scalar"]),
        h0=rng.choice(H0S),
        state_out=rng.random() < 0.4,
        state_dtype="input" if rng.random() < 0.1 else "fp32",
        gate_values=rng.choice(GATE_VALUES) if rng.random() < 0.35 else "normal",
        beta_values=rng.choice(BETA_VALUES) if rng.random() < 0.25 else "rand",
        k_values="raw" if rng.random() < 0.2 else "unit",
        grad=grad,
        grad_inputs=grad_inputs,
        mutation=mutation,
        mutation_step=rng.randrange(0, 12),
        target=rng.choice(INPUT_NAMES),
        plan=rng.choice(PLANS[1:]) if rng.random() < 0.5 else "auto",
    )
    return normalize(spec)


def normalize(spec: KDASpec) -> KDASpec:
    """Make a spec consistent (a fixed point: idempotent)."""
    for _ in range(4):
        new = _normalize_once(spec)
        if new == spec:
            return new
        spec = new
    return spec


def _normalize_once(spec: KDASpec) -> KDASpec:
    d = KDASpec(seed=spec.seed)
    r = dataclasses.asdict(spec)
    mut = r["mutation"]
    if r["dtype"] == "float16" and r["upcast"] == "none":
        r["upcast"] = "step"  # half products mixed with a float32 state in one einsum: eager raises
    if r["dtype"] == "float32" and r["state_dtype"] == "input":
        r["state_dtype"] = d.state_dtype  # the same program
    if r["state_dtype"] == "input":
        r["upcast"] = "none"  # the whole loop in the inputs' dtype
    if mut in SQUARE_MUTATIONS:
        r["value_dim"] = r["key_dim"]
    if mut == "gate_on_v":
        r["gate"] = "channel"
        if r["decay"] == "inline":
            r["decay"] = "index"
    if mut in BUFFER_MUTATIONS and r["assembly"] == "stack":
        r["assembly"] = "zeros"
    if mut == "buffer_read" and r["assembly"] == "empty":
        r["assembly"] = "zeros"  # a half-filled empty buffer holds garbage: eager's result too
    if r["assembly"] != "stack":
        r["stack_dim"] = d.stack_dim
    else:
        r["setitem"] = d.setitem
        if not -4 <= r["stack_dim"] <= 3:
            r["stack_dim"] = d.stack_dim
    if r["scale"] == "none":
        r["scale_value"] = d.scale_value
    if r["group"] < 1:
        r["group"] = 1
    if mut == "gate_inside":
        r["gate_values"] = d.gate_values  # the gate is computed from raw values in the loop
    if mut == "beta_inside":
        r["sigmoid_beta"] = False
    if mut in ("input_write_before", "input_write_after") and r["target"] == "h0" and r["h0"] != "input":
        r["target"] = "v"
    if mut not in ("input_write_before", "input_write_after"):
        r["target"] = d.target
    if mut == "none":
        r["mutation_step"] = d.mutation_step
    else:
        r["mutation_step"] = max(0, min(r["mutation_step"], min(r["steps"]) - 1))
        if mut in ("scale_at_t", "skip_decay_at_t", "damping", "grad_switch") and min(r["steps"]) > 1:
            r["mutation_step"] = max(1, r["mutation_step"])  # a step after the first differs
    if r["plan"] == "chunk" and r["state_dtype"] == "input":
        r["plan"] = d.plan  # not offered for a half-precision state (patterns/kda.py)
    names = [n for n in INPUT_NAMES if n != "h0" or r["h0"] == "input"]
    r["grad_inputs"] = () if r["grad"] == "none" else tuple(n for n in names if n in r["grad_inputs"])
    if r["grad"] != "none" and not r["grad_inputs"]:
        r["grad"] = "none"
    r["steps"] = tuple(max(1, int(t)) for t in r["steps"]) or d.steps
    return KDASpec(**r)


def candidates(spec: KDASpec):
    """Simpler variants of ``spec``, most promising first (for :mod:`.minimise`)."""
    d = KDASpec(seed=spec.seed)
    if len(spec.steps) > 1:
        for i in range(len(spec.steps)):
            yield dataclasses.replace(spec, steps=spec.steps[:i] + spec.steps[i + 1:])
    first = ("mutation", "grad", "plan", "layout", "upcast", "assembly", "h0", "state_out", "l2norm", "sigmoid_beta",
             "gate", "scale", "group", "gate_values", "beta_values", "k_values", "dtype", "dynamic")
    names = [f.name for f in dataclasses.fields(KDASpec)]
    for name in list(first) + [n for n in names if n not in first and n not in ("pattern", "seed", "steps")]:
        if getattr(spec, name) != getattr(d, name):
            yield dataclasses.replace(spec, **{name: getattr(d, name)})
    for i in range(len(spec.grad_inputs)):
        yield dataclasses.replace(spec, grad_inputs=spec.grad_inputs[:i] + spec.grad_inputs[i + 1:])
    for name, small in (("batch", 1), ("heads", 1), ("group", 1)):
        if getattr(spec, name) != small:
            yield dataclasses.replace(spec, **{name: small})
    for i, t in enumerate(spec.steps):
        for new in (2, 3, max(2, t // 2)):
            if new < t:
                yield dataclasses.replace(spec, steps=spec.steps[:i] + (new,) + spec.steps[i + 1:])


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

def _sel(spec: KDASpec, x: str, t: str, rank: int) -> str:
    """``x`` at time ``t`` (``rank``: x's rank; the time axis is 1 for bthk, 2 otherwise)."""
    td = 1 if spec.layout == "bthk" else 2
    if spec.select == "select":
        return f"{x}.select({td}, {t})"
    if spec.select == "ellipsis":
        if td == 1:
            return f"{x}[:, {t}, ...]"
        after = rank - td - 1
        return f"{x}[..., {t}{', :' * after}]"
    return f"{x}[:, {t}]" if td == 1 else f"{x}[:, :, {t}]"


def render(spec: KDASpec, oracle: bool = False, _normalize: bool = True):
    """The :class:`.grammar.Program` of ``spec``; ``oracle``: float64 where it pins float32."""
    from .grammar import Program

    if _normalize:
        spec = normalize(spec)
    up = ".double()" if oracle else ".float()"
    acc = "torch.float64" if oracle else "torch.float32"
    mut = spec.mutation
    m = spec.mutation_step
    names = ["q", "k", "v", "g", "beta"] + (["h0"] if spec.h0 == "input" else [])
    L: list = []
    grad_in = set(spec.grad_inputs) if spec.grad != "none" else set()

    # -- before the loop
    written = spec.target if mut in ("input_write_before", "input_write_after", "input_write_inside") else None
    if mut == "input_write_inside":
        written = "v"
    # a clone where the write would hit a leaf that requires grad (eager raises), and in training
    # before a write after the loop: compiled (aot_eager and Inductor alike) a graph that writes
    # an input after reading it gets wrong gradients (torch 2.13), which would hide fuser's
    if written and (written in grad_in or (mut == "input_write_after" and spec.grad == "train")):
        L.append(f"{written} = {written}.clone()  # written in place below")
    if mut == "input_write_before":
        L.append(f"{written}.mul_(2.0)")
    if spec.upcast == "before":
        L.append("dtype = v.dtype")
        L.append(f"q, k, v, g, beta = (x{up} for x in (q, k, v, g, beta))")
    if spec.layout == "transpose":
        L.append("q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))")
        L.append("beta = beta.transpose(1, 2)")
    hd = 2 if spec.layout == "bthk" else 1  # the heads dim inside the loop
    if spec.group > 1:
        L.append(f"q = q.repeat_interleave({spec.group}, dim={hd})")
        L.append(f"k = k.repeat_interleave({spec.group}, dim={hd})")
    if spec.l2norm:
        L.append("q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)")
    if spec.sigmoid_beta:
        L.append("beta = beta.sigmoid()")
    if spec.scale == "before":
        L.append(f"q = q * {spec.scale_value!r}")
    if mut == "input_write_inside":
        L.append("v = v.clone()  # later steps read what the loop writes into v")
    L.append(f"T = q.shape[{1 if spec.layout == 'bthk' else 2}]")
    L.append(f"B, H, K, V = q.shape[0], v.shape[{hd}], q.shape[-1], v.shape[-1]")
    sdt = "q.dtype" if spec.state_dtype == "input" else acc
    if spec.h0 == "input":
        if mut == "state_inplace" and spec.state_dtype != "input" and spec.dtype == "float16":
            L.append(f"s = h0{up}")
        elif mut == "state_inplace":
            L.append("s = h0.clone()" if "h0" in grad_in else "s = h0  # updated in place below")
        elif spec.state_dtype == "input":
            L.append("s = h0")
        else:
            L.append(f"s = h0{up}")
    elif spec.h0 == "zeros":
        L.append(f"s = torch.zeros(B, H, K, V, dtype={sdt})")
    else:
        L.append(f"s = q.new_zeros(B, H, K, V, dtype={sdt})")
    td = 1 if spec.layout == "bthk" else 2
    buf = spec.assembly != "stack"
    if spec.assembly == "empty":
        L.append("o = torch.empty_like(v)")
    elif spec.assembly == "zeros":
        L.append("o = torch.zeros_like(v)")
    elif spec.assembly == "new_zeros":
        L.append("o = v.new_zeros(" + ("B, T, H, V" if td == 1 else "B, H, T, V") + ")")
    elif spec.assembly == "zeros_f32":
        L.append(f"o = torch.zeros(v.shape, dtype={acc})")
    else:
        L.append("outs = []")
    extras = mut in ("state_read", "buffer_read", "readout_reused")
    if extras:
        L.append("extras = []")

    # -- the loop
    loop = {"reversed": "reversed(range(T))", "wrap_index": f"range(-{max(1, m)}, T - {max(1, m)})"}.get(mut, "range(T)")
    L.append(f"for t in {loop}:")
    body: list = []
    # the time index: t, or t - T (the same steps, counted from the end)
    tt = "t - T" if mut == "negative_index" else "t"
    cast = up if spec.upcast == "step" else ""
    rk = 4
    rg = 3 if spec.gate == "scalar" else 4
    body.append(f"q_t = {_sel(spec, 'q', tt, rk)}{cast}")
    body.append(f"k_t = {_sel(spec, 'k', tt, rk)}{cast}")
    vt = "T - 1 - t" if mut == "shifted_v" else tt
    body.append(f"v_t = {_sel(spec, 'v', vt, rk)}{cast}")
    bsel = f"{_sel(spec, 'beta', tt, 3)}{cast}"
    body.append(f"b_t = {bsel}.sigmoid()" if mut == "beta_inside" else f"b_t = {bsel}")
    gsel = f"{_sel(spec, 'g', tt, rg)}{cast}"
    if mut == "gate_inside":
        body.append(f"g_t = -F.softplus({gsel})")
    elif spec.decay != "inline":
        body.append(f"g_t = {gsel}")
    # the decay factor
    scalar = spec.gate == "scalar"
    if mut == "gate_on_v":
        dec = "g_t[..., None, :].exp()"
    elif spec.decay == "index" or (spec.decay == "inline" and mut == "gate_inside"):
        dec = "g_t[..., None, None].exp()" if scalar else "g_t[..., None].exp()"
    elif spec.decay == "unsqueeze":
        dec = "torch.exp(g_t).unsqueeze(-1).unsqueeze(-1)" if scalar else "torch.exp(g_t).unsqueeze(-1)"
    else:  # inline: the selection and the unit dims in one index
        tail = ", None, None" if scalar else ", :, None"
        if td == 1:
            dec = f"g[:, {tt}, :{tail}]{cast}.exp()"
        else:
            dec = f"g[:, :, {tt}{tail}]{cast}.exp()"
    inplace = mut == "state_inplace"

    def vhat_line(state: str) -> str:
        if mut == "vhat_wrong_axis":
            return f"v_hat = (k_t[..., None, :] * {state}).sum(-1)"
        return {"bcast": f"v_hat = (k_t[..., None] * {state}).sum(-2)",
                "einsum": f'v_hat = torch.einsum("bhk,bhkv->bhv", k_t, {state})',
                "matmul": f"v_hat = (k_t.unsqueeze(-2) @ {state}).squeeze(-2)"}[spec.vhat]

    def readout_expr() -> str:
        qx = "q_t"
        if spec.scale == "inside":
            c = spec.scale_value
            qx = f"(q_t * ({c * 0.5!r} if t == {m} else {c!r}))" if mut == "scale_at_t" else f"(q_t * {c!r})"
        elif mut == "scale_at_t":
            qx = f"(q_t * 0.5 if t == {m} else q_t)"
        if mut == "readout_wrong_axis":
            e = f"({qx}[..., None, :] * s).sum(-1)"
        else:
            e = {"einsum": f'torch.einsum("bhk,bhkv->bhv", {qx}, s)',
                 "bcast": f"({qx}[..., None] * s).sum(-2)",
                 "matmul": f"({qx}.unsqueeze(-2) @ s).squeeze(-2)"}[spec.readout]
        if spec.scale == "after":
            e = f"{e} * {spec.scale_value!r}"
        return e

    def update_expr() -> str:
        if mut == "transpose_update":
            return 'torch.einsum("bhk,bhv->bhkv", v_t - v_hat, b_t[..., None] * k_t)'
        return {"einsum": 'torch.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - v_hat)',
                "bcast": "k_t[..., :, None] * (b_t[..., None] * (v_t - v_hat))[..., None, :]",
                "bcast_k": "(b_t[..., None] * k_t)[..., None] * (v_t - v_hat)[..., None, :]"}[spec.update]

    if mut == "undecayed_vhat":
        body.append(vhat_line("s"))
    decay_line = f"s.mul_({dec})" if inplace else f"s = s * {dec}"
    if mut == "skip_decay_at_t":
        body.append(f"if t != {m}:")
        body.append("    " + decay_line)
    else:
        body.append(decay_line)
    if mut != "undecayed_vhat":
        body.append(vhat_line("s"))
    if mut == "readout_before_update":
        body.append(f"o_t = {readout_expr()}")
    body.append(f"s.add_({update_expr()})" if inplace else f"s = s + {update_expr()}")
    if mut == "damping":
        body.append(f"if t == {m}:")
        body.append("    s = s * 0.99")
    if mut == "state_read":
        body.append(f"if t == {m}:")
        body.append("    extras.append(s)  # an intermediate state, read after the loop")
    if mut != "readout_before_update":
        body.append(f"o_t = {readout_expr()}")
    if buf:
        if spec.setitem == "ellipsis" and td == 2:
            body.append(f"o[..., {tt}, :] = o_t")
        else:
            body.append(f"o[:, {tt}] = o_t" if td == 1 else f"o[:, :, {tt}] = o_t")
    else:
        body.append("outs.append(o_t)")
    if mut == "readout_reused":
        body.append(f"if t == {m}:")
        body.append("    extras.append(o_t * 2.0)  # o_t read twice")
    if mut == "buffer_read":
        body.append(f"if t == {m}:")
        body.append("    extras.append(o.sum(-1))  # o half filled")
    if mut == "input_write_inside":
        body.append("if 0 <= t and t + 1 < T:")
        body.append(f"    {_sel(spec, 'v', 't + 1', 4)}.mul_(2.0)  # later steps read the doubled values")
    if mut == "grad_switch":
        body = [f"with torch.set_grad_enabled(t >= {m}):"] + ["    " + b for b in body]
    L += ["    " + b for b in body]

    # -- after the loop
    if not buf:
        L.append(f"o = torch.stack(outs, dim={spec.stack_dim})")
    if mut == "out_write_after":
        L.append("o.mul_(2.0)")
    if mut == "write_after":
        L.append(("o[:, 0] = 0.0" if td == 1 else "o[:, :, 0] = 0.0") + "  # after the loop")
    if mut == "input_write_after":
        L.append(f"{written}.add_(1.0)")
    if spec.upcast == "before":
        L.append("o = o.to(dtype)")
    parts = ["o"] + (["s"] if spec.state_out else []) + (["*extras"] if extras else [])
    if len(parts) == 1:
        L.append("return o")
    else:
        L.append("return torch.cat([x.flatten() for x in (" + ", ".join(parts) + ")])")

    feats = ", ".join(f"{k}={v!r}" for k, v in spec.features().items())
    head = [f"# fuzz program: kda, seed {spec.seed}" + (" (float64 oracle)" if oracle else ""), *textwrap.wrap(
        f"features: {feats or 'none (defaults)'}", 96, initial_indent="# ", subsequent_indent="#   ")]
    src = [*head, "import torch", "import torch.nn.functional as F", "", "",
           f"def program({', '.join(names)}):"]
    src += ["    " + line for line in L]
    src += ["", "", "def make_inputs(n_q, n_k, seed, dtype=torch.float32, call=0):"]
    src += ["    " + line for line in _render_inputs(spec, names)]
    src += [
        "", "",
        f"CALLS = {list(spec.calls)!r}",
        f"DYNAMIC = {spec.dynamic!r}",
        f"DTYPE = torch.{spec.dtype}",
        f"GRAD = {spec.grad!r}  # none | train (GRAD_INPUTS require grad) | no_grad (they do, calls under torch.no_grad())",
        f"GRAD_INPUTS = {tuple(spec.grad_inputs)!r}",
    ]
    if spec.plan != "auto":
        src.append(f'FUSER_PLAN = "kda.plan={spec.plan}"  # forced while fuser compiles (the runner sets it)')
    return Program(spec=spec, source="\n".join(src) + "\n", entry="program", input_names=tuple(names),
                   float_inputs=tuple(names), hides_rows=False, documented_fill=False, mask_buffer=False)


def _render_inputs(spec: KDASpec, names: list) -> list:
    b, h, hv, kd, vd = spec.batch, spec.heads, spec.value_heads, spec.key_dim, spec.value_dim
    in_bthk = spec.layout in ("bthk", "transpose")

    def shp(heads, last):
        dims = [str(b), "n_q", str(heads)] if in_bthk else [str(b), str(heads), "n_q"]
        return "(" + ", ".join(dims + ([str(last)] if last else [])) + ")"

    out = ["gen = torch.Generator().manual_seed(seed)",
           "rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731",
           f"q = rnd{shp(h, kd)}"]
    out.append(f"k = F.normalize(rnd{shp(h, kd)}, dim=-1)" if spec.k_values == "unit"
               else f"k = rnd{shp(h, kd)} * {kd ** -0.5!r}")
    out.append(f"v = rnd{shp(hv, vd)}")
    gshape = shp(hv, None if spec.gate == "scalar" else kd)
    gv = spec.gate_values
    if spec.mutation == "gate_inside":
        out.append(f"g = rnd{gshape}  # the loop applies -softplus")
    elif gv == "zero":
        out.append(f"g = torch.zeros({gshape[1:-1]}, dtype=torch.float64)")
    else:
        out.append(f"g = -F.softplus(rnd{gshape})" + (" * 0.05" if gv == "small" else ""))
        if gv in ("very_negative", "neg_inf"):
            fill = "-1e4" if gv == "very_negative" else 'float("-inf")'
            out.append(f"g = g.masked_fill(torch.rand(g.shape, generator=gen) < 0.25, {fill})")
    bshape = shp(hv, None)
    logits = spec.sigmoid_beta or spec.mutation == "beta_inside"
    bv = spec.beta_values
    if logits:
        val = {"rand": f"rnd{bshape}", "zero": f"torch.full({bshape}, -1e4, dtype=torch.float64)",
               "one": f"torch.full({bshape}, 1e4, dtype=torch.float64)",
               "mixed": f"(torch.rand({bshape}, generator=gen) < 0.5).double() * 2e4 - 1e4"}[bv]
    else:
        val = {"rand": f"torch.rand({bshape}, generator=gen, dtype=torch.float64)",
               "zero": f"torch.zeros({bshape}, dtype=torch.float64)",
               "one": f"torch.ones({bshape}, dtype=torch.float64)",
               "mixed": f"(torch.rand({bshape}, generator=gen) < 0.5).double()"}[bv]
    out.append(f"beta = {val}")
    if "h0" in names:
        out.append(f"h0 = rnd({b}, {hv}, {kd}, {vd})")
    out.append("return {" + ", ".join(f'"{n}": {n}.to(dtype)' for n in names) + "}")
    return out
