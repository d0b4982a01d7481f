"""LM head + cross-entropy fused over chunks of tokens, gradients computed in the forward pass.

For each chunk of `chunk` tokens: logits = h @ W^T (in the compute dtype), log-softmax in fp32, loss,
and right away dL/dlogits = softmax - onehot, from which dL/dh = g @ W and dL/dW += g^T @ h. Only one
chunk of logits ever exists (never the [tokens x 151,936] fp32 tensor a plain loss builds) and nothing
is recomputed in backward, which only scales the stored gradients. Same idea as Liger-Kernel's
fused linear cross-entropy, in plain PyTorch.

`compiled=True` (parallel.compile_loss) turns each chunk's softmax gradient into one torch.compile'd
pass that reads the bf16 logits and writes the bf16 gradient, instead of the eager path's half a
dozen fp32 passes over the [chunk x vocab] block (about a quarter of Qwen2-0.5B's GPU time).

`pytest tests/test_loss.py` checks values and gradients against `F.cross_entropy` on full logits.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def loss_and_logit_grad(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of one chunk and dL/dlogits = softmax - onehot, in the logits' dtype.
    Written for torch.compile: the fp32 values below live in registers, never in memory."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss = (lse - x.gather(1, labels[:, None]).squeeze(1)).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    grad = (x - lse[:, None]).exp() - onehot.to(x.dtype)
    return loss, grad.to(logits.dtype)


@functools.cache
def compiled_loss_and_logit_grad():
    return torch.compile(loss_and_logit_grad, dynamic=False)


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
            if compiled and (want_h or want_w):
                loss, g = compiled_loss_and_logit_grad()(h @ weight.t(), y)
                total += loss
            else:
                logits = (h @ weight.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
                if want_h or want_w:
                    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place over the logits
                    g[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                    g = g.to(hidden.dtype)
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
    """Sum over tokens of cross-entropy(hidden @ weight^T, labels); hidden [N, d], weight [V, d], labels [N]."""
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


def token_log_likelihoods(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int = 4096) -> Tensor:
    """log p(label) of every token in fp32, computed chunk by chunk (downstream evals, no gradient);
    hidden [..., d], weight [V, d], labels [...]."""
    h, y = hidden.flatten(0, -2), labels.flatten()
    chunk = chunk if chunk > 0 else h.shape[0]
    out = torch.empty(y.shape, dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        logits = (h[start : start + chunk] @ weight.t()).float()
        picked = logits.gather(1, y[start : start + chunk, None]).squeeze(1)
        out[start : start + chunk] = picked - torch.logsumexp(logits, dim=-1)
    return out.view(labels.shape)
