"""DDP's bf16 compression hook in ``paratrain plan``: its measured cost on this machine's CPUs
(:mod:`paratrain.bench.microbench_hooks`), its price per bucket (:mod:`paratrain.bench.costmodel_hooks`)
and where the plan uses it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.bench.costmodel import MIB, Link, Workload, make_buckets, predict
from paratrain.bench.costmodel_hooks import compress_hook_bucket_s
from paratrain.bench.plan_model import Layout, step_parts
from paratrain.bench.plan_rank import unpriced
from paratrain.bench.strategy_model import RING, SHARDED_OPTIMIZER
from paratrain.config import Config

ROOT = Path(__file__).resolve().parents[2]
# the whole hook between 2 ranks: 2 ms at 1 MB, 20 ms at 10 MB (2 ns a byte between them); its payload's
# link: 0.1 ms, 2 ns a byte
MEASURED = {"world_size": 2, "hook": [[1e6, 2e-3], [1e7, 2e-2]],
            "payload_link": {"alpha_s": 1e-4, "beta_s_per_byte": 2e-9, "gamma_s_per_byte": 0.0}}
W = Workload(forward_s=0.1, backward_s=0.2, data_s=0.0, optimizer_s=0.05, param_bytes=(4_000_000,) * 10,
             tokens_per_step=1000)


def test_a_bucket_under_the_hook_is_the_measured_hook_moved_to_n_by_its_payloads_ring():
    at2, at4 = compress_hook_bucket_s(2, MEASURED), compress_hook_bucket_s(4, MEASURED)
    # 8 MB at the measured 2 ranks: 2 ms + 18 ms x 7/9 = 16 ms
    assert at2(8e6) == pytest.approx(16e-3, rel=1e-12)
    # at 4 ranks its payload (4 MB) rings 6 x 0.1 ms + 2 (3/4) 4e6 x 2e-9 = 12.6 ms instead of
    # 2 x 0.1 ms + 2 (1/2) 4e6 x 2e-9 = 8.2 ms
    assert at4(8e6) == pytest.approx(16e-3 + 12.6e-3 - 8.2e-3, rel=1e-12)
    # below the smallest measured bucket its seconds; above the largest, its seconds per byte
    assert at2(5e5) == pytest.approx(2e-3, rel=1e-12) and at2(2e7) == pytest.approx(4e-2, rel=1e-12)
    assert compress_hook_bucket_s(1, MEASURED)(8e6) == 0.0 and at2(0) == 0.0  # no hook runs
    # 4 processes on cores for 2 (compute_scale 2): the hook's own work, 16 - 8.2 = 7.8 ms, takes twice as long
    assert compress_hook_bucket_s(4, MEASURED, compute_scale=2.0)(8e6) == pytest.approx(
        16e-3 + 7.8e-3 + 12.6e-3 - 8.2e-3, rel=1e-12)
    assert compress_hook_bucket_s(2, MEASURED, compute_scale=2.0)(8e6) == pytest.approx(16e-3 + 7.8e-3, rel=1e-12)


def test_predict_charges_each_bucket_its_measured_hook_seconds_without_overlap():
    link = Link(name="x", alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    bucket_mb = 8e6 / MIB  # five buckets of 8 MB
    assert make_buckets(W.param_bytes, bucket_mb * MIB) == [8_000_000] * 5
    plain = predict(W, 2, link, bucket_mb=bucket_mb, overlap=False)
    hooked = predict(W, 2, link, bucket_mb=bucket_mb, overlap=False, bucket_s=compress_hook_bucket_s(2, MEASURED))
    # plain: 5 x (2 x 0.1 ms + 8e6 x 1 ns) = 41 ms; the hook: 5 x 16 ms = 80 ms; local 0.35 s
    assert plain.step_s == pytest.approx(0.35 + 0.041, rel=1e-12)
    assert hooked.step_s == pytest.approx(0.35 + 0.080, rel=1e-12)
    assert hooked.exposed_comm_s == pytest.approx(0.080, rel=1e-12)


class _Ring:
    cost_model, synchronous, name = RING, True, "allreduce"


class _Zero1:
    cost_model, synchronous, name = SHARDED_OPTIMIZER, True, "zero1"


def test_the_plan_prices_a_bf16_layout_by_the_measured_hook_and_otherwise_by_half_the_bytes():
    link = Link(name="x", alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    lay = Layout("allreduce", 4, {"comm_hook": "bf16", "bucket_mb": 8e6 / MIB})
    halved = step_parts(_Ring(), lay, W, link, Config(), {}, overlap=False)
    priced = step_parts(_Ring(), lay, W, link, Config(), {"bf16_hook": MEASURED}, overlap=False)
    # halved: 5 x ring(4 MB, 4) = 5 x (6 x 0.1 ms + 1.5 x 4e6 x 1 ns) = 33 ms; measured: 5 x 20.4 ms
    assert halved["step_s"] == pytest.approx(0.35 + 0.033, rel=1e-12)
    assert priced["step_s"] == pytest.approx(0.35 + 0.102, rel=1e-12)
    assert priced["comm_s"] == pytest.approx(0.102, rel=1e-12)
    # at compute_scale 2 the local step doubles (0.7 s) and so does each bucket's own work: 5 x 28.2 ms
    scaled = step_parts(_Ring(), lay, W, link, Config(), {"bf16_hook": MEASURED}, overlap=False, compute_scale=2.0)
    assert scaled["step_s"] == pytest.approx(0.7 + 0.141, rel=1e-12)
    # zero1's gradients go through the same buckets and hook: the same 69 ms more, also where its step is
    # priced by the path measured between 2 processes (this machine's CPU: zero1_step_s)
    for path in ({}, {"zero1_step_s": 0.01}):
        halved, priced = [step_parts(_Zero1(), lay, W, link, Config(), {"units": [4_000_000] * 10, **path, **x},
                                     overlap=False) for x in ({}, {"bf16_hook": MEASURED})]
        assert priced["step_s"] - halved["step_s"] == pytest.approx(0.069, rel=1e-9), path
    # the measurement is the bf16 hook's alone: the plain layout and an fp16 one do not use it
    for overrides in ({"bucket_mb": 8e6 / MIB}, {"comm_hook": "fp16", "bucket_mb": 8e6 / MIB}):
        lay = Layout("allreduce", 4, overrides)
        assert (step_parts(_Ring(), lay, W, link, Config(), {"bf16_hook": MEASURED}, overlap=False)
                == step_parts(_Ring(), lay, W, link, Config(), {}, overlap=False))


def test_a_cpu_bf16_row_is_priced_only_where_its_hook_was_measured_on_this_machine():
    cpu, measured = {"device": "cpu"}, {"device": "cpu", "bf16_hook": MEASURED}
    assert unpriced(RING, measured, on_this_machine=True, comm_hook="bf16") == ""
    assert unpriced(RING, cpu, on_this_machine=True, comm_hook="bf16").startswith("bf16 hook on CPUs")
    assert unpriced(RING, measured, on_this_machine=False, comm_hook="bf16").startswith("bf16 hook on CPUs")
    assert unpriced(RING, measured, on_this_machine=True, comm_hook="fp16").startswith("fp16 hook on CPUs")


def test_the_stored_profile_with_a_measured_hook_prices_the_bf16_row_from_it():
    """The wiring from a profile's ``bf16_hook`` to the plan's row: a hook measured at c seconds a bucket
    over the plain link's all-reduce of the bucket predicts, at n = 2, the plain step plus c per
    bucket, and the row is priced."""
    from paratrain.bench.plan import predict_layout
    from paratrain.config import load

    prof = json.loads((ROOT / "benchmarks" / "results" / "plan-xeon" / "ptb_small-v23" / "profile.json").read_text())
    cfg = load(str(ROOT / "configs" / "ptb_small.toml"), [])
    ar = prof["links"]["all_reduce"]
    link = Link(name="measured", **ar)
    c = 0.004
    plain_ring = [[b, 2 * ar["alpha_s"] + b * (ar["beta_s_per_byte"] + ar["gamma_s_per_byte"] / 2) + c]
                  for b in (1.0, 1e8)]  # linear in b: exact between the two points
    prof = {**prof, "bf16_hook": {"world_size": 2, "hook": plain_ring, "payload_link": {
        "alpha_s": ar["alpha_s"], "beta_s_per_byte": 3 * ar["beta_s_per_byte"], "gamma_s_per_byte": 0.0}}}
    # (at the measured n = 2 the payload's link cancels out)

    def row(overrides, p=prof, here=True):
        return predict_layout(Layout("allreduce", 2, overrides, "x"), p, cfg, link, on_this_machine=here,
                              global_batch=None)

    plain, hooked = row({}), row({"comm_hook": "bf16"})
    buckets = make_buckets(prof["param_bytes"], plain["overrides"]["bucket_mb"] * MIB)
    assert hooked["overrides"]["bucket_mb"] == plain["overrides"]["bucket_mb"]
    assert hooked["step_s"] == pytest.approx(plain["step_s"] + c * len(buckets), rel=1e-9)
    assert hooked["unpriced"] == "" and plain["unpriced"] == ""
    without = {k: v for k, v in prof.items() if k != "bf16_hook"}
    assert row({"comm_hook": "bf16"}, without)["unpriced"].startswith("bf16 hook on CPUs")
    assert row({"comm_hook": "bf16"}, prof, here=False)["unpriced"].startswith("bf16 hook on CPUs")


@pytest.mark.slow
def test_the_hook_is_measured_between_two_processes_and_its_parts_are_kept():
    """A real two-process measurement (small buckets, few repeats): every part is a time and the
    payload's link is a fit (alpha, beta >= 0)."""
    from paratrain.bench.microbench_hooks import measured_compress_hook

    got = measured_compress_hook(sizes_bytes=(4096, 1 << 20), repeats=3, warmup=1, timeout_s=120.0)
    assert got["world_size"] == 2
    for key in ("cast", "payload", "hook"):
        assert [b for b, _ in got[key]] == [4096.0, float(1 << 20)] and all(t > 0 for _, t in got[key])
    link = got["payload_link"]
    assert link["alpha_s"] >= 0 and link["beta_s_per_byte"] >= 0 and link["gamma_s_per_byte"] == 0.0
    assert link["alpha_s"] + link["beta_s_per_byte"] > 0


