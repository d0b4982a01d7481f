"""Data pipeline: packing, sharding, resume (map-style and streaming), cache, tokenizers, user errors.

Everything is made in tmp_path; nothing touches the network (the Hub is forced offline).
Run: pytest tests/test_data.py -q
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from muonrun.config import Config, DataConfig, SourceConfig, TrainConfig
from muonrun.data import ByteTokenizer, build_loader, build_tokenizer, check_data, ensure_cached, prepare
from muonrun.data import cache as cache_mod
from muonrun.errors import UserError

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "ü",
    "café",
    "数据",
    "λ",
    "ok",
]


@pytest.fixture(autouse=True)
def _offline_and_private_caches(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setenv("MUONRUN_CACHE", str(tmp_path / "muonrun-cache"))
    datasets.disable_progress_bars()


def docs(n: int, seed: int = 0, prefix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [f"{prefix}{i} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 30))) for i in range(n)]


def write_jsonl(path, texts, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({field: t, "id": i}, ensure_ascii=False) + "\n")
    return str(path)


def make_cfg(sources, seq_len=16, batch=2, eval_sources=(), seed=0, eval_steps=3, **data):
    as_src = [s if isinstance(s, SourceConfig) else SourceConfig(path=s) for s in sources]
    evals = [s if isinstance(s, SourceConfig) else SourceConfig(path=s) for s in eval_sources]
    return Config(
        data=DataConfig(sources=as_src, eval_sources=evals, seq_len=seq_len, **data),
        train=TrainConfig(micro_batch_size=batch, seed=seed, eval_steps=eval_steps),
    )


def byte_stream(texts) -> np.ndarray:
    return np.concatenate(
        [np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int64), 256) for t in texts]
    )


def rows(batch) -> np.ndarray:
    """The full windows of a batch (inputs plus the last label), [B, T+1]."""
    return np.concatenate([batch["input_ids"].numpy(), batch["labels"].numpy()[:, -1:]], axis=1)


def take(loader, n) -> list[np.ndarray]:
    return [rows(next(loader)) for _ in range(n)]


def assert_each_rank_resumes(cfg, tok, states, expect) -> None:
    """A fresh loader per rank, given that rank's saved state, yields exactly the batches `expect[rank]`."""
    dp = len(states)
    for r in range(dp):
        resumed = build_loader(cfg, tok, dp_rank=r, dp_size=dp)
        resumed.load_state_dict(states[r])
        got = take(resumed, len(expect[r]))
        assert all(np.array_equal(a, b) for a, b in zip(got, expect[r], strict=True))


@pytest.fixture
def corpus(tmp_path):
    texts = docs(80)
    return texts, write_jsonl(tmp_path / "corpus.jsonl", texts)


# -- tokenizers -------------------------------------------------------------------------------------------


def test_byte_tokenizer_roundtrip():
    tok = build_tokenizer("byte")
    assert (tok.vocab_size, tok.eos_token_id) == (257, 256)
    texts = ["héllo 数据 λ", "", "plain"]
    ids = tok.encode_batch(texts)
    assert [tok.decode(x) for x in ids] == texts
    flat, lens = tok.encode_docs(texts)
    assert flat.tolist() == [t for x in ids for t in [*x, 256]]
    assert lens.tolist() == [len(x) + 1 for x in ids]


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"], show_progress=False)
    raw.train_from_iterator(docs(200, seed=1), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    folder = tmp_path / "tok"
    hf.save_pretrained(folder)
    return str(folder)


def test_auto_tokenizer_folder(hf_tokenizer_dir, corpus):
    tok = build_tokenizer(hf_tokenizer_dir)
    assert tok.eos_token_id == 1 and 100 < tok.vocab_size <= 300
    texts, path = corpus
    ids = tok.encode_batch(texts[:3])
    assert tok.decode(ids[0]) == texts[0] and all(isinstance(i, int) for i in ids[0])
    cfg = make_cfg([path])
    entry = ensure_cached(cfg.data.sources[0], "data.sources.0", tok, cfg.data)
    assert entry.meta["dtype"] == "uint16" and entry.meta["num_docs"] == len(texts)
    expected = np.concatenate([np.array([*x, 1]) for x in tok.encode_batch(texts)])
    assert np.array_equal(np.asarray(entry.tokens), expected)
    batch = next(build_loader(cfg, tok))
    assert batch["input_ids"].max() < tok.vocab_size


# -- packing, order, sharding ------------------------------------------------------------------------------


def test_packing_keeps_every_token_in_order(corpus):
    texts, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=16, batch=4, shuffle=False)
    stream = byte_stream(texts)
    entry = ensure_cached(cfg.data.sources[0], "data.sources.0", tok, cfg.data)
    assert np.array_equal(np.asarray(entry.tokens), stream)  # the cache is the whole stream
    windows = entry.windows(16, "k")
    n = len(stream) // 17
    assert windows.shape == (n, 17)
    loader = build_loader(cfg, tok)
    served = np.concatenate(take(loader, -(-n // 4)))[:n]  # unshuffled: one epoch in order
    assert np.array_equal(served.reshape(-1), stream[: n * 17])
    batch = next(build_loader(cfg, tok))
    assert batch["input_ids"].dtype == batch["labels"].dtype == __import__("torch").long
    assert batch["input_ids"].shape == (4, 16)
    assert np.array_equal(batch["input_ids"][:, 1:].numpy(), batch["labels"][:, :-1].numpy())


def test_one_epoch_covers_every_window_once(corpus):
    _, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=8, batch=1)
    loader = build_loader(cfg, tok)
    windows = np.asarray(loader.windows[0])
    served = np.concatenate(take(loader, loader.epoch_size))
    assert sorted(map(bytes, served.astype(np.uint16))) == sorted(map(bytes, windows.astype(np.uint16)))
    assert not np.array_equal(served, windows)  # shuffled
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["cursor"] == 0
    assert not np.array_equal(np.concatenate(take(loader, 20)), served[:20])  # a new order each epoch


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_rank_shards_are_disjoint_and_cover(corpus, dp):
    _, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=8, batch=2)
    reference = build_loader(cfg, tok)  # dp=1: global samples in order
    steps = reference.epoch_size // (2 * dp)
    ref = take(reference, steps * dp)
    ranks = [build_loader(cfg, tok, dp_rank=r, dp_size=dp) for r in range(dp)]
    for k in range(steps):
        for r, loader in enumerate(ranks):
            assert np.array_equal(
                rows(next(loader)), ref[k * dp + r]
            )  # rank r gets global samples (k*dp+r)*B..
    ids = np.concatenate(
        [ranks[0].global_samples((k * dp + r) * 2, 2) for k in range(steps) for r in range(dp)]
    )
    assert len(set(ids.tolist())) == len(ids)  # disjoint
    assert len({ld.state_dict()["cursor"] for ld in ranks}) == 1  # every rank holds the same global state


# -- resume -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2])
def test_map_resume_is_exact(corpus, dp):
    _, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=32, batch=3)
    full = [build_loader(cfg, tok, dp_rank=r, dp_size=dp) for r in range(dp)]
    epoch = full[0].epoch_size
    k, m = epoch // (3 * dp) - 1, 6  # the continuation crosses an epoch boundary
    for ld in full:
        take(ld, k)
    states = [ld.state_dict() for ld in full]
    expect = [take(ld, m) for ld in full]
    assert_each_rank_resumes(cfg, tok, states, expect)


