"""What sharded data parallel costs beyond the plain step, for ``paratrain plan``: the optimizer's
step on DTensor shards (in this process), and what FSDP2 adds to each unit (two processes).

``zero1`` and ``fsdp`` step the user's optimizer on ``DTensor`` shards of the parameters
(:mod:`paratrain.strategies.zero1`, :mod:`paratrain.strategies.fsdp`). A DTensor dispatches every
operation through Python (sharding propagation, then the local operation), so a step over many small
tensors costs far more than 1/N of the plain step: on digits_cnn's 11 tensors SGD took 0.61 ms on
DTensors against 0.21 ms on plain tensors. The cost model's ``optimizer / N`` sees none of that.
FSDP2's collectives cost far more than the link's alpha-beta time on a CPU: its hooks, the copies
in and out of their buffers and the Python around each (:func:`time_fsdp_unit`: digits_cnn's 91 KiB
unit, 3.1 ms forward and 5.0 ms backward between two ranks on 2026-11-26, against an all-gather's
0.5 ms).
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Sequence

import torch

from .microbench_workload import check_workload, rank_workload as _rank_workload


@contextmanager
def _one_rank_mesh(device: torch.device, threads: int):
    """A one-rank ``DeviceMesh`` of ``device``'s type over a gloo group made for it (destroyed after,
    unless one existed), at ``threads`` intra-op threads (restored after). RuntimeError if a default
    process group of another size exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("the DTensor and FSDP2 micro-benchmarks need a one-rank process group or none")
    from ..env import intra_op_threads

    try:
        with intra_op_threads(threads):
            yield init_device_mesh(device.type, (1,))
    finally:
        if made:
            dist.destroy_process_group()


def measured_sharded_optimizer(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                               threads: int = 1, repeats: int = 15, warmup: int = 3) -> float:
    """Seconds per step that ``optimizer``'s class and defaults (built by
    :func:`~paratrain.train.optim.optimizer_like`) spend beyond the same step on plain tensors, when
    its parameters and gradients are ``DTensor`` shards (``Shard(0)``; ``Replicate()`` for 0-dim
    tensors), the gradients wrapped anew each step as ``zero1`` does: median over ``repeats`` steps
    of each, difference clamped at 0. Measured in this process on a one-rank gloo mesh of the
    parameters' device (a process group is made for it and destroyed after, unless one exists), at
    ``threads`` intra-op threads. The per-operation dispatch it measures does not depend on the
    number of ranks; the arithmetic it leaves out (the plain step) shrinks with the shard, which the
    cost model counts apart. Left out: gradient clipping (FSDP clips DTensor gradients: more
    dispatch) and FSDP's norm of its DTensor gradients (:func:`measured_sharded_norm`). FSDP's
    gradients arrive as DTensors from its reduce-scatter, so the wrap timed here (zero1's) is charged
    to FSDP too: a few hundredths of a millisecond a tensor. Raises RuntimeError if a default process
    group of another size exists."""
    from torch import nn

    from ..devices import synchronize
    from ..strategies.zero1 import row_dtensor
    from ..train.optim import optimizer_like
    from .microbench import median_seconds

    values = [p.detach().clone() for p in params]
    device = values[0].device if values else torch.device("cpu")
    grads = [torch.randn_like(v) * 1e-3 for v in values]
    with _one_rank_mesh(device, threads) as mesh:
        def wrap(t: torch.Tensor):
            return row_dtensor(t, t, mesh)  # zero1's wrap: on one rank the rows are the whole tensor

        def median_step(shards: list[torch.Tensor], sharded: bool) -> float:
            opt = optimizer_like(type(optimizer), [{"params": shards}], optimizer.defaults)

            def step() -> None:
                for s, g in zip(shards, grads):
                    s.grad = wrap(g) if sharded else g
                opt.step()
                synchronize(device)
            return median_seconds(step, repeats, warmup)

        # one copy of the parameters for both runs (what the steps do to them does not change the time);
        # each run's optimizer state is freed when it returns
        plain = median_step([nn.Parameter(v) for v in values], False)
        sharded = median_step([nn.Parameter(wrap(v)) for v in values], True)
        return max(0.0, sharded - plain)