def test_the_validation_runs_the_bf16_layouts_at_two_where_the_hook_was_measured(monkeypatch):
    from paratrain.bench import plan as pl
    from paratrain.bench import plan_validate as pv

    def lays(n):
        return [pl.Layout("allreduce", n, {}, "allreduce"), pl.Layout("allreduce", n, {"comm_hook": "bf16"},
                                                                      "allreduce + bf16 hook"),
                pl.Layout("allreduce", n, {"comm_hook": "fp16"}, "allreduce + fp16 hook")]
    monkeypatch.setattr(pl, "layouts", lambda n, prof, cfg: lays(n))
    monkeypatch.setattr(pl, "refusal", lambda *a: None)
    measured = {"device": "cpu", "bf16_hook": MEASURED, "batch_size": 8}
    runs = pv.validation_runs(measured, None, [1, 2, 4], "c.toml", None, [])
    assert [(lay.label, n) for lay, n in runs] == [("allreduce", 1), ("allreduce", 2), ("allreduce + bf16 hook", 2),
                                                   ("allreduce", 4)]
    for prof in ({"device": "cpu", "batch_size": 8}, {"device": "cuda:0", "bf16_hook": MEASURED, "batch_size": 8}):
        # not measured: priced by bytes
        assert [lay.label for lay, _ in pv.validation_runs(prof, None, [2], "c.toml", None, [])] == ["allreduce"]


