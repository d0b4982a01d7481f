"""QK-clip under FSDP2 through the trainer, with AdamW and with Muon, run by tests/test_qkclip.py under
torch.distributed.run (gloo, CPU, 2 ranks).

usage: qkclip_worker.py OUT_DIR

A tiny Qwen2 with 3 query heads over 1 key head, head_dim 32: q_proj's 96 rows split 48/48 and k_proj's
32 rows 16/16, so a query head and the key head straddle the two ranks' shards. Its query and key
weights are scaled up (and biases made non-zero) so that the logits are large; tau is set between the
heads' logits so that some clip and some do not. For one step taken by `Trainer.train_step`:

- the max logit measured in the step (reduced over ranks) equals the max of the materialized logits
  of the same forward (recomputed with the pre-step weights on the same batch);
- the clip scales the rows of q_proj/k_proj weights and biases by the per-head factors, written out
  head by head here, on the gathered full tensors;
- on the same per-layer inputs each head's logits scale by exactly its gamma.

Then `Trainer.train()` runs 3 logged steps with optimizer telemetry and TensorBoard on, and rank 0
checks the rows: the attention keys, and `update_rms_<opt>`, `momentum_norm_<opt>` (and for Muon
`ortho_residual_muon`) with finite values. Rank 0 prints ``QKCLIP_WORKER_OK`` at the end.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from muonrun.features import qkclip
from muonrun.config import load_config
from muonrun.distributed import all_reduce_max, destroy, local_tensor, release_process_groups
from muonrun.train.trainer import Trainer

HEAD_DIM, HEADS, KV_HEADS = 32, 3, 1


def qk_clip(trainer: Trainer):
    """The trainer's QK-clip tracker (the qk_clip feature's)."""
    return next(f.tracker for f in trainer.features if f.name == "qk_clip")


def materialized_max_logit(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    group = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2)
    seq = scores.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)).float()


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def attention_inputs(trainer: Trainer, batch: dict) -> list:
    seen = []
    hooks = [
        m.register_forward_pre_hook(lambda _, a, kw: seen.append((a, kw)), with_kwargs=True)
        for m in qk_clip(trainer).modules
    ]
    trainer.model.eval()  # not counted by the tracker
    with torch.no_grad():
        trainer.model(batch["input_ids"], batch["labels"])
    trainer.model.train()
    for hook in hooks:
        hook.remove()
    return seen


def reference(trainer: Trainer, batch: dict, inputs: list | None = None) -> torch.Tensor:
    """[layers, heads] materialized max logits over both ranks' batches: of a whole forward of `batch`,
    or of each attention layer alone on `inputs`. Leaves the tracker's own maxima as they were."""
    tracker = qk_clip(trainer)
    saved = tracker.current.clone()
    tracker.current.fill_(float("-inf"))
    with mock.patch.object(qkclip, "causal_max_logit", materialized_max_logit), torch.no_grad():
        if inputs is None:
            trainer.model(batch["input_ids"], batch["labels"])
        else:
            # FSDP2 gathers parameters in the decoder layer's hooks: gather them around the attention call
            layers = trainer_layers(trainer)
            for layer, module, (args, kwargs) in zip(layers, tracker.modules, inputs, strict=True):
                layer.unshard()
                module(*args, **kwargs)
                layer.reshard()
    out = all_reduce_max(tracker.current.clone())
    tracker.current.copy_(saved)
    return out


def trainer_layers(trainer: Trainer) -> list:
    """The FSDP2 units (decoder layers) holding each attention module."""
    return [m for m in trainer.model.modules() if getattr(m, "self_attn", None) in qk_clip(trainer).modules]


