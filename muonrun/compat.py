"""Private torch names muonrun uses, in one place, each with a test in tests/test_compat.py that fails
naming it when a torch release changes or removes it.

- `torch._dynamo.exc.TorchDynamoException`: what `torch.compile` raises when it cannot compile a
  function (`BackendCompilerFailed`, `Unsupported`, ... derive from it). Muon's fused passes
  (muonrun/optim/fused.py) catch it on their first call, before anything ran, to fall back to the
  eager ops; torch exports no public base class for compile failures, and catching every exception
  would also swallow a failure that happened after some kernels had run.
"""

from __future__ import annotations


def compile_error() -> type[Exception]:
    """The base class of `torch.compile`'s own errors (imported when first needed: it loads dynamo)."""
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException
