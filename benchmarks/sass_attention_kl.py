"""Instruction mix of the attention-KL forward loop, compiled for sm_90a without a GPU.

    python benchmarks/sass_attention_kl.py --block-m 128 --block-n 64 --warps 8 --stages 4 [--dim 128]

Renders the forward kernel (no mask, not causal, statistics stored: the training forward),
compiles it with Triton's normal pipeline for an H100 target through a stand-in driver (Triton
never touches a device: ``JITFunction.warmup`` only compiles), disassembles the cubin with the
``cuobjdump`` shipped in Triton's NVIDIA backend, and prints, for every loop that holds tensor-core
(HGMMA) or MUFU work, its instruction count per warp and iteration by opcode, plus the order of
HGMMA / wait / MUFU runs. Registers, spills and shared memory come from ``cuobjdump
--dump-resource-usage``.

This is how ``benchmarks/results/attention_kl.md`` found that the loop waits for both score
products before its exponentials (no overlap) and issues ~575 instructions per 128×64 tile pair.
It is a development aid for kernel work without device time: counts, not timings.
It depends on Triton internals (the driver interface): checked with Triton 3.9.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _CompileOnlyDriver:
    """Just enough of Triton's active-driver interface for ``warmup`` to compile for sm_90."""

    def __init__(self, torch, target):
        self._torch, self._target = torch, target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self._target

    def get_active_torch_device(self):
        return self._torch.device("cpu")

    def get_device_interface(self):
        return self._torch.cuda

    def get_benchmarker(self):
        return None

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def compile_forward(config: dict, dim: int, n: int = 1024):
    """The compiled forward kernel (Triton ``CompiledKernel``) for one launch config."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from fuser.codegen import attention_kl as akl

    driver.set_active(_CompileOnlyDriver(torch, GPUTarget("cuda", 90, 32)))
    _, module = akl._fwd_module("none", "none", False, True, False, False)
    compiled = []
    jit_fn = module.attention_kl_fwd_kernel

    class _Capture:  # module.launch_fwd calls kernel[grid](...): compile instead of launching
        def __getitem__(self, grid):
            def call(*args, **kw):  # launch.jit_call passes ROW_BASE to the kernel itself, not to a stand-in
                compiled.append(jit_fn.warmup(*args, grid=grid, ROW_BASE=0, **kw))
            return call

    module.attention_kl_fwd_kernel = _Capture()
    try:
        q = [torch.empty(1, 2, n, dim, dtype=torch.bfloat16) for _ in range(4)]
        stats = [torch.empty(1, 2, n) for _ in range(4)]
        module.launch_fwd(*q, *stats, qk_scale1=0.1, qk_scale2=0.1, causal_offset=0, config=config,
                          input_precision="ieee")
    finally:
        module.attention_kl_fwd_kernel = jit_fn
    return compiled[-1]


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_report(kernel) -> str:
    """Per-loop opcode counts and the HGMMA/wait/MUFU order of a compiled kernel's SASS."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    finally:
        os.unlink(f.name)
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    res = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)
    out = [(res.group(0) if res else usage.strip()) + f"; dynamic shared memory {kernel.metadata.shared} B"]
    for i, (addr, text) in enumerate(ins):
        if "BRA" not in text:
            continue
        target = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if not target or int(target.group(1), 16) >= addr or int(target.group(1), 16) not in index:
            continue
        body = [t for _, t in ins[index[int(target.group(1), 16)]:i + 1]]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        if not (ops["HGMMA"] or ops["MUFU"]):
            continue
        order = []
        for t in body:
            key = next((k for k in ("HGMMA", "WARPGROUP.DEPBAR", "MUFU", "BAR.SYNC") if k in t), None)
            if key:
                if order and order[-1][0] == key:
                    order[-1][1] += 1
                else:
                    order.append([key, 1])
        out.append(f"loop {ins[index[int(target.group(1), 16)]][0]:#x}-{addr:#x}: {len(body)} instructions per warp-iteration")
        out.append("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
        out.append("  order: " + " ".join(f"{k}x{v}" for k, v in order))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128, help="head dim of both sides")
    args = ap.parse_args()
    config = {"BLOCK_M": args.block_m, "BLOCK_N": args.block_n, "num_warps": args.warps, "num_stages": args.stages}
    print(f"attention_kl_fwd (no mask, stats stored), D={args.dim}, {config}, sm_90a")
    print(loop_report(compile_forward(config, args.dim)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
