"""The planner's cost model: symbolic costs (sympy) evaluated per concrete shape.

A pattern describes each candidate plan by sympy expressions in its shape symbols —
FLOPs on the matrix units, exponentials, bytes through HBM, parallel tiles, kernel launches —
and :func:`estimate_ms` turns them into a time on a :class:`DeviceModel`::

    t = max(flops / (peak · eff), bytes / bandwidth, exps / exp_rate) / wave_efficiency(tiles)
        + launches · launch_overhead

``eff`` is the fraction of the matrix-unit peak an implementation reaches, measured per
implementation and head-dim bucket; each pattern keeps its table beside its plans.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import sympy

# Shape symbols shared by the patterns' cost expressions.
B, H, HKV, NQ, NK, D, DV = sympy.symbols("B H H_kv N_q N_k D D_v", positive=True, integer=True)


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """Peak rates of a device.

    Attributes:
        name: device name.
        tflops: dense matrix-unit peak in TFLOP/s per operand kind (``"bf16"``, ``"fp16"``,
            ``"tf32"``, ``"fp32"`` — the last for IEEE fp32 on the FMA units).
        bandwidth_gbs: HBM bandwidth in GB/s (bytes read plus written).
        sm_count: streaming multiprocessors.
        exp_per_s: exponentials per second (MUFU ``ex2`` throughput).
        atomic_per_s: fp32 atomic adds to global memory per second (resolved in L2).
        launch_us: overhead per kernel launch in microseconds.
    """

    name: str
    tflops: Mapping[str, float]
    bandwidth_gbs: float
    sm_count: int
    exp_per_s: float
    atomic_per_s: float
    launch_us: float


# Measured on the lent H100 (BENCHMARKS.md): 798 TFLOP/s bf16 GEMM, ~3.0 TB/s copy.
H100 = DeviceModel(
    name="NVIDIA H100 80GB HBM3",
    tflops={"bf16": 790.0, "fp16": 790.0, "tf32": 395.0, "fp32": 51.0},
    bandwidth_gbs=3000.0,
    sm_count=132,
    exp_per_s=132 * 16 * 1.755e9,  # 16 ex2 per clock per SM
    # fp32 atomic adds resolved in L2: 1.2e12/s reproduces the attention-KL atomic_dq backward
    # without a mask (N=8192, D=64 and 128, frozen teacher and both sides) within ~20% with the
    # efficiencies below; causal atomic_dq is overestimated (~30%): the atomics term does not
    # skip the tiles above the diagonal
    atomic_per_s=1.2e12,
    launch_us=4.0,
)

#: Fraction of the matrix-unit peak a plain matmul reaches (eager and Inductor plans, which
#: materialise the scores with cuBLAS GEMMs), by head-dim bucket (<=64, <=128, <=256). Each
#: pattern keeps the measured efficiencies of its own kernels and libraries beside its plans
#: (``patterns/*_plans.py``), in the same form.
EAGER_MATMUL = (0.70, 0.70, 0.70)


def efficiency(table: tuple, head_dim: int) -> float:
    """The entry of a ``(<=64, <=128, <=256)`` head-dim-bucket table for ``head_dim``: the
    fraction of the matrix-unit peak an implementation reaches, used as ``eff``."""
    return table[0] if head_dim <= 64 else table[1] if head_dim <= 128 else table[2]


#: Host time of a kernel launch replayed from a CUDA graph, in µs: none (one host call replays
#: the whole graph). The gap between consecutive kernel nodes on the device (about a microsecond)
#: is part of the device times the launch-heavy plans' tables were fitted to (the KDA plan sweeps
#: time CUDA-graph replays: ``benchmarks/kda_plan_sweep.py``); for the attention, attention-KL and
#: H2O kernels (tens of µs and more at the shapes they take) it is below the models' error.
GRAPH_LAUNCH_US = 0.0


def device_model(name: str, sm_count: int | None = None, *, cuda_graphs: bool = False) -> DeviceModel:
    """The model for a device by name; unknown GPUs and the interpreter use the H100's
    rates (estimates then rank plans but their absolute values mean little). With
    ``cuda_graphs`` (the compiled graph is replayed from CUDA graphs: ``Options.cuda_graphs``),
    ``launch_us`` is :data:`GRAPH_LAUNCH_US` instead of the host's dispatch and launch time."""
    model = H100
    if cuda_graphs:
        model = dataclasses.replace(model, launch_us=GRAPH_LAUNCH_US)
    if sm_count is not None and sm_count != model.sm_count:
        model = dataclasses.replace(model, sm_count=sm_count)
    if name != model.name:
        model = dataclasses.replace(model, name=name)
    return model