def test_map_resume_on_a_different_dp_size(corpus):
    _, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=16, batch=2)
    ref = np.concatenate(take(build_loader(cfg, tok), 40))  # dp=1, global samples 0..79
    two = [build_loader(cfg, tok, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(5):
        for ld in two:
            next(ld)  # 5 steps x 2 ranks x 2 = 20 global samples
    state = two[0].state_dict()
    assert state.pop("identity") and state == two[1].state_dict()  # rank 0's also holds the data's identity
    three = [build_loader(cfg, tok, dp_rank=r, dp_size=3) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    for k in range(3):
        for r, ld in enumerate(three):
            start = 20 + (k * 3 + r) * 2
            assert np.array_equal(rows(next(ld)), ref[start : start + 2])


def resumed(cfg, tok, state, dp_rank=0, dp_size=1):
    loader = build_loader(cfg, tok, dp_rank=dp_rank, dp_size=dp_size)
    loader.load_state_dict(state)
    return loader


def edit_in_place(path, offset: int) -> None:
    """Change one byte (an ASCII letter for another) at or after `offset`, keeping the size; the file's
    modification time moves on as an editor's would."""
    data = bytearray(Path(path).read_bytes())
    at = next(i for i in range(offset, len(data)) if 97 <= data[i] <= 122 and data[i] != ord("q"))
    data[at] = ord("q")
    mtime = os.stat(path).st_mtime_ns
    Path(path).write_bytes(bytes(data))
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_resume_on_a_file_edited_at_the_same_size_warns_once_naming_it(tmp_path, capsys, streaming):
    path = write_jsonl(tmp_path / "corpus.jsonl", docs(80))
    tok = build_tokenizer("byte")
    cfg = make_cfg([SourceConfig(path=path, streaming=streaming)], seq_len=16, shuffle_buffer=7)
    loader = build_loader(cfg, tok)
    take(loader, 3)
    state, other_rank = loader.state_dict(), build_loader(cfg, tok, dp_rank=1, dp_size=2).state_dict()
    assert "identity" in state and "identity" not in other_rank  # rank 0 alone reads and reports
    size = os.path.getsize(path)
    edit_in_place(path, 100)
    assert os.path.getsize(path) == size
    capsys.readouterr()
    resumed(cfg, tok, state)
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "UserWarning" not in err, err
    assert f"data.sources.0 ({path}): '{path}' changed (the same size, other contents)" in err
    assert "data.strict_resume=true refuses" in err
    strict = make_cfg(
        [SourceConfig(path=path, streaming=streaming)], seq_len=16, shuffle_buffer=7, strict_resume=True
    )
    with pytest.raises(UserError, match=rf"'{path}' changed \(the same size.*data.strict_resume is true"):
        resumed(strict, tok, state)
    capsys.readouterr()
    resumed(cfg, tok, build_loader(cfg, tok).state_dict())  # the data as it is now: nothing to say
    assert capsys.readouterr().err == ""


def test_an_edit_between_the_sampled_blocks_is_seen_by_the_token_hash(tmp_path, capsys):
    """A 2.6 MB file: its fingerprint reads 16 blocks of 64 KiB; an edit between them changes no
    fingerprint, but the token stream the cache rebuilt (the modification time moved) differs."""
    from muonrun.data.identity import BLOCK, sampled_sha256

    path = write_jsonl(tmp_path / "big.jsonl", docs(30000))
    size = os.path.getsize(path)
    assert size > 16 * BLOCK * 2  # gaps between the sampled blocks
    before = sampled_sha256(path, size)
    between = (size - BLOCK) // 15 + BLOCK + 100  # past the second sampled block, before the third
    edit_in_place(path, between)
    assert sampled_sha256(path, size) == before
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=16)
    state = build_loader(cfg, tok).state_dict()
    edit_in_place(path, between + 1)  # after the state was saved
    capsys.readouterr()
    resumed(cfg, tok, state)
    err = capsys.readouterr().err
    assert f"data.sources.0 ({path}): its text changed (the tokens differ)" in err, err


def test_a_resume_reads_no_unchanged_file_and_a_copy_elsewhere_is_the_same_data(
    tmp_path, capsys, monkeypatch
):
    from muonrun.data import identity

    folder = tmp_path / "data"
    folder.mkdir()
    paths = [write_jsonl(folder / f"part{i}.jsonl", docs(30, seed=i)) for i in range(3)]
    tok = build_tokenizer("byte")

    def cfg(where):
        return make_cfg([SourceConfig(path=f"{where}/*.jsonl", streaming=True)], seq_len=16, shuffle_buffer=7)

    loader = build_loader(cfg(folder), tok)
    take(loader, 2)
    state = loader.state_dict()  # a streaming source's files are hashed here, at the first save

    def no_reading(*args):
        raise AssertionError("a file was read")

    with monkeypatch.context() as m:
        m.setattr(identity, "sampled_sha256", no_reading)
        again = resumed(cfg(folder), tok, state)  # sizes and times unchanged: the saved hashes serve
        assert again.state_dict()["identity"] == state["identity"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in paths:  # another folder, new modification times, the same bytes
        (copy / os.path.basename(path)).write_bytes(Path(path).read_bytes())
    capsys.readouterr()
    resumed(cfg(copy), tok, state)
    assert capsys.readouterr().err == ""
    os.remove(copy / "part1.jsonl")
    resumed(cfg(copy), tok, state)
    assert f"'part1.jsonl', read from '{folder}' then, is not in '{copy}'" in capsys.readouterr().err


def test_a_changed_layout_is_reported_as_what_it_is_once(corpus, capsys):
    _, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=16, batch=2)
    loader = build_loader(cfg, tok)
    take(loader, 5)
    state = loader.state_dict()
    capsys.readouterr()
    longer = resumed(make_cfg([path], seq_len=32, batch=2), tok, state)
    out, err = capsys.readouterr()
    assert err.count("WARNING") == 1 and "data.seq_len is 32, the checkpoint was saved with 16" in err, err
    assert "data changed" not in err and out == ""
    assert longer.cursor == state["cursor"] * longer.epoch_size // state["epoch_size"]  # same fraction
    wider = resumed(make_cfg([path], seq_len=16, batch=4), tok, state, dp_rank=1, dp_size=2)
    out, err = capsys.readouterr()
    assert err == "" and out.count("muonrun: ") == 1, (out, err)
    assert (
        "batch layout changed since the checkpoint (train.micro_batch_size 2 -> 4, data-parallel ranks 1 -> 2)"
        in out
    )
    assert wider.cursor == state["cursor"]  # the same sample, the same order
    old = {k: v for k, v in state.items() if k not in ("identity", "layout")}  # saved before identities
    resumed(make_cfg([path], seq_len=32, batch=2), tok, old)
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "The data changed since the checkpoint (an epoch of" in err


def stream_cfg(path, **kw):
    kw.setdefault("shuffle_buffer", 7)
    return make_cfg([SourceConfig(path=path, streaming=True)], **kw)


def test_streaming_packs_the_same_stream(corpus):
    texts, path = corpus
    tok = build_tokenizer("byte")
    cfg = stream_cfg(path, seq_len=16, batch=4, shuffle=False)
    stream = byte_stream(texts)
    n = len(stream) // 17
    got = np.concatenate(take(build_loader(cfg, tok), n // 4)).reshape(-1)
    assert np.array_equal(got, stream[: len(got)])


@pytest.mark.parametrize("dp", [1, 2])
def test_streaming_resume_is_exact(corpus, dp, tmp_path):
    _, path = corpus
    other = write_jsonl(tmp_path / "other.jsonl", docs(30, seed=5, prefix="B"))
    tok = build_tokenizer("byte")
    cfg = stream_cfg(path, seq_len=64, batch=4)
    cfg.data.sources.append(SourceConfig(path=other, streaming=True, weight=0.3))  # a weighted mixture
    full = [build_loader(cfg, tok, dp_rank=r, dp_size=dp) for r in range(dp)]
    k, m = 9, 25  # the continuation crosses blocks and an epoch boundary
    for ld in full:
        take(ld, k)
    states = [ld.state_dict() for ld in full]
    json.dumps(states)  # small and plain
    expect = [take(ld, m) for ld in full]
    assert full[0].packers[0].epoch >= 1
    if dp == 2:  # ranks read different documents
        assert not np.array_equal(expect[0][0], expect[1][0])
    assert_each_rank_resumes(cfg, tok, states, expect)


def test_streaming_tokenizes_the_next_block_ahead_on_a_thread(corpus):
    """Training reads and tokenizes block k+1 in the background while block k is served; evaluation
    does not read ahead; rewinding a loader that is reading ahead replays exactly."""
    _, path = corpus
    threads, second_block = [], threading.Event()

    class Recording(ByteTokenizer):
        def encode_docs(self, texts):
            threads.append(threading.current_thread().name)
            if len(threads) == 2:
                second_block.set()
            return super().encode_docs(texts)

    cfg = stream_cfg(path, seq_len=16, batch=1, shuffle=False)  # 7 documents per block
    loader = build_loader(cfg, Recording())
    first = take(loader, 1)
    assert second_block.wait(timeout=30)  # nobody asked for block 1 yet
    assert threads[:2] == [threading.current_thread().name, "muonrun-stream"]
    state = loader.state_dict()
    expect = take(loader, 40)  # crosses several blocks
    loader.load_state_dict(state)  # while the thread is reading ahead
    assert all(np.array_equal(a, b) for a, b in zip(take(loader, 40), expect, strict=True))
    assert np.array_equal(first[0], take(build_loader(cfg, ByteTokenizer()), 1)[0])

    threads.clear()
    evals = make_cfg(
        [path], eval_sources=[SourceConfig(path=path, streaming=True)], eval_steps=2, shuffle_buffer=7
    )
    assert len(list(build_loader(evals, Recording(), split="eval"))) == 2
    time.sleep(0.2)
    assert threads == [threading.current_thread().name]  # one block, read when asked


def test_streaming_resume_on_a_different_dp_size_is_refused(corpus):
    _, path = corpus
    tok = build_tokenizer("byte")
    cfg = stream_cfg(path)
    state = build_loader(cfg, tok, dp_rank=0, dp_size=2).state_dict()
    with pytest.raises(UserError, match=r"2 data-parallel ranks, this run has 1.*streaming: false"):
        build_loader(cfg, tok).load_state_dict(state)


# -- mixture, eval, text files, cache --------------------------------------------------------------------


def test_mixture_weights(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", docs(120, prefix="A"))
    small = write_jsonl(tmp_path / "small.jsonl", docs(20, prefix="B"))
    tok = build_tokenizer("byte")
    cfg = make_cfg([SourceConfig(path=big, weight=1.0), SourceConfig(path=small, weight=3.0)], seq_len=8)
    loader = build_loader(cfg, tok)
    n_big, n_small = loader.sizes.tolist()
    assert n_big > 4 * n_small
    order = loader.order(0)
    from_small = int((order >= n_big).sum())
    assert from_small == round(0.75 * (n_big + n_small)) and len(order) == loader.epoch_size
    # the small source repeats only after all of its windows were used
    small_ids = order[order >= n_big]
    assert len(set(small_ids[:n_small].tolist())) <= n_small
    counts = np.bincount(small_ids - n_big, minlength=n_small)
    assert counts.max() - counts.min() <= 1
    assert np.array_equal(build_loader(cfg, tok).order(0), order)  # deterministic


def test_eval_loader_is_finite_and_restartable(corpus, tmp_path):
    _, path = corpus
    held_out = write_jsonl(tmp_path / "eval.jsonl", docs(30, seed=9))
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], eval_sources=[held_out], seq_len=16, batch=2, eval_steps=4)
    evals = [build_loader(cfg, tok, dp_rank=r, dp_size=2, split="eval") for r in range(2)]
    first = [[rows(b) for b in e] for e in evals]
    assert [len(f) for f in first] == [4, 4] and len(evals[0]) == 4
    again = [rows(b) for b in evals[0]]
    assert all(np.array_equal(a, b) for a, b in zip(first[0], again, strict=True))
    seen = [bytes(w.astype(np.uint16)) for f in first for batch in f for w in batch]
    assert len(set(seen)) == len(seen)  # ranks evaluate different windows


def test_text_files_are_one_document_each(tmp_path):
    folder = tmp_path / "src"
    (folder / "pkg" / "__pycache__").mkdir(parents=True)
    files = {"a.py": "def f():\n    return 1\n", "pkg/b.txt": "line one\nline two\n\nline three\n"}
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\x00\xff\xfe")
    (folder / ".hidden").write_text("secret")
    (folder / "logo.png").write_bytes(b"\x89PNG\xff")
    tok = build_tokenizer("byte")
    for path in (str(folder), str(folder / "**" / "*")):
        cfg = make_cfg([path], seq_len=4)
        entry = ensure_cached(cfg.data.sources[0], "data.sources.0", tok, cfg.data)
        assert entry.meta["num_docs"] == 2
        assert np.array_equal(np.asarray(entry.tokens), byte_stream([files["a.py"], files["pkg/b.txt"]]))


def entries(root) -> list:
    """The cache entries in a cache folder (beside them: `datasets`, datasets' own files)."""
    return [p for p in root.iterdir() if p.is_dir() and p.name != "datasets"]


def test_cache_is_reused_and_follows_file_changes(corpus, monkeypatch):
    texts, path = corpus
    tok = build_tokenizer("byte")
    cfg = make_cfg([path], seq_len=16)
    root = prepare(cfg)
    (entry,) = entries(root)
    meta, mtime = json.loads((entry / "meta.json").read_text()), (entry / "tokens.bin").stat().st_mtime_ns
    assert meta["num_tokens"] == len(byte_stream(texts)) and meta["num_docs"] == len(texts)

    def no_retokenizing(*a, **k):
        raise AssertionError("retokenized")

    monkeypatch.setattr(cache_mod, "_write_tokens", no_retokenizing)
    next(build_loader(cfg, tok))
    next(build_loader(make_cfg([path], seq_len=64), tok))  # seq_len is not part of the key
    assert (entry / "tokens.bin").stat().st_mtime_ns == mtime
    monkeypatch.undo()
    monkeypatch.setenv("MUONRUN_CACHE", str(root))
    write_jsonl(path, texts[:40])  # an edited file is a new cache entry
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert ensure_cached(cfg.data.sources[0], "k", tok, cfg.data).meta["num_docs"] == 40
    assert len(entries(root)) == 2


def test_a_killed_builders_temporary_folder_is_removed_by_the_next_build(corpus):
    """A builder killed mid-tokenization (SIGKILL, the OOM killer) leaves `.tmp-<entry>-<pid>-*`; the next
    build of that entry, holding its lock, removes it. Other entries' folders are left alone."""
    _, path = corpus
    cfg = make_cfg([path])
    root = cache_mod.cache_root(cfg.data)
    tok = build_tokenizer("byte")
    src = cfg.data.sources[0]
    files = cache_mod.resolve_files(src, "data.sources.0")
    final = cache_mod.entry_dir(root, src, cache_mod.cache_key(src, tok, files))
    root.mkdir(parents=True, exist_ok=True)
    stale, other = root / f".tmp-{final.name}-99999-deadbeef", root / ".tmp-another-entry-99999-deadbeef"
    for folder in (stale, other):
        folder.mkdir()
        (folder / "tokens.bin").write_bytes(b"half")
    entry = ensure_cached(src, "data.sources.0", tok, cfg.data)
    assert entry.path == final and not stale.exists() and other.exists()


def _build_in_child(cfg, queue):
    entry = ensure_cached(cfg.data.sources[0], "data.sources.0", build_tokenizer("byte"), cfg.data)
    queue.put(str(entry.path))


def test_concurrent_builds_make_one_entry(corpus):
    import multiprocessing as mp

    _, path = corpus
    cfg = make_cfg([path])
    ctx = mp.get_context("fork")  # children inherit the private caches patched in above
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(cfg, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    paths = {queue.get(timeout=5) for _ in procs}
    root = cache_mod.cache_root(cfg.data)
    assert len(paths) == 1 and [p.name for p in entries(root)] == [os.path.basename(paths.pop())]


# -- user errors --------------------------------------------------------------------------------------------


def expect_error(cfg, match, tok="byte"):
    with pytest.raises(UserError, match=match):
        build_loader(cfg, build_tokenizer(tok))


def test_missing_paths(tmp_path):
    expect_error(make_cfg([str(tmp_path / "nope.jsonl")]), r"data.sources.0.path.*does not exist")
    expect_error(make_cfg([str(tmp_path / "*.parquet")]), r"data.sources.0.path.*matches no readable files")
    (tmp_path / "empty").mkdir()
    expect_error(make_cfg([str(tmp_path / "empty")]), r"folder .* holds no readable files")
    with pytest.raises(UserError, match=r"data.sources.0.path.*does not exist"):
        check_data(make_cfg([str(tmp_path / "nope.jsonl")]))


def test_pipes_and_devices_in_a_data_folder_are_skipped_naming_them_and_refused_when_named_alone(
    tmp_path, capsys
):
    """Opening a FIFO waits for a writer forever: the rank building the cache would block, the others wait
    on its lock, and no stop request gets through."""
    from muonrun.data.sources import resolve_files

    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", docs(50))
    os.mkfifo(folder / "b.jsonl")
    for path in (str(folder), str(folder / "*.jsonl")):
        key = f"data.sources.{len(path)}"  # each its own key: said once per source
        assert resolve_files(SourceConfig(path=path), key) == [str(folder / "a.jsonl")]
        said = " ".join(capsys.readouterr().err.split())
        assert (
            f"{key}.path: skipping '{folder / 'b.jsonl'}', a named pipe (FIFO): muonrun reads regular" in said
        )
    assert next(build_loader(make_cfg([str(folder)]), build_tokenizer("byte")))  # trains on the rest
    expect_error(
        make_cfg([str(folder / "b.jsonl")]), r"is a named pipe \(FIFO\), not a file muonrun can read"
    )


def test_empty_and_too_short(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    expect_error(make_cfg([str(tmp_path / "empty.jsonl")]), r"data.sources.0.*no documents")
    short = write_jsonl(tmp_path / "short.jsonl", ["tiny"])
    expect_error(make_cfg([short], seq_len=16), r"data.sources.0.*5 tokens, fewer than one window.*seq_len")
    stream = make_cfg([SourceConfig(path=str(tmp_path / "empty.jsonl"), streaming=True)])
    expect_error(stream, r"data.sources.0.*no documents")


def test_missing_text_field_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", docs(5), field="body")
    match = r"data.sources.0.text_field.*'text'.*columns are: body, id"
    expect_error(make_cfg([path]), match)
    with pytest.raises(UserError, match=match):
        check_data(make_cfg([path]))
    expect_error(make_cfg([SourceConfig(path=path, streaming=True)]), match)
    assert next(build_loader(make_cfg([SourceConfig(path=path, text_field="body")]), build_tokenizer("byte")))


def test_undecodable_text_names_the_file(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfe rest")
    expect_error(make_cfg([str(tmp_path / "*.txt")]), r"bad\.txt' is not valid UTF-8")


def test_bad_weight_split_and_offline_hub(tmp_path, corpus):
    _, path = corpus
    with pytest.raises(UserError, match=r"data.sources.0.weight.*positive"):  # the config refuses it
        make_cfg([SourceConfig(path=path, weight=0)])
    with pytest.raises(UserError, match=r"data.eval_sources.0.weight.*positive"):
        make_cfg([path], eval_sources=[SourceConfig(path=path, weight=-1)])
    expect_error(make_cfg([SourceConfig(path=path, split="validation")]), r"data.sources.0.split")
    for streaming in (False, True):
        hub = make_cfg(
            [path], eval_sources=[SourceConfig(path="no-such-org/no-such-data", streaming=streaming)]
        )
        with pytest.raises(UserError, match=r"data.eval_sources.0.path.*Hub.*HF_HUB_OFFLINE"):
            build_loader(hub, build_tokenizer("byte"), split="eval")
    with pytest.raises(UserError, match=r"data.eval_sources.0.path.*HF_HUB_OFFLINE"):
        check_data(hub)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match=r"data.tokenizer.*no-such-org/tok.*HF_HUB_OFFLINE.*local folder"):
        build_tokenizer("no-such-org/tok")
    (tmp_path / "broken").mkdir()
    with pytest.raises(UserError, match=r"data.tokenizer.*folder.*cannot load it"):
        build_tokenizer(str(tmp_path / "broken"))


# -- bad records, empty files, progress bars ------------------------------------------------------------------


def write_lines(path, records) -> str:
    """One JSON value per line; a str is written as the line itself."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def mixed_records(n=40):
    """n records, every 5th bad (alternately no 'text' field and 'text': null); returns (records, good)."""
    records, good = [], []
    for i, text in enumerate(docs(n, seed=3)):
        if i % 5 == 1:
            records.append({"title": text} if i % 10 == 1 else {"text": None})
        else:
            records.append({"text": text})
            good.append(text)
    return records, good


def bad_cfg(path, streaming=False, skip=False, **kw):
    kw.setdefault("seq_len", 8)
    kw.setdefault("shuffle_buffer", 7)
    return make_cfg([SourceConfig(path=path, streaming=streaming)], skip_bad_records=skip, **kw)


@pytest.mark.parametrize("streaming", [False, True])
def test_records_missing_the_text_field_fail_naming_file_and_record(tmp_path, streaming):
    records, _ = mixed_records()
    path = write_lines(tmp_path / "mixed.jsonl", ["", *records])  # a blank line first: lines != records
    with pytest.raises(UserError) as e:
        next(build_loader(bad_cfg(path, streaming), build_tokenizer("byte")))  # streaming: as a block is read
    msg = str(e.value)
    assert f"line 3 of '{path}' has no 'text' field (its fields: title)" in msg
    assert "data.sources.0.text_field" in msg and "data.skip_bad_records=true" in msg
    if not streaming:  # map-style sources count them all before tokenizing
        assert "8 of its 40 records have a 'text' that is missing, null or not a string" in msg
        with pytest.raises(UserError, match="line 3 of"):
            prepare(bad_cfg(path))


def test_a_null_text_is_named_too(tmp_path):
    path = write_lines(tmp_path / "n.jsonl", [{"text": "fine"}, {"text": "ok"}, {"text": None}])
    for streaming in (False, True):
        with pytest.raises(
            UserError, match=rf"line 3 of '{path}' has 'text': null.*data.sources.0.text_field"
        ):
            next(build_loader(bad_cfg(path, streaming, seq_len=2), build_tokenizer("byte")))


def test_skip_bad_records_map_style(tmp_path, capsys):
    records, good = mixed_records()
    path = write_lines(tmp_path / "mixed.jsonl", records)
    tok = build_tokenizer("byte")
    cfg = bad_cfg(path, skip=True, shuffle=False)
    entry = ensure_cached(cfg.data.sources[0], "data.sources.0", tok, cfg.data)
    assert np.array_equal(np.asarray(entry.tokens), byte_stream(good))  # exactly the good records
    meta = entry.meta
    assert (meta["num_records"], meta["skipped_records"], meta["num_docs"]) == (40, 8, 32)
    line = (
        f"muonrun: skipped 8 of 40 records of data.sources.0 ({path}) whose 'text' is missing, null or not a "
        "string (data.skip_bad_records=true)"
    )
    assert capsys.readouterr().out.splitlines().count(line) == 1  # beside it: the "tokenizing" line
    served = np.concatenate(take(build_loader(cfg, tok), 3)).reshape(-1)
    assert np.array_equal(served, byte_stream(good)[: len(served)])
    # the entry built while skipping is not used silently by a run that does not skip
    with pytest.raises(UserError, match=r"line 2 of .*8 of its 40 records.*data.skip_bad_records"):
        build_loader(bad_cfg(path), tok)
    with pytest.raises(UserError, match=r"line 2 of .*data.skip_bad_records"):
        check_data(bad_cfg(path))
    check_data(cfg)  # fine with the switch on


def test_skip_bad_records_reported_once_per_process_and_rank_0_only(tmp_path, capsys):
    records, _ = mixed_records()
    path = write_lines(tmp_path / "mixed.jsonl", records)
    tok = build_tokenizer("byte")
    cfg = bad_cfg(path, skip=True)
    build_loader(cfg, tok, dp_rank=1, dp_size=2)
    assert "skipped" not in capsys.readouterr().out
    build_loader(cfg, tok, dp_rank=0, dp_size=2)
    build_loader(cfg, tok, dp_rank=0, dp_size=2)
    assert capsys.readouterr().out.count("skipped 8 of 40 records") == 1


def test_skip_bad_records_streaming(tmp_path, capsys):
    records, good = mixed_records()
    path = write_lines(tmp_path / "mixed.jsonl", records)
    tok = build_tokenizer("byte")
    cfg = bad_cfg(path, streaming=True, skip=True, shuffle=False, batch=1)  # blocks of 7 records
    loader = build_loader(cfg, tok)
    first = np.concatenate(take(loader, 2)).reshape(-1)
    out = capsys.readouterr().out
    assert "skipping records of data.sources.0" in out and "2 of the first 7 read" in out
    stream = byte_stream(good)
    n = len(stream) // 9
    rest = np.concatenate(take(loader, n - 2)).reshape(-1)  # through the end of the first pass
    assert np.array_equal(np.concatenate([first, rest]), stream[: n * 9])
    out = capsys.readouterr().out
    assert f"muonrun: skipped 8 of 40 records of data.sources.0 ({path}) whose 'text' is missing" in out
    take(loader, n)  # a second pass reports nothing new
    assert capsys.readouterr().out == ""


def test_a_value_of_the_wrong_type(tmp_path, capsys):
    path = write_lines(tmp_path / "wrongtype.jsonl", [{"text": 5}, {"text": "ok, a string"}, {"text": ["a"]}])
    tok = build_tokenizer("byte")
    match = (
        rf"line 1 of '{path}' has 'text': 5, a number where a string was expected.*data.sources.0.text_field"
    )
    assert "Json" not in match
    for streaming in (False, True):
        with pytest.raises(UserError, match=match) as e:
            build_loader(bad_cfg(path, streaming, seq_len=2), tok)
        assert "Json(" not in str(e.value) and "data.skip_bad_records" in str(e.value)
    with pytest.raises(UserError, match=match):
        check_data(bad_cfg(path))  # the first record is checked before workers start
    entry = ensure_cached(SourceConfig(path=path), "data.sources.0", tok, bad_cfg(path, skip=True).data)
    assert np.array_equal(np.asarray(entry.tokens), byte_stream(["ok, a string"]))
    assert "skipped 2 of 3 records" in capsys.readouterr().out
    served = rows(next(build_loader(bad_cfg(path, True, True, seq_len=2, shuffle=False), tok)))
    assert bytes(served.reshape(-1)[:4].astype(np.uint8)) == b"ok, "


def test_no_string_text_at_all(tmp_path):
    path = write_lines(tmp_path / "ints.jsonl", [{"text": 1}, {"text": 2}])
    for streaming in (False, True):
        for skip in (False, True):
            if streaming and not skip:
                match = r"line 1 of .* has 'text': 1"
            elif streaming:
                match = r"all 2 records read .*nothing to train on.*data.sources.0.text_field"
            else:
                match = r"none of its 2 records has a string in 'text'.*line 1 of .*data.sources.0.text_field"
            with pytest.raises(UserError, match=match):
                next(build_loader(bad_cfg(path, streaming, skip), build_tokenizer("byte")))


def test_bad_records_in_parquet_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": ["first doc", "second", None, "fourth"]}), path)
    with pytest.raises(
        UserError, match=rf"record 3 of '{path}' \(counting from 1\) has 'text': null; 1 of its 4"
    ):
        build_loader(bad_cfg(path, seq_len=2), build_tokenizer("byte"))
    entry = ensure_cached(
        SourceConfig(path=path), "k", build_tokenizer("byte"), bad_cfg(path, skip=True).data
    )
    assert np.array_equal(np.asarray(entry.tokens), byte_stream(["first doc", "second", "fourth"]))


def test_a_text_of_another_type_in_a_later_file_is_not_trained_on_as_json(tmp_path):
    """datasets settles the column's type from the first file (its first 10 MB); a later list makes it
    write every later text as JSON ('"c"' for "c"), or stop reading. Both are caught, naming the record."""
    folder = tmp_path / "d"
    folder.mkdir()
    write_lines(folder / "a.jsonl", [{"text": t} for t in docs(30)])
    bad = write_lines(folder / "b.jsonl", [{"text": "c"}, {"text": ["x", "y"]}, {"text": "last"}])
    cause = rf"line 2 of '{bad}', which has 'text': \[\"x\", \"y\"\], a list where a string was expected"
    for streaming in (False, True):
        for skip in (False, True):
            cfg = bad_cfg(str(folder), streaming, skip=skip, seq_len=2, shuffle=False, shuffle_buffer=100)
            with pytest.raises(UserError, match=rf"read its JSON files wrongly: .*{cause}.*jq -c") as e:
                next(build_loader(cfg, build_tokenizer("byte")))
            assert "skip_bad_records cannot skip it" in str(e.value)
    # a blank line in the later file makes datasets' reader fail instead: the same record is named
    write_lines(folder / "b.jsonl", ["", {"text": "c"}, {"text": ["x", "y"]}])
    cause = cause.replace("line 2", "line 3")
    for streaming in (False, True):
        with pytest.raises(UserError, match=rf"could not read its JSON files .*{cause}"):
            next(
                build_loader(
                    bad_cfg(str(folder), streaming, seq_len=2, shuffle_buffer=100), build_tokenizer("byte")
                )
            )


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = write_lines(tmp_path / "broken.jsonl", [{"text": "a"}, '{"text": "b"', {"text": "c"}])
    for streaming in (False, True):
        with pytest.raises(UserError, match=rf"line 2 of '{path}' is not JSON \(Expecting"):
            check_data(bad_cfg(path, streaming))
        with pytest.raises(UserError, match=rf"line 2 of '{path}' is not JSON"):
            next(build_loader(bad_cfg(path, streaming, seq_len=2), build_tokenizer("byte")))


def test_a_line_that_is_json_but_not_an_object_is_named(tmp_path):
    first = write_lines(tmp_path / "arrays.jsonl", [["a", "b"], ["c"]])  # starts like one JSON array
    later = write_lines(tmp_path / "later.jsonl", [{"text": "a"}, {"text": "b"}, ["c"]])
    for path, line in ((first, 1), (later, 3)):
        for streaming in (False, True):
            with pytest.raises(UserError, match=rf"line {line} of '{path}' is not an object \(\["):
                check_data(bad_cfg(path, streaming))


def test_datasets_own_files_go_under_the_data_cache(corpus, tmp_path):
    """datasets' Arrow copy of a local source and its locks: under data.cache_dir, not in datasets'
    default cache (HF_DATASETS_CACHE, pointed at tmp_path/hf-datasets by the autouse fixture)."""
    _, path = corpus
    cache = tmp_path / "cache"
    for streaming in (False, True):
        cfg = make_cfg([SourceConfig(path=path, streaming=streaming)], cache_dir=str(cache))
        check_data(cfg)
        next(build_loader(cfg, build_tokenizer("byte")))
    prepare(make_cfg([path], cache_dir=str(cache)))
    assert not (tmp_path / "hf-datasets").exists()
    assert any((cache / "datasets").iterdir())


def test_quoted_texts_are_fine(tmp_path):
    texts = ['"To be, or not to be"', '"Quoted"', "plain"]
    path = write_lines(tmp_path / "q.jsonl", [{"text": t} for t in texts])
    for streaming in (False, True):
        cfg = bad_cfg(path, streaming, seq_len=2, shuffle=False, batch=1)
        got = np.concatenate(take(build_loader(cfg, build_tokenizer("byte")), 10)).reshape(-1)
        assert np.array_equal(got, byte_stream(texts)[: len(got)])


def test_empty_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    match = rf"data.sources.0' .*has no documents: the file '{empty}' is empty"
    for streaming in (False, True):
        cfg = bad_cfg(str(empty), streaming)
        with pytest.raises(UserError, match=match) as e:
            check_data(cfg)
        assert "StopIteration" not in str(e.value)
        with pytest.raises(UserError, match=match):
            build_loader(cfg, build_tokenizer("byte"))
    with pytest.raises(UserError, match=match):
        prepare(bad_cfg(str(empty)))
    blank = write_lines(tmp_path / "blank.jsonl", ["", "  "])
    for streaming in (False, True):
        with pytest.raises(UserError, match=rf"the file '{blank}' holds no records"):
            build_loader(bad_cfg(blank, streaming), build_tokenizer("byte"))
    # an empty file next to others is no error: it adds no records
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "empty.jsonl").write_text("")
    texts = docs(20)
    write_jsonl(tmp_path / "d" / "full.jsonl", texts)
    for streaming in (False, True):
        check_data(bad_cfg(str(tmp_path / "d"), streaming))
        assert next(build_loader(bad_cfg(str(tmp_path / "d"), streaming), build_tokenizer("byte")))


def test_progress_bars_stay_out_of_log_files(tmp_path, capfd, monkeypatch):
    import datasets

    from muonrun.data.sources import quiet_progress_bars

    path = write_jsonl(tmp_path / "c.jsonl", docs(50))
    datasets.enable_progress_bars()
    cfg = bad_cfg(path)
    check_data(cfg)
    prepare(cfg)
    next(build_loader(bad_cfg(path, streaming=True), build_tokenizer("byte")))
    out, err = capfd.readouterr()  # stderr is not a terminal here
    assert not datasets.is_progress_bar_enabled()
    for text in (out, err):
        assert "examples/s" not in text and "Tokenizing" not in text and "Generating" not in text
        assert "\r" not in text and "%|" not in text

    class Terminal:
        def isatty(self):
            return True

        def write(self, s):
            return len(s)

        def flush(self):
            pass

    datasets.enable_progress_bars()
    monkeypatch.setattr("sys.stderr", Terminal())
    quiet_progress_bars()
    assert datasets.is_progress_bar_enabled()  # a terminal keeps them
    datasets.disable_progress_bars()


def test_cli_prepare_missing_text_field_exits_2_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from muonrun.cli import app

    records, _ = mixed_records()
    path = write_lines(tmp_path / "mixed.jsonl", records)
    args = ["prepare", "tiny", f"data.sources.0.path={path}", "data.eval_sources=[]", "train.eval_interval=0"]
    args.append(f"data.cache_dir={tmp_path / 'cache'}")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    squashed = "".join(result.output.split())  # the console wraps lines (even inside the path)
    for part in (
        f"line 2 of '{path}' has no 'text' field",
        "data.sources.0.text_field",
        "data.skip_bad_records=true",
    ):
        assert "".join(part.split()) in squashed, result.output
    result = CliRunner().invoke(app, [*args, "data.skip_bad_records=true", "data.seq_len=8"])
    assert result.exit_code == 0, result.output
    assert "skipped 8 of 40 records" in " ".join(result.output.split())


def test_a_token_cache_that_cannot_be_written_exits_2_before_anything_runs(tmp_path):
    """data.cache_dir under a file (or not writable): named by prepare and by pretrain before any worker
    starts, and nothing is created."""
    from typer.testing import CliRunner

    from muonrun.cli import app

    (tmp_path / "afile").write_text("")
    for command, cache in (("prepare", tmp_path / "afile"), ("pretrain", tmp_path / "afile" / "sub")):
        args = [
            command,
            "tiny",
            f"data.cache_dir={cache}",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
        ]
        result = CliRunner().invoke(app, args)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"The token cache '{cache}' cannot be used" in text and "Set data.cache_dir" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
