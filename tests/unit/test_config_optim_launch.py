"""Config validation, --set parsing, LR rules, launch command building, checkpoints (no process group)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from paratrain import config
from paratrain.errors import UsageError
from paratrain.launch import LaunchSpec, build_command, job_id
from paratrain.train import checkpoint
from paratrain.train.optim import LRSchedule, effective_lr_clip, scaling_factor

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_recipes_load(name):
    cfg = config.load(REPO / "configs" / name)
    cfg.check_world()
    assert cfg.name == name[:-5]


def test_toml_roundtrip(tmp_path):
    cfg = config.load(REPO / "configs" / "ptb_small.toml", ["train.lr=0.25", "model.tie_weights=false"])
    (tmp_path / "c.toml").write_text(config.to_toml(cfg))
    assert config.load(tmp_path / "c.toml") == cfg


def test_overrides_typed():
    cfg = config.load(None, ["train.lr=3", "data.corpus=wikitext-2", "train.dtype=float64", "model.tie_weights=true",
                             "model.embed_dim=200"])
    assert cfg.train.lr == 3.0 and isinstance(cfg.train.lr, float)
    assert cfg.data.corpus == "wikitext-2" and cfg.model.tie_weights is True


@pytest.mark.parametrize("override,needle", [
    ("train.lrr=1", "train.lrr"), ("train.batch_size=1.5", "int"), ("train.batch_size=true", "int"),
    ("trian.lr=1", "trian"), ("train.lr=0", "train.lr"), ("data.mode=chars", "bptt"),
    ("dist.strategy=horovod", "allreduce"), ("train.batch_size", "section.key=value"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(UsageError, match=needle):
        config.load(None, [override])


def test_world_checks():
    cfg = config.load(None, ["train.batch_size=20", "dist.nproc=3"])
    with pytest.raises(UsageError, match="use a multiple of 3"):
        cfg.check_world()
    cfg = config.load(None, ["train.batch_size=2", "dist.nproc=4"])
    with pytest.raises(UsageError, match="--nproc <= 2"):
        cfg.check_world()
    cfg = config.load(None, ["train.batch_size=12", "train.accumulation=2", "dist.nproc=4"])
    with pytest.raises(UsageError, match="multiple of 8"):
        cfg.check_world()


def test_paper_convention_conversion():
    t = config.TrainConfig(lr=1.0, clip=5.0, convention="sum_over_time", optimizer="sgd")
    assert effective_lr_clip(t, 20) == (20.0, 0.25)
    t = config.TrainConfig(lr=1e-3, clip=5.0, convention="sum_over_time", optimizer="adam")
    assert effective_lr_clip(t, 20) == (1e-3, 0.25)  # Adam is invariant to the loss scale
    t = config.TrainConfig(lr=20.0, clip=0.25, convention="mean_over_tokens")
    assert effective_lr_clip(t, 35) == (20.0, 0.25)


def test_scaling_rules():
    assert scaling_factor("linear", 80, 20) == 4
    assert scaling_factor("sqrt", 80, 20) == 2
    assert scaling_factor("none", 80, 20) == 1


def test_zaremba_step_schedule():
    s = LRSchedule(config.TrainConfig(schedule="step", decay=0.5, decay_start_epoch=4), base_lr=20.0)
    assert [s.lr(0, e) for e in (1, 4, 5, 6, 13)] == [20, 20, 10, 5, 20 * 0.5 ** 9]


def test_warmup_goyal():
    s = LRSchedule(config.TrainConfig(schedule="constant", warmup_steps=4), base_lr=1.0, factor=4.0)
    assert [s.lr(i, 1) for i in range(6)] == [1.75, 2.5, 3.25, 4.0, 4.0, 4.0]


def test_plateau_decay_and_state():
    s = LRSchedule(config.TrainConfig(schedule="plateau", decay=0.25, plateau_patience=0), base_lr=20.0)
    s.observe(5.0)
    s.observe(4.0)
    assert s.lr(0, 3) == 20.0
    s.observe(4.5)
    assert s.lr(0, 4) == 5.0
    t = LRSchedule(config.TrainConfig(schedule="plateau"), base_lr=20.0)
    t.load_state_dict(s.state_dict())
    assert t.lr(0, 4) == 5.0


def test_build_command_single_node_loopback():
    cmd = build_command(LaunchSpec(nproc=2, target=["train.py", "--x", "1"], rdzv_id="abc", python="py"))
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--rdzv-endpoint=127.0.0.1:0" in cmd and "--local-addr=127.0.0.1" in cmd
    assert cmd[-5:] == ["--module", "paratrain.child", "train.py", "--x", "1"]  # the worker dies with its launcher


def test_build_command_multi_node_static_rendezvous_honours_node_rank():
    cmd = build_command(LaunchSpec(nproc=4, target=["paratrain.worker", "d"], module=True, nnodes=2, node_rank=1,
                                   rdzv_endpoint="10.0.0.1:29400", max_restarts=3, rdzv_id="j", rdzv_timeout_s=30))
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--rdzv-endpoint=10.0.0.1:29400" in cmd
    assert "--rdzv-backend=static" in cmd and "--rdzv-conf=timeout=30" in cmd and "--rdzv-id=j" in cmd
    assert "--max-restarts=3" in cmd and cmd[-5:] == ["--module", "paratrain.child", "-m", "paratrain.worker", "d"]
    from torch.distributed.run import parse_args

    args = parse_args(cmd[3:])  # torchrun accepts what we build
    assert args.nproc_per_node == "4" and args.module and args.node_rank == 1 and args.rdzv_backend == "static"


def test_multi_node_job_id_is_the_same_on_every_node(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("PARATRAIN_JOB_ID", raising=False)
    node = dict(nproc=1, target=["t.py"], nnodes=2, rdzv_endpoint="127.0.0.2:29400")
    ids = {job_id(LaunchSpec(node_rank=r, **node)) for r in (0, 1, 0)}  # what each launcher derives
    assert len(ids) == 1
    assert job_id(LaunchSpec(node_rank=0, **{**node, "rdzv_endpoint": "127.0.0.2:29401"})) not in ids
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert job_id(LaunchSpec(node_rank=1, **node)) == "slurm-4242"
    assert job_id(LaunchSpec(node_rank=1, rdzv_id="mine", **node)) == "mine"


def test_checkpoint_atomic_keep_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, {"model": {"w": torch.full((2,), float(step))}}, step, keep=2)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["checkpoint-00000003.pt", "checkpoint-00000004.pt"]
    assert checkpoint.load(checkpoint.latest(tmp_path))["model"]["w"][0] == 4
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_checkpoint_refuses_code_execution(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    bad = tmp_path / "checkpoint-00000001.pt"
    with open(bad, "wb") as f:
        pickle.dump({"model": Evil()}, f)
    with pytest.raises(UsageError, match="cannot be loaded"):
        checkpoint.load(bad)
    assert not (tmp_path / "pwned").exists()


def test_checkpoint_no_resume_point(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint"):
        checkpoint.latest(tmp_path)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sum_over_time_converts_weight_decay_too(optimizer):
    """The recipe minimises the loss summed over T steps with weight decay wd; paratrain minimises the
    mean over tokens with the converted lr, clip and wd: the same parameters, step for step."""
    from paratrain.train.optim import build_optimizer, effective_weight_decay

    T = 7
    t = config.TrainConfig(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-2, momentum=0.9,
                           weight_decay=0.3, convention="sum_over_time", clip=0.0)
    torch.manual_seed(0)
    x, y = torch.randn(T, 5, 3, dtype=torch.float64), torch.randn(T, 5, 2, dtype=torch.float64)
    recipe, ours = (torch.nn.Linear(3, 2).double() for _ in range(2))
    ours.load_state_dict(recipe.state_dict())
    opt_recipe = build_optimizer(recipe.parameters(), t, t.lr)  # the paper's summed loss, its own lr and wd
    lr, _ = effective_lr_clip(t, T)
    opt_ours = build_optimizer(ours.parameters(), t, lr, effective_weight_decay(t, T))
    for _ in range(3):
        for model, opt, scale in ((recipe, opt_recipe, 1.0), (ours, opt_ours, 1.0 / T)):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean(dim=(1, 2)).sum() * scale  # summed over T, or the mean over T
            loss.backward()
            opt.step()
    worst = max(((a - b).abs() / a.abs()).max().item() for a, b in zip(recipe.parameters(), ours.parameters()))
    assert worst < (1e-12 if optimizer == "sgd" else 1e-5), worst  # Adam: up to its eps, not quite scale-free
