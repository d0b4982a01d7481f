"""The `eval` section: multiple-choice tasks scored during training (muonrun/eval/), beside the held-out
loss of `data.eval_sources`, at every `train.eval_interval`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from muonrun.config.checks import at_least
from muonrun.errors import UserError

FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass
class EvalTaskConfig:
    name: str = "???"
    """The task's name: its metrics are `eval_acc_NAME` and `eval_acc_norm_NAME`, and `muonrun eval RUN
    --tasks NAME` scores the same examples with lm-evaluation-harness. Letters, digits, `_` and `-`."""
    path: str = "???"
    """A local .jsonl, .json or .parquet file with one example per record, or a Hub dataset id (read with
    `datasets.load_dataset`, with `subset` and `split`)."""
    subset: str | None = None
    """Hub dataset configuration name (`datasets.load_dataset`'s `name`). Local files have none."""
    split: str = "train"
    """Split to read (Hub datasets: usually `validation` or `test`); local files form `train`."""
    context_field: str = "context"
    """Field with the text the choices continue."""
    choices_field: str = "choices"
    """Field with the list of choices (at least two non-empty strings)."""
    label_field: str = "label"
    """Field with the right answer: the choice's index (an int, or digits as text, as HellaSwag writes
    it; ASCII digits are always an index, as lm-evaluation-harness reads them) or the choice's own text."""
    target_delimiter: str = " "
    """Text between the context and each choice (the harness's `target_delimiter`): each choice is
    scored as the continuation `DELIMITER + choice` of the context."""
    limit: int | None = None
    """Score only the first N examples (None: all); `muonrun eval` scores the same ones."""


@dataclass
class EvalConfig:
    tasks: list[EvalTaskConfig] = field(default_factory=list)
    """Multiple-choice tasks scored at every `train.eval_interval` (and the last step), as
    lm-evaluation-harness scores them: `acc` (the choice with the largest summed log-likelihood of its
    tokens after the context) and `acc_norm` (that log-likelihood divided by the choice's length in
    characters, which is its length in bytes for ASCII text). Logged per task and as their mean
    (`eval_acc_mean`, `eval_acc_norm_mean`); the examples are split over the data-parallel ranks. From
    the command line: `eval.tasks=[{name: arc, path: arc.jsonl}]`. Each file is checked before any
    worker starts (docs/evals.md)."""
    batch_size: int = 16
    """Sequences (one per choice of an example) per forward on each rank."""

    def __post_init__(self) -> None:
        at_least(1, **{"eval.batch_size": self.batch_size})
        names = [t.name for t in self.tasks]
        for i, task in enumerate(self.tasks):
            check_task(task, f"eval.tasks.{i}")
            if names.count(task.name) > 1:
                raise UserError(
                    f"Eval task name '{task.name}' is given twice in eval.tasks; names must differ."
                )


MEAN_KEYS = ("eval_acc_mean", "eval_acc_norm_mean")
"""The keys of the tasks' mean accuracies in an eval row."""


def check_task(task: EvalTaskConfig, key: str) -> None:
    for name in ("name", "path"):
        if getattr(task, name) in ("???", ""):
            raise UserError(f"Config key '{key}.{name}' is not set; every eval task needs a name and a path.")
    if task.name == "mean" or task.name.startswith("norm_"):
        raise UserError(
            f"Config key '{key}.name' is '{task.name}', which reads as one of the metrics' own names "
            "(eval_acc_mean, eval_acc_norm_NAME); rename the task."
        )
    if not TASK_NAME.fullmatch(task.name):
        raise UserError(
            f"Config key '{key}.name' is '{task.name}'; a task name holds only letters, digits, '_' and '-', "
            "starting with a letter or digit (it names metrics and the task lm-evaluation-harness runs)."
        )
    for name in ("context_field", "choices_field", "label_field"):
        value = getattr(task, name)
        if not FIELD_NAME.fullmatch(value):
            raise UserError(
                f"Config key '{key}.{name}' is '{value}'; a field name is letters, digits and '_' "
                "(lm-evaluation-harness reads it inside a template)."
            )
    if task.limit is not None:
        at_least(1, **{f"{key}.limit": task.limit})


def metric_keys(name: str) -> tuple[str, str]:
    """The metrics.jsonl keys of a task's accuracies: `eval_acc_NAME`, `eval_acc_norm_NAME`."""
    return f"eval_acc_{name}", f"eval_acc_norm_{name}"
