"""SLURM environment -> launch settings, host lists, dp_replicate=-1, and mesh errors before any worker starts.

Fast and in-process; tests/test_cluster.py runs the real multi-node launches.
"""

import pytest
from typer.testing import CliRunner

from muonrun.cli import app
from muonrun.config import PRESET_DIR, load_config
from muonrun.distributed import mesh_shape
from muonrun.errors import UserError
from muonrun.launch.slurm import expand_hostlist, hostnames, launch_defaults

runner = CliRunner()

STEP = {  # what srun --ntasks-per-node=1 sets on the second node of a 2-node job
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x1, y[2,4] ,z", ["x1", "y2", "y4", "z"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1", "node[a-b]"])
def test_expand_hostlist_rejects_malformed_lists(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_hostnames_prefers_scontrol_and_falls_back(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo head-from-scontrol && echo other\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert hostnames("gpu[07-08]") == ["head-from-scontrol", "other"]
    fake.write_text("#!/bin/sh\nexit 1\n")  # a broken scontrol: the parser answers
    assert hostnames("gpu[07-08]") == ["gpu07", "gpu08"]


def test_job_step_maps_to_launch_settings(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the parser expands the list
    assert launch_defaults(STEP) == {
        "launch.nnodes": 2,
        "launch.node_rank": 1,
        "launch.rdzv_endpoint": "gpu07:29500",
        "launch.rdzv_id": "4242",
    }
    env = {**STEP, "MUONRUN_RDZV_PORT": "31000", "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_STEP_ID": ""}
    env["SLURM_STEPID"] = "1"  # older SLURM spelling
    assert launch_defaults(env)["launch.rdzv_endpoint"] == "n3:31000"
    # Older SLURM without SLURM_STEP_NUM_NODES / SLURM_STEP_NODELIST: the job's values.
    old = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP_N")}
    assert launch_defaults(old)["launch.nnodes"] == 2
    assert launch_defaults(old)["launch.rdzv_endpoint"] == "gpu07:29500"
    # One node: no fixed port (a free local one, as outside SLURM).
    one = {**STEP, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0"}
    assert launch_defaults(one) == {"launch.nnodes": 1, "launch.node_rank": 0, "launch.rdzv_id": "4242"}


def test_outside_a_job_step_slurm_is_ignored(capsys):
    assert launch_defaults({}) == {}
    batch_shell = {k: v for k, v in STEP.items() if "STEP" not in k}  # sbatch's shell: no srun step
    assert launch_defaults(batch_shell) == {}
    assert "not an srun step" in capsys.readouterr().err


def test_several_tasks_per_node_is_a_user_error():
    with pytest.raises(UserError, match="ONE task per node"):
        launch_defaults({**STEP, "SLURM_STEP_NUM_TASKS": "16"})


def test_precedence_slurm_below_preset_overrides_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = launch_defaults(STEP)
    c = load_config("tiny", [], environment=env)
    assert (c.launch.nnodes, c.launch.node_rank, c.launch.rdzv_endpoint, c.launch.rdzv_id) == (
        2,
        1,
        "gpu07:29500",
        "4242",
    )
    preset = tmp_path / "p.yaml"
    preset.write_text(f"defaults: [{PRESET_DIR / 'tiny.yaml'}]\nlaunch:\n  rdzv_id: from-config\n")
    c = load_config(str(preset), ["launch.node_rank=0"], environment=env)
    assert c.launch.rdzv_id == "from-config" and c.launch.node_rank == 0 and c.launch.nnodes == 2


def test_cli_flags_beat_slurm_in_a_dry_run(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(app, ["pretrain", "tiny", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "world size 4 (mesh dp_replicate=1 x dp_shard=4), 2 nodes x 2" in " ".join(result.output.split())
    result = runner.invoke(app, ["pretrain", "tiny", "--dry-run", "--nnodes", "1", "--node-rank", "0"])
    assert result.exit_code == 0, result.output
    assert "world size 2 (mesh dp_replicate=1 x dp_shard=2)" in " ".join(result.output.split())


def test_dp_replicate_minus_one_is_one_replica_per_node():
    c = load_config("tiny", ["parallel.dp_replicate=-1", "launch.nnodes=4", "launch.rdzv_endpoint=h:1"])
    assert mesh_shape(c, 32) == (4, 8)
    with pytest.raises(UserError, match=r"dp_replicate=-1 \(one per node: 4\)"):
        mesh_shape(c, 6)
    result = runner.invoke(
        app, ["pretrain", "qwen2-muon-fsdp2", "--dry-run", "--world-size", "256", "--nnodes", "32",
              "parallel.dp_replicate=-1"]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "dp_replicate=32 x dp_shard=8), 32 nodes x 8" in out
    assert "activations/rank (rough)" in out and "tokens/step 8,388,608" in out


def test_launcher_rejects_a_mesh_that_does_not_fit_before_any_worker_starts():
    result = runner.invoke(app, ["pretrain", "tiny", "parallel.dp_replicate=3", "--nproc-per-node", "2"])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "does not fit a world of 2 workers (1 node(s) x 2 workers per node)" in out
    assert "Traceback" not in result.output and "step" not in out


def test_world_size_without_dry_run_is_refused():
    result = runner.invoke(app, ["pretrain", "tiny", "--world-size", "8"])
    assert result.exit_code == 2 and "--dry-run" in result.output


def test_an_explicit_endpoint_means_the_node_list_is_never_read(monkeypatch):
    """The documented order is SLURM < preset < overrides < flags: with --rdzv-endpoint or an override of
    launch.rdzv_endpoint, a node list muonrun cannot read does not refuse the run; without one it does."""
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the list is parsed here
    for key, value in {**STEP, "SLURM_STEP_NODELIST": "node[01-02"}.items():
        monkeypatch.setenv(key, value)
    for given in (["--rdzv-endpoint", "head:29400"], ["launch.rdzv_endpoint=head:29400"]):
        result = runner.invoke(app, ["pretrain", "tiny", "--dry-run", *given])
        assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["pretrain", "tiny", "--dry-run"])
    assert result.exit_code == 2 and "node list 'node[01-02' cannot be read" in result.output, result.output
