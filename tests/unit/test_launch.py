"""Launchers: SLURM variables -> torchrun flags (pure function), and the thin shell scripts
run for real against stand-in `torchrun` / `srun` executables that print their arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_snip.launcher import expand_nodelist, nproc_per_node, torchrun_command

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
SLURM = {"SLURM_JOB_NODELIST": "node[01-04]", "SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "123456"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("node[01-03,07],gpu-a1", ["node01", "node02", "node03", "node07", "gpu-a1"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("a7,b[3]", ["a7", "b3"]),
    ("login", ["login"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-04", "node01-04]", "node[4-1]", "node[a-b]", "n[1],,m", "n[[1]]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad)


def test_torchrun_command_from_slurm_variables():
    overrides = ["training.max_steps=10", "training.run_dir=runs/a b"]
    cmd = torchrun_command(SLURM, "launch/configs/llama_70b.toml", overrides)
    # srun runs the torchrun of this environment ($PYTHON), not the first one on the nodes' PATH;
    # resume=auto comes first so that a requeued/restarted job continues (and an override wins).
    assert cmd == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=node01:{15000 + 123456 % 15000}", "--rdzv_id=123456", "--max-restarts=3",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=240",
        "-m", "megatron_snip.train", "--config", "launch/configs/llama_70b.toml", "--set", "training.resume=auto",
        "--set", "training.max_steps=10", "--set", "training.run_dir=runs/a b",
    ]
    cmd = torchrun_command({**SLURM, "MAX_RESTARTS": "0", "SHUTDOWN_TIMEOUT": "60"}, "c.toml")
    assert "--max-restarts=0" in cmd and "--shutdown-timeout=60" in cmd
    with pytest.raises(ValueError, match=r"MAX_RESTARTS='-1' must be a non-negative integer"):
        torchrun_command({**SLURM, "MAX_RESTARTS": "-1"}, "c.toml")


def test_port_override_and_older_variable_names():
    env = {"SLURM_NODELIST": "g[7-8]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:4",
           "SLURM_JOB_ID": "9", "MASTER_PORT": "29500"}
    cmd = torchrun_command(env, "c.toml")
    assert "--nnodes=2" in cmd and "--nproc_per_node=4" in cmd and "--rdzv_endpoint=g7:29500" in cmd
    with pytest.raises(ValueError, match="MASTER_PORT"):
        torchrun_command({**env, "MASTER_PORT": "80"}, "c.toml")


def test_processes_per_node_precedence():
    assert nproc_per_node({"NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"}) == 2  # explicit override wins
    assert nproc_per_node({"SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"}) == 8
    assert nproc_per_node({"SLURM_GPUS_PER_NODE": "gpu:h200:8"}) == 8
    assert nproc_per_node({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4  # CPU-only allocation
    with pytest.raises(ValueError, match="NPROC_PER_NODE"):
        nproc_per_node({})
    with pytest.raises(ValueError, match="SLURM_GPUS_ON_NODE"):
        nproc_per_node({"SLURM_GPUS_ON_NODE": "0"})


@pytest.mark.parametrize("change, match", [
    ({"SLURM_NNODES": "3"}, "does not match"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST"),
])
def test_inconsistent_allocation_is_an_error(change, match):
    with pytest.raises(ValueError, match=match):
        torchrun_command({**SLURM, **change}, "c.toml")


def test_override_must_be_dotted_assignment():
    with pytest.raises(ValueError, match="section.field=value"):
        torchrun_command(SLURM, "c.toml", ["training.max_steps"])


# --- the shell scripts -------------------------------------------------------------------
@pytest.mark.parametrize("script", [TORCHRUN_SH, SBATCH])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH directory whose `torchrun` and `srun` print one argument per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "srun"):
        exe = bin_dir / name
        exe.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" {name} "$@"\n')
        exe.chmod(0o755)
    return bin_dir


def _run(script, args, fake_bin, **env):
    base = {k: v for k, v in os.environ.items() if k != "NPROC" and not k.startswith(("SLURM_", "MASTER_"))}
    full_env = {**base, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
                "PYTHONPATH": str(REPO), **env}
    return subprocess.run(["bash", str(script), *args], check=False, cwd=REPO, env=full_env, capture_output=True, text=True)


def test_torchrun_sh_passes_config_and_overrides_through(fake_bin):
    res = _run(TORCHRUN_SH, ["4", "launch/configs/tiny.toml", "--set", "parallel.tp=2", "--dry-run"], fake_bin)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=4",
                                       "--max-restarts=0", "-m", "megatron_snip.train", "--config",
                                       "launch/configs/tiny.toml", "--set", "training.resume=auto",
                                       "--set", "parallel.tp=2", "--dry-run"]
    res = _run(TORCHRUN_SH, ["launch/configs/tiny.toml"], fake_bin, MAX_RESTARTS="2")
    assert "--max-restarts=2" in res.stdout.splitlines()
    res = _run(TORCHRUN_SH, ["launch/configs/tiny.toml"], fake_bin, NPROC="2")
    assert "--nproc_per_node=2" in res.stdout.splitlines()
    res = _run(TORCHRUN_SH, ["launch/configs/tiny.toml"], fake_bin, NPROC="zero")
    assert res.returncode == 2 and "NPROC" in res.stderr


def test_sbatch_starts_one_torchrun_per_node(fake_bin):
    slurm = {**SLURM, "SLURM_CPUS_ON_NODE": "96", "SLURM_SUBMIT_DIR": str(REPO)}
    res = _run(SBATCH, ["launch/configs/llama_70b.toml", "--set", "training.max_steps=5"], fake_bin, **slurm)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    argv = lines[lines.index("srun"):]
    expected = torchrun_command(SLURM, "launch/configs/llama_70b.toml", ["training.max_steps=5"])
    # The launcher's interpreter is this one, but its sys.executable is spelled as that process
    # computed it: `<checkout>/../venv/bin/python -m pytest` here is `<venv>/bin/python` there
    # (issue #36). The same file is what must match, not the spelling.
    assert os.path.realpath(argv[5]) == os.path.realpath(expected[0]), (argv[5], expected[0])
    assert argv[:5] + argv[6:] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=96",
                                   "--kill-on-bad-exit=1", *expected[1:]]


def test_sbatch_stops_on_a_bad_allocation(fake_bin):
    res = _run(SBATCH, ["launch/configs/llama_70b.toml"], fake_bin, **{**SLURM, "SLURM_NNODES": "3"})
    assert res.returncode == 2 and "does not match" in res.stderr and "srun" not in res.stdout
    res = _run(SBATCH, ["launch/configs/missing.toml"], fake_bin, **SLURM)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_sbatch_forwards_the_time_limit_warning_and_requeues(tmp_path, fake_bin):
    # srun stand-in: runs until it gets SIGUSR1 (what the workers' checkpoint-and-exit looks like
    # from here), then exits 75; scontrol stand-in prints its arguments.
    (fake_bin / "srun").write_text('#!/usr/bin/env bash\ntrap \'echo srun-got-USR1; exit 75\' USR1\n'
                                   'echo srun-started\nwhile true; do sleep 0.1; done\n')
    (fake_bin / "scontrol").write_text('#!/usr/bin/env bash\nprintf "%s\\n" scontrol "$@"\n')
    (fake_bin / "scontrol").chmod(0o755)
    slurm = {**SLURM, "SLURM_CPUS_ON_NODE": "96", "SLURM_SUBMIT_DIR": str(REPO)}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env = {**base, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), **slurm}
    proc = subprocess.Popen(["bash", str(SBATCH), "launch/configs/tiny.toml"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("srun-started"):
            proc.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@300 delivers
            break
    out, err = proc.communicate(timeout=60)
    lines += out.splitlines()
    assert "srun-got-USR1" in lines, (lines, err)
    assert lines[-4:] == ["job 123456: requeued; it resumes from the latest verified checkpoint",
                          "scontrol", "requeue", "123456"], lines
    assert proc.returncode == 75, (proc.returncode, err)
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
