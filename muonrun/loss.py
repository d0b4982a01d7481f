"""LM head + cross-entropy fused over chunks of tokens, gradients computed in the forward pass.

For each chunk of `chunk` tokens: logits = h @ W^T (in the compute dtype), log-softmax in fp32, loss,
and right away dL/dlogits = softmax - onehot, from which dL/dh = g @ W and dL/dW += g^T @ h. Only one
chunk of logits ever exists (never the [tokens x 151,936] fp32 tensor a plain loss builds) and nothing
is recomputed in backward, which only scales the stored gradients. Same idea as Liger-Kernel's
fused linear cross-entropy, in plain PyTorch.

`pytest tests/test_loss.py` checks values and gradients against `F.cross_entropy` on full logits.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _loss_and_logit_grad(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of one chunk and dL/dlogits = softmax - onehot (in the logits' dtype).
    Compiled, this is one fused pass over the chunk instead of half a dozen fp32 passes."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss = (lse - x.gather(1, labels[:, None]).squeeze(1)).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    grad = (x - lse[:, None]).exp() - onehot.to(x.dtype)
    return loss, grad.to(logits.dtype)


_compiled_loss_and_logit_grad = None


def _chunk_fn(compiled: bool):
    global _compiled_loss_and_logit_grad
    if not compiled:
        return _loss_and_logit_grad
    if _compiled_loss_and_logit_grad is None:
        _compiled_loss_and_logit_grad = torch.compile(_loss_and_logit_grad, dynamic=False)
    return _compiled_loss_and_logit_grad


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, compiled: bool) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_h else None
        # The weight gradient sums over chunks: keep that sum in fp32 even for bf16 weights.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            if not (want_h or want_w):
                logits = (h @ weight.t()).float()
                total += torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                continue
            loss, g = _chunk_fn(compiled)(h @ weight.t(), y)
            total += loss
            if want_h:
                torch.mm(g, weight, out=grad_hidden[start : start + chunk])
            if want_w:
                grad_weight.add_(g.t() @ h)
        if want_w:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.to(grad_hidden.dtype if grad_hidden is not None else grad_weight.dtype)
        return (
            grad_hidden * scale if grad_hidden is not None else None,
            grad_weight * scale if grad_weight is not None else None,
            None,
            None,
            None,
        )


def linear_cross_entropy_sum(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int = 4096, compiled: bool = False
) -> Tensor:
    """Sum over tokens of cross-entropy(hidden @ weight^T, labels); hidden [N, d], weight [V, d], labels [N].
    `compiled` fuses each chunk's elementwise work with torch.compile."""
    chunk = chunk if chunk > 0 else hidden.shape[0]
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():
            return _LinearCrossEntropy.forward(_NoCtx(), hidden, weight, labels, chunk, False)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, compiled)


class _NoCtx:
    """Stands in for autograd's ctx when no gradient is wanted (evaluation)."""

    needs_input_grad = (False, False, False, False, False)

    def save_for_backward(self, *tensors) -> None:
        pass