def operand_kind(dtype_name: str, tf32: bool) -> str:
    """The ``tflops`` key for operands of torch dtype name ``dtype_name``."""
    if dtype_name in ("bfloat16", "torch.bfloat16"):
        return "bf16"
    if dtype_name in ("float16", "torch.float16"):
        return "fp16"
    return "tf32" if tf32 else "fp32"


def pairs_causal(nq: sympy.Expr, nk: sympy.Expr, offset: sympy.Expr) -> sympy.Expr:
    """Number of (query, key) pairs with ``0 <= j <= i + offset``, ``i < nq``, ``j < nk``:
    ``Σ_i clamp(i + offset + 1, 0, nk)`` in closed form."""

    def cum(x: sympy.Expr) -> sympy.Expr:  # Σ_{a <= x} clamp(a, 0, nk)
        return sympy.Piecewise(
            (0, x <= 0),
            (x * (x + 1) / 2, x <= nk),
            (nk * (nk + 1) / 2 + (x - nk) * nk, True),
        )

    return cum(nq + offset) - cum(offset)


def wave_efficiency(tiles: float, sm_count: int) -> float:
    """Useful fraction of the last wave: ``tiles / (ceil(tiles / SMs) · SMs)``."""
    if tiles <= 0:
        return 1.0
    waves = math.ceil(tiles / sm_count)
    return tiles / (waves * sm_count)


def evaluate(expr: sympy.Expr | float, subs: Mapping) -> float:
    """A cost term's value at concrete shapes.

    Args:
        expr: a number or a sympy expression in the shape symbols (``Piecewise`` included).
        subs: shape symbol -> number, for every symbol of ``expr``.

    Raises:
        TypeError: a symbol of ``expr`` has no value in ``subs``.

    Symbols are replaced structurally (``xreplace``; ~10x faster than ``subs``, which matters
    at compile time: every candidate of every match evaluates several terms); ``subs`` is the
    fallback for an expression that does not reduce to a number that way.
    """
    if isinstance(expr, (int, float)):
        return float(expr)
    expr = sympy.sympify(expr)
    value = expr.xreplace({k: sympy.sympify(v) for k, v in subs.items()})
    if not value.is_number:
        value = expr.subs(subs)
    return float(value)


def estimate_ms(cost: Mapping[str, sympy.Expr], subs: Mapping, device: DeviceModel, kind: str, efficiency: float) -> float:
    """Estimated milliseconds of one candidate.

    Args:
        cost: terms ``flops``, ``bytes``, ``exps``, ``tiles``, ``launches`` (missing = 0).
        subs: shape symbol -> value.
        device: rates.
        kind: operand kind for the matrix units (see :func:`operand_kind`).
        efficiency: fraction of the matrix peak reached (see :func:`efficiency`).
    """
    flops = evaluate(cost.get("flops", 0), subs)
    nbytes = evaluate(cost.get("bytes", 0), subs)
    exps = evaluate(cost.get("exps", 0), subs)
    tiles = evaluate(cost.get("tiles", 0), subs)
    launches = evaluate(cost.get("launches", 1), subs)
    t_math = flops / (device.tflops[kind] * 1e12 * efficiency)
    t_mem = nbytes / (device.bandwidth_gbs * 1e9)
    t_exp = exps / device.exp_per_s
    t = max(t_math, t_mem, t_exp) / wave_efficiency(tiles, device.sm_count) if tiles else max(t_math, t_mem, t_exp)
    return (t + launches * device.launch_us * 1e-6) * 1e3


def atomics_ms(cost: Mapping[str, sympy.Expr], subs: Mapping, device: DeviceModel) -> float:
    """Milliseconds of a candidate's global float32 atomic adds (its ``atomics`` term, 0 if
    none), at ``device.atomic_per_s``: added to :func:`estimate_ms` by plans that accumulate
    with atomics (split dQ, one-kernel column sums)."""
    return evaluate(cost.get("atomics", 0), subs) / device.atomic_per_s * 1e3
