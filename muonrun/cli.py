"""The `muonrun` command line (Typer). Heavy imports (torch, transformers) happen inside commands.

muonrun pretrain                       # the tiny CPU preset, 2 workers
muonrun pretrain qwen2-muon-fsdp2 train.max_steps=100 --nproc-per-node 2
muonrun config show tiny optimizer.name=muon
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from muonrun import __version__
from muonrun.config.load import overridden_keys, preset_names
from muonrun.errors import UserError

app = typer.Typer(
    name="muonrun",
    help="Pretrain LLMs with FSDP2 and AdamW or distributed Muon, from one CPU to many GPU nodes.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")
checkpoint_app = typer.Typer(help="Check checkpoints.", no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")
# A command's exit frees everything at once: collecting the objects torch and transformers made first
# costs seconds of interpreter teardown (2-3 s on a small CPU). Frozen, the final collections skip them;
# exit handlers still run.
atexit.register(gc.freeze)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # paths stay whole

PresetArg = Annotated[
    str,
    typer.Argument(help=f"YAML config file, or a built-in preset name ({', '.join(preset_names())})."),
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Config overrides KEY=VALUE with dotted keys (train.max_steps=100); +KEY=VALUE adds a key."
    ),
]


def user_errors(fn):
    """User mistakes: one paragraph on stderr, exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            err_console.print(f"[bold red]muonrun:[/] {escape(str(e))}")
            raise typer.Exit(2) from None
        except KeyboardInterrupt as e:  # a second Ctrl-C (the first saves and stops cleanly), or SIGQUIT
            what = getattr(e, "signal_name", "Ctrl-C")
            err_console.print(
                f"[bold red]muonrun:[/] stopped by {what}; steps since the last checkpoint are lost."
            )
            raise typer.Exit(getattr(e, "exit_code", 130)) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        print(f"muonrun {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


def _flag_overrides(**flags) -> list[str]:
    """Launcher flags become `launch.*` overrides, so the saved config records how the job ran."""
    return [f"launch.{key}={value}" for key, value in flags.items() if value is not None]


@app.command()
@user_errors
def pretrain(
    config: PresetArg = "tiny",
    overrides: OverridesArg = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(help="Workers per node (default: launch.nproc_per_node, else every local GPU, else 1)."),
    ] = None,
    nnodes: Annotated[int | None, typer.Option(help="Number of nodes (under srun: SLURM_NNODES).")] = None,
    node_rank: Annotated[
        int | None, typer.Option(help="Rank of this node, 0 .. nnodes-1 (under srun: SLURM_NODEID).")
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT of the rendezvous on node 0 (under srun: first node, MUONRUN_RDZV_PORT)."
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None, typer.Option(help="Job id shared by all nodes (under srun: SLURM_JOB_ID).")
    ] = None,
    max_restarts: Annotated[int | None, typer.Option(help="Restart failed workers this many times.")] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Validate the config, check the data (not with --world-size), build the model on the meta device, print the plan.",
        ),
    ] = False,
    world_size: Annotated[
        int | None, typer.Option(help="With --dry-run: plan for this many workers instead of this machine's.")
    ] = None,
) -> None:
    """Train a model from a preset or YAML file, with optional KEY=VALUE overrides."""
    from muonrun.config import load_config
    from muonrun.launch.slurm import launch_defaults

    flags = _flag_overrides(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
    )
    if world_size is not None and not dry_run:
        raise UserError(
            "--world-size only plans (with --dry-run); to train, use --nnodes and --nproc-per-node."
        )
    # Inside `srun`, SLURM's variables fill the launch.* keys that the config and the flags leave unset.
    endpoint_given = rdzv_endpoint is not None or "launch.rdzv_endpoint" in overridden_keys(overrides or [])
    environment = launch_defaults(endpoint_given=endpoint_given)
    cfg = load_config(config, [*(overrides or []), *flags], environment=environment)
    if dry_run:
        from muonrun.config.load import overridden_settings
        from muonrun.tools.plan import print_plan

        print_plan(cfg, world_size, overridden_settings(config, [*(overrides or []), *flags], environment))
        return
    from muonrun.launch.launcher import launch

    code = launch(cfg)
    if code:
        raise typer.Exit(code)


@config_app.command("show")
@user_errors
def config_show(config: PresetArg = "tiny", overrides: OverridesArg = None) -> None:
    """Print the resolved configuration as YAML."""
    from muonrun.config import load_config, to_yaml

    sys.stdout.write(to_yaml(load_config(config, overrides or [])))


@config_app.command("docs")
@user_errors
def config_docs(
    keys: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[SECTION_OR_KEY]...",
            help="Only these sections (data, optimizer.muon) or keys (train.max_steps). Default: every key.",
        ),
    ] = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="One Markdown table (for a docs page) instead of wrapped text.")
    ] = False,
) -> None:
    """Print the reference of config keys: each key's type, default and meaning, wrapped to the terminal."""
    from muonrun.config.docs import markdown_table, selected, text_reference

    docs = selected(keys)
    print(markdown_table(docs) if markdown else text_reference(docs))


@app.command()
@user_errors
def prepare(config: PresetArg = "tiny", overrides: OverridesArg = None) -> None:
    """Tokenize and pack the training data once into a cache that `pretrain` reuses."""
    from muonrun.config import load_config
    from muonrun.data import prepare as prepare_data

    path = prepare_data(load_config(config, overrides or []))
    print(f"Data cache ready: {path}")


