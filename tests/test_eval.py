"""Downstream evals: task files checked record by record, scoring as lm-evaluation-harness scores, the
examples split over ranks; end to end, a tiny model trained for well under a minute on 2 gloo workers
scores far above its own untrained weights on a task made from the standard library's text, and
`muonrun eval` (lm-evaluation-harness, when installed) gives the loop's accuracies on its checkpoint."""

from __future__ import annotations

import importlib.util
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import muonrun, ok

from muonrun.config import load_config
from muonrun.data import build_tokenizer
from muonrun.errors import UserError
from muonrun.eval import check_tasks, task_set
from muonrun.eval.scoring import Encoder, Request, accuracies, batches
from muonrun.eval.tasks import Example, parse_label
from muonrun.eval.text_tasks import ending_task, last_word_task, text_lines

STDLIB = sysconfig.get_paths()["stdlib"]
HAS_HARNESS = importlib.util.find_spec("lm_eval") is not None


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def config(*tasks: str, extra=()):
    return load_config("tiny", [f"eval.tasks=[{','.join(tasks)}]", *extra])


GOOD = {"context": "x = ", "choices": ["1", "22"], "label": 0}


@pytest.mark.parametrize(
    "bad, where, says",
    [
        (
            {"context": "a", "choices": ["b", "c"]},
            "line 2",
            "has no 'label' field (its fields: context, choices)",
        ),
        ({"context": "a", "choices": ["b", "c"], "label": 2}, "line 2", "outside the 2 choices (0 to 1)"),
        ({"context": "a", "choices": ["b", "c"], "label": "d"}, "line 2", "none of the 2 choices"),
        ({"context": "a", "choices": ["b", "c"], "label": True}, "line 2", "neither a choice's index"),
        ({"context": "a", "choices": ["b"], "label": 0}, "line 2", "at least two choices"),
        ({"context": "a", "choices": ["b", ""], "label": 0}, "line 2", "choice 1 = ''"),
        ({"context": 3, "choices": ["b", "c"], "label": 0}, "line 2", "is int, not text"),
        ('{"context": "a", ', "line 2", "is not valid JSON"),
    ],
)
def test_a_bad_record_names_the_file_and_its_line(tmp_path, bad, where, says):
    path = write_jsonl(tmp_path / "task.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(UserError) as e:
        check_tasks(config(f"{{name: t, path: {path}}}"), build_tokenizer("byte"))
    text = str(e.value)
    assert f"'{path}' {where} " in text and says in text and "eval.tasks.0" in text, text


def test_parquet_rows_json_lists_and_hub_ids_are_read_and_bad_paths_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = build_tokenizer("byte")
    rows = [{"q": "a", "opts": ["b", "c"], "ans": "c"}, {"q": "a", "opts": ["b", "c"], "ans": "e"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    fields = "context_field: q, choices_field: opts, label_field: ans"
    with pytest.raises(UserError, match=r"t.parquet' row 2 has a 'ans' that is the text 'e'"):
        check_tasks(config(f"{{name: t, path: {tmp_path / 't.parquet'}, {fields}}}"), tok)
    (tmp_path / "t.json").write_text(json.dumps([GOOD, {**GOOD, "label": 5}]))
    with pytest.raises(UserError, match=r"t.json' record 2 has a 'label' that is 5, outside"):
        check_tasks(config(f"{{name: t, path: {tmp_path / 't.json'}}}"), tok)
    for path, says in ((tmp_path / "none.jsonl", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(UserError, match=says):
            check_tasks(config(f"{{name: t, path: {path}}}"), tok)
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(UserError, match=r"a \.txt file; a task file is \.jsonl"):
        check_tasks(config(f"{{name: t, path: {tmp_path / 't.txt'}}}"), tok)


def test_config_refuses_tasks_that_never_run_and_names_that_clash(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    task = f"{{name: t, path: {path}}}"
    with pytest.raises(UserError, match="train.eval_interval is 0, so they would never run"):
        config(task, extra=["train.eval_interval=0"])
    for name, says in (
        ("mean", "reads as one of the metrics"),
        ("norm_x", "reads as one"),
        ("a b", "letters"),
    ):
        with pytest.raises(UserError, match=says):
            config(f"{{name: '{name}', path: {path}}}")
    with pytest.raises(UserError, match="is given twice"):
        config(task, task)
    with pytest.raises(UserError, match="eval.tasks.0.label_field' is 'a-b'"):
        config(f"{{name: t, path: {path}, label_field: a-b}}")
    # tasks alone (no eval sources) are an evaluation; an eval interval with neither is refused
    assert config(task, extra=["data.eval_sources=[]"]).eval.tasks[0].name == "t"
    with pytest.raises(UserError, match="'data.eval_sources' and 'eval.tasks' are empty"):
        load_config("tiny", ["data.eval_sources=[]"])


def test_labels_are_read_as_the_harness_template_reads_them():
    choices = ("a", "[]", "b", "7")
    assert [parse_label(v, choices) for v in (2, "3", "[]", "b")] == [2, 3, 1, 2]
    assert "outside the 4 choices" in parse_label("7", choices)  # digits are an index, even a choice's text
    assert isinstance(parse_label("²", choices), str)  # unicode digits are text, not an index
    if not HAS_HARNESS:
        return
    from lm_eval.utils import apply_template

    from muonrun.eval.harness import target_template

    template = target_template("label", "choices")
    for value in (2, "3", "[]", "b"):
        rendered = apply_template(template, {"label": value, "choices": list(choices)})
        assert int(rendered) == parse_label(value, choices), (value, rendered)


def test_pairs_split_as_the_harness_splits_them():
    enc = Encoder(build_tokenizer("byte"))
    # the context's trailing spaces move to the continuation; an empty context is the prefix token (EOS)
    assert enc.pair("a b  ", "c") == (list(b"a b"), list(b"  c"))
    assert enc.pair("", " x") == ([256], list(b" x"))
    from muonrun.eval.byte_tokenizer import byte_tokenizer

    hf = byte_tokenizer()
    for text in ("def f(x):\n    return x  ", "héllo wörld", "日本語", "\t\r\n"):
        assert hf.encode(text) == list(text.encode()), text
    assert hf.eos_token_id == 256 and hf.bos_token_id is None


def test_acc_takes_the_largest_log_likelihood_and_acc_norm_divides_by_characters():
    examples = (
        Example("c", ("a", "bbbb"), 1),
        Example("c", ("xx", "y", "zz"), 0),
        Example("c", ("p", "q"), 0),
    )
    lls = np.array([-1.0, -2.0, -4.0, -3.0, -4.0, -1.0, -1.0])
    # 1: acc picks a (-1 > -2), acc_norm bbbb (-0.5 > -1); 2: acc picks y (-3), acc_norm xx and zz tie
    # (-2 per character) and the first wins, as with numpy's argmax; 3: both tie, the first wins
    assert accuracies(examples, lls) == (1 / 3, 1.0)
    assert accuracies(examples[:1], lls[:2]) == (0.0, 1.0)


def test_every_rank_runs_the_same_forwards_and_each_request_is_scored_once():
    requests = [Request(tuple(range(3 + i % 5)), 1 + i % 2) for i in range(23)]
    seen = []
    for rank in range(3):
        out = list(batches(requests, rank, 3, 4, pad=0, length=9))
        assert len(out) == 2 and all(ids.shape == (4, 9) for _, ids, _, _ in out)  # 8 rows each, padded
        for index, ids, labels, mask in out:
            for row, i in enumerate(index.tolist()):
                if i < 0:
                    assert not mask[row].any()
                    continue
                seen.append(i)
                r = requests[i]
                assert mask[row].sum() == r.continuation
                assert labels[row][mask[row]].tolist() == list(r.tokens[-r.continuation :])
                assert ids[row, : len(r.tokens) - 1].tolist() == list(r.tokens[:-1])
    assert sorted(seen) == list(range(23))


def test_text_tasks_have_one_right_choice_each():
    lines = text_lines(f"{STDLIB}/json/*.py")
    ending, last = ending_task(lines, 50), last_word_task(lines, 50)
    assert len(ending) == len(last) == 50
    for record in ending:
        right = record["choices"][record["label"]]
        assert right[::-1] == record["choices"][1 - record["label"]] and right != right[::-1]
    for record in last:
        assert len(set(record["choices"])) == 4 and 0 <= record["label"] < 4


def test_eval_without_the_harness_installed_exits_2_with_the_install_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from muonrun.cli import app

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    result = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert result.exit_code == 2 and "pip install 'muonrun[eval]'" in " ".join(result.output.split())


# -- end to end -------------------------------------------------------------------------------------------


def make_tasks(folder: Path) -> list[str]:
    """`ending` from the held-out json package's lines; `last_word` as Parquet with other field names and
    the right choice as its text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = text_lines(f"{STDLIB}/json/*.py")
    ending = write_jsonl(folder / "ending.jsonl", ending_task(lines, 100))
    rows = [
        {"text": r["context"], "options": r["choices"], "answer": r["choices"][r["label"]]}
        for r in last_word_task(lines, 60)
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "last.parquet")
    return [
        f"{{name: ending, path: {ending}}}",
        f"{{name: last, path: {folder / 'last.parquet'}, context_field: text, choices_field: options, "
        "label_field: answer}",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[str], str]:
    """The tiny preset on two workers (128-token windows), its eval loss and two tasks scored at steps 25
    and 50."""
    folder = tmp_path_factory.mktemp("evals")
    tasks = make_tasks(folder)
    out = folder / "run"
    text = ok(
        muonrun(
            "pretrain",
            "tiny",
            f"output_dir={out}",
            "train.max_steps=50",
            "data.seq_len=128",  # half the preset's windows: the same accuracies over chance, at half the cost
            "train.eval_interval=25",
            "checkpoint.interval=0",
            "logging.log_interval=5",
            "logging.console=plain",
            f"eval.tasks=[{','.join(tasks)}]",
            "--nproc-per-node",
            "2",
        )
    )
    return out, tasks, text


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_time" in r]


@pytest.mark.slow
def test_two_workers_learn_and_score_far_above_the_untrained_weights(trained):
    """The run learns (its loss and eval loss fall), saves at the end, counts its tokens, and its last
    eval scores the reversed-ending task far above the untrained weights, which score it at chance."""
    from muonrun.model.build import build_hf_config, build_model, init_weights
    from muonrun.model.causal_lm import CausalLMWithLoss

    run, tasks, text = trained
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(5, 51, 5))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, [r["loss"] for r in train]  # clearly learning
    assert train[-1]["tokens_seen"] == 50 * 2 * 8 * 128  # steps x workers x micro-batch x seq_len
    saved = (run / "config.yaml").read_text()
    assert "max_steps: 50" in saved and "nproc_per_node: 2" in saved and "step     50/50" in text
    assert (run / "checkpoints" / "step-50" / ".metadata").is_file()  # saved at the end
    cfg = config(*tasks)
    tok = build_tokenizer("byte")
    hf = build_hf_config(cfg.model, tok.vocab_size)
    model = CausalLMWithLoss(build_model(cfg.model, hf), 0)
    model.to_empty(device="cpu")
    init_weights(model, hf.initializer_range, cfg.train.seed, torch.device("cpu"))  # the run's step 0
    untrained = task_set(cfg, tok).score(model.eval(), torch.device("cpu"))
    evals = eval_rows(run)
    assert [r["step"] for r in evals] == [25, 50] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    final = evals[-1]
    # the reversed ending shares every character and run of them with the right one: chance, untrained
    assert 0.35 <= untrained["eval_acc_ending"] <= 0.65, untrained
    assert final["eval_acc_ending"] >= untrained["eval_acc_ending"] + 0.3, (untrained, evals)
    assert final["eval_acc_mean"] == (final["eval_acc_ending"] + final["eval_acc_last"]) / 2
    assert final["tokens_seen"] == 50 * 2 * 8 * 128


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_HARNESS, reason="lm-evaluation-harness is not installed (pip install 'muonrun[eval]')"
)
def test_muonrun_eval_on_the_checkpoint_gives_the_loops_accuracies_and_compare_shows_them(trained, tmp_path):
    from muonrun.tools.compare import compare

    run, _, _ = trained
    text = ok(muonrun("eval", str(run)))
    assert "harness.jsonl" in " ".join(text.split())
    harness = {r["task"]: r for r in map(json.loads, (run / "harness.jsonl").read_text().splitlines())}
    final = eval_rows(run)[-1]
    for task, examples in (("ending", 100), ("last", 60)):
        row = harness[task]
        assert row["step"] == 50 and row["examples"] == examples and row["num_fewshot"] == 0
        assert row["acc"] == final[f"eval_acc_{task}"], (row, final)
        assert row["acc_norm"] == final[f"eval_acc_norm_{task}"], (row, final)
    # the run's own export: its tasks come from the run's config; its rows from the export carry no step
    ok(muonrun("export", str(run), str(run / "hf")))
    ok(muonrun("eval", str(run / "hf"), "--tasks", "ending"))
    exported = json.loads((run / "harness.jsonl").read_text().splitlines()[-1])
    assert (exported["task"], exported["step"], exported["acc"]) == ("ending", None, final["eval_acc_ending"])
    rows = compare([run], tmp_path / "c.png")
    table = (tmp_path / "c.md").read_text()
    assert (
        rows[0]["downstream:ending acc, lm-evaluation-harness"] == f"{harness['ending']['acc']:.3f} (step 50)"
    )
    assert f"| ending acc at {final['tokens_seen']:,} tokens | {final['eval_acc_ending']:.3f} |" in table
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_bad_task_file_stops_the_launch_and_the_dry_run_before_any_worker_starts(tmp_path):
    from typer.testing import CliRunner

    from muonrun.cli import app

    path = write_jsonl(
        tmp_path / "bad.jsonl", [GOOD, GOOD, {"context": "a", "choices": ["b", "c"], "label": 3}]
    )
    run = tmp_path / "run"
    args = ["pretrain", "tiny", f"output_dir={run}", f"eval.tasks=[{{name: t, path: {path}}}]"]
    for extra in ([], ["--dry-run"]):
        result = CliRunner().invoke(app, [*args, *extra])
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and f"'{path}' line 3 has a 'label' that is 3, outside" in text, text
    assert not run.exists()  # refused before the launcher claimed the folder


def test_per_token_log_likelihoods_are_log_softmax_picks_in_any_chunking():
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(2, 5, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 5))
    from muonrun.model.loss import token_log_likelihoods

    expect = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, labels[..., None]).squeeze(-1)
    for chunk in (0, 3, 100):
        torch.testing.assert_close(token_log_likelihoods(hidden, weight, labels, chunk), expect)
