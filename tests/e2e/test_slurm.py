"""paratrain inside a real Slurm allocation: a cluster of slurmctld + two slurmd "nodes" on 127.0.0.1
(benchmarks/slurm/local_cluster.sh, started and stopped here; needs Debian's slurm-wlm and root).

* `sbatch -N2` whose script runs `srun --ntasks-per-node=1 paratrain train ...` with no rendezvous
  flags: each node's paratrain reads SLURM_* (nodes, node id, node list, job id), the two form one
  job, and the result equals `single` at the same global batch (float64);
* `srun -N1 -n2 paratrain launch script.py`: each Slurm task is one worker (RANK from SLURM_PROCID).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_cli import TINY, final_model, paratrain

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "benchmarks" / "slurm" / "local_cluster.sh"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("slurmctld") is None or os.geteuid() != 0,
                                 reason="needs Debian's slurm-wlm (apt install slurm-wlm) and root")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(CLUSTER), "start", str(state), "2"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr[-3000:]
    conf = up.stdout.strip().split("=", 1)[1]
    env = {**os.environ, "SLURM_CONF": conf, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}  # n0/n1 do not resolve
    env.pop("SLURM_JOB_ID", None)
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, timeout=60)


def test_sbatch_two_nodes_need_no_rendezvous_flags_and_equal_single(slurm, tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    steps = ("--set", "train.max_steps=12", "--set", "train.checkpoint_every=4")
    one = paratrain("train", "tiny.toml", "--strategy", "single", "--run-dir", "one", "--data-dir", tiny_data, *steps,
                    cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n#SBATCH -N 2\n#SBATCH --ntasks-per-node=1\n#SBATCH --time=10\n"
                   f"srun bash -c '{sys.executable} -m paratrain.cli train tiny.toml --nproc 1 --threads 1 "
                   f"--data-dir {tiny_data} --run-dir node$SLURM_NODEID {' '.join(steps)}'\n")
    r = subprocess.run(["sbatch", "--wait", "-o", "slurm-%j.out", str(job)], cwd=tmp_path, env=slurm,
                       capture_output=True, text=True, timeout=600)
    out = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert r.returncode == 0, r.stdout + r.stderr + out[-3000:]
    print(out.strip().splitlines()[0])
    assert out.count("world_size 2") == 2  # both nodes joined one job of 2 ranks
    assert list((tmp_path / "node0").glob("checkpoint-*.pt")) and not list((tmp_path / "node1").glob("checkpoint-*"))
    a, b = final_model(tmp_path / "node0"), final_model(tmp_path / "one")
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)
    print(f"sbatch -N2 vs single, 12 steps, float64: max relative difference {worst:.2e}")
    assert worst < 1e-10


def test_srun_with_two_tasks_on_a_node_runs_each_task_as_a_worker(slurm, tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text("import torch, paratrain as pt\n"
                      "env = pt.init()\n"
                      "t = pt.all_mean(torch.tensor([float(env.rank)]))\n"
                      "print(f'rank {env.rank} of {env.world_size}: mean rank {t.item()}', flush=True)\n"
                      "pt.shutdown()\n")
    r = subprocess.run(["srun", "-N1", "-n2", sys.executable, "-m", "paratrain.cli", "launch", "--nproc", "1",
                        str(script)], cwd=tmp_path, env=slurm, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = sorted(ln for ln in r.stdout.splitlines() if ln.startswith("rank "))
    assert lines == ["rank 0 of 2: mean rank 0.5", "rank 1 of 2: mean rank 0.5"], r.stdout + r.stderr[-2000:]
