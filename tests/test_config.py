"""Config precedence, presets and error messages (no workers are started)."""

import pytest

from muonrun.config import (
    PRESET_DIR,
    field_docs,
    from_yaml,
    load_config,
    to_yaml,
)
from muonrun.distributed import mesh_shape
from muonrun.errors import UserError

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def test_precedence_schema_preset_override(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  max_steps: 7\n  seed: 1\ndata:\n  sources: [{path: x}]\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: [base]\ntrain:\n  seed: 2\nname: child\n")
    c = load_config(child, ["train.seed=3"])
    assert c.train.max_steps == 7  # from the base file
    assert c.train.seed == 3  # override beats preset beats base
    assert c.train.micro_batch_size == 1  # schema default
    assert c.output_dir == "runs/child"  # interpolation of ${name}


def test_open_section_accepts_plus_keys():
    c = load_config("tiny", ["+model.hf.rope_theta=10000.0"])
    assert c.model.hf["rope_theta"] == 10000.0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.max_stepz=3"], r"Unknown config key 'train.max_stepz'.*Did you mean 'train.max_steps'"),
        (["trian.max_steps=3"], r"'trian.max_steps'.*Did you mean 'train.max_steps'\?"),
        (["data.sources.0.pth=x"], r"Did you mean 'data.sources.0.path'\?"),
        (["trainz=3"], r"Unknown config key 'trainz'.*Did you mean 'train'\?"),
        (["zzz.max_steps=3"], r"'zzz.max_steps'.* `muonrun config docs` lists every key\.$"),
        (["model.hf.rope_theta=1"], r"Prefix it with '\+'.*\(\+model.hf.KEY=value\)"),
        (["train.max_steps=abc"], r"'train.max_steps'.*wrong type"),
        (["train.max_steps"], r"Override 'train.max_steps' is malformed"),
        (["train.micro_batch_size=0"], r"'train.micro_batch_size' is 0; it must be at least 1"),
        (["optimizer.name=sgd"], r"'optimizer.name' is 'sgd'; choose one of: adamw, muon"),
        (["schedule.name=step"], r"'schedule.name' is 'step'"),
        (["checkpoint.keep_last=1"], r"keep at least 2"),
        (["launch.node_rank=3"], r"'launch.node_rank' is 3"),
        (["model.init=pretrained"], r"'model.name_or_path' is not set"),
    ],
)
def test_bad_input_names_the_key(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config("tiny", overrides)


def test_overrides_alone_apply_to_the_default_preset():
    c = load_config("optimizer.name=muon", ["train.max_steps=5"])
    assert c.name == load_config().name and c.optimizer.name == "muon" and c.train.max_steps == 5


def test_a_saved_config_with_an_unknown_key_is_refused():
    """A run's config.yaml read back (by `muonrun export`) is checked like any other config."""
    saved = to_yaml(load_config("tiny", ["train.max_steps=7"]))
    assert from_yaml(saved).train.max_steps == 7
    with pytest.raises(UserError, match="Unknown config key 'train.not_a_key'"):
        from_yaml(saved.replace("train:\n", "train:\n  not_a_key: 1\n", 1))


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(UserError, match=r"'.*nope.yaml' does not exist.*tiny"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)
    missing_base = tmp_path / "child.yaml"
    missing_base.write_text("defaults: [nothere]\n")
    with pytest.raises(UserError, match="nothere"):
        load_config(missing_base)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trian:\n  max_steps: 3\n")
    with pytest.raises(UserError, match=r"Unknown config key 'trian'.*Did you mean 'train'"):
        load_config(unknown)


def test_world_size_check():
    c = load_config("tiny", ["parallel.dp_replicate=2"])
    assert mesh_shape(c, 4) == (2, 2)
    with pytest.raises(UserError, match="does not fit a world of 3"):
        mesh_shape(c, 3)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_resolve(preset):
    c = load_config(preset)
    assert c.data.sources and c.train.max_steps > 0


def test_qwen2_presets_share_the_recipe():
    adamw = load_config("qwen2-adamw-fsdp2")
    muon = load_config("qwen2-muon-fsdp2")
    assert adamw.model == muon.model and adamw.data == muon.data and adamw.train == muon.train
    assert (adamw.optimizer.name, muon.optimizer.name) == ("adamw", "muon")
    assert adamw.optimizer.lr == 2e-4 and muon.optimizer.muon.lr == 0.02
    assert adamw.data.seq_len == 2048 and adamw.train.micro_batch_size == 16 and adamw.train.max_steps == 305


def test_every_field_is_documented():
    docs = field_docs()
    assert "train.max_steps" in docs and "data.sources[].path" in docs
    undocumented = [k for k, (_, _, doc) in docs.items() if not doc]
    assert not undocumented, undocumented


def test_list_elements_are_set_by_index_in_either_syntax(tmp_path):
    c = load_config("tiny", ["data.sources.0.path=a.jsonl", "data.sources[0].text_field=body"])
    assert (c.data.sources[0].path, c.data.sources[0].text_field) == ("a.jsonl", "body")
    c = load_config("tiny", ["data.sources=[{path: a.jsonl, weight: 2}, {path: b.txt}]"])
    assert [(s.path, s.weight) for s in c.data.sources] == [("a.jsonl", 2.0), ("b.txt", 1.0)]
    with pytest.raises(UserError, match=r"'data.sources' is a list of 1 entries.*data.sources=\[\{path"):
        load_config("tiny", ["data.sources.3.path=x.jsonl"])
    with pytest.raises(UserError, match=r"Unknown config key 'data.sources.0.pth'.*'data.sources.0.path'"):
        load_config("tiny", ["data.sources.0.pth=x.jsonl"])
    with pytest.raises(UserError, match=r"'data.sources.0.weight'.*wrong type"):
        load_config("tiny", ["data.sources.0.weight=heavy"])
    with pytest.raises(UserError, match=r"not valid YAML.*Quote values"):  # an unquoted `:` in a list
        load_config("tiny", ["data.sources=[{path: ${stdlib:}/*.py}]"])


def test_defaults_may_name_a_builtin_preset(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("defaults: [tiny]\ntrain:\n  max_steps: 9\n")
    c = load_config(mine)
    assert c.name == "tiny" and c.train.max_steps == 9
    mine.write_text("defaults: [no-such-preset]\n")
    with pytest.raises(UserError, match=r"'no-such-preset' under `defaults:`.*built-in preset \(.*tiny"):
        load_config(mine)


def test_config_docs_is_one_table_cell_per_column():
    from muonrun.config import markdown_table

    rows = markdown_table().splitlines()
    # an unescaped `|` (as in `str | None`) would add a column and shift the table
    assert all(row.replace("\\|", "").count("|") == 5 for row in rows), [r for r in rows if r.count("|") != 5]
    by_key = {row.split("|")[1].strip(" `"): row for row in rows[2:]}
    assert "cosine / linear / constant / wsd" in by_key["schedule.name"]  # allowed values shown
    assert "str \\| None" in by_key["model.name_or_path"]
