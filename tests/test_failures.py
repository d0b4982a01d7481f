"""Nothing hangs without saying so: a rank that stalls stops the job after launch.collective_timeout_s,
named in one paragraph, with nothing half-written left; a stop request during data preparation (which
can take hours, and cannot be saved) stops every worker within seconds. Both on CPU, 2 gloo workers,
with MUONRUN_FAULT drills: hang@STEP:rN (rank N's step lasts until a stop request) and hang@prepare."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_env, pretrain, steps_of

from muonrun.launch.stall import is_timeout, stall_message


def test_a_timed_out_collective_is_told_from_other_failures():
    gloo = RuntimeError(
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"
    )
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = gloo
    assert is_timeout(gloo) and is_timeout(wrapped)
    assert not is_timeout(RuntimeError("Connection reset by peer")) and not is_timeout(
        OSError("Read timed out")
    )
    assert "ranks 1, 3 never joined it: they stalled" in stall_message([1, 3], 60)
    assert "every rank timed out waiting" in stall_message([], 60)


@pytest.mark.slow
def test_a_rank_that_stalls_stops_the_job_after_the_timeout_naming_it_and_publishes_nothing_of_the_step(
    tmp_path,
):
    out = tmp_path / "run"
    # rank 1's step 4 lasts until a stop request; rank 0 goes on into step 4's save and waits there
    result = pretrain(out, "checkpoint.interval=2", "launch.collective_timeout_s=5", fault="hang@4:r1")
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, text[-3000:]
    assert (
        "A collective waited launch.collective_timeout_s=5 s for every rank and timed out: rank 1 never"
        in text
    )
    assert text.count("A collective waited") == 1 and "Traceback" not in text
    # step 4's save never published: at most its step-4.tmp, which loading ignores and the next run deletes
    assert steps_of(out) == [2] and {p.name for p in (out / "checkpoints").iterdir()} <= {
        "step-2",
        "step-4.tmp",
    }


@pytest.mark.slow
def test_a_stop_request_during_data_preparation_stops_every_worker_within_seconds(tmp_path):
    """The rank that tokenizes waits (hang@prepare) and the other waits on the cache's lock: SIGTERM to the
    launcher stops both, says so once, exits 0 and leaves no half-built cache entry."""
    data, cache, out = tmp_path / "data", tmp_path / "cache", tmp_path / "run"
    data.mkdir()
    for f in sorted(Path(shutil.__file__).parent.glob("json/*.py")):
        shutil.copy(f, data / f.name)
    log = tmp_path / "launch.log"
    env = {**cli_env("hang@prepare"), "MUONRUN_CACHE": str(cache)}
    args = [
        f"output_dir={out}",
        "data.seq_len=64",
        f"data.sources=[{{path: {data}}}]",
        "data.eval_sources=[]",
    ]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "muonrun", "pretrain", "tiny", *args, "train.eval_interval=0", "--nproc-per-node", "2"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        # the tokenizing rank (whichever won the cache's lock; only rank 0 logs) has made its temporary entry
        deadline = time.monotonic() + 240
        while not (cache.is_dir() and any(p.name.startswith(".tmp-") for p in cache.iterdir())):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # both workers in: one tokenizing, one at the lock
        launcher.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        code = launcher.wait(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    text = " ".join(log.read_text().split())
    assert code == 0 and took < 30, (code, took, text[-3000:])
    assert text.count("got SIGTERM while preparing the data: stopped before the first step") == 1, text[
        -3000:
    ]
    assert "Traceback" not in text and not (out / "checkpoints").exists()
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")]