@app.command()
@user_errors
def compare(
    run_dirs: Annotated[
        list[str],
        typer.Argument(
            metavar="RUN_DIR", help="Run folders (each run's output_dir: metrics.jsonl, config.yaml)."
        ),
    ],
    out: Annotated[
        str, typer.Option("--out", "-o", help="PNG to draw; the table is also written as FILE.md.")
    ] = "compare.png",
    smoothing: Annotated[
        float, typer.Option(help="EMA smoothing of the loss per logged row, in [0, 1); 0 plots the raw loss.")
    ] = 0.6,
    title: Annotated[str | None, typer.Option(help="Figure title (default: the runs' labels).")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace FILE.png and FILE.md even if compare did not write them.")
    ] = False,
) -> None:
    """Plot runs' loss vs step, tokens and wall time, and print a table: final and best eval loss, tokens/s,
    MFU, and the steps/tokens each run needed to reach the worse run's final loss."""
    from muonrun.tools.compare import compare as compare_runs

    compare_runs(run_dirs, out, smoothing=smoothing, title=title, force=force)  # prints where it wrote


@app.command()
@user_errors
def export(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="A checkpoint folder OUTPUT_DIR/checkpoints/step-N, or a run folder (its latest)."
        ),
    ],
    out_dir: Annotated[str, typer.Argument(help="New folder for the Hugging Face model.")],
    dtype: Annotated[
        str, typer.Option(help="Weight dtype: float32 (as trained), bfloat16 or float16.")
    ] = "float32",
    adapter_only: Annotated[
        bool,
        typer.Option(
            "--adapter-only",
            help="LoRA runs: write the adapter alone (for peft.PeftModel.from_pretrained), not the merged model.",
        ),
    ] = False,
) -> None:
    """Write a Hugging Face folder (safetensors, config.json, tokenizer) from a muonrun checkpoint; a LoRA
    run's adapters merged into its base model, or with --adapter-only the adapter alone."""
    from muonrun.checkpoint.export import export_hf

    out = export_hf(checkpoint, out_dir, dtype, adapter_only=adapter_only)
    if adapter_only:
        print(
            f"Exported the adapter to {out}; load it with peft.PeftModel.from_pretrained(base_model, '{out}')."
        )
    else:
        print(f"Exported to {out}; load it with AutoModelForCausalLM.from_pretrained('{out}').")


@app.command("eval")
@user_errors
def eval_(
    target: Annotated[
        str,
        typer.Argument(
            metavar="RUN_OR_CHECKPOINT",
            help="A run folder (its latest checkpoint), a checkpoint folder step-N, or an exported folder.",
        ),
    ],
    tasks: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated tasks: the run's own eval.tasks by name, or lm-evaluation-harness tasks "
            "(hellaswag,arc_easy,...). Default: the run's eval.tasks."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Score only the first N examples of each task.")] = None,
    num_fewshot: Annotated[
        int | None,
        typer.Option(help="Examples shown before each one (default: the task's own, 0 for the run's)."),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward.")] = 16,
    device: Annotated[
        str | None, typer.Option(help="Device to run on (default: cuda if there is one).")
    ] = None,
    include_path: Annotated[
        str | None, typer.Option(help="A folder of more harness task YAML files (tasks on local data).")
    ] = None,
) -> None:
    """Score a checkpoint with lm-evaluation-harness (pip install 'muonrun[eval]'); the results go to the run
    folder's harness.jsonl, which `muonrun compare` shows."""
    from muonrun.eval.harness import print_results, run_eval

    names = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None
    print_results(*run_eval(target, names, limit, num_fewshot, batch_size, device, include_path))


@checkpoint_app.command("verify")
@user_errors
def checkpoint_verify(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="PATH", help="Checkpoint folders step-N, or run folders (all their checkpoints)."
        ),
    ],
) -> None:
    """Compare every file of a checkpoint with the sizes and SHA-256 checksums written when it was saved
    (e.g. after copying it between clusters). Exit code 1 if any checkpoint is damaged."""
    from muonrun.checkpoint import checkpoints_of, read_meta, verify

    damaged = 0
    for path in paths:
        for checkpoint in checkpoints_of(path):
            verdict = verify(checkpoint)
            if not verdict.ok:
                damaged += 1
                err_console.print(f"[bold red]damaged[/]     {escape(str(verdict.error()))}")
            else:
                files = read_meta(checkpoint)["files"]
                size = sum(f["bytes"] for f in files.values()) / 2**30
                print(f"ok          {checkpoint} ({len(files)} files, {size:.2f} GiB, all checksums match)")
    if damaged:
        raise typer.Exit(1)


@app.command()
@user_errors
def bench(
    config: PresetArg = "tiny",
    overrides: OverridesArg = None,
    variant: Annotated[
        list[str] | None, typer.Option(help="NAME or NAME:key=value,key=value; repeat to compare variants.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Measured steps per variant.")] = 10,
    warmup: Annotated[
        int, typer.Option(help="Steps run first and not measured (compilation, allocator).")
    ] = 5,
    out: Annotated[
        str, typer.Option(help="JSON file for the results; runs go beside it.")
    ] = "bench/results.json",
    repeat: Annotated[
        int, typer.Option(help="Run the variants this many times, round-robin; report medians and the range.")
    ] = 1,
) -> None:
    """Time short training runs of one or more variants side by side: tokens/s, MFU, step and optimizer time."""
    import json
    from pathlib import Path

    from muonrun.tools.bench import print_results, run_bench

    out_path = Path(out)
    results = run_bench(config, overrides or [], variant or [], steps, warmup, out_path.parent, repeat)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    print_results(results)
    if any("error" in r for r in results.values()):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
