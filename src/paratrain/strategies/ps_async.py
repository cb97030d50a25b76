"""``ps-async``: asynchronous SGD through parameter servers (Dean et al. 2012, Downpour SGD).

Every pushed gradient is applied on arrival; staleness (server version at apply
time minus the version the worker pulled) is recorded for every update.
``--max-staleness s`` admits a worker's next step only when no update can
become more than s versions stale (stale-synchronous parallel, Ho et al. 2013);
``--staleness-lr`` divides the lr by the staleness (Zhang et al. 2016).
"""
from ..ps.client import ParameterServerStrategy


class PSAsync(ParameterServerStrategy):
    name = "ps-async"
    mode = "async"
    synchronous = False  # workers apply their gradients at their own pace: replicas differ
    dist_keys = ("num_ps", "max_staleness", "staleness_lr")