def test_the_bucket_of_a_hooked_layout_is_the_one_its_own_step_formula_prices_fastest():
    """DDP's bucket for a bf16 layout is chosen by the price its step gets (:func:`step_parts`): with a
    hook of 20 ms a call at 1 MB and 1.1 ms a MB above that (overlapped with the backward, 8 ranks;
    the plan's own rows of this machine's CPU do not overlap, and there every bucket of a small model
    ties), 5 MB buckets (385.0 ms a step) beat the 2 MB (445.3 ms) the plain float32 ring
    picks; unmeasured, the payload is half the bytes; fp32 without a hook is unchanged."""
    from paratrain.bench.costmodel import BUCKET_CANDIDATES_MB
    from paratrain.bench.plan_model import best_bucket

    link = Link(name="x", alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    costly = {**MEASURED, "hook": [[1e6, 2e-2], [1e7, 3e-2]]}
    for n, hook, measured in [(8, "bf16", costly), (2, "bf16", costly), (8, "bf16", MEASURED), (8, "fp16", None),
                              (8, None, None)]:
        inputs = {"bf16_hook": measured} if measured else {}
        steps = {mb: step_parts(_Ring(), Layout("allreduce", n, {"comm_hook": hook or "none", "bucket_mb": mb}), W,
                                link, Config(), inputs, overlap=True)["step_s"] for mb in BUCKET_CANDIDATES_MB}
        fastest = min(sorted(steps, reverse=True), key=steps.__getitem__)  # ties to the larger, as pick_bucket
        assert best_bucket(W, n, link, 1.0, True, hook, measured) == fastest, (n, hook, steps)
    assert best_bucket(W, 8, link, 1.0, True, "bf16", costly) == 5.0
    assert best_bucket(W, 8, link, 1.0, True) == 2.0  # the plain ring's choice, which the hooked layout had been given
    steps8 = {mb: step_parts(_Ring(), Layout("allreduce", 8, {"comm_hook": "bf16", "bucket_mb": mb}), W, link,
                             Config(), {"bf16_hook": costly}, overlap=True)["step_s"] for mb in (2.0, 5.0)}
    assert steps8[5.0] < steps8[2.0]


def test_paratrain_predict_prices_each_bucket_by_the_measured_hook_at_each_n():
    """``paratrain predict``'s curve with a measured bf16 hook: at every N each bucket costs
    :func:`compress_hook_bucket_s` at that N (the ring's formula), not the halved payload,
    and the bucket it picks is the one that price predicts fastest."""
    import argparse
    from dataclasses import replace

    from paratrain.bench.predict_command import _curve
    from paratrain.bench.costmodel import pick_bucket

    link = Link(name="x", alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    args = argparse.Namespace(strategy="allreduce", algorithm="ring", bucket_mb=None, num_ps=1)
    preds = _curve(args, Config(), None, link, [1, 2, 4])(W, MEASURED)
    for p in preds:
        priced = compress_hook_bucket_s(p.n, MEASURED)
        assert p.bucket_mb == pick_bucket(W, p.n, link, bucket_s=priced)
        assert p.step_s == predict(W, p.n, link, bucket_mb=p.bucket_mb, bucket_s=priced).step_s
    assert preds[0].step_s == pytest.approx(W.local_s())  # one device: no hook runs
    halved = _curve(args, Config(), None, link, [4])(replace(W, payload_ratio=0.5))
    assert preds[2].step_s > halved[0].step_s  # the measured hook costs more than half the bytes on this link
