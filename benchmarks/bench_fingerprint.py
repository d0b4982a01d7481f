"""What a data source's identity costs at each start (muonrun/data/identity.py): the sampled-block
fingerprint of one large file, read cold (its pages dropped from the page cache first) and warm, beside
a full SHA-256 of the same file.

    python benchmarks/bench_fingerprint.py /path/to/big.file      # e.g. head -c 2000000000 /dev/urandom > big.file
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

from muonrun.data.identity import sampled_sha256


def file_fingerprint(path: str) -> str:
    return sampled_sha256(path, os.path.getsize(path))


def drop_cached(path: str) -> None:
    """Ask the kernel to forget the file's cached pages (written data must be on disk: `sync` first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def seconds(fn, path: str, cold: bool, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if cold:
            drop_cached(path)
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def full_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    size = os.path.getsize(args.file) / 1e9
    cold = seconds(file_fingerprint, args.file, True, args.repeat)
    warm = seconds(file_fingerprint, args.file, False, args.repeat)
    full = seconds(full_sha256, args.file, True, 1)
    print(
        f"{size:.2f} GB: fingerprint {cold * 1e3:.1f} ms cold, {warm * 1e3:.2f} ms warm (median of "
        f"{args.repeat}); full SHA-256 {full:.1f} s cold"
    )


if __name__ == "__main__":
    main()
