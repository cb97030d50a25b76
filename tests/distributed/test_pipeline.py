"""Pipeline parallelism computes what one device computes: ``gpt`` cut into S=2 stages (embeddings
+ block 0 | block 1 + head, the tied embedding in both) with M micro-batches under gpipe and 1f1b,
and with the stage plan "2,0" (both blocks on stage 0, the head alone on stage 1), and the hybrid
of 2 data-parallel replicas x 2 stages (4 processes on a 2-D DeviceMesh), equal
``single`` with the same global batch after 10 steps (float64 to 1e-10; SGD with momentum and
weight decay, clipping active). The DCP checkpoint of a pipeline run resumes under allreduce."""
from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.train import Trainer

from .harness import fit_rank, max_rel_diff, run_ranks
from .test_sharded import cfg_dict, train_here, whole_model

pytestmark = pytest.mark.slow
# (schedule, micro-batches, stage plan): "" = blocks spread evenly; "2,0" = both blocks on stage 0,
# stage 1 only the final LayerNorm and the (tied) head
CASES = {2: [("gpipe", 4, ""), ("1f1b", 4, ""), ("1f1b", 2, "2,0")], 4: [("1f1b", 2, ""), ("gpipe", 2, "")]}


def pipeline_cfg(world: int, schedule: str, microbatches: int, split: str = "") -> dict:
    d = cfg_dict("gpt", "pipeline", world, 1)
    d["dist"].update(pipeline_stages=2, microbatches=microbatches, pipeline_schedule=schedule, pipeline_split=split)
    return d


def _job(rank: int, world_size: int, data_dir: str, work: str) -> list:
    for schedule, m, split in CASES[world_size]:
        fit_rank(rank, world_size, pipeline_cfg(world_size, schedule, m, split), data_dir,
                 f"{work}/w{world_size}-{schedule}-{m}")
    return []


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline")
    single = train_here(cfg_dict("gpt", "single", 1, 1), tiny_data, work / "single")
    for world in (2, 4):
        run_ranks(_job, world, work, str(tiny_data), str(work), deadline_s=300)
    return work, single


@pytest.mark.parametrize("world, schedule, m", [(w, s, m) for w, cases in CASES.items() for s, m, _ in cases])
def test_pipeline_matches_single(runs, world, schedule, m):
    work, single = runs
    got = whole_model(work / f"w{world}-{schedule}-{m}")
    assert got.keys() == single.keys()
    assert max_rel_diff(got, single) < 1e-10


def test_a_pipeline_checkpoint_resumes_under_allreduce(runs, tiny_data):
    """The stages' DCP folder read whole by one process: allreduce W=1 continues from it to step 14,
    equal to single trained 14 steps."""
    work, _ = runs
    run = work / "w2-1f1b-4"
    d = cfg_dict("gpt", "allreduce", 1, 1, steps=14)
    from paratrain.train.checkpoint import latest

    tr = Trainer(from_dict(d), DistEnv(), run, str(tiny_data), verbose=False)
    tr.restore(latest(run))
    tr.fit()
    tr.close()
    ref = train_here(cfg_dict("gpt", "single", 1, 1, steps=14), tiny_data, work / "single14")
    assert max_rel_diff(whole_model(Path(run)), ref) < 1e-10
