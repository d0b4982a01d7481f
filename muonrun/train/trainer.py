"""The training worker: wires the parts in data-flow order, then loops.

Run one worker in-process with:  muonrun pretrain tiny --nproc-per-node 1 train.max_steps=20
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from muonrun import faults
from muonrun.checkpoint import Checkpointer, ModelState, OptimizerState, RNGState, write_run_config
from muonrun.checkpoint.export import export_replacing
from muonrun.config import Config, to_yaml
from muonrun.data import build_loader, build_tokenizer
from muonrun.distributed import Dist, all_reduce_mean, init_distributed, pick_device_type
from muonrun.eval import task_set
from muonrun.features import enabled, flops_per_token, pretrained_name
from muonrun.model.build import architecture_of, build_hf_config, build_model, init_weights
from muonrun.model.build import flops_per_token as model_flops_per_token
from muonrun.model.causal_lm import CausalLMWithLoss
from muonrun.model.expert_parallel import take_counts
from muonrun.model.hf import load_pretrained
from muonrun.model.moe import router_aux_loss_coef
from muonrun.model.parallelize import parallelize
from muonrun.observe.metrics import LossWindow, Metrics, optimizer_telemetry
from muonrun.observe.profiling import StepProfiler, phase
from muonrun.optim.build import build_optimizers
from muonrun.train.agreement import Agreed, StepAgreement, non_finite_message
from muonrun.train.clip import clip_grad_norm
from muonrun.train.ramp import accum_steps, lr_scale
from muonrun.train.schedule import lr_multiplier


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/inf on some rank; raised before any checkpoint of it is written."""


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Training tokens consumed by all ranks together."""

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


class OptimizerTimer:
    """Times the optimizer step without waiting for the GPU (only with logging.time_optimizer): CUDA
    events around it, read when the metrics row is written."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> Callable[[], float]:
        """A function returning the step's seconds (it waits for the end event, long done by then)."""
        if not self.cuda:
            seconds = time.perf_counter() - self.t0
            return lambda: seconds
        begin, end = self.begin, torch.cuda.Event(enable_timing=True)
        end.record()

        def elapsed() -> float:
            end.synchronize()
            return begin.elapsed_time(end) / 1e3

        return elapsed


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dist: Dist = init_distributed(cfg)
        device_type = pick_device_type(cfg)
        torch.manual_seed(cfg.train.seed)
        self.features = enabled(cfg)  # optional features: muonrun/features/__init__.py

        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.hf_config = build_hf_config(cfg.model, self.tokenizer.vocab_size)
        self.model = CausalLMWithLoss(
            build_model(cfg.model, self.hf_config, self.features),
            cfg.train.loss_chunk_tokens,
            cfg.parallel.compile_loss and device_type == "cuda",  # a GPU pass (config/inert.py)
            router_aux_loss_coef(cfg, self.hf_config),
            cfg.train.router_z_loss_coef,
        )
        # gradients the tp ranks hold in part (Qwen3's q_norm/k_norm under parallel.tp), summed each step
        self.partial_grads = parallelize(
            self.model, self.dist.mesh, cfg.parallel, device_type, self.features, self.dist.expert_mesh
        )
        self.model.to_empty(device=self.dist.device)
        init_weights(
            self.model, self.hf_config.initializer_range, cfg.train.seed, self.dist.device, self.features
        )
        self.optimizers = build_optimizers(self.model, cfg.optimizer, device_type)
        for feature in self.features:
            feature.start(self.model, self.dist.device)

        # HSDP replicas and FSDP shards all read different data; the tp ranks of one of them read the
        # same. Pinned host batches let the copy to the GPU (non_blocking) overlap with compute.
        self.loader = build_loader(
            cfg,
            self.tokenizer,
            dp_rank=self.dist.dp_rank,
            dp_size=self.dist.dp_size,
            pin_memory=self.dist.device.type == "cuda",
        )
        self.eval_loader = (
            build_loader(
                cfg, self.tokenizer, dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size, split="eval"
            )
            if cfg.train.eval_interval and cfg.data.eval_sources
            else None
        )
        self.tasks = task_set(cfg, self.tokenizer)  # multiple-choice tasks scored with the eval loss
        self.state = TrainState()
        self.agreement = StepAgreement(self.dist.rank, self.dist.world_size)
        self.optimizer_time: Callable[[], float] | None = None
        # train.batch_ramp: a step accumulates a number of micro-batches that the tokens seen decide
        self.tokens_per_micro_batch = cfg.tokens_per_step(self.dist.world_size) // cfg.train.grad_accum_steps

        # Frozen parameters (LoRA's base) are read from model.name_or_path at every start and never
        # checkpointed; a resume (or init_from) overwrites the rest; a fresh start may take pretrained
        # weights.
        frozen = any(not p.requires_grad for p in self.model.parameters())
        config_yaml = to_yaml(cfg)
        self.loss_window = LossWindow(self.dist.rank, self.dist.world_size)  # checkpointed: exact rows
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            Path(cfg.output_dir) / "checkpoints",
            self.dist,
            states={
                "model": ModelState(self.model, trainable_only=frozen),
                "optim": OptimizerState(self.model, self.optimizers),
                "train": self.state,
            },
            rank_states={"loader": self.loader, "rng": RNGState(self.dist.device), "loss": self.loss_window},
            identity={k: v for f in self.features for k, v in f.identity(self.dist).items()},
            config_yaml=config_yaml,
            architecture=architecture_of(self.hf_config),
        )

        def load_base() -> None:
            rename = partial(pretrained_name, self.features)
            load_pretrained(self.model.lm, cfg.model.name_or_path, self.dist, rename)

        try:
            if frozen:
                load_base()
            if self.checkpointer.load() is None and cfg.model.init == "pretrained" and not frozen:
                load_base()
        except BaseException:
            self.checkpointer.close()  # gives the signal handlers back: no Trainer exists to close it
            raise
        # A finished run rerun trains nothing and leaves its config and metrics as they were.
        self.complete = self.state.step >= cfg.train.max_steps
        if self.dist.is_main and not self.complete:  # only now: a run refused at load leaves the config be
            write_run_config(Path(cfg.output_dir), config_yaml)
        fpt = model_flops_per_token(self.hf_config, cfg.data.seq_len)
        self.metrics = Metrics(
            cfg,
            self.dist,
            flops_per_token=flops_per_token(self.features, fpt, self.model.lm),
            model=self.model.lm,
            loss_window=self.loss_window,
        )

    def accum_steps(self) -> int:
        """Micro-batches of the next step: train.grad_accum_steps, fewer while the batch ramps up."""
        return accum_steps(self.state.tokens_seen, self.cfg.train.grad_accum_steps, self.cfg.train.batch_ramp)

    def set_lr(self, accum: int) -> float:
        multiplier = lr_multiplier(self.state.step + 1, self.cfg.schedule, self.cfg.train.max_steps)
        multiplier *= lr_scale(accum, self.cfg.train.grad_accum_steps)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * multiplier
        return multiplier

    def next_batch(self) -> tuple[dict[str, torch.Tensor], float]:
        start = time.perf_counter()
        batch = next(self.loader)
        wait = time.perf_counter() - start
        return {k: v.to(self.dist.device, non_blocking=True) for k, v in batch.items()}, wait

    def train_step(self, accum: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches. Returns (loss, grad norm, data wait s) as device
        tensors: nothing here waits for the GPU (the agreement is read one step late)."""
        loss_sum = torch.zeros((), device=self.dist.device)
        data_wait = 0.0
        self.model.watch_experts = self.logs(self.state.step + 1)  # MoE load statistics: logged steps
        for _ in range(accum):
            with phase("data"):
                batch, wait = self.next_batch()
            data_wait += wait
            with phase("forward_backward"):
                loss = self.model(batch["input_ids"], batch["labels"]) / accum
                # MUONRUN_FAULT=nan@STEP
                loss = faults.corrupt_loss(loss, self.state.step + 1, self.dist.rank)
                loss.backward()
                loss_sum += loss.detach()
        with phase("clip"):
            self.partial_grads.sum_()
            clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
            grad_norm = clip_grad_norm(self.model.parameters(), clip)
        # One collective per step, agreed by every rank (muonrun/train/agreement.py): non-finite loss/grad
        # (the loss is per rank) so all stop together, plus the checkpointer's stop/async-write flags.
        # Queued now, read at the next step: the host does not wait here.
        with phase("agree"):
            previous = self.agreement.settle()
            self.agreement.launch(self.state.step + 1, loss_sum, grad_norm, self.checkpointer.local_flags())
            self.act_on(previous)
        timer = OptimizerTimer(self.dist.device) if self.cfg.logging.time_optimizer else None
        # Optimizer telemetry costs device work: only on the steps that log it.
        telemetry = self.cfg.logging.optimizer_telemetry and self.logs(self.state.step + 1)
        with phase("optimizer"):
            for opt in self.optimizers:
                opt.collect_telemetry = telemetry
                opt.step()
                opt.zero_grad(set_to_none=True)
        self.optimizer_time = timer.stop() if timer else None
        for feature in self.features:
            with phase(feature.name):
                feature.after_step()
        return loss_sum, grad_norm, data_wait

    def logs(self, step: int) -> bool:
        """Whether `step` writes a metrics row."""
        return step == self.cfg.train.max_steps or step % self.cfg.logging.log_interval == 0

    def telemetry(self) -> dict[str, torch.Tensor]:
        """This step's optimizer and features' telemetry as device tensors (read one step late)."""
        values = optimizer_telemetry(self.optimizers) if self.cfg.logging.optimizer_telemetry else {}
        values.update(self.model.moe_telemetry())
        values.update(
            {k: torch.tensor(v, device=self.dist.device) for k, v in take_counts(self.model).items()}
        )
        for feature in self.features:
            values.update(feature.telemetry())
        return values

    def act_on(self, agreed: Agreed | None) -> None:
        """Stop on a non-finite step anywhere; hand the agreed flags to the checkpointer."""
        if agreed is None:
            return
        if agreed.loss_bad or agreed.norm_bad:
            # An async save still being written is of an earlier step, checked finite before it was
            # saved: publish it (every rank is here, at the same step) rather than leave it as .tmp.
            self.checkpointer.finish()
            latest = self.checkpointer.published_step
            raise NonFiniteError(non_finite_message(agreed, self.dist.world_size, latest))
        self.checkpointer.agree(agreed.stop, agreed.writing)

    def settle(self) -> None:
        """Wait for the last step's agreement (before saving it, and at the end)."""
        self.act_on(self.agreement.settle())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The loss on data.eval_sources and the accuracies on eval.tasks (collective)."""
        self.model.eval()
        values = {}
        if self.eval_loader is not None:
            losses = [
                self.model(b["input_ids"].to(self.dist.device), b["labels"].to(self.dist.device))
                for b in self.eval_loader
            ]
            loss = all_reduce_mean(torch.stack(losses).mean()).item()
            values.update(eval_loss=loss, eval_ppl=math.exp(loss))
        if self.tasks is not None:
            d = self.dist
            values.update(self.tasks.score(self.model, d.device, d.dp_rank, d.dp_size))
        self.model.train()
        return values

    def train(self) -> None:
        cfg = self.cfg
        self.model.train()
        if self.complete:
            self.metrics.note(
                f"Nothing to train: this run is complete at step {self.state.step} (train.max_steps="
                f"{cfg.train.max_steps}); its config and metrics are left as they were. Raise train.max_steps to "
                "train on, or set name (or output_dir) for a new run."
            )
            return
        self.metrics.start(self.state)
        profiler = StepProfiler(cfg, self.dist)
        try:
            while self.state.step < cfg.train.max_steps:
                accum = self.accum_steps()
                lr_mult = self.set_lr(accum)
                loss, grad_norm, data_wait = self.train_step(accum)
                self.state.step += 1
                self.state.tokens_seen += accum * self.tokens_per_micro_batch
                step = self.state.step
                # MUONRUN_FAULT=kill@STEP / term@STEP / hang@STEP (until a stop request)
                faults.after_step(step, self.dist.rank, lambda: self.checkpointer.flag.raised is not None)
                profiler.step()
                last, log = step == cfg.train.max_steps, self.logs(step)
                self.metrics.record(
                    self.state,
                    loss,
                    grad_norm,
                    lr_mult,
                    data_wait,
                    self.optimizers,
                    log=log,
                    optimizer_time=self.optimizer_time,
                    telemetry=self.telemetry() if log else None,
                )
                if cfg.train.eval_interval and (last or step % cfg.train.eval_interval == 0):
                    self.metrics.log_eval(self.state, self.evaluate())
                if self.checkpointer.due(step, last):
                    self.settle()  # never save a step some rank found non-finite
                    self.metrics.flush()  # the step's row first, then its checkpoint's line
                if self.checkpointer.after_step(step, self.state.tokens_seen, last):
                    self.metrics.note(
                        f"Stopped by signal after step {step}; checkpoint saved. Rerun to resume."
                    )
                    return
            self.settle()
        finally:
            profiler.close()

    def finish(self) -> None:
        """After training ended normally (collective): publish a pending async save; export if asked."""
        self.checkpointer.finish()
        step, cfg = self.state.step, self.cfg
        out = None
        if cfg.checkpoint.export_at_end and step >= cfg.train.max_steps:  # a rerun exports again: its own
            if self.dist.is_main:
                out = export_replacing(
                    Path(cfg.output_dir) / "checkpoints" / f"step-{step}", Path(cfg.output_dir) / "hf"
                )
            torch.distributed.barrier()
        newest = self.checkpointer.published_step
        checkpoint = None if newest is None else Path(cfg.output_dir) / "checkpoints" / f"step-{newest}"
        self.metrics.summary(self.state, checkpoint, out)

    def close(self) -> None:
        self.metrics.close()
        self.checkpointer.close()


def run_worker(config_yaml: str) -> None:
    """Entry point of every worker process (and of the single in-process worker)."""
    from muonrun.config import from_yaml
    from muonrun.distributed import destroy

    cfg = from_yaml(config_yaml)
    trainer, together = None, False
    try:
        trainer = Trainer(cfg)
        trainer.train()
        trainer.finish()
        together = True
    except NonFiniteError:
        together = True  # every rank agreed on it and stops at the same step
        raise
    finally:
        if trainer is not None:
            trainer.close()
        # After an error on this rank alone the others may be inside a collective: leave their process
        # group as it is (tearing it down under a peer's traffic can abort the process); exiting
        # closes it. A world of one has no peers.
        alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        if together or alone:
            destroy(barrier=together)
