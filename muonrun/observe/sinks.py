"""Where rank 0's metric rows go: OUTPUT_DIR/metrics.jsonl always, TensorBoard and Weights & Biases
when the config asks. Every sink takes the same rows (start, train, eval); see docs/observability.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from muonrun import log
from muonrun.config import Config
from muonrun.errors import UserError
from muonrun.paths import open_own, refuse_not_own


def _numbers(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}


TELEMETRY_SECTIONS = {
    "max_attention_logit": "attention",
    "qk_clipped_heads": "attention",
    "update_rms_": "optimizer",
    "momentum_norm_": "optimizer",
    "ortho_residual_": "optimizer",
}
"""Train-row keys (by prefix) that get their own tag section: `attention/max_attention_logit_3`,
`optimizer/update_rms_muon` (TensorBoard groups its charts by the part before the first slash)."""


def _section(key: str, default: str) -> str:
    return next((s for prefix, s in TELEMETRY_SECTIONS.items() if key.startswith(prefix)), default)


def _tags(row: dict) -> dict[str, float]:
    """A train or eval row's numbers as TensorBoard / W&B tags: `train/loss`, `eval/loss`, `eval/ppl`,
    `eval/acc_NAME` (eval.tasks), and the telemetry under `attention/` and `optimizer/`."""
    numbers = {k: v for k, v in _numbers(row).items() if k not in ("step", "time")}
    if "eval_time" in row or "eval_loss" in row:
        return {f"eval/{k.removeprefix('eval_')}": v for k, v in numbers.items()}
    return {f"{_section(k, 'train')}/{k}": v for k, v in numbers.items()}


class JsonlSink:
    """OUTPUT_DIR/metrics.jsonl: one JSON object per line, appended (a resumed run continues the file);
    never through a symbolic link (muonrun/paths.py)."""

    def __init__(self, path: Path):
        fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "the run's metrics")
        self.file = os.fdopen(fd, "a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """OUTPUT_DIR/tensorboard: train rows under `train/`, eval rows under `eval/`, the start row as text."""

    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "logging.tensorboard is true but tensorboard is not installed: pip install 'muonrun[tensorboard]' "
                "(or set logging.tensorboard=false)."
            ) from None
        self.writer = SummaryWriter(str(folder))

    def write(self, row: dict) -> None:
        if row.get("event") == "start":
            self.writer.add_text("run", "```\n" + json.dumps(row, indent=2) + "\n```", row["step"])
            return
        for tag, value in _tags(row).items():
            self.writer.add_scalar(tag, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run named after the muonrun run; its id is kept in the run folder for resumes."""

    def __init__(self, cfg: Config, out: Path):
        import wandb
        from omegaconf import OmegaConf

        id_file = out / "wandb_id"
        refuse_not_own(id_file, "file", "the run's Weights & Biases id")
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        with os.fdopen(
            open_own(id_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "the run's W&B id"), "w"
        ) as f:
            f.write(run_id)
        self.run = wandb.init(
            project=cfg.logging.wandb_project,
            entity=cfg.logging.wandb_entity,
            name=cfg.name,
            id=run_id,
            resume="allow",
            dir=str(out),
            config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
        )
        # Log against our step, not W&B's own counter, so a resumed run may re-log steps after its checkpoint.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, row: dict) -> None:
        if row.get("event") == "start":
            self.run.summary.update({f"start/{k}": v for k, v in _numbers(row).items()})
            return
        self.run.log({"step": row["step"], **_tags(row)})

    def close(self) -> None:
        self.run.finish()


def _wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def make_sinks(cfg: Config, out: Path) -> list:
    """The sinks `cfg.logging` asks for, writing into the run folder `out` (created here). A W&B project
    without wandb installed is one warning, not a failed run; TensorBoard missing is a UserError."""
    out.mkdir(parents=True, exist_ok=True)
    sinks: list = [JsonlSink(out / "metrics.jsonl")]
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    if cfg.logging.wandb_project:
        if _wandb_installed():
            sinks.append(WandbSink(cfg, out))
        else:
            log.warning(
                f"logging.wandb_project is '{cfg.logging.wandb_project}' but wandb is not installed "
                "(pip install wandb); not logging to Weights & Biases."
            )
    return sinks
