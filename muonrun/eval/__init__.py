"""Downstream evaluation: multiple-choice tasks scored in the training loop (`eval.tasks`), and
`muonrun eval` on lm-evaluation-harness for checkpoints (harness.py, the `eval` extra).

    tasks = task_set(cfg, tok)                       # every task file read and checked, tokenized
    tasks.score(model, device, dp_rank, dp_size)     # {"eval_acc_NAME": ..., "eval_acc_mean": ...}

Modules: tasks.py (files -> checked examples), scoring.py (requests, batches over ranks, acc and
acc_norm as the harness computes them), harness.py (`muonrun eval`), byte_tokenizer.py (the byte
tokenizer as a transformers tokenizer, for the harness), text_tasks.py (tasks made from local text).
docs/evals.md; `pytest tests/test_eval.py`.
"""

from __future__ import annotations

from muonrun.eval.scoring import TaskSet
from muonrun.eval.tasks import read_tasks


def task_set(cfg, tok) -> TaskSet | None:
    """The config's tasks ready to score (None without tasks); a bad task file raises UserError."""
    if not cfg.eval.tasks:
        return None
    return TaskSet(read_tasks(cfg.eval.tasks), tok, cfg.data.seq_len, cfg.eval.batch_size)


def check_tasks(cfg, tok) -> None:
    """Read and tokenize every task as the workers will (the launcher and the dry run, before any
    worker starts): a missing field or a label outside the choices exits 2 naming the file and line."""
    task_set(cfg, tok)


__all__ = ["TaskSet", "check_tasks", "read_tasks", "task_set"]
