"""Slurm: hostlists, and the [dist] settings a job step implies (as Lightning's SLURMEnvironment reads them)."""
from __future__ import annotations

import pytest

from paratrain.cluster import expand_hostlist, slurm_dist
from paratrain.errors import UsageError


def test_expand_hostlist_like_scontrol_show_hostnames():
    assert expand_hostlist("n[0-2,5],gpu-a[08-09],login") == ["n0", "n1", "n2", "n5", "gpu-a08", "gpu-a09", "login"]
    assert expand_hostlist("node7") == ["node7"]


STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "cn[03-04]", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": "cn04", "SLURM_NODEID": "1"}


def test_a_two_node_step_gives_the_rendezvous_of_its_first_node():
    assert slurm_dist(STEP) == {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "cn03:19242", "rdzv_id": "slurm-4242"}
    assert slurm_dist({**STEP, "MASTER_ADDR": "10.1.0.3", "MASTER_PORT": "29500"})["rdzv_endpoint"] == "10.1.0.3:29500"


def test_outside_a_step_or_on_one_node_nothing_changes():
    assert slurm_dist({}) == {}
    assert slurm_dist({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a[1-2]", "SLURM_NNODES": "2"}) == {}  # sbatch script
    assert slurm_dist({**STEP, "SLURM_STEP_NODELIST": "cn03", "SLURM_STEP_NUM_NODES": "1",
                       "SLURM_STEP_TASKS_PER_NODE": "1"}) == {}


def test_several_tasks_on_a_node_are_refused_with_the_fix():
    with pytest.raises(UsageError, match="use srun --ntasks-per-node=1 and give --nproc N"):
        slurm_dist({**STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})


def test_launch_in_a_step_with_several_tasks_per_node_makes_each_task_a_worker():
    from paratrain.cluster import slurm_task_env

    step = {**STEP, "SLURM_STEP_NODELIST": "cn03", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"}
    assert slurm_task_env(step) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                    "GROUP_RANK": "0", "MASTER_ADDR": "cn03", "MASTER_PORT": "19242"}
    assert slurm_task_env(STEP) == {}  # one task per node: paratrain starts the workers (slurm_dist)
