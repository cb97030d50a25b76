"""``pt.train_step`` in a user's own loop as a user runs it: ``examples/pipeline_mlp.py`` (one call
per step, clipping on, float64) under ``paratrain launch --strategy pipeline`` with 2 stages and 4
micro-batches, and as 2 replicas x 2 stages, ends at the parameters (and logs the losses) of the
same script in one plain ``python`` process, to 1e-10. Under ``pipeline`` a plain loop's
``model(x)``, an evaluation before ``pt.gather_model()`` and a batch that does not split into the
micro-batches are one line each, exit 2; after loading a whole state_dict no gather is needed.
"""
from __future__ import annotations

import pytest
import torch

from ..conftest import REPO
from ..distributed.harness import max_rel_diff
from .test_minimal_api import launch, run

pytestmark = pytest.mark.slow

MLP = ("--epochs", "2", "--dtype", "float64", "--lr", "0.2", "--clip", "0.5")
ONE_STEP_LAYOUTS = {"pipeline": ("--nproc", 2, "--strategy", "pipeline", "--set", "dist.microbatches=4"),
                    "hybrid": ("--nproc", 4, "--strategy", "pipeline", "--set", "dist.pipeline_stages=2",
                               "--set", "dist.microbatches=2")}


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    pytest.importorskip("sklearn", reason="the example reads scikit-learn's digits")
    tmp = tmp_path_factory.mktemp("one-step")
    script = REPO / "examples" / "pipeline_mlp.py"
    runs = {"single": run([script, *MLP, "--save", "single.pt"], tmp)}
    for name, layout in ONE_STEP_LAYOUTS.items():
        runs[name] = run(launch(*layout, script, *MLP, "--save", f"{name}.pt"), tmp)
    return tmp, runs


@pytest.mark.parametrize("layout", list(ONE_STEP_LAYOUTS))
def test_train_step_port_equals_one_process(mlp_runs, layout):
    tmp, runs = mlp_runs
    for name in ("single", layout):
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    assert runs[layout].stdout.count("epoch  2") == 1  # rank 0 alone prints
    first = [float(r.stdout.split("train loss")[1].split()[0]) for r in (runs["single"], runs[layout])]
    assert first[0] == pytest.approx(first[1], rel=1e-10)  # the returned losses, averaged over the replicas
    diff = max_rel_diff(torch.load(tmp / f"{layout}.pt", weights_only=True),
                        torch.load(tmp / "single.pt", weights_only=True))
    print(f"DIFF train_step port {layout}: {diff:.3e}")
    assert diff <= 1e-10, f"{layout}: max relative difference {diff:.2e}"


PLAIN_LOOP = """
import sys, torch, torch.nn as nn
import paratrain as pt
pt.init()
model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).double()
start = {k: v.clone() for k, v in model.state_dict().items()}
model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
loss = lambda m, b: (m(b[0]) - b[1]).pow(2).mean()
mode = sys.argv[1]
if mode == "train":
    (model(x) - y).pow(2).mean().backward()
pt.train_step((x, y), loss)
if mode == "uneven":
    pt.train_step((x[:6], y[:6]), loss)
if mode == "loaded":
    model.load_state_dict(start)  # every process now holds the whole model
with torch.no_grad():
    model.eval()(x)
"""


@pytest.mark.parametrize("mode, match", [
    ("train", "train with pt.train_step(batch, loss_fn) instead of model(x)"),
    ("eval", "call pt.gather_model() on every rank before evaluating the model"),
    ("uneven", "a batch of 6 rows does not split into dist.microbatches = 4 micro-batches"),
    ("loaded", None)])
def test_pipeline_refuses_a_plain_loop_a_stale_evaluation_and_uneven_batches_in_one_line(tmp_path, mode, match):
    (tmp_path / "loop.py").write_text(PLAIN_LOOP)
    r = run(launch("--nproc", 2, "--strategy", "pipeline", "loop.py", mode), tmp_path)
    if match is None:  # a loaded whole model needs no gather
        assert r.returncode == 0, r.stderr[-2000:]
        return
    assert r.returncode == 2, r.stderr[-2000:]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("paratrain: rank")]
    assert said and all(match in ln for ln in said if "failed first" not in ln), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
