"""Checks shared by the kernel test modules: relative errors, random masks, config tables,
compiled specialisations."""

import torch

from fuser.codegen import launch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (``‖a − b‖`` when ``b`` is all zeros)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def random_mask(kind: str, row_shape: tuple, full_shape: tuple, row: bool, gen: torch.Generator):
    """A random mask of ``kind`` (``"none"``: None; ``"additive"``: normal floats; boolean kinds:
    ~70% True), shaped ``row_shape`` (one row broadcast over queries) if ``row`` else ``full_shape``."""
    if kind == "none":
        return None
    shape = row_shape if row else full_shape
    if kind == "additive":
        return torch.randn(*shape, generator=gen)
    return torch.rand(*shape, generator=gen) > 0.3


def check_table(fwd: dict, bwd: dict) -> None:
    """Every (device kind, head-dim bucket, dtype size) has candidates, and each candidate has
    power-of-two blocks >= 16 (``launch.check_config``), 1..8 warps and >= 1 stage."""
    for dev in ("sm90", "cuda"):
        for bucket in (64, 128, 256):
            for size in (2, 4):
                for table, keys in ((fwd, ("BLOCK_M", "BLOCK_N")), (bwd, ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))):
                    cands = table[(dev, bucket, size)]
                    assert cands
                    for c in cands:
                        assert all(key in c for key in keys)
                        launch.check_config(c)
                        assert c["num_warps"] in (1, 2, 4, 8) and c["num_stages"] >= 1


def compiled_keys(fn) -> set:
    """The specialisation keys a @triton.jit function has compiled on the device so far (to
    check that new sequence lengths do not recompile); skips the test on a Triton that keeps no
    ``device_caches``."""
    import pytest

    if not hasattr(fn, "device_caches"):
        pytest.skip("this Triton keeps no device_caches")
    return {key for entry in fn.device_caches.values() for key in entry[0]}
