"""Uneven inputs as a user meets them: ranks with different numbers of batches in their own loop
(``pt.join()``, torch's ``Join``) finish without hanging and compute what DDP's join semantics say."""
from __future__ import annotations

import pytest
import torch

from .test_minimal_api import launch, run

pytestmark = pytest.mark.slow

SCRIPT = """
import sys, torch, paratrain as pt
env = pt.init()
torch.manual_seed(0)
model = torch.nn.Linear(3, 2).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = pt.setup(model, opt)
data = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
mine = data[:3] if env.rank == 0 else data[3:]  # rank 0: 3 batches, rank 1: 2
with pt.join():
    for x in mine:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, sys.argv[1] + f".{env.rank}")
pt.shutdown()
"""


def expected() -> dict[str, torch.Tensor]:
    """DDP's Join, by hand: steps 1 and 2 average both ranks' gradients; at step 3 rank 1 is done and
    contributes zero, so the merge is rank 0's gradient / 2 (divided by the initial world size)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    data = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for parts in ((data[0], data[3]), (data[1], data[4]), (data[2],)):
        for x in parts:
            (model(x).pow(2).sum() / 2).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_ranks_with_different_numbers_of_batches_finish_and_agree(tmp_path):
    (tmp_path / "uneven.py").write_text(SCRIPT)
    r = run(launch("--nproc", 2, "uneven.py", "out"), tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    want = expected()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_a_strategy_without_join_refuses_in_one_line(tmp_path, strategy):
    (tmp_path / "uneven.py").write_text(SCRIPT)
    r = run(launch("--nproc", 2, "--strategy", strategy, "uneven.py", "out"), tmp_path, timeout=180)
    assert r.returncode != 0 and "cannot train on uneven inputs" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
