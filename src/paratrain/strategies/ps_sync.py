"""``ps-sync``: synchronous SGD through parameter servers (between-graph replication).

Each step every server waits for the gradients of all W workers (or the first
W - b with ``--backup-workers b``; Chen et al. 2016, "Revisiting Distributed
Synchronous SGD"), averages them, clips by the global norm agreed by all
servers, updates and bumps the version. Numerically the all-reduce step.
"""
from ..ps.client import ParameterServerStrategy


class PSSync(ParameterServerStrategy):
    name = "ps-sync"
    mode = "sync"
