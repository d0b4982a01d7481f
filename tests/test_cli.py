"""The command line in-process (Typer's runner): help, version, config show, dry runs, exit codes."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from muonrun import __version__
from muonrun.cli import app
from muonrun.config import PRESET_DIR

runner = CliRunner()
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("pretrain", "config", "prepare"):
        assert command in result.output
    result = runner.invoke(app, ["pretrain", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--max-restarts",
        "--dry-run",
    ):
        assert flag in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_config_show_applies_overrides():
    result = runner.invoke(app, ["config", "show", "tiny", "train.max_steps=9", "optimizer.name=muon"])
    assert result.exit_code == 0
    assert "max_steps: 9" in result.output and "name: muon" in result.output


def test_config_docs_is_a_reference():
    result = runner.invoke(app, ["config", "docs"])
    assert result.exit_code == 0
    # text for a terminal (tests/test_config_docs.py); the Markdown table on request
    assert "\noptimizer.muon.adjust_lr_fn: " in result.output
    table = runner.invoke(app, ["config", "docs", "--markdown"])
    assert table.exit_code == 0 and "| `optimizer.muon.adjust_lr_fn` |" in table.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["config", "show", "tiny", "train.max_stepz=3"], "Did you mean"),
        (["config", "show", "missing-preset"], "does not exist"),
        (
            ["pretrain", "tiny", "--dry-run", "parallel.dp_replicate=3", "--world-size", "4"],
            "does not fit a world of 4",
        ),
        (["pretrain", "tiny", "--dry-run", "model.hf.vocab_size=abc"], "'vocab_size'"),
        (
            ["pretrain", "tiny", "--dry-run", "model.name_or_path=no-such-org/no-such-model"],
            "could not be loaded",
        ),
        # nan and inf pass every range check: refused by key wherever they are, as is what float32 cannot hold
        (["pretrain", "tiny", "--dry-run", "optimizer.lr=nan"], "'optimizer.lr' is nan; it must be a finite"),
        (["pretrain", "tiny", "--dry-run", "optimizer.muon.lr=inf"], "'optimizer.muon.lr' is inf"),
        (["pretrain", "tiny", "--dry-run", "+model.hf.rope_theta=-.inf"], "'model.hf.rope_theta' is -inf"),
        # a '+' adds keys to open sections only: in a list's entry a typo is still a typo
        (
            ["pretrain", "tiny", "--dry-run", "+data.sources.0.wieght=5"],
            "Did you mean 'data.sources.0.weight'?",
        ),
        # sections given the wrong shape, keys OmegaConf cannot look up, interpolations: one sentence each
        (["pretrain", "tiny", "--dry-run", "model.hf=[1]"], "gives a section the wrong shape"),
        (["pretrain", "tiny", "--dry-run", "train=5"], "(a section takes a mapping of its keys)"),
        (["pretrain", "tiny", "--dry-run", "data.sources[a].path=x"], "names no config key"),
        (
            ["pretrain", "tiny", "--dry-run", "name=${oops}"],
            "'name' cannot be resolved: Interpolation key 'oops' not found.",
        ),
        # ranges a worker would otherwise meet late (the first eval, the optimizer's constructor, the end)
        (
            ["pretrain", "tiny", "--dry-run", "train.eval_steps=0"],
            "'train.eval_steps' is 0; it must be at least 1",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "optimizer.muon.momentum=1.5"],
            "'optimizer.muon.momentum' is 1.5; it must be in [0, 1)",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "optimizer.eps=-1"],
            "'optimizer.eps' is -1.0; it must be positive",
        ),
        (["pretrain", "tiny", "--dry-run", "schedule.decay_fraction=2"], "it must be in (0, 1]"),
        (["pretrain", "tiny", "--dry-run", "logging.peak_tflops=-1"], "'logging.peak_tflops' is -1.0"),
        (
            ["pretrain", "tiny", "--dry-run", "--max-restarts", "-1"],
            "'launch.max_restarts' is -1; it must not be negative",
        ),
        # model settings transformers cannot build with, or a model without layers: named, before any worker
        (
            ["pretrain", "tiny", "--dry-run", "model.hf.num_attention_heads=0"],
            "do not build a qwen2: ZeroDivisionError",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "+model.hf.hidden_act=foo"],
            "do not build a qwen2: KeyError: 'foo'. Fix model.hf",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "model.hf.num_hidden_layers=0"],
            "no decoder layers (Qwen2DecoderLayer)",
        ),
        (["pretrain", "tiny", "--dry-run", 'name=""'], "Config key 'name' is empty"),
        (["pretrain", "tiny-moe", "--dry-run", "model.hf.num_experts_per_tok=99"], "is 99, more than the"),
        (
            ["pretrain", "tiny-moe", "--dry-run", "model.hf.num_experts_per_tok=0"],
            "no expert ever sees a token",
        ),
        (  # YAML reads nan as text: transformers fails on it, the message names the key
            ["pretrain", "tiny", "--dry-run", "+model.hf.rope_theta=nan"],
            "(model.hf.rope_theta is the text 'nan', where a finite number belongs)",
        ),
        (["config", "show", str(Path(__file__).parent)], "is a folder, not a YAML file"),
        (["pretrain", "tiny", "--dry-run", "--world-size", "0"], "--world-size is 0; it must be at least 1"),
        # finite, but no float32 holds it: the optimizer's first step would fail
        (
            ["pretrain", "tiny", "--dry-run", "optimizer.lr=1e40"],
            "'optimizer.lr' is 1e+40; it must be a finite number within float32",
        ),
        (  # a setting that left the config: named, with what took its place
            ["pretrain", "tiny", "--dry-run", "optimizer.muon.ns_steps=4"],
            "'optimizer.muon.ns_steps' in override 'optimizer.muon.ns_steps=4' is no longer a setting: Muon runs",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "optimizer.muon.cuda_graph=false"],
            "is no longer a setting: Muon's step replays from a CUDA graph on GPUs; `optimizer.muon.eager=true`",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "data.seq_len=100000"],
            "'data.seq_len' is 100000, longer than the model's max_position_embeddings of 1024",
        ),
        (  # checked in the config, not with the files (which a cached source skips)
            ["pretrain", "tiny", "--dry-run", "data.sources.0.weight=-1"],
            "'data.sources.0.weight' is -1.0; mixture weights must be positive",
        ),
        (
            [
                "pretrain",
                "tiny",
                "--dry-run",
                "optimizer.name=muon",
                'optimizer.muon.muon_patterns=["*norm*"]',
            ],
            "optimizer.muon.muon_patterns ['*norm*'] matches model.layers.0.input_layernorm.weight, of shape (128,)",
        ),
        (
            ["pretrain", "tiny", "--dry-run", "train.router_z_loss_coef=0.001"],
            "'train.router_z_loss_coef' is 0.001: it keeps a mixture of experts' router logits small, and this"
            " model (qwen2) has no experts",
        ),
    ],
)
def test_user_errors_exit_2_without_traceback(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_passes_dry_run(preset, tmp_path):
    from muonrun.config import load_config

    extra = []
    if load_config(preset).model.name_or_path:  # a Hub model (the LoRA presets): offline, its
        from transformers import Qwen2Config  # config.json is written from the inline 0.5B preset's

        Qwen2Config(**load_config("qwen2-adamw-fsdp2").model.hf).save_pretrained(tmp_path)
        extra = [f"model.name_or_path={tmp_path}"]
    result = runner.invoke(app, ["pretrain", preset, *extra, "--dry-run", "--world-size", "8"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "FLOPs/token" in out and "world size 8" in out


def test_the_dry_run_checks_the_data_as_the_launch_does(tmp_path):
    """A data mistake fails the dry run with the launcher's message (exit 2); with a tokenizer this
    machine cannot load, or with --world-size (a plan for other machines), the plan says the data went
    unchecked instead of failing."""
    ok = runner.invoke(app, ["pretrain", "tiny", "--dry-run"])
    assert ok.exit_code == 0, ok.output
    assert "data 1 train source(s), 1 eval source(s), checked as the launch checks them" in " ".join(
        ok.output.split()
    )
    body = tmp_path / "c.jsonl"
    body.write_text('{"body": "some text"}\n')
    for path, message in (
        (body, "'data.sources.0.text_field' is 'text', but"),
        (tmp_path / "nope.jsonl", "'data.sources.0.path'"),
    ):
        bad = runner.invoke(app, ["pretrain", "tiny", "--dry-run", f"data.sources.0.path={path}"])
        out = " ".join(bad.output.split())
        assert bad.exit_code == 2 and message in out and "Traceback" not in out, bad.output
    unloadable = ["data.tokenizer=no-such-org/no-such-tokenizer", f"data.sources.0.path={body}"]
    planned = runner.invoke(app, ["pretrain", "tiny", "--dry-run", *unloadable])
    assert planned.exit_code == 0, planned.output
    assert "data not checked (the tokenizer is not loadable here)" in " ".join(planned.output.split())
    elsewhere = ["--world-size", "4", f"data.sources.0.path={tmp_path / 'nope.jsonl'}"]  # a cluster's path
    planned = runner.invoke(app, ["pretrain", "tiny", "--dry-run", *elsewhere])
    assert planned.exit_code == 0, planned.output
    assert "data not checked (--world-size plans for other machines)" in " ".join(planned.output.split())


def test_dry_run_plans_a_large_world_and_counts_qwen2():
    result = runner.invoke(app, ["pretrain", "qwen2-muon-fsdp2", "--dry-run", "--world-size", "256"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "494,032,768" in out  # Qwen2.5-0.5B with tied embeddings
    assert "dp_shard=256" in out and "params in Muon" in out
    # 168 matrices over 256 ranks: some rank still orthogonalizes a whole 4864 x 896 MLP matrix
    # (in the preset's Gram form with its split restart; 85.3 GFLOP in the standard form)
    assert "Muon Newton–Schulz 43.0 GFLOP per rank per optimizer step" in out
    adamw = runner.invoke(app, ["pretrain", "qwen2-adamw-fsdp2", "--dry-run", "--world-size", "2"])
    assert adamw.exit_code == 0 and "Newton–Schulz" not in adamw.output


@pytest.mark.parametrize(
    "override, names",
    [
        ("+model.hf.hiden_size=64", ["'model.hf.hiden_size'", "'model.hf.hidden_size'", "hf_extra_keys"]),
        # rope_theta is no key of the config's own (transformers moves it into rope_parameters)
        ("+model.hf.rope_thetaa=1e4", ["'model.hf.rope_thetaa'", "Did you mean 'model.hf.rope_theta'?"]),
        ("model.hf.num_key_value_heads=3", ["num_key_value_heads=3", "multiple of num_key_value_heads"]),
        ("model.hf.vocab_size=200", ["257 tokens", "model.hf.vocab_size to at least 257"]),
    ],
)
def test_a_model_the_architecture_cannot_build_fails_the_dry_run(override, names):
    """Caught before any worker starts (the dry run builds the model on the meta device and runs a
    forward there), so also before training: exit 2, one paragraph naming the key, no traceback."""
    result = runner.invoke(app, ["pretrain", "tiny", override, "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert all(n in text for n in names), text
    assert "Traceback" not in result.output


def test_a_deliberate_extra_model_key_is_admitted():
    result = runner.invoke(
        app, ["pretrain", "tiny", "+model.hf.my_flag=1", "model.hf_extra_keys=[my_flag]", "--dry-run"]
    )
    assert result.exit_code == 0, result.output


def test_pretrain_help_lists_every_preset():
    result = runner.invoke(app, ["pretrain", "--help"])
    text = "".join(result.output.split())  # rich wraps the help text anywhere
    assert all(name in text for name in PRESETS), (PRESETS, result.output)


def test_float8_is_planned_by_layer_size_and_refused_on_cpu():
    code = runner.invoke(app, ["pretrain", "qwen2-muon-fsdp2", "parallel.float8=tensorwise", "--dry-run"])
    text = " ".join(code.output.split())
    assert code.exit_code == 0, code.output
    # torchao's size rule: the 0.5B MLP matrices run in float8, the small attention ones stay bf16
    assert "72 of 168 decoder Linear layers run in float8 (24 x 896x4864, 48 x 4864x896;" in text
    assert "kept bf16: 48 x 128x896, 48 x 896x896" in text
    result = runner.invoke(app, ["pretrain", "tiny", "parallel.float8=rowwise", "train.max_steps=1"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "'parallel.float8'" in text and "no GPU" in text, result.output
    assert "Traceback" not in result.output


def test_the_dry_run_counts_the_newton_schulz_the_run_would_run(tmp_path):
    """Without a GPU the dry run counts torch's products (quack's run only on Hopper GPUs), and names the
    iteration."""
    args = ["pretrain", "tiny", "optimizer.name=muon", f"output_dir={tmp_path / 'run'}", "--dry-run"]
    plan = runner.invoke(app, args)
    text = " ".join(plan.output.split())
    assert plan.exit_code == 0 and "torch's products" in text and "5 iterations" in text, plan.output
    assert not (tmp_path / "run").exists()


def test_an_output_dir_that_cannot_hold_a_run_exits_2_before_training(tmp_path):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    for out, says in (
        (a_file, "is a file, not a folder"),
        (a_file / "run", "cannot be written (Not a directory"),
    ):
        result = runner.invoke(app, ["pretrain", "tiny", f"output_dir={out}", "train.max_steps=1"])
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and f"output_dir '{out}'" in text and says in text, result.output
        assert "Traceback" not in result.output


# The reason names the build: a CPU build of torch has no CUDA support, a CUDA build (the registry's
# wheel of torch 2.15) finds no GPU on a machine without one.
NO_CUDA = "no CUDA support" if __import__("torch").version.cuda is None else "finds no CUDA GPU"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "override, names",
    [
        ("train.device=cuda", ["'train.device' is 'cuda'", NO_CUDA, "train.device=cpu"]),
        ("launch.backend=nccl", ["'launch.backend' is 'nccl'", "launch.backend=gloo"]),
    ],
)
def test_cuda_settings_on_a_machine_without_cuda_exit_2_before_any_worker_starts(override, names, tmp_path):
    result = runner.invoke(app, ["pretrain", "tiny", override, f"output_dir={tmp_path / 'run'}"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and all(n in text for n in names), result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_muon_patterns_that_cannot_split_the_model_exit_2_before_any_worker_starts(tmp_path):
    both = ['optimizer.muon.muon_patterns=["*q_proj*"]', 'optimizer.muon.adamw_patterns=["*q_proj*"]']
    result = runner.invoke(
        app, ["pretrain", "tiny", "optimizer.name=muon", *both, f"output_dir={tmp_path / 'run'}"]
    )
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "matches both optimizer.muon.muon_patterns and" in text, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_a_resume_or_init_path_that_names_no_checkpoint_exits_2_before_any_worker_starts(tmp_path):
    """Checked by the launcher with the workers' own rule (`resume.load_order`): nothing is created."""
    (tmp_path / "empty").mkdir()
    for override, says in (
        (f"checkpoint.resume_from={tmp_path / 'nowhere'}", "checkpoint.resume_from: '{}' does not exist"),
        (
            f"checkpoint.init_from={tmp_path / 'empty'}",
            "checkpoint.init_from: '{}' is not a muonrun checkpoint",
        ),
    ):
        path = override.split("=", 1)[1]
        result = runner.invoke(app, ["pretrain", "tiny", override, f"output_dir={tmp_path / 'run'}"])
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and says.format(path) in text, result.output
        assert "Traceback" not in result.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides, says, quiet",
    [
        (  # a warmup as long as the run
            ["schedule.warmup_steps=300"],
            [
                "WARNING: schedule.warmup_steps (300) is not shorter than train.max_steps (150)",
                "reaching 50% of its peak",
            ],
            ["schedule.warmup_steps=149"],
        ),
        (  # Muon settings on an AdamW run
            ["optimizer.muon.lr=0.01"],
            [
                "WARNING: optimizer.muon.lr set by an override, but optimizer.name is 'adamw'",
                "Add optimizer.name=muon",
            ],
            ["optimizer.name=muon", "optimizer.muon.lr=0.01"],
        ),
    ],
)
def test_a_setting_that_would_not_do_what_it_says_is_warned_about_and_runs(overrides, says, quiet):
    result = runner.invoke(app, ["pretrain", "tiny", *overrides, "--dry-run"])
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and all(s in text for s in says), result.output
    calm = runner.invoke(app, ["pretrain", "tiny", *quiet, "--dry-run"])
    assert calm.exit_code == 0 and "WARNING" not in calm.output, calm.output
