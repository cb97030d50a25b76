"""Parameter-server machinery: layout of roles, sharding, server shards, RPC endpoints, runtime.

The worker-side strategies are ``ps-sync`` and ``ps-async`` in :mod:`paratrain.strategies`.
"""
