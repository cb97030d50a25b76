"""How a parameter-server worker talks to its servers, apart from the protocol itself: the
tensors of a shard, the answers of a round of RPCs (a dead server becomes one line naming it),
the heartbeats that keep it alive while it evaluates, and leaving. A mixin of
:class:`~paratrain.ps.client.ParameterServerStrategy` (it uses ``servers``, ``shards``,
``params``, ``layout`` and ``env``)."""
from __future__ import annotations

import torch
import torch.distributed.rpc as rpc

from . import rpc_api


class ServerCalls:
    def _shard_tensors(self, k: int) -> list[torch.Tensor]:
        """CPU copies of the parameters server ``k`` holds."""
        return [self.params[i].detach().cpu() for i in self.shards[k]]

    def _answers(self, futs: list, first: int = 0) -> list:
        """The servers' answers, in shard order (``futs[i]`` is server ``first + i``'s). A server that
        is gone (its process died: the RPC ends with a transport error) stops this worker with one
        line naming it."""
        out = []
        for k, f in enumerate(futs, start=first):
            try:
                out.append(f.wait())
            except RuntimeError:
                if not self._server_gone(k):
                    raise
                from ..errors import TrainingStopped

                rank = self.layout.global_rank("server", k)
                raise TrainingStopped(f"parameter server {k} (rank {rank}, shard {k}: {len(self.shards[k])} parameter "
                                      f"tensors) is gone; this worker stops: resume from the last checkpoint with "
                                      f"--resume (or --max-restarts N restarts the job)", every_rank=True) from None
        return out

    def _server_gone(self, k: int) -> bool:
        """True when server ``k`` no longer answers a trivial RPC within 5 s."""
        try:
            rpc.rpc_async(self.servers[k], rpc_api.heartbeat, args=(k, self.env.rank), timeout=5).wait()
            return False
        except RuntimeError:
            return True

    def _start_heartbeats(self, timeout_s: float) -> None:
        """A daemon thread tells every server this process is alive every min(timeout_s / 4, 5 s):
        liveness does not depend on pushes (a long evaluation or checkpoint on rank 0 is not death)."""
        import threading

        if getattr(self, "_beating", None) is not None:
            return
        from .server import heartbeat_interval

        every = heartbeat_interval(timeout_s)
        self._beating = threading.Event()

        def beat() -> None:
            while not self._beating.wait(every):
                try:
                    for k, srv in enumerate(self.servers):
                        rpc.rpc_async(srv, rpc_api.heartbeat, args=(k, self.env.rank))
                except Exception:  # RPC is shutting down: the worker is leaving
                    return

        threading.Thread(target=beat, name="paratrain-ps-heartbeat", daemon=True).start()

    def _leave(self) -> None:
        """Stop the heartbeats and tell every server this worker is done."""
        if getattr(self, "_beating", None) is not None:
            self._beating.set()
        futs = [rpc.rpc_async(srv, rpc_api.worker_done, args=(k, self.env.rank))
                for k, srv in enumerate(getattr(self, "servers", []))]
        for f in futs:
            try:
                f.wait()
            except RuntimeError:  # the last worker's answer can race the server's exit: nothing is outstanding
                pass
