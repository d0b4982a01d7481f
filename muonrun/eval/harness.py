"""`muonrun eval RUN_OR_CHECKPOINT`: lm-evaluation-harness (the `eval` extra) on a checkpoint or an
exported Hugging Face folder, results appended to the run folder's harness.jsonl (`muonrun compare`
shows them).

    muonrun eval runs/tiny                               # the run's own eval.tasks, latest checkpoint
    muonrun eval runs/tiny/checkpoints/step-150 --tasks hellaswag,arc_easy --limit 500

A checkpoint is exported to a temporary folder first (muonrun/checkpoint/export.py). A task named in the
run's `eval.tasks` is written as the harness's own task YAML pointing at the task's file (or Hub
dataset), so the harness scores exactly the examples the training loop scored; any other name is one
of the harness's tasks (which read the Hub unless its datasets are cached). A byte-level run is
scored through muonrun/eval/byte_tokenizer.py.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from muonrun.config.evaluation import EvalTaskConfig
from muonrun.errors import UserError
from muonrun.eval.tasks import is_local, local_path

RESULTS = "harness.jsonl"
"""The file in a run folder that `muonrun eval` appends its results to, one row per task."""
PREFIX = "muonrun_"
"""The harness's name for a run's own task NAME is PREFIX + NAME (kept apart from its built-in tasks)."""


@dataclass
class Target:
    """What `muonrun eval` scores: a checkpoint (exported first) or an exported folder."""

    checkpoint: Path | None
    folder: Path | None
    run: Path
    """Where the results go: the checkpoint's run folder, or the run folder an export lies in, or the
    exported folder itself."""
    config: object | None = None
    """The run's Config, when known (a checkpoint carries it)."""
    step: int | None = None
    tokens_seen: int | None = None


def resolve_target(path: str) -> Target:
    from muonrun.checkpoint import read_meta, resolve_checkpoint

    given = Path(path)
    if (given / "config.json").is_file() and not (given / "checkpoints").is_dir():
        if not (given.parent / "metrics.jsonl").is_file():
            return Target(None, given, given)
        # a run's own export (OUTPUT_DIR/hf): the run's config names its tasks, sequence length, tokenizer
        from muonrun.config import from_yaml

        saved = given.parent / "config.yaml"
        config = from_yaml(saved.read_text(), source=f"file '{saved}'") if saved.is_file() else None
        return Target(None, given, given.parent, config)
    from muonrun.checkpoint.export import read_run_config

    checkpoint = resolve_checkpoint(given)  # a UserError naming the path when it holds none
    meta = read_meta(checkpoint)
    return Target(
        checkpoint,
        None,
        checkpoint.resolve().parent.parent,
        read_run_config(checkpoint),
        meta["step"],
        meta.get("tokens_seen"),
    )


def task_yaml(task: EvalTaskConfig, key: str) -> dict:
    """The harness's task config for one of the run's tasks: its records as they are, zero-shot by
    default, `acc` and `acc_norm`."""
    if is_local(task):
        path = local_path(task, key).resolve()
        builder = "parquet" if path.suffix == ".parquet" else "json"
        data = {
            "dataset_path": builder,
            "dataset_kwargs": {"data_files": {"train": str(path)}},
            "test_split": "train",
        }
    else:
        data = {"dataset_path": task.path, "dataset_name": task.subset, "test_split": task.split}
    return {
        "task": PREFIX + task.name,
        **data,
        "output_type": "multiple_choice",
        "doc_to_text": task.context_field,
        "doc_to_choice": task.choices_field,
        "doc_to_target": target_template(task.label_field, task.choices_field),
        "target_delimiter": task.target_delimiter,
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")
        ],
    }


def target_template(label: str, choices: str) -> str:
    """The right choice's index as the harness renders the target, read as muonrun reads a label
    (tasks.parse_label): an int or ASCII digits are the index, other text is looked up in the choices
    (the harness itself would read text like `[0]` as a list)."""
    return (
        f"{{% if {label} is string and not ({label}.isascii() and {label}.isdigit()) %}}"
        f"{{{{ {choices}.index({label}) }}}}{{% else %}}{{{{ {label} }}}}{{% endif %}}"
    )


def import_harness():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise UserError(
            "`muonrun eval` runs lm-evaluation-harness, which is not installed: pip install 'muonrun[eval]' "
            "(or pip install lm-eval)."
        ) from None
    return lm_eval, HFLM


