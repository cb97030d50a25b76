"""``ps-sync``: synchronous SGD through parameter servers (between-graph replication).

Each step every server waits for the gradients of all W workers (or the first
W - b with ``--backup-workers b``; Chen et al. 2016, "Revisiting Distributed
Synchronous SGD"), averages them, clips by the global norm agreed by all
servers, updates and bumps the version. Numerically the all-reduce step.
"""
from ..errors import UsageError
from ..ps.client import ParameterServerStrategy


class PSSync(ParameterServerStrategy):
    name = "ps-sync"
    mode = "sync"
    dist_keys = ("num_ps", "backup_workers")

    @classmethod
    def check_dist(cls, dist) -> None:
        workers = dist.nproc * dist.nnodes
        if dist.backup_workers and dist.backup_workers >= workers:
            raise UsageError(f"dist.backup_workers = {dist.backup_workers} leaves no gradient to aggregate with "
                             f"{workers} workers; use at most {workers - 1}")
