"""The torch reference on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from radixlm.constrained import allocate_bitmask, apply_bitmask

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_bitmask_on_cuda_matches_the_cpu() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=generator)
    bitmask = allocate_bitmask(4, 1000)
    bitmask[:, ::3] = 0x5555
    on_cpu = logits.clone()
    apply_bitmask(on_cpu, bitmask)
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)
