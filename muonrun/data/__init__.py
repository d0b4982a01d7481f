"""Data pipeline: sources -> tokenize -> pack -> per-rank shards, with a small resumable state.

    from muonrun.data import build_tokenizer, build_loader, check_data, prepare
    tok = build_tokenizer(cfg.data.tokenizer)
    loader = build_loader(cfg, tok, dp_rank=r, dp_size=n)        # infinite; loader.state_dict()
    batch = next(loader)   # {"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}, labels = inputs shifted by one
    evals = build_loader(cfg, tok, dp_rank=r, dp_size=n, split="eval")   # finite, restartable

Modules: tokenizer.py (byte / AutoTokenizer), formats.py (which builder reads a file), sources.py
(config -> datasets), records.py (records whose text is missing or not a string:
data.skip_bad_records), cache.py (tokenized token streams on disk), loader.py (map-style order,
sharding, mixing, state), streaming.py (streaming sources), batches.py (windows -> batches). Exercise it with
`pytest tests/test_data.py` and measure it with `python benchmarks/bench_data.py`.
"""

from muonrun.data.cache import CACHE_VERSION, TokenCache, cache_root, ensure_cached
from muonrun.data.loader import EvalLoader, PackedLoader, build_loader, check_data, prepare
from muonrun.data.streaming import StreamingLoader
from muonrun.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "CACHE_VERSION",
    "ByteTokenizer",
    "EvalLoader",
    "HFTokenizer",
    "PackedLoader",
    "StreamingLoader",
    "TokenCache",
    "build_loader",
    "build_tokenizer",
    "cache_root",
    "check_data",
    "ensure_cached",
    "prepare",
]
