"""``SyncBatchNorm`` between processes (:class:`~paratrain.strategies.sync_batchnorm.GroupBatchNorm`):
2 ranks with half the rows each compute what ``torch.nn.functional.batch_norm`` computes on all the
rows (float64, 1e-12): the output, the input's gradient of the sum of both ranks' losses, the sum of
the ranks' weight and bias gradients, the running statistics; and its forward and backward hold at
most one input-sized tensor more than plain BatchNorm's (torch's native kernels)."""
from __future__ import annotations

import torch

from .harness import run_ranks

ROWS, C = 8, 3


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, C, 4, 5, generator=g, dtype=torch.float64) * 3 + 1
    up = torch.randn(ROWS, C, 4, 5, generator=g, dtype=torch.float64)  # the loss: (y * up).sum()
    w = torch.randn(C, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64)
    return x, up, w, b


def _rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from paratrain.bench.memory import track_memory
    from paratrain.strategies.sync_batchnorm import GroupReducer, SyncBatchNorm

    x, up, w, b = _data()
    rows = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    bn = SyncBatchNorm(C, reducer=GroupReducer(dist.group.WORLD)).double()
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    mine = x[rows].clone().requires_grad_()
    y = bn(mine)
    (y * up[rows]).sum().backward()
    out = {"y": y.detach(), "dx": mine.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
           "running": (bn.running_mean.clone(), bn.running_var.clone())}

    big = torch.randn(64, 16, 16, 16)  # 1 MiB: the layer's tensors make the peaks

    def step(layer):
        def run():
            t = big.clone().requires_grad_()
            layer(t).sum().backward()
        return track_memory(run, layer, None)[1]["peak"]

    out["peaks"] = (step(SyncBatchNorm(16, reducer=GroupReducer(dist.group.WORLD))), step(SyncBatchNorm(16)))
    out["input_bytes"] = big.numel() * big.element_size()
    return out


def test_two_ranks_compute_what_batchnorm_computes_on_all_rows_with_one_temporary_more(tmp_path):
    x, up, w, b = _data()
    whole = x.clone().requires_grad_()
    weight, bias = w.clone().requires_grad_(), b.clone().requires_grad_()
    mean, var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y = torch.nn.functional.batch_norm(whole, mean, var, weight, bias, training=True, momentum=0.1, eps=1e-5)
    (y * up).sum().backward()
    out = run_ranks(_rank, 2, tmp_path, deadline_s=120)
    torch.testing.assert_close(torch.cat([r["y"] for r in out]), y.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["dx"] for r in out]), whole.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0]["dw"] + out[1]["dw"], weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0]["db"] + out[1]["db"], bias.grad, rtol=1e-12, atol=1e-12)
    for r in out:
        torch.testing.assert_close(r["running"][0], mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["running"][1], var, rtol=1e-12, atol=1e-12)
        synced, plain = r["peaks"]
        assert synced <= plain + 1.01 * r["input_bytes"], (synced / r["input_bytes"], plain / r["input_bytes"])
