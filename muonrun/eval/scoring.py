"""Scoring multiple-choice tasks as lm-evaluation-harness scores them, on the sharded model in the loop.

Each (example, choice) pair is one request: the context and `delimiter + choice` tokenized as the
harness's causal models do (the context's trailing spaces move to the continuation; the whole text is
encoded and the context's tokens cut off its front; an empty context is the prefix token: BOS, else
EOS), truncated on the left to `max_len` + 1 tokens. Its log-likelihood is the sum of the choice's
token log-probabilities. `acc`: the example's right choice has the largest; `acc_norm`: the largest
after dividing by the choice's length in characters (ties go to the first, as numpy's argmax).

The requests are split over the data-parallel ranks in equal shares, padded with empty requests, and
run in batches of one shape, so every rank runs the same forwards (FSDP2's all-gathers need
every rank); one all-reduce brings the log-likelihoods together.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from muonrun.config.evaluation import MEAN_KEYS, metric_keys
from muonrun.errors import UserError
from muonrun.eval.tasks import Example, Task


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]
    """The sequence scored: context then continuation, at most max_len + 1 tokens."""
    continuation: int
    """How many of its last tokens are the choice's."""


class Encoder:
    """The harness's tokenization of a (context, continuation) pair with one of muonrun's tokenizers:
    the byte tokenizer's UTF-8 bytes, or a transformers tokenizer's `encode` with its own special tokens
    (the harness's default)."""

    def __init__(self, tok):
        hf = getattr(tok, "hf", None)
        if hf is None:
            self.encode = lambda text: list(text.encode("utf-8", errors="replace"))
            self.prefix = tok.eos_token_id
        else:
            self.encode = hf.encode
            self.prefix = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            cont = self.encode(continuation)
            return ([self.prefix], cont) if cont[:1] != [self.prefix] else (cont[:1], cont[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx) :]


def requests_of(task: Task, encoder: Encoder, max_len: int) -> list[Request]:
    out = []
    for n, example in enumerate(task.examples, 1):
        for choice in example.choices:
            ctx, cont = encoder.pair(example.context, task.delimiter + choice)
            if len(cont) > max_len:
                raise UserError(
                    f"Eval task '{task.name}': example {n} has a choice of {len(cont)} tokens, more than the "
                    f"{max_len} a sequence holds (data.seq_len); shorten it or leave the example out."
                )
            out.append(Request(tuple((ctx + cont)[-(max_len + 1) :]), len(cont)))
    return out


def accuracies(examples: tuple[Example, ...], lls: np.ndarray) -> tuple[float, float]:
    """(acc, acc_norm) of the examples from their choices' log-likelihoods, in request order."""
    acc = norm = 0
    at = 0
    for example in examples:
        ll = lls[at : at + len(example.choices)]
        at += len(example.choices)
        lengths = np.array([float(len(c)) for c in example.choices])
        acc += int(np.argmax(ll)) == example.label
        norm += int(np.argmax(ll / lengths)) == example.label
    assert at == len(lls), (at, len(lls))
    return acc / len(examples), norm / len(examples)


def batches(requests: list[Request], rank: int, world: int, batch_size: int, pad: int, length: int):
    """This rank's share of `requests` as (global index of each row or -1, input ids, labels, mask of the
    continuation's positions) batches: as many batches of one shape [batch_size, length] on every rank."""
    share = -(-len(requests) // world)
    mine = list(range(rank * share, min((rank + 1) * share, len(requests))))
    rows = -(-share // batch_size) * batch_size
    mine += [-1] * (rows - len(mine))
    for start in range(0, rows, batch_size):
        index = mine[start : start + batch_size]
        ids = torch.full((batch_size, length), pad, dtype=torch.long)
        labels = torch.full((batch_size, length), pad, dtype=torch.long)
        mask = torch.zeros((batch_size, length), dtype=torch.bool)
        for row, i in enumerate(index):
            if i < 0:
                continue
            r = requests[i]
            seq = torch.tensor(r.tokens)
            ids[row, : len(seq) - 1], labels[row, : len(seq) - 1] = seq[:-1], seq[1:]
            mask[row, len(seq) - 1 - r.continuation : len(seq) - 1] = True
        yield torch.tensor(index), ids, labels, mask


class TaskSet:
    """The tasks of `eval.tasks`, tokenized once; `score` runs them on the model (every rank calls it)."""

    def __init__(self, tasks: list[Task], tok, max_len: int, batch_size: int):
        encoder = Encoder(tok)
        self.tasks = tasks
        self.requests = [requests_of(task, encoder, max_len) for task in tasks]
        self.batch_size = batch_size
        self.pad = tok.eos_token_id
        # one shape for every task's batches: a compiled model (parallel.compile) compiles it once
        self.length = max(len(r.tokens) for requests in self.requests for r in requests) - 1

    @torch.no_grad()
    def score(self, model, device: torch.device, dp_rank: int = 0, dp_size: int = 1) -> dict[str, float]:
        """`eval_acc_NAME`, `eval_acc_norm_NAME` per task and their means. `model(ids, labels,
        per_token=True)` returns each label's log-probability; the model is in eval mode."""
        sums, counts = [], []
        for requests in self.requests:
            ll = torch.zeros(len(requests), dtype=torch.float64)
            count = torch.zeros(len(requests), dtype=torch.float64)
            shares = batches(requests, dp_rank, dp_size, self.batch_size, self.pad, self.length)
            for index, ids, labels, mask in shares:
                logp = model(ids.to(device), labels.to(device), per_token=True)
                total = (logp * mask.to(device)).sum(dim=1).double().cpu()
                real = index >= 0
                ll[index[real]] += total[real]
                count[index[real]] += 1
            sums.append(ll)
            counts.append(count)
        together = torch.cat([torch.cat(sums), torch.cat(counts)]).to(device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(together)  # a request's ranks (its tp ranks) agree: mean = value
        together = together.cpu().numpy()
        lls = together[: len(together) // 2] / together[len(together) // 2 :]
        values, at = {}, 0
        for task, requests in zip(self.tasks, self.requests, strict=True):
            acc, norm = accuracies(task.examples, lls[at : at + len(requests)])
            at += len(requests)
            values.update(zip(metric_keys(task.name), (acc, norm), strict=True))
        n = len(self.tasks)
        values[MEAN_KEYS[0]] = sum(values[metric_keys(t.name)[0]] for t in self.tasks) / n
        values[MEAN_KEYS[1]] = sum(values[metric_keys(t.name)[1]] for t in self.tasks) / n
        return values