def measured_sharded_norm(params: Sequence[torch.Tensor], *, threads: int = 1, repeats: int = 30,
                          warmup: int = 3) -> float:
    """Seconds per step that the norm of ``params``' gradients (their shapes, random values) costs
    beyond the same norm on plain tensors when they are ``DTensor`` shards, as ``fsdp``'s non-finite
    guard computes it every step (:meth:`~paratrain.strategies.fsdp.FSDP._grad_norm`:
    ``torch.nn.utils.get_total_norm`` over the shards, then ``full_tensor``): the per-operation
    dispatch and ``full_tensor``'s all-reduce over one rank (on a one-rank gloo mesh in this process,
    as :func:`measured_sharded_optimizer`; on a CPU that all-reduce is a few microseconds, and the
    all-reduce between the ranks is priced apart). Median over ``repeats`` of each after ``warmup``,
    difference clamped at 0. Raises RuntimeError if a default process group of another size exists."""
    from torch import nn

    from ..strategies.zero1 import row_dtensor
    from .microbench import median_seconds

    grads = [torch.randn_like(p.detach()) for p in params]
    device = grads[0].device if grads else torch.device("cpu")
    with _one_rank_mesh(device, threads) as mesh:
        sharded = [row_dtensor(g, g, mesh) for g in grads]

        def median_norm(tensors: list[torch.Tensor]) -> float:
            def norm() -> float:
                total = nn.utils.get_total_norm(tensors, foreach=True)
                return float(total.full_tensor() if hasattr(total, "full_tensor") else total)
            return median_seconds(norm, repeats, warmup)

        return max(0.0, median_norm(sharded) - median_norm(grads))


