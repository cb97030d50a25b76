"""Where the job runs: Slurm allocations, read the way Lightning's ``SLURMEnvironment`` does.

Inside ``srun`` (or an ``sbatch`` script's ``srun``), ``paratrain train`` and ``paratrain launch``
need no rendezvous flags: :func:`slurm_dist` turns the step's ``SLURM_*`` variables into the
multi-node settings, one paratrain per node (``srun --ntasks-per-node=1``) starting ``--nproc``
workers there:

* nodes: ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``); this node: the index of
  ``SLURMD_NODENAME`` in the step's node list (else ``SLURM_NODEID``);
* rendezvous: ``$MASTER_ADDR`` if set, else the first host of ``SLURM_STEP_NODELIST`` (else
  ``SLURM_JOB_NODELIST``), expanded like ``scontrol show hostnames``; port ``$MASTER_PORT`` if set,
  else 15000 + job id mod 20000, the same on every node;
* job id: ``slurm-<SLURM_JOB_ID>`` (see :func:`paratrain.launch.job_id`).

Several tasks per node (``srun -n 4`` on one node): ``paratrain launch`` runs each task as one
worker (:func:`slurm_task_env`, Lightning's way); ``paratrain train`` refuses with one line saying
how to start it (one launcher per node). One node needs no rendezvous at all (loopback).
"""
from __future__ import annotations

import os
import re
from typing import Mapping

from .errors import UsageError


def expand_hostlist(spec: str) -> list[str]:
    """``"n[0-2,5],gpu-a[08-09]"`` -> ``["n0", "n1", "n2", "n5", "gpu-a08", "gpu-a09"]`` (Slurm's
    hostlist syntax: comma-separated names, each with at most one bracketed range list, zero-padded)."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{width}d}{suffix}")
    return out


def _tasks_per_node(spec: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``) as one count per node."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _in_step(env: Mapping[str, str]) -> bool:
    return "SLURM_JOB_ID" in env and ("SLURM_STEP_ID" in env or "SLURM_NODEID" in env)


def _rendezvous(env: Mapping[str, str], hosts: list[str]) -> tuple[str, int]:
    job = env["SLURM_JOB_ID"]
    host = env.get("MASTER_ADDR") or (hosts[0] if hosts else "")
    if not host:
        raise UsageError("cannot tell node 0 of this Slurm step (no SLURM_STEP_NODELIST); set MASTER_ADDR")
    return host, int(env.get("MASTER_PORT") or 15000 + int(re.sub(r"\D", "", job) or 0) % 20000)


def slurm_task_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """For ``paratrain launch`` in a step with several tasks on a node (``srun -n 4``): each task is
    one worker, Lightning's way; returns the torch ``env://`` variables of this task (RANK from
    ``SLURM_PROCID``, WORLD_SIZE from ``SLURM_NTASKS``, LOCAL_RANK from ``SLURM_LOCALID``, ...),
    or ``{}`` when the step runs one task per node (then :func:`slurm_dist` applies)."""
    env = os.environ if env is None else env
    if not _in_step(env):
        return {}
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")))
    if not any(n > 1 for n in per_node):
        return {}
    hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "")))
    host, port = _rendezvous(env, hosts)
    node = int(env.get("SLURM_NODEID", 0))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")),
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": str(per_node[node] if node < len(per_node) else per_node[0]),
            "GROUP_RANK": str(node), "MASTER_ADDR": host, "MASTER_PORT": str(port)}


def slurm_dist(env: Mapping[str, str] | None = None) -> dict:
    """The ``[dist]`` settings of this Slurm step (``nnodes``, ``node_rank``, ``rdzv_endpoint``,
    ``rdzv_id``), or ``{}`` outside Slurm, outside a job step, or on one node. UsageError when the
    step runs several tasks on a node."""
    env = os.environ if env is None else env
    if not _in_step(env):
        return {}  # not in a job step (a login node, or an sbatch script outside srun)
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")))
    if any(n > 1 for n in per_node):
        raise UsageError(f"this Slurm step runs {max(per_node)} tasks on a node; paratrain starts the workers "
                         f"itself: use srun --ntasks-per-node=1 and give --nproc N (processes per node)")
    hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "")))
    nnodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", len(hosts) or 1)))
    if nnodes <= 1:
        return {}
    name = env.get("SLURMD_NODENAME", "")
    node_rank = hosts.index(name) if name in hosts else int(env.get("SLURM_NODEID", 0))
    host, port = _rendezvous(env, hosts)
    return {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": f"{host}:{port}",
            "rdzv_id": f"slurm-{env['SLURM_JOB_ID']}"}
