"""What ``paratrain plan`` does with a GPU's profile, checked on a CPU: the N it plans and validates
with the measured interconnect, the device its validation runs use, the device memory it takes from
the profile, how the profile moves a task's batch to the device, and the collectives' names on the
older torch a GPU image may carry (2.11: ``all_gather_into_tensor``)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from paratrain.bench import microbench
from paratrain.bench.costmodel import PRESETS, Workload
from paratrain.bench.plan_report import _device_limit, _gpu_nproc
from paratrain.bench.plan_validate import validation_counts
from paratrain.bench.profile import _to
from paratrain.data.batching import LMBatch
from paratrain.errors import UsageError

GPU = {"device": "cuda:0"}
CPU = {"device": "cpu"}


def test_a_gpu_profile_validates_n_1_alone_on_the_gpu(monkeypatch):
    assert validation_counts(CPU, "2,1,4,1") == ([1, 2, 4], (), [])
    assert validation_counts(CPU, None) == ([1, 2], (), [])
    with pytest.raises(UsageError, match=r"--validate: the profile is of a GPU \(cuda:0\) and this machine has none"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        validation_counts(GPU, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert validation_counts(GPU, None) == ([1], ('dist.device="cuda"',), [2])  # the default's N = 2 skipped
    assert validation_counts(GPU, "1") == ([1], ('dist.device="cuda"',), [])
    for asked in ("1,2", "2"):  # an explicit N > 1 (or no N = 1 at all) is refused, not skipped to nothing
        with pytest.raises(UsageError, match=f"--validate-nproc {asked}: .* not NCCL between GPUs; give "
                                             f"--validate-nproc 1"):
            validation_counts(GPU, asked)


def test_a_gpu_profile_plans_n_1_alone_with_the_measured_link(capsys):
    assert _gpu_nproc([1, 2, 4], True, None, None) == [1]  # the default --nproc: cut, with a line
    assert "only N = 1 is planned" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--nproc 1,2 with --interconnect measured: .* not NCCL between GPUs; "
                                         "plan N > 1 with --interconnect nvlink"):
        _gpu_nproc([1, 2], True, None, "1,2")
    assert _gpu_nproc([1, 2, 8], True, PRESETS["nvlink"], "1,2,8") == [1, 2, 8]  # a preset: every N
    assert _gpu_nproc([1, 2, 4], False, None, "1,2,4") == [1, 2, 4]  # a CPU's profile: its own links
    assert _gpu_nproc([1], True, None, "1") == [1]


def test_the_device_memory_comes_from_the_profiled_gpu_also_on_another_machine():
    assert _device_limit(None, {"device": "cuda:0", "device_memory_bytes": 150_754_820_096}) == 150_754_820_096
    assert _device_limit(80, {"device": "cuda:0", "device_memory_bytes": 150_754_820_096}) == 80e9
    assert _device_limit(None, CPU) is None
    if not torch.cuda.is_available():  # an older GPU profile without the key, read where there is no GPU
        assert _device_limit(None, {"device": "cuda:0"}) is None


@dataclasses.dataclass
class _Step:  # a task's own micro-batch: a dataclass of tensors, as gpt's and lstm-lm's batches are
    inputs: torch.Tensor
    targets: torch.Tensor
    count: int


def test_the_profile_moves_a_tasks_dataclass_and_lm_batches_to_the_device():
    # the GPU's profile failed with "index is on cpu" when only tensors, tuples and dicts were moved
    meta = torch.device("meta")
    x = torch.zeros(4, 3, dtype=torch.long)
    step = _to(_Step(x, x, 12), meta)
    assert step.inputs.device == meta and step.targets.device == meta and step.count == 12
    lm = _to([LMBatch(inputs=x, targets=x, mask=None, hidden_key=0, num_tokens=12)], meta)[0]
    assert lm.inputs.device == meta and lm.targets.device == meta
    pair = _to((x, {"y": x}), meta)
    assert pair[0].device == meta and pair[1]["y"].device == meta


@pytest.mark.parametrize("new, old, helper, args", [
    ("all_gather_single", "all_gather_into_tensor", microbench.all_gather_single, ("out", "part")),
    ("reduce_scatter_single", "reduce_scatter_tensor", microbench.reduce_scatter_single, ("part", "whole")),
])
def test_the_collectives_take_their_older_name_on_an_older_torch(monkeypatch, new, old, helper, args):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, new, lambda *a: calls.append((new, a)), raising=False)
    monkeypatch.setattr(dist, old, lambda *a: calls.append((old, a)), raising=False)
    helper(*args)
    monkeypatch.delattr(dist, new)  # torch 2.11 has only the older name
    helper(*args)
    assert calls == [(new, args), (old, args)]


class _Cls:  # a registry entry's attributes that step_parts reads
    def __init__(self, model, synchronous=True):
        self.cost_model, self.synchronous, self.name = model, synchronous, "x"


_W = Workload(forward_s=0.002, backward_s=0.004, data_s=0.0, optimizer_s=0.001, param_bytes=(4_000_000,) * 10,
              tokens_per_step=1000)
_INPUTS = {"units": [4_000_000] * 10, "output_bytes": 1e6, "sharded_optimizer_s": 0.002, "sharded_norm_s": 0.0005}


def test_a_gpu_profile_adds_each_strategys_own_work_at_one_rank_to_its_step_and_parts():
    """The one-rank runs' differences (profile_runs.loop_one_rank_overheads) go into the step and
    its compute and optimizer parts at every n > 1, and replace the DTensors' dispatch terms they
    hold; none at n = 1, and none for a strategy that has no measurement."""
    from paratrain.bench.plan_model import Layout, step_parts
    from paratrain.bench.strategy_model import RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS
    from paratrain.config import Config

    link = PRESETS["nvlink"]
    own = {"step_s": 0.006, "compute_s": 0.004, "optimizer_s": 0.0015}  # 0.0005 s left: exposed at one rank
    for model, dispatch in ((RING, 0.0), (SHARDED_OPTIMIZER, 0.002), (SHARDED_PARAMETERS, 0.0025)):
        for n in (2, 8):
            a, b = [step_parts(_Cls(model), Layout("x", n), _W, link, Config(), x)
                    for x in (_INPUTS, {**_INPUTS, "one_rank_s": own})]
            # without: the dispatch terms (zero1: the optimizer's 2 ms; fsdp: and the norm's 0.5 ms)
            assert b["step_s"] == pytest.approx(a["step_s"] - dispatch + 0.006, abs=1e-12)
            assert b["compute_s"] == pytest.approx(a["compute_s"] + 0.004, abs=1e-12)
            assert b["optimizer_s"] == pytest.approx(a["optimizer_s"] - dispatch + 0.0015, abs=1e-12)
            assert b["comm_s"] == pytest.approx(a["comm_s"] + 0.0005, abs=1e-12)
            assert b["units_per_s"] == pytest.approx(1000 * n / b["step_s"], rel=1e-9)
    one = [step_parts(_Cls(RING), Layout("x", 1), _W, link, Config(), x)
           for x in (_INPUTS, {**_INPUTS, "one_rank_s": own})]
    assert one[0] == one[1]  # one device: a single run, no strategy's work
    # measured at nothing (fsdp faster than single in its runs): still measured, the dispatch stays out
    zero = {"step_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0}
    a, b = [step_parts(_Cls(SHARDED_PARAMETERS), Layout("x", 2), _W, link, Config(), x)
            for x in (_INPUTS, {**_INPUTS, "one_rank_s": zero})]
    assert b["step_s"] == pytest.approx(a["step_s"] - 0.0025, abs=1e-12)


def test_the_plan_takes_the_one_rank_term_of_the_layouts_own_strategy(monkeypatch):
    """plan.predict_layout hands step_parts the profile's one-rank measurement of the row's strategy."""
    from paratrain.bench import plan

    seen, links = {}, []

    def step_parts(cls, layout, w, link, cfg, inputs, **kw):
        seen[layout.strategy] = inputs["one_rank_s"]
        links.append(kw["links"])
        return None

    monkeypatch.setattr(plan, "step_parts", step_parts)
    prof = _gpu_profile()
    prof["loop_one_rank_s"] = {"zero1": {"step_s": 0.003, "compute_s": 0.001, "optimizer_s": 0.002}}
    from paratrain.config import Config

    for name in ("zero1", "allreduce"):
        plan.predict_layout(plan.Layout(name, 2, {}, name), prof, Config(), PRESETS["nvlink"], on_this_machine=False,
                            global_batch=None)
    assert seen == {"zero1": {"step_s": 0.003, "compute_s": 0.001, "optimizer_s": 0.002}, "allreduce": None}
    assert links[0] == {}  # no parameter server's exchange in this profile: the preset alone
    # a CPU's one-rank runs price a preset (a cluster of such CPUs), not this machine's own rows, which
    # have their two-process terms (zero1_step_s, fsdp_units)
    cpu = {**prof, "device": "cpu", "cores": 2, "default_threads": 2, "workloads": {"2": prof["workloads"]["16"]},
           "workloads_in_process": {"2": prof["workloads"]["16"]}}
    seen.clear()  # a GPU's on this machine too (measured link: N = 1 in practice; any N > 1 adds it)
    plan.predict_layout(plan.Layout("zero1", 2, {}, "zero1"), prof, Config(), PRESETS["nvlink"], on_this_machine=True,
                        global_batch=None)
    assert seen == {"zero1": prof["loop_one_rank_s"]["zero1"]}
    for here in (False, True):
        seen.clear()
        plan.predict_layout(plan.Layout("zero1", 2, {}, "zero1"), cpu, Config(),
                            PRESETS["eth25"] if not here else PRESETS["nvlink"], on_this_machine=here,
                            global_batch=None)
        assert seen == {"zero1": None if here else prof["loop_one_rank_s"]["zero1"]}, here
    links.clear()
    # with one: a parameter server's messages on the preset cost at least the host's measured exchange
    # (40 MB each way in 0.09 s less the update 0.01 s and 2 x 0.5 ms: beta = 0.079 / 80e6 s a byte)
    prof.update(links={"rpc": {"alpha_s": 5e-4, "beta_s_per_byte": 2e-10, "gamma_s_per_byte": 0.0}},
                ps_round_trip_s=0.09, ps_update_s={"async": 0.01})
    plan.predict_layout(plan.Layout("ps-sync", 2, {"num_ps": 1}, "ps-sync"), prof, Config(), PRESETS["nvlink"],
                        on_this_machine=False, global_batch=None)
    rpc = links[-1]["rpc"]
    assert (rpc.alpha_s, rpc.beta_s_per_byte) == pytest.approx((5e-4, 0.079 / 80e6), rel=1e-9)
    assert rpc.gamma_s_per_byte == PRESETS["nvlink"].gamma_s_per_byte > 0  # the preset's, term by term
    assert set(links[-1]) == {"rpc"}  # the collectives keep the preset's link


def _gpu_profile() -> dict:
    w = {"forward_s": 0.002, "backward_s": 0.004, "data_s": 0.0, "optimizer_s": 0.001, "local_sd_s": 0.0}
    return {"device": "cuda:0", "cores": 16, "batch_size": 32, "default_threads": 16, "tokens_per_step": 1000,
            "param_bytes": [4_000_000] * 10, "workloads": {"16": w}, "workloads_in_process": {"16": w},
            "strategy_inputs": {"units": [4_000_000] * 10}, "output_bytes": 1e6}


def test_loop_one_rank_overheads_is_each_strategys_one_rank_step_less_singles(monkeypatch, capsys):
    """profile_runs.loop_one_rank_overheads with the runs stubbed: the commands (single and each
    strategy at --nproc 1, the recipe's batch, round after round) and the arithmetic (the round with
    the median step, less single's; the step at least 0, the compute within [0, step], the optimizer
    within [0, step - compute]); a failing strategy, or one that timed no step, is left out with a
    line, a failing single run ends the profile with one line."""
    from pathlib import Path
    from types import SimpleNamespace

    from paratrain.bench import report, runner, sweep, validate
    from paratrain.bench.profile_runs import loop_one_rank_overheads, one_rank_strategies

    assert one_rank_strategies() == ("allreduce", "zero1", "fsdp")  # the registry's ring, ZeRO-1 and FSDP models
    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "gpt_wt2.toml")
    # (step, compute, optimizer) seconds by strategy, one per round
    runs = {"single": [(0.0078, 0.0060, 0.0016), (0.0076, 0.0058, 0.0016), (0.0090, 0.0070, 0.0016)],
            "allreduce": [(0.0083, 0.0066, 0.0016), (0.0085, 0.0065, 0.0016), (0.0081, 0.0064, 0.0017)],
            "zero1": [(0.0146, 0.0083, 0.0061), (0.0150, 0.0080, 0.0062), (0.0140, 0.0084, 0.0060)],
            "fsdp": [(0.0070, 0.0050, 0.0017), (0.0072, 0.0052, 0.0018), (0.0071, 0.0051, 0.0016)]}
    commands = []

    def strategy(cmd):
        return cmd[cmd.index("--strategy") + 1]

    def record(i):
        cmd = commands[i]
        k = sum(1 for c in commands[:i + 1] if strategy(c) == strategy(cmd)) - 1
        return {"ok": strategy(cmd) not in failing, "units_per_step": 2048, "train_step_ms": 1000 * runs[strategy(
            cmd)][k][0], "k": k, "cmd": cmd}

    def workload(rec, ranks, units):
        _, compute, optimizer = runs[strategy(rec["cmd"])][rec["k"]]
        return SimpleNamespace(data_s=0.0002, forward_s=compute / 2 - 0.0001, backward_s=compute / 2 - 0.0001,
                               optimizer_s=optimizer)

    failing: set[str] = set()
    monkeypatch.setattr(runner, "run_cmd", lambda cmd, log, timeout_s, env: (commands.append(cmd), (0, None))[1])
    monkeypatch.setattr(sweep, "read_outcome", lambda plan, rc, run_dir: len(commands) - 1)
    monkeypatch.setattr(report, "run_record", record)
    monkeypatch.setattr(validate, "workload_from_record", workload)
    got = loop_one_rank_overheads(recipe, None, (), None, 32, 40, repeats=3)
    # medians: single 7.8 / 6.0 / 1.6 ms; allreduce 8.3 / 6.5 / 1.6; zero1 14.6 / 8.3 / 6.1; fsdp 7.1 (below)
    assert got["allreduce"] == pytest.approx({"step_s": 0.0005, "compute_s": 0.0005, "optimizer_s": 0.0}, abs=1e-12)
    assert got["zero1"] == pytest.approx({"step_s": 0.0068, "compute_s": 0.0023, "optimizer_s": 0.0045}, abs=1e-12)
    assert got["fsdp"] == {"step_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0}  # faster than single: no term
    assert [strategy(c) for c in commands] == ["single", "allreduce", "zero1", "fsdp"] * 3  # rounds, in turn
    assert all("dist.nproc=1" in c and "train.batch_size=32" in c and "train.max_steps=40" in c for c in commands)
    # parts that add up to more than the step: the optimizer's is what the step leaves after the compute
    runs["allreduce"][0] = (0.0083, 0.0064, 0.0019)  # round 0 alone: single's (7.8, 6.0, 1.6) ms
    commands.clear()
    got = loop_one_rank_overheads(recipe, None, (), None, 32, 40, strategies=("allreduce",))
    assert got["allreduce"] == pytest.approx({"step_s": 0.0005, "compute_s": 0.0004, "optimizer_s": 0.0001},
                                             abs=1e-12)
    # a run that timed no step is left out, not priced at 0
    runs["zero1"][0] = (math.nan, 0.0083, 0.0061)
    commands.clear()
    assert set(loop_one_rank_overheads(recipe, None, (), None, 32, 40)) == {"allreduce", "fsdp"}
    assert "zero1 at one rank: left out (its run failed (exit 0): no step was timed" in capsys.readouterr().out
    failing.add("fsdp")
    commands.clear()
    assert set(loop_one_rank_overheads(recipe, None, (), None, 32, 40)) == {"allreduce"}
    assert "fsdp at one rank: left out (its run failed" in capsys.readouterr().out
    failing.add("single")
    commands.clear()
    with pytest.raises(UsageError, match="the one-device run for the profile failed"):
        loop_one_rank_overheads(recipe, None, (), None, 32, 40)


def test_towers_on_a_gpu_are_listed_but_recommended_only_where_nothing_priced_fits():
    from paratrain.bench.plan import rank, unpriced
    from paratrain.bench.strategy_model import RING, TOWERS

    for here in (True, False):
        assert unpriced(TOWERS, {"device": "cuda:0"}, on_this_machine=here).startswith("towers on GPUs")
        assert unpriced(RING, {"device": "cuda:0"}, on_this_machine=here) == ""
    assert unpriced(TOWERS, CPU, on_this_machine=True) == ""
    # a CPU's towers on a preset: one process' virtual devices, on this machine's cores
    assert unpriced(TOWERS, CPU, on_this_machine=False).startswith("towers on CPUs")
    assert unpriced(RING, CPU, on_this_machine=False) == ""
    # a 16-bit compression hook on CPUs: its casts and gloo's 16-bit sum are not measured; on GPUs it is priced
    for here in (True, False):
        assert unpriced(RING, CPU, on_this_machine=here, comm_hook="bf16").startswith("bf16 hook on CPUs")
        assert unpriced(RING, {"device": "cuda:0"}, on_this_machine=here, comm_hook="bf16") == ""
    assert unpriced(RING, CPU, on_this_machine=True, comm_hook="none") == ""

    def row(label, units, unpriced="", feasible=True):
        return {"label": label, "units_per_s": units, "n": 8, "feasible": feasible, "synchronous": True,
                "memory": {"total": 1.0}, "unpriced": unpriced}

    rows = [row("towers", 500.0, "not priced"), row("allreduce", 450.0), row("zero1", 420.0)]
    assert [r["label"] for r in rank(rows, "words_per_s")] == ["allreduce", "zero1", "towers"]
    rows[1]["feasible"] = rows[2]["feasible"] = False  # nothing priced fits: the towers, with their note
    assert rank(rows, "words_per_s")[0]["label"] == "towers"


def test_a_parameter_servers_messages_on_a_preset_are_no_faster_than_the_exchange_measured_on_the_host():
    from paratrain.bench.costmodel import Link
    from paratrain.bench.plan_ps import slower

    a = Link(name="nvlink", alpha_s=5e-6, beta_s_per_byte=1 / 450e9, gamma_s_per_byte=1e-12)
    b = Link(name="measured-ps", alpha_s=4.6e-4, beta_s_per_byte=5e-10, gamma_s_per_byte=0.0)
    got = slower(a, b)
    assert (got.alpha_s, got.beta_s_per_byte, got.gamma_s_per_byte) == (4.6e-4, 5e-10, 1e-12)
    assert slower(b, a) == dataclasses.replace(got, name="slower of measured-ps, nvlink")


def test_dist_broadcast_buffers_reaches_ddp_and_sync_batchnorm_turns_it_off_itself():
    """``dist.broadcast_buffers`` (allreduce, zero1) is DDP's per-forward broadcast of rank 0's buffers:
    on by default, off when set false; the profile's sync BatchNorm key-off runs set it false
    (profile_runs.loop_sync_batchnorm) to compare like with like."""
    import torch.distributed as dist
    from torch import nn

    from paratrain.config import DistConfig
    from paratrain.env import DistEnv
    from paratrain.strategies import STRATEGIES

    assert DistConfig().broadcast_buffers is True
    assert "broadcast_buffers" in STRATEGIES["allreduce"].dist_keys and "broadcast_buffers" in STRATEGIES[
        "zero1"].dist_keys
    import gc

    got = {}
    for value in (True, False):
        strategy = STRATEGIES["allreduce"](DistEnv(), bucket_mb=25.0, broadcast_buffers=value)
        try:
            ddp = strategy._wrap(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), 0)
            got[value] = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))
        finally:
            # DDP's reducer holds the gloo group: free it while the group exists. Freed after
            # destroy_process_group (at the next loop or the function's end), ~ProcessGroupGloo hung
            # on a mutex once in a full suite (2026-11-27, a worker stuck 15 min).
            ddp = strategy = None
            gc.collect()
            if dist.is_initialized():
                dist.destroy_process_group()
    assert got == {True: True, False: False}
