"""Each private torch name in muonrun/compat.py still exists and means what muonrun relies on."""

import pytest
import torch

from muonrun import compat


def test_torch_dynamo_exc_torch_dynamo_exception_is_what_a_failed_compile_raises():
    """torch._dynamo.exc.TorchDynamoException: the base of the error torch.compile raises when its
    backend fails, before the function ran (Muon's fused passes then run eagerly)."""
    base = compat.compile_error()
    assert issubclass(base, Exception)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend failure")

    ran = []

    def fn(x):
        ran.append(1)
        return x * 2

    with pytest.raises(base):
        torch.compile(fn, backend=broken_backend, fullgraph=True)(torch.ones(2))
    assert ran == []  # traced, not run: its side effect never happened, so falling back is safe
