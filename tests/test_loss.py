"""The fused, chunked LM head + cross-entropy equals F.cross_entropy on full logits, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from muonrun.model.loss import linear_cross_entropy_sum, loss_and_logit_grad


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


def test_chunk_function_matches_the_eager_path():
    """parallel.compile_loss runs `loss_and_logit_grad` compiled; uncompiled it must give the same
    values and gradients as the eager chunk loop."""
    torch.manual_seed(2)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    logits = (hidden @ weight.t()).detach()
    loss, grad = loss_and_logit_grad(logits, labels)
    ref = F.cross_entropy(logits.clone().requires_grad_(), labels, reduction="sum")
    torch.testing.assert_close(loss, ref)
    expected = torch.softmax(logits, -1) - F.one_hot(labels, 50).float()
    torch.testing.assert_close(grad, expected)


@pytest.mark.gpu
def test_compiled_chunks_match_full_logits_on_gpu():
    torch.manual_seed(3)
    n, d, v = 4096 + 100, 256, 32_000  # a ragged last chunk compiles a second shape
    hidden = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, d, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy((ref_h @ ref_w.t()).float(), labels, reduction="sum")
    ref.backward()
    out = linear_cross_entropy_sum(hidden, weight, labels, 2048, compiled=True)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-2)
    for got, want in ((hidden.grad, ref_h.grad), (weight.grad, ref_w.grad)):
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 1e-2, rel
