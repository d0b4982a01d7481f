"""How long does the training thread wait for streaming data? Lookahead off vs on, one run.

A streaming source is read and tokenized in blocks of data.shuffle_buffer documents. This serves
batches to a simulated trainer that consumes --tokens-per-s per rank (sleeping for each batch's
share) and records how long each `next(loader)` took, with the next block read ahead on a thread
(what training does) and without:

    python benchmarks/bench_stream_stall.py --tokenizer bpe             # a 32k BPE trained here, offline
    python benchmarks/bench_stream_stall.py --tokenizer Qwen/Qwen2.5-0.5B --path 'c4/*.json.gz'
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path

from muonrun.config import Config, DataConfig, SourceConfig, TrainConfig
from muonrun.data import build_loader, build_tokenizer
from muonrun.data.tokenizer import HFTokenizer


def train_bpe(path: str, docs: int = 300) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in sorted(glob.glob(path))[:docs]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<eos>"], initial_alphabet=alphabet)
    )
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>"), "bpe-32k")


def measure(cfg: Config, tok, lookahead: bool, tokens_per_s: float, batches: int) -> dict:
    loader = build_loader(cfg, tok)  # the training loader, as the trainer builds it
    for packer in loader.packers:  # before the first block is read: "off" is the old behaviour
        packer.lookahead = lookahead
    waits = []
    for _ in range(batches):
        start = time.perf_counter()
        batch = next(loader)
        waits.append(time.perf_counter() - start)
        time.sleep(batch["input_ids"].numel() / tokens_per_s)  # the "training step"
    step_s = cfg.train.micro_batch_size * cfg.data.seq_len / tokens_per_s
    return {
        "lookahead": lookahead,
        "simulated_train_s": round(step_s * batches, 1),
        "wait_s_total": round(sum(waits), 2),
        "wait_s_first_block": round(waits[0], 2),
        "wait_s_max_after_first": round(max(waits[1:]), 2),
        "wait_share_after_first": round(sum(waits[1:]) / (sum(waits[1:]) + step_s * (batches - 1)), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))
    ap.add_argument(
        "--tokenizer", default="bpe", help="`bpe` (trained here on --path), `byte`, a folder or Hub id"
    )
    ap.add_argument("--block-docs", type=int, default=100, help="data.shuffle_buffer")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--tokens-per-s", type=float, default=125_000, help="simulated consumption per rank")
    args = ap.parse_args()
    os.environ.setdefault("MUONRUN_CACHE", tempfile.mkdtemp(prefix="muonrun-bench-"))
    tok = train_bpe(args.path) if args.tokenizer == "bpe" else build_tokenizer(args.tokenizer)
    cfg = Config(
        data=DataConfig(
            sources=[SourceConfig(path=args.path, streaming=True)],
            seq_len=args.seq_len,
            shuffle_buffer=args.block_docs,
        ),
        train=TrainConfig(micro_batch_size=args.batch),
    )
    results = [measure(cfg, tok, lookahead, args.tokens_per_s, args.batches) for lookahead in (False, True)]
    print(json.dumps({"tokenizer": tok.name, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
