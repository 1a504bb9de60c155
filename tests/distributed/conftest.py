"""Fixtures of the DTensor tests that run in one process."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def mesh(request):
    """A 1-D device mesh of 2 ranks on torch's fake process group (this process is rank 0; no
    communication happens), on the module's ``MESH_DEVICE`` (default ``"cpu"``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh(getattr(request.module, "MESH_DEVICE", "cpu"), (2,))
    finally:
        dist.destroy_process_group()
