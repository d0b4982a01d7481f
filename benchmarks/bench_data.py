"""Loader throughput: tokens/s served per rank from the map-style cache and from a streaming source.

    python benchmarks/bench_data.py                       # the standard library's top-level modules, byte tokenizer
    python benchmarks/bench_data.py --seq-len 4096 --batch 4 --tokenizer path/to/tokenizer_folder
    python benchmarks/bench_data.py --jsonl                # the same text as one JSON-lines file (a `text` column)

A GPU eats roughly 1e5 tokens/s; the loader should be far above that. The cache goes to a temporary
folder unless MUONRUN_CACHE is set, so the first (tokenizing) build is timed too.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path

from muonrun.config import Config, DataConfig, SourceConfig, TrainConfig
from muonrun.data import build_loader, build_tokenizer


def timed(loader, batches: int) -> float:
    next(loader)
    start, tokens = time.perf_counter(), 0
    for _ in range(batches):
        tokens += next(loader)["input_ids"].numel()
    return tokens / (time.perf_counter() - start)


def to_jsonl(pattern: str, out: Path) -> str:
    with open(out, "w", encoding="utf-8") as f:
        for name in sorted(glob.glob(pattern, recursive=True)):
            with contextlib.suppress(UnicodeDecodeError, OSError):
                f.write(json.dumps({"text": Path(name).read_text(encoding="utf-8"), "file": name}) + "\n")
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))
    ap.add_argument("--tokenizer", default="byte")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--dp-size", type=int, default=8)
    ap.add_argument(
        "--jsonl",
        action="store_true",
        help="first write the files of --path as records of one JSON-lines file and read that (the table path)",
    )
    args = ap.parse_args()
    os.environ.setdefault("MUONRUN_CACHE", tempfile.mkdtemp(prefix="muonrun-bench-"))
    if args.jsonl:
        args.path = to_jsonl(args.path, Path(os.environ["MUONRUN_CACHE"]) / "bench.jsonl")

    def cfg(streaming: bool) -> Config:
        return Config(
            data=DataConfig(
                sources=[SourceConfig(path=args.path, streaming=streaming)],
                tokenizer=args.tokenizer,
                seq_len=args.seq_len,
            ),
            train=TrainConfig(micro_batch_size=args.batch),
        )

    tok = build_tokenizer(args.tokenizer)
    start = time.perf_counter()
    loader = build_loader(cfg(False), tok, dp_rank=args.dp_size - 1, dp_size=args.dp_size)
    build_s = time.perf_counter() - start
    streaming = build_loader(cfg(True), tok)
    result = {
        "cache": str(Path(os.environ["MUONRUN_CACHE"])),
        "windows": loader.epoch_size,
        "first_build_s": round(build_s, 2),
        "map_tokens_per_s": round(timed(loader, args.batches)),
        "streaming_tokens_per_s": round(timed(streaming, max(1, args.batches // 10))),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