def tokenizer_for(target: Target, folder: Path):
    """The tokenizer the harness uses: muonrun's byte tokenizer for a byte-level model (whose export has
    no tokenizer files), else None (the folder's own)."""
    from muonrun.eval.byte_tokenizer import byte_tokenizer

    if target.config is not None:
        return byte_tokenizer() if target.config.data.tokenizer == "byte" else None
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    readme = folder / "README.md"
    if readme.is_file() and "built-in byte-level tokenizer" in readme.read_text():
        return byte_tokenizer()
    raise UserError(
        f"'{folder}' has no tokenizer files (tokenizer.json, tokenizer_config.json) and is not a muonrun export "
        "of a byte-level model; save the tokenizer into it, or evaluate the run's checkpoint instead."
    )


def plan_tasks(names: list[str] | None, target: Target, include: Path) -> list[tuple[str, str, int | None]]:
    """(name shown, harness task name, the run's own limit) per task; the run's own tasks written as
    YAML into `include`. Without names: the run's eval.tasks."""
    own = {t.name: (i, t) for i, t in enumerate(target.config.eval.tasks)} if target.config else {}
    names = names or list(own)
    if not names:
        raise UserError(
            "Name the tasks to evaluate with --tasks (lm-evaluation-harness task names, e.g. hellaswag,arc_easy); "
            "this run has no eval.tasks of its own."
        )
    import yaml

    out = []
    for name in names:
        if name in own:
            i, task = own[name]
            (include / f"{PREFIX}{name}.yaml").write_text(yaml.safe_dump(task_yaml(task, f"eval.tasks.{i}")))
            out.append((name, PREFIX + name, task.limit))
        else:
            out.append((name, name, None))
    return out


def run_eval(
    path: str,
    tasks: list[str] | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 16,
    device: str | None = None,
    include_path: str | None = None,
) -> tuple[list[dict], Path]:
    """Score `path` (a run, checkpoint or exported folder) on `tasks` with the harness; append a row per
    task to the run folder's harness.jsonl; return the rows and that file."""
    import torch

    from muonrun.checkpoint.export import export_hf

    if limit is not None and limit < 1:
        raise UserError(f"--limit is {limit}; give a number of examples, at least 1.")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot is {num_fewshot}; it must not be negative.")
    lm_eval, HFLM = import_harness()
    from lm_eval.tasks import TaskManager

    target = resolve_target(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="muonrun-eval-") as tmp:
        include = Path(tmp) / "tasks"
        include.mkdir()
        planned = plan_tasks(tasks, target, include)
        folder = target.folder or export_hf(target.checkpoint, Path(tmp) / "hf")
        model = HFLM(
            pretrained=str(folder),
            tokenizer=tokenizer_for(target, folder),
            max_length=target.config.data.seq_len if target.config else None,
            batch_size=batch_size,
            device=device,
            # Its cache shares one forward among requests whose tokens but the last are equal, and then reads
            # a shorter continuation's log-probs at the longer one's first positions (lm-eval 0.4.13): two
            # tasks cut from the same text score wrongly together. Off: every request is its own forward.
            logits_cache=False,
        )
        manager = TaskManager(include_path=[str(include), *([include_path] if include_path else [])])
        results = {}
        for own_limit in {limit or lim for _, _, lim in planned}:  # one harness call per limit
            names = [h for _, h, lim in planned if (limit or lim) == own_limit]
            out = lm_eval.simple_evaluate(
                model=model,
                tasks=names,
                num_fewshot=num_fewshot,
                limit=own_limit,
                task_manager=manager,
                log_samples=False,
            )
            for name in names:
                results[name] = (out["results"][name], out["n-samples"][name]["effective"])
    rows = []
    for shown, name, _ in planned:
        metrics, n = results[name]
        row = {
            "event": "harness",
            "task": shown,
            "step": target.step,
            "tokens_seen": target.tokens_seen,
            "examples": n,
            "num_fewshot": num_fewshot or 0,
            # the harness's "metric,filter" keys; the default filter's without its suffix
            **{
                k.removesuffix(",none"): v
                for k, v in metrics.items()
                if "," in k and isinstance(v, int | float)
            },
            "source": str(target.checkpoint or target.folder),
            "lm_eval": lm_eval.__version__,
            "time": time.time(),
        }
        rows.append(row)
    results_file = target.run / RESULTS
    with open(results_file, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows, results_file


def print_results(rows: list[dict], results_file: Path) -> None:
    from rich.table import Table

    from muonrun.observe.console import print_table

    step = rows[0]["step"]
    table = Table(
        title="muonrun eval (lm-evaluation-harness)" + (f", step {step:,}" if step is not None else "")
    )
    for column in ("task", "examples", "acc", "acc_norm"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for row in rows:
        cells = [f"{row[k]:.4f}" if isinstance(row.get(k), float) else "-" for k in ("acc", "acc_norm")]
        table.add_row(row["task"], f"{row['examples']:,}", *cells)
    print_table(table)
    print(f"Appended {len(rows)} row(s) to {results_file.resolve()}")
