"""The fused, chunked LM head + cross-entropy equals F.cross_entropy on full logits, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from muonrun.loss import linear_cross_entropy_sum


@pytest.mark.parametrize("chunk", [0, 7, 16, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_full_logits(chunk, dtype):
    torch.manual_seed(0)
    n, d, v = 37, 16, 50
    hidden = torch.randn(n, d, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,))
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy((ref_h @ ref_w.t()).float(), labels, reduction="sum")
    (ref * 0.5).backward()
    out = linear_cross_entropy_sum(hidden, weight, labels, chunk)
    (out * 0.5).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(hidden.grad.float(), ref_h.grad.float(), **tol)
    torch.testing.assert_close(weight.grad.float(), ref_w.grad.float(), **tol)


def test_no_grad_path_returns_the_same_value():
    torch.manual_seed(1)
    hidden, weight, labels = torch.randn(9, 4), torch.randn(11, 4), torch.randint(0, 11, (9,))
    with torch.no_grad():
        value = linear_cross_entropy_sum(hidden, weight, labels, 4)
    torch.testing.assert_close(value, F.cross_entropy(hidden @ weight.t(), labels, reduction="sum"))
