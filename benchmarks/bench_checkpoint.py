"""Checkpoint save / load / export timing and size, with the real Trainer and Checkpointer.

    python -m torch.distributed.run --standalone --nproc-per-node 8 benchmarks/bench_checkpoint.py qwen2-adamw-fsdp2
    python -m torch.distributed.run --standalone --nproc-per-node 8 benchmarks/bench_checkpoint.py qwen2-muon-fsdp2
    python benchmarks/bench_checkpoint.py tiny --out /tmp/ckbench       # CPU smoke test, one process

It trains --steps steps (so the optimizer state exists), then times: a synchronous save (and its size
on disk), an async save (time blocking the training loop, then until published), a load (resume) into
the same model and optimizers, and (rank 0) an HF export in bfloat16. The data are random tokens
(byte tokenizer), so neither `datasets` nor the network is needed (--real-data keeps the preset's).
Prints one JSON object on rank 0. Remove --out afterwards: a 0.5B AdamW checkpoint is about 6 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist


class SyntheticLoader:
    """Random token batches with a tiny state: the benchmark measures checkpoints, not data (and needs
    neither `datasets` nor the network)."""

    def __init__(self, cfg, tok, dp_rank=0, dp_size=1, split="train", pin_memory=False):
        self.shape = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
        self.vocab, self.seed, self.rank, self.count = tok.vocab_size, cfg.train.seed, dp_rank, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1000003 + self.rank * 7919 + self.count)
        self.count += 1
        rows = torch.randint(0, self.vocab, self.shape, generator=gen)
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        return {"kind": "synthetic", "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        self.count = sd["count"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="qwen2-adamw-fsdp2")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    ap.add_argument(
        "--out", default="/tmp/muonrun-ckbench", help="output_dir of the benchmark run (deleted first)"
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--real-data", action="store_true", help="the preset's data and tokenizer, not random tokens"
    )
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument(
        "--writer-threads", type=int, help="threads writing each rank's share (default: muonrun's)"
    )
    args = ap.parse_intermixed_args()

    import muonrun.checkpoint.checkpointer as checkpointer
    from muonrun.checkpoint.export import export_hf
    from muonrun.config import load_config, to_yaml
    from muonrun.distributed import destroy
    from muonrun.model.build import count_params
    from muonrun.train.trainer import Trainer

    if args.writer_threads:
        checkpointer.WRITER_THREADS = args.writer_threads
    out = Path(args.out)
    overrides = [
        *([] if args.real_data else ["data.tokenizer=byte"]),
        f"output_dir={out}",
        f"train.max_steps={args.steps}",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.save_at_end=false",
        "logging.console=plain",
        f"logging.log_interval={args.steps}",
        *args.overrides,
    ]
    cfg_node = load_config(args.config, overrides)
    cfg = cfg_node
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / "config.yaml").write_text(to_yaml(cfg_node))  # what `muonrun export` reads
    if not args.real_data:
        import muonrun.train.trainer

        muonrun.train.trainer.build_loader = SyntheticLoader
    trainer = Trainer(cfg)
    ck, dev, main_rank = trainer.checkpointer, trainer.dist.device, trainer.dist.is_main
    trainer.train()
    result: dict = {
        "config": args.config,
        "world_size": trainer.dist.world_size,
        "params": count_params(trainer.model.lm)["total"],
        "optimizer": cfg.optimizer.name,
        "writer_threads": checkpointer.WRITER_THREADS,
    }

    sync(dev)
    t = time.perf_counter()
    path = ck.save(trainer.state.step, trainer.state.tokens_seen)
    sync(dev)
    result["save_s"] = time.perf_counter() - t
    result["checksum_s"] = ck.timings["checksum_s"]  # part of save_s: hashing the files just written
    result["size_gib"] = folder_bytes(path) / 2**30 if main_rank else None
    result["save_gib_per_s"] = result["size_gib"] / result["save_s"] if main_rank else None

    ck.cfg.async_save = True  # async needs its gloo group, made here as Checkpointer would
    ck._pg = dist.new_group(backend="gloo")
    trainer.state.step += 1  # a second folder
    sync(dev)
    t = time.perf_counter()
    ck.save(trainer.state.step, last=False)
    result["async_blocking_s"] = time.perf_counter() - t
    ck._finish_pending()
    sync(dev)
    result["async_total_s"] = time.perf_counter() - t

    sync(dev)
    t = time.perf_counter()
    ck._verify(path)
    result["verify_s"] = time.perf_counter() - t
    ck._dcp_load(dict(ck.states), path)
    sync(dev)
    result["load_s"] = time.perf_counter() - t  # verify + load, as a resume does

    if main_rank and not args.no_export:
        t = time.perf_counter()
        hf = export_hf(path, out / "hf", dtype="bfloat16")
        result["export_bf16_s"] = time.perf_counter() - t
        result["export_gib"] = folder_bytes(hf) / 2**30
    if main_rank:
        print(
            "BENCH " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})
        )
    trainer.close()
    destroy()


if __name__ == "__main__":
    main()
