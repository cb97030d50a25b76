"""The ``paratrain train`` command of a plan row (:func:`command_line`), on one machine or as the command
each of several machines runs, and why a row over several machines cannot be started as it was priced
(:func:`launch_refusal`). Split from :mod:`.plan`, which re-exports these names."""
from __future__ import annotations

import shlex

from .strategy_model import TOWERS


NODE_RANK, NODE0 = "$NODE_RANK", "$NODE0"
"""The shell variables a command over several machines names: each machine's rank (0 .. M - 1) and the
first machine's address (its rendezvous, README "Several machines")."""


def machines_of(n: int, per_node: int | None) -> int:
    """Machines a job of ``n`` processes spans where a machine holds ``per_node`` devices (None: one machine
    of any size): ceil(n / per_node)."""
    return 1 if per_node is None or n <= per_node else -(-n // per_node)


def launch_refusal(row: dict, per_node: int | None) -> str:
    """Why ``paratrain train`` cannot start a row over several machines as it was priced ("" where it can):
    every machine starts the same ``--nproc`` workers and ``dist.num_ps`` servers (README "Several
    machines"; :class:`~paratrain.ps.layout.PSLayout`), so N must fill machines of ``per_node`` devices
    whole, and a parameter server's K servers must split evenly over them. Towers are bounded apart
    (one process)."""
    from ..strategies import STRATEGIES

    n, nodes = row["n"], machines_of(row["n"], per_node)
    if nodes == 1 or STRATEGIES[row["strategy"]].cost_model == TOWERS:
        return ""
    if n % per_node:
        return (f"N = {n} fills {nodes} machines of {per_node} devices unevenly; paratrain starts the same --nproc on "
                f"every machine: give N a multiple of {per_node}")
    k = row["overrides"].get("num_ps")
    if k is not None and k % nodes:
        return (f"{k} parameter server(s) do not split over {nodes} machines (dist.num_ps servers start on every "
                f"machine): give K a multiple of {nodes}")
    return ""


def command_line(row: dict, config: str, extra: list[str], recipe_batch: int, device_type: str = "cpu",
                 per_node: int | None = None) -> str:
    """The ``paratrain train`` command of a plan row: N processes (towers: N devices of
    ``device_type`` in one process), the layout's ``dist`` keys, and the global batch the prediction
    assumed (``train.batch_size`` is the global batch: the row's per-replica batch x replicas).
    ``per_node``: the devices of one machine of the interconnect the row was priced on (a flat network
    preset: 1; ``INTRA+INTER``: ``--devices-per-node``; None: one machine): a row over M > 1 machines is
    the command each machine runs, ``--nnodes M --nproc N / M --node-rank $NODE_RANK --rdzv-endpoint
    $NODE0:29400`` (:data:`NODE_RANK`, :data:`NODE0`: set them on each machine)."""
    from ..strategies import STRATEGIES

    parts = ["paratrain", "train", config, "--strategy", row["strategy"]]
    towers = STRATEGIES[row["strategy"]].cost_model == TOWERS
    nodes = 1 if towers else machines_of(row["n"], per_node)
    overrides = dict(row["overrides"])
    if towers:
        parts += ["--devices", ",".join(f"{device_type}:{i}" for i in range(row["n"]))]
    elif nodes > 1:  # every machine starts --nproc workers and dist.num_ps servers (launch_refusal: they divide)
        parts += ["--nnodes", str(nodes), "--nproc", str(row["n"] // nodes)]
        if "num_ps" in overrides and overrides["num_ps"] % nodes == 0:
            overrides["num_ps"] //= nodes
    else:
        parts += ["--nproc", str(row["n"])]
    for k, v in overrides.items():
        value = str(v).lower() if isinstance(v, bool) else (f'"{v}"' if isinstance(v, str) else f"{v:g}")
        parts += ["--set", f"dist.{k}={value}"]
    if row["checkpointing"]:
        parts += ["--set", "model.activation_checkpointing=true"]
    batch = row["per_replica_batch"] * row["replicas"]
    if batch != recipe_batch:
        parts += ["--set", f"train.batch_size={batch}"]
    for o in extra:
        parts += ["--set", o]
    command = " ".join(shlex.quote(p) for p in parts)
    if nodes > 1:  # the shell expands these on each machine
        command += f" --node-rank {NODE_RANK} --rdzv-endpoint {NODE0}:29400"
    return command