def expected_row_scales(current: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, the scale of every q_proj row and every k_proj row, head by head."""
    group = HEADS // KV_HEADS
    q_rows, k_rows = [], []
    for layer in current.tolist():
        gammas = [min(1.0, tau / s) for s in layer]
        k = [math.sqrt(min(gammas[g * group : (g + 1) * group])) for g in range(KV_HEADS)]
        q = [gammas[h] / k[h // group] for h in range(HEADS)]
        q_rows.append(torch.tensor(q).repeat_interleave(HEAD_DIM))
        k_rows.append(torch.tensor(k).repeat_interleave(HEAD_DIM))
    return torch.stack(q_rows), torch.stack(k_rows)


def qk_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{proj}.{kind}": getattr(getattr(m, proj), kind)
        for i, m in enumerate(qk_clip(trainer).modules)
        for proj in ("q_proj", "k_proj")
        for kind in ("weight", "bias")
    }


def make_large(trainer: Trainer) -> None:
    """Logits of tens: q/k weights x8, biases N(0, 0.5) (the same full tensor on every rank)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in qk_params(trainer).items():
            rows = qkclip.local_rows(p)
            if name.endswith("weight"):
                local_tensor(p).mul_(8.0)
            else:
                local_tensor(p).copy_(torch.randn(p.shape, generator=g)[rows.start : rows.stop] * 0.5)


def check_one_step(trainer: Trainer, rank: int) -> None:
    batch, _ = trainer.next_batch()
    measured_ref = reference(trainer, batch)
    tau = measured_ref.flatten().median().item()
    assert 0 < (measured_ref > tau).sum() < measured_ref.numel(), measured_ref
    qk_clip(trainer).tau = tau
    trainer.next_batch = lambda: (batch, 0.0)
    seen = {}
    after_step = qk_clip(trainer).after_step

    def spy() -> None:
        seen["measured"] = all_reduce_max(qk_clip(trainer).current.clone())
        seen["updated"] = {n: full(p) for n, p in qk_params(trainer).items()}
        seen["inputs"] = attention_inputs(trainer, batch)
        seen["updated_logits"] = reference(trainer, batch, seen["inputs"])
        after_step()

    qk_clip(trainer).after_step = spy
    trainer.train_step(trainer.cfg.train.grad_accum_steps)
    qk_clip(trainer).after_step = after_step
    del trainer.next_batch
    torch.testing.assert_close(seen["measured"], measured_ref, rtol=1e-6, atol=0)
    q_rows, k_rows = expected_row_scales(seen["measured"], tau)
    for name, p in qk_params(trainer).items():
        layer = int(name.split(".")[0])
        scale = (q_rows if ".q_proj." in name else k_rows)[layer]
        before = seen["updated"][name]
        want = before * (scale[:, None] if before.ndim == 2 else scale)
        torch.testing.assert_close(full(p), want, rtol=1e-6, atol=0, msg=f"rank {rank} {name}")
    gamma = (tau / seen["measured"]).clamp(max=1.0)
    after = reference(trainer, batch, seen["inputs"])
    torch.testing.assert_close(after, gamma * seen["updated_logits"], rtol=1e-5, atol=1e-6)


def check_rows(out: Path, optimizer: str) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3], train
    attention = ["max_attention_logit", "max_attention_logit_0", "max_attention_logit_1", "qk_clipped_heads"]
    for r in train:
        for key in attention:
            assert key in r and math.isfinite(r[key]), (key, r)
    if (out / "tensorboard").is_dir():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"))
        events.Reload()
        assert "attention/max_attention_logit" in events.Tags()["scalars"]
    # The optimizers' side of the interface (collect_telemetry / telemetry)
    wanted = [f"update_rms_{optimizer}", f"momentum_norm_{optimizer}", "update_rms_adamw"]
    wanted += ["ortho_residual_muon"] if optimizer == "muon" else []
    for r in train:
        for key in wanted:
            assert key in r and math.isfinite(r[key]), f"{key} missing or not finite in {r}"


def main(out_dir: str) -> None:
    for optimizer in ("adamw", "muon"):
        run_one(Path(out_dir) / optimizer, optimizer)
    rank = dist.get_rank()
    destroy()
    release_process_groups()  # the trainers are gone: no gloo thread is left for interpreter teardown
    if rank == 0:
        print("QKCLIP_WORKER_OK", flush=True)


def run_one(out: Path, optimizer: str) -> None:
    overrides = [
        f"output_dir={out}",
        f"optimizer.name={optimizer}",
        f"model.hf.hidden_size={HEADS * HEAD_DIM}",
        f"model.hf.num_attention_heads={HEADS}",
        f"model.hf.num_key_value_heads={KV_HEADS}",
        "model.hf.intermediate_size=128",
        "model.hf.num_hidden_layers=2",
        "data.seq_len=48",
        "train.micro_batch_size=2",
        "train.max_steps=3",
        "train.eval_interval=0",
        "train.qk_clip.tau=1.0",
        "logging.optimizer_telemetry=true",
        "logging.tensorboard=true",
        "logging.log_interval=1",
        "logging.console=plain",
        "checkpoint.save_at_end=false",
    ]
    trainer = Trainer(load_config("tiny", overrides))
    try:
        rank = trainer.dist.rank
        make_large(trainer)
        check_one_step(trainer, rank)
        qk_clip(trainer).tau = 20.0
        trainer.train()
    finally:
        trainer.close()
    if rank == 0:
        check_rows(out, optimizer)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