def fsdp_unit_module(unit: int | dict) -> torch.nn.Module:
    """The module :func:`time_fsdp_unit` shards: parameters of ``unit``'s shapes and dtypes (zeros; a
    number: one float32 tensor of so many bytes, at least 2 elements), its forward ``x`` (one element)
    times the sum of each parameter's first element, so that every parameter gets a gradient and the
    compute is almost none."""
    from torch import nn

    if isinstance(unit, dict):
        dtypes = unit.get("dtypes") or ["float32"] * len(unit["shapes"])
        tensors = [(tuple(int(d) for d in shape), getattr(torch, dtype))
                   for shape, dtype in zip(unit["shapes"], dtypes, strict=True)]
    else:
        tensors = [((max(2, int(unit) // 4),), torch.float32)]

    class Unit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in tensors])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * sum(w.reshape(-1)[:1].sum().float() for w in self.weights)

    return Unit()


def time_fsdp_unit(unit: int | dict, repeats: int, warmup: int) -> list[float]:
    """What FSDP2 adds to one shard unit between the ranks of the default group (gloo), beyond the
    same module without FSDP2: ``[forward, backward resharded, backward kept]`` seconds, each the
    difference of the means over 20 (10 with a workload) to ``repeats`` passes (about 1 s of each kind,
    workload included) after ``warmup``
    (a barrier before each pass). ``unit``: its parameters, ``{"shapes": [[...], ...], "dtypes":
    ["float32", ...]}`` (their stored dtypes, one for the unit as FSDP2 requires; default float32),
    or a number of bytes: one float32 tensor of them (profile versions 17-36); the module:
    :func:`fsdp_unit_module`. ``unit["param_dtype"]`` (optional, e.g. ``"bfloat16"``): FSDP2's
    ``MixedPrecisionPolicy`` as ``fsdp`` sets it for a bf16 or fp16 recipe (the parameters cast to it
    before the all-gather, which moves half the bytes; the gradients reduce-scattered in float32;
    profile version 41; before, such a recipe's units were timed in float32). FSDP2's hooks
    copy and view each parameter of a unit in and out of the collectives' buffers: on the 2-vCPU EPYC
    VM digits_cnn's features unit (93.6 KB in 9 tensors) cost 0.15 ms more forward and 0.4 ms more
    backward than one tensor of its bytes (2026-11-29).

    That is everything FSDP2 does around the unit's compute: its hooks, the copies into and out of
    the collectives' buffers, the collectives, and the wait for the rank that reaches each one last
    (the mean of a measured collective includes it; here the ranks come to it from a barrier, where
    a training step's come from a stretch of compute: :func:`~.costmodel_sharded.predict_fsdp` adds
    the difference). The forward all-gathers the unit; the backward reduce-scatters its
    gradient after gathering it again when it was resharded after the forward
    (``reshard_after_forward``). The module without FSDP2 runs the same forward and backward, so that
    what is left is FSDP2's own. Each pass also runs an FSDP2 root with no parameters of its own, as
    ``fsdp`` wraps a model: a step has one root, and a model of k units is priced k of them (its
    hooks, about 0.1 ms a pass here). ``unit["workload"]`` (optional): a recipe whose model's forward
    and backward each rank runs before every pass (:func:`~.microbench_workload.rank_workload`), as a
    training step's units find the caches after the model's other compute. Collective: every rank of
    the group calls it."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x = torch.ones(1)
    workload = unit.get("workload") if isinstance(unit, dict) else None
    low = unit.get("param_dtype") if isinstance(unit, dict) else None
    policy = MixedPrecisionPolicy() if low is None else MixedPrecisionPolicy(  # as strategies.fsdp's
        param_dtype=getattr(torch, low), reduce_dtype=torch.float32, output_dtype=torch.float32)
    between = _rank_workload(workload, dist.get_rank(), dist.get_world_size())

    def passes(reshard: bool | None, count: int) -> tuple[float, float]:
        """Mean forward and backward seconds; ``reshard`` None: the module without FSDP2."""
        root = nn.Sequential(fsdp_unit_module(unit))
        if reshard is not None:
            mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
            fully_shard(root[0], mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
            fully_shard(root, mesh=mesh, mp_policy=policy)
        fwd, bwd = [], []
        for i in range(warmup + count):
            between()
            dist.barrier()
            t0 = time.perf_counter()
            y = root(x)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            root.zero_grad(set_to_none=True)
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        return statistics.fmean(fwd), statistics.fmean(bwd)

    fewest = 20 if workload is None else 10  # with a model's compute before each pass: fewer
    t0 = time.perf_counter()
    passes(True, fewest // 2)  # then as many passes as fit in about 1 s, with the workload (rank 0's count)
    wall = (time.perf_counter() - t0) / (fewest // 2 + warmup)
    count = torch.tensor([max(fewest, min(repeats, round(1.0 / max(wall, 1e-6))))])
    dist.broadcast(count, 0)
    count = int(count)
    (f2, b2), (_, k2), (f0, b0) = passes(True, count), passes(False, count), passes(None, count)
    got = torch.tensor([max(0.0, f2 - f0), max(0.0, b2 - b0), max(0.0, k2 - b0)], dtype=torch.float64)
    dist.all_reduce(got)  # the ranks' mean
    return [float(v) / dist.get_world_size() for v in got]


def optimizer_spec(optimizer: torch.optim.Optimizer) -> dict:
    """``{"optimizer": "module:QualName", "defaults": {...}}``: ``optimizer``'s class (the user's,
    under a strategy's wrapper) and defaults, for :func:`time_sharded_step` in other processes."""
    from ..strategies.wrapping import user_optimizer_class

    cls = user_optimizer_class(optimizer)
    return {"optimizer": f"{cls.__module__}:{cls.__qualname__}", "defaults": dict(optimizer.defaults)}


def time_sharded_step(spec: dict, repeats: int, warmup: int) -> float:
    """Seconds that a sharded strategy's optimizer step (``spec["strategy"]``: ``zero1``, the
    default, or ``fsdp``) adds to ``allreduce``'s between the ranks of the
    default group (gloo, CPU), for parameters of ``spec["shapes"]`` and the optimizer of
    :func:`optimizer_spec` (``spec["optimizer"]``, ``spec["defaults"]``), of ``spec["dtypes"]``
    (default float32), at ``spec["threads"]`` intra-op threads (default 1; restored after): the mean of
    ``optimizer.step()`` under the real strategy (:class:`~paratrain.strategies.zero1.Zero1`,
    :class:`~paratrain.strategies.fsdp.FSDP`) less the mean under
    :class:`~paratrain.strategies.allreduce.AllReduce` (the plain step on whole tensors), both with
    training's options (the non-finite guard on), the same gradients set before each step, a barrier
    before each. For ZeRO-1 that difference is everything it changes in the step: the gradients' rows
    wrapped as DTensors, the optimizer's per-operation dispatch on them, its arithmetic on 1/W of the
    rows instead of all, the copies into and out of the all-gather's buffer, the all-gather and the
    wait for the rank that reaches it last. For FSDP2 (one unit holding every parameter: the step does
    not depend on the units) the gradients are DTensor shards, as FSDP2's reduce-scatter leaves them:
    the guard's norm of them (their dispatch and the all-reduce of the norm, a blocking collective)
    and the optimizer's dispatch and arithmetic on 1/W of each parameter. The two kinds of steps
    alternate in rounds (about 1 s in all, at least 2 rounds of 10 steps of each), so that a change of
    the machine's speed meets both. ``spec["workload"]`` (optional): ``{"config": Config, "data_dir":
    str | None}``, a recipe whose model each rank builds as rank ``rank`` of the group would train it
    (:func:`~paratrain.runs.build_task`, its first batch) and runs forward and backward on before each
    step, of both kinds, as the training loop does (:func:`~.microbench_workload.rank_workload`): on the 2-vCPU EPYC VM
    digits_cnn's zero1 step path was 0.55 ms more with its model's forward and backward between the
    steps than with nothing between them (2026-11-29): the caches and the allocator as a step finds
    them. Returns the ranks' mean. The global random generator is left as it was. Collective: every
    rank of the group calls it."""
    import functools
    import importlib

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ..env import DistEnv, intra_op_threads
    from ..errors import UsageError
    from ..strategies import DEFAULT, get_strategy, modelled
    from ..train.optim import optimizer_like
    from .strategy_model import SHARDED_OPTIMIZER, SHARDED_PARAMETERS

    name = spec.get("strategy", modelled(SHARDED_OPTIMIZER)[0])
    if name not in (modelled(SHARDED_OPTIMIZER)[0], modelled(SHARDED_PARAMETERS)[0]):
        raise UsageError(f"time_sharded_step times zero1 or fsdp, got strategy {name!r}")
    module_name, _, qualname = spec["optimizer"].partition(":")
    cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    world, rank = dist.get_world_size(), dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    shapes = [tuple(s) for s in spec["shapes"]]
    dtypes = [getattr(torch, d) for d in spec.get("dtypes", ["float32"] * len(shapes))]
    seeded = torch.Generator().manual_seed(0)  # the same parameters and gradients on every rank
    values = [torch.randn(s, generator=seeded).to(d) for s, d in zip(shapes, dtypes)]
    grads = [(torch.randn(s, generator=seeded) * 1e-3).to(d) for s, d in zip(shapes, dtypes)]
    with intra_op_threads(int(spec.get("threads", 1))):
        between = _rank_workload(spec.get("workload"), rank, world)

        def built(name: str):
            module = nn.ParameterList([nn.Parameter(v.clone()) for v in values])
            opt = optimizer_like(cls, module.parameters(), spec["defaults"])
            strategy = get_strategy(name, env, timing=True, skip_nonfinite=True)
            _, opt = strategy.setup(module, opt)
            params = list(module.parameters())
            given = [distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
                     for p, g in zip(params, grads)]  # fsdp: each rank's shard of the gradient

            def step() -> float:
                between()  # the model's forward and backward, then its gradients, as in a training step
                for p, g in zip(params, given):
                    p.grad = g.clone()
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                return time.perf_counter() - t0
            return step

        sharded, plain = built(name), built(DEFAULT)  # DDP's all-reduce
        for _ in range(warmup):
            sharded(), plain()
        per_round = 10
        t0 = time.perf_counter()
        for _ in range(2):
            sharded(), plain()
        pair = (time.perf_counter() - t0) / 2  # one step of each kind, with the workload between
        rounds = torch.tensor([max(2, min(repeats // per_round, round(1.0 / max(pair * per_round, 1e-6))))])
        dist.broadcast(rounds, 0)  # rank 0's count
        s_times, a_times = [], []
        for _ in range(int(rounds)):
            s_times += [sharded() for _ in range(per_round)]
            a_times += [plain() for _ in range(per_round)]
        got = torch.tensor([statistics.fmean(s_times) - statistics.fmean(a_times)], dtype=torch.float64)
        dist.all_reduce(got)
        return float(got) / world


def measured_sharded_step(strategy: str, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                          threads: int = 1, repeats: int = 200, timeout_s: float = 300.0,
                          workload: dict | None = None) -> float:
    """:func:`time_sharded_step` of ``strategy`` (``zero1`` or ``fsdp``) between two local gloo
    processes of ``threads`` intra-op threads each (a process' share of the cores at N = 2), for
    ``params``' shapes and dtypes and ``optimizer``'s class and defaults (seconds; may be below 0 where
    the sharded step is faster, on large models). ``workload``: a recipe whose model's forward and
    backward each rank runs before every step (:func:`time_sharded_step`'s ``spec["workload"]``; None:
    nothing between the steps). For :func:`~.costmodel_sharded.predict_zero1`'s and
    :func:`~.costmodel_sharded.predict_fsdp`'s ``step_path_s`` on this machine. Raises RuntimeError as
    :func:`~.microbench.measure_allreduce`, ValueError for a ``workload`` of another form
    (:func:`~.microbench_workload.check_workload`)."""
    from .microbench import measure_allreduce

    check_workload(workload)
    spec = {**optimizer_spec(optimizer), "shapes": [list(p.shape) for p in params], "strategy": strategy,
            "dtypes": [str(p.dtype).removeprefix("torch.") for p in params], "threads": threads}
    if workload is not None:
        spec["workload"] = workload
    ((_, seconds),) = measure_allreduce(2, [spec], repeats=repeats, warmup=3, timeout_s=timeout_s,
                                        op="sharded_step")
    return float(seconds)


def measured_fsdp_units(unit_bytes: Sequence[int], *, parameters: Sequence[Sequence[torch.Tensor]] | None = None,
                        repeats: int = 200, timeout_s: float = 300.0,
                        workload: dict | None = None, param_dtype: str | None = None) -> list[list[float]]:
    """``[bytes, forward, backward resharded, backward kept]`` (seconds) per distinct unit size > 0:
    :func:`time_fsdp_unit` between two local gloo processes of one thread each, of the parameters'
    shapes and dtypes of the first unit of that size (``parameters``: each unit's own, in the order of
    ``unit_bytes``, :func:`~.strategy_model.fsdp_unit_parameters`; None: one float32 tensor of the
    size). ``workload``: a recipe whose model's forward and backward each rank runs before every pass
    (:func:`time_fsdp_unit`'s ``unit["workload"]``; None: nothing between the passes). ``param_dtype``:
    the units' ``MixedPrecisionPolicy`` dtype under a bf16 or fp16 recipe (``"bfloat16"``,
    ``"float16"``; None: none, float32), :func:`time_fsdp_unit`'s ``unit["param_dtype"]``. For
    :func:`~.costmodel_sharded.predict_fsdp`'s ``unit_path_s`` on this machine. Raises RuntimeError as
    :func:`~.microbench.measure_allreduce`, ValueError for a ``workload`` of another form
    (:func:`~.microbench_workload.check_workload`) or parameters that are not the units'."""
    from .microbench import measure_allreduce

    check_workload(workload)
    sizes = sorted({int(b) for b in unit_bytes if b > 0})
    if not sizes:
        return []
    specs: list[int | dict] = list(sizes)
    if parameters is not None:
        held = [sum(p.numel() * p.element_size() for p in own) for own in parameters]
        if held != [int(b) for b in unit_bytes]:
            raise ValueError(f"measured_fsdp_units: the units' parameters hold {held} bytes, not the units' "
                             f"{list(unit_bytes)}: give each unit's own parameters in the same order")
        first = {}
        for b, own in zip(unit_bytes, parameters):
            first.setdefault(int(b), own)
        specs = [{"bytes": b, "shapes": [list(p.shape) for p in first[b]],
                  "dtypes": [str(p.dtype).removeprefix("torch.") for p in first[b]]} for b in sizes]
    extra = {**({"workload": workload} if workload is not None else {}),
             **({"param_dtype": param_dtype} if param_dtype is not None else {})}
    if extra:
        specs = [{**(u if isinstance(u, dict) else {"shapes": [[max(2, u // 4)]]}), **extra} for u in specs]
    points = measure_allreduce(2, specs, repeats=repeats, warmup=3, timeout_s=timeout_s, op="fsdp_unit")
    return [[float(b), *t] for b, (_, t) in zip(sizes, points)]


__all__ = ["measured_sharded_optimizer", "measured_sharded_norm", "fsdp_unit_module", "time_fsdp_unit",
           "measured_fsdp_units",
           "optimizer_spec", "time_sharded_step", "measured_sharded_step"]
