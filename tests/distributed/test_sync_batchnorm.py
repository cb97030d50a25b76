"""``SyncBatchNorm`` between processes (:class:`~paratrain.strategies.sync_batchnorm.GroupBatchNorm`):
2 ranks with 3 and 5 of the rows compute what ``torch.nn.functional.batch_norm`` computes on all the
rows (float64, 1e-12): the output, the input's gradient of the sum of both ranks' losses, the sum of
the ranks' weight and bias gradients, the running statistics; also without affine parameters, for an
input that needs no gradient (nothing hangs: no rank all-reduces in the backward), for (N, C) input,
and for a bf16 input (computed in float32, returned in bf16, as the native kernel does); and its
forward and backward hold at most one input-sized tensor more than plain BatchNorm's (torch's native
kernels)."""
from __future__ import annotations

import torch

from .harness import run_ranks

ROWS, C = 8, 3
SPLIT = (0, 3, 8)  # uneven: a mean of the ranks' means, or a count of local rows x 2, would be wrong


def _data(shape=(ROWS, C, 4, 5)):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 1
    up = torch.randn(*shape, generator=g, dtype=torch.float64)  # the loss: (y * up).sum()
    w = torch.randn(C, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64)
    return x, up, w, b


def _reference(x, up, w, b, affine=True, grad_x=True):
    """One device, all the rows: (y, dx, dw, db, running mean, running var)."""
    whole = x.clone().requires_grad_(grad_x)
    weight, bias = (w.clone().requires_grad_(), b.clone().requires_grad_()) if affine else (None, None)
    mean, var = torch.zeros(C, dtype=x.dtype), torch.ones(C, dtype=x.dtype)
    y = torch.nn.functional.batch_norm(whole, mean, var, weight, bias, training=True, momentum=0.1, eps=1e-5)
    (y * up).sum().backward()
    return (y.detach(), whole.grad, weight.grad if affine else None, bias.grad if affine else None, mean, var)


def _synced(rank, x, up, w, b, affine=True, grad_x=True):
    import torch.distributed as dist

    from paratrain.strategies.sync_batchnorm import GroupReducer, SyncBatchNorm

    rows = slice(SPLIT[rank], SPLIT[rank + 1])
    bn = SyncBatchNorm(C, affine=affine, reducer=GroupReducer(dist.group.WORLD)).to(torch.float64)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(w)
            bn.bias.copy_(b)
    mine = x[rows].clone().requires_grad_(grad_x)
    y = bn(mine)
    (y.double() * up[rows]).sum().backward()
    return (y.detach(), mine.grad, bn.weight.grad if affine else None, bn.bias.grad if affine else None,
            bn.running_mean.clone(), bn.running_var.clone())


def _rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from paratrain.bench.memory import track_memory
    from paratrain.strategies.sync_batchnorm import GroupReducer, SyncBatchNorm

    x, up, w, b = _data()
    out = {"plain": _synced(rank, x, up, w, b), "no_affine": _synced(rank, x, up, w, b, affine=False),
           "no_grad_x": _synced(rank, x, up, w, b, grad_x=False)}
    x2, up2, w2, b2 = _data((ROWS, C))
    out["2d"] = _synced(rank, x2, up2, w2, b2)
    out["bf16"] = _synced(rank, (x * 0.2 + 60).to(torch.bfloat16), up, w, b)  # mean / std about 100

    big = torch.randn(64, 16, 16, 16)  # 1 MiB: the layer's tensors make the peaks

    def step(layer):
        def run():
            t = big.clone().requires_grad_()
            layer(t).sum().backward()
        return track_memory(run, layer, [])[1]["peak"]

    out["peaks"] = (step(SyncBatchNorm(16, reducer=GroupReducer(dist.group.WORLD))), step(SyncBatchNorm(16)))
    out["input_bytes"] = big.numel() * big.element_size()
    return out


def _joined(out, case):
    """The ranks' rows of y and dx joined, their dw and db summed, each rank's running statistics."""
    a, b = out[0][case], out[1][case]
    cat = [None if a[i] is None else torch.cat([a[i], b[i]]) for i in (0, 1)]
    add = [None if a[i] is None else a[i] + b[i] for i in (2, 3)]
    return [*cat, *add], [(a[4], a[5]), (b[4], b[5])]


def test_two_ranks_compute_what_batchnorm_computes_on_all_rows_with_one_temporary_more(tmp_path):
    x, up, w, b = _data()
    x2, up2, w2, b2 = _data((ROWS, C))
    want = {"plain": _reference(x, up, w, b), "no_affine": _reference(x, up, w, b, affine=False),
            "no_grad_x": _reference(x, up, w, b, grad_x=False), "2d": _reference(x2, up2, w2, b2)}
    out = run_ranks(_rank, 2, tmp_path, deadline_s=120)
    for case, ref in want.items():
        got, running = _joined(out, case)
        for g, r in zip(got, ref[:4]):
            assert (g is None) == (r is None), case
            if r is not None:
                torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=case)
        for mean, var in running:
            torch.testing.assert_close(mean, ref[4], rtol=1e-12, atol=1e-12, msg=case)
            torch.testing.assert_close(var, ref[5], rtol=1e-12, atol=1e-12, msg=case)
    # bf16: the input rounded to bf16, then float32 arithmetic (a mean rounded to bf16 would be up to
    # 0.125 off, a fifth of std); y and dx come back in bf16
    ref = _reference((x * 0.2 + 60).to(torch.bfloat16).double(), up, w, b)
    got, _ = _joined(out, "bf16")
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    for g, r in zip(got, ref[:4]):
        torch.testing.assert_close(g.double(), r, rtol=1e-2, atol=1e-2 * float(r.abs().max()))
    for r in out:
        synced, plain = r["peaks"]
        assert synced <= plain + 1.01 * r["input_bytes"], (synced / r["input_bytes"], plain / r["input_bytes"])
