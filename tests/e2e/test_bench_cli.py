"""``paratrain bench`` and ``paratrain predict`` as a user runs them, on the tiny corpus."""
from __future__ import annotations

import json

import pytest

from .test_cli import TINY, paratrain

pytestmark = pytest.mark.slow


def test_bench_two_workers_writes_results_report_and_plots(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    out = tmp_path / "bench"
    # 36 timed steps: on a loaded machine one preemption that lands between two timed spans is
    # counted as "other", so a sample of 8 steps of 1-10 ms moved the coverage by 5-10% (CI saw 0.89)
    r = paratrain("bench", "tiny.toml", "--strategies", "single,allreduce,ps-sync", "--nproc", "1,2", "--steps", "40",
                  "--warmup", "4", "--scaling", "weak,strong", "--data-dir", tiny_data, "--out", out, cwd=tmp_path,
                  timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert all(run["ok"] for run in res["runs"]), [run["name"] for run in res["runs"] if not run["ok"]]
    for mode in ("weak", "strong"):
        rows = {(row["strategy"], row["n"]): row for row in res["scaling"][mode]}
        assert set(rows) == {("single", 1), ("allreduce", 1), ("allreduce", 2), ("ps-sync", 1), ("ps-sync", 2)}
        assert rows[("single", 1)]["speedup"] == pytest.approx(1.0)
        two = rows[("allreduce", 2)]
        assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
        assert len(two["per_rank_ms"]) == 2 and two["breakdown_ms"]["comm_ms"] > 0
        assert two["per_replica_batch"] == (4 if mode == "weak" else 2)
        for key, row in rows.items():
            # every rank times its forward/backward and optimizer step, and every run but single its exchange
            # (DDP's hook and the PS client time theirs at N = 1 too)
            for rank_ms in row["per_rank_ms"]:
                assert rank_ms["compute_ms"] > 0 and rank_ms["optimizer_ms"] > 0, (key, rank_ms)
                assert rank_ms["comm_ms"] > 0 or key == ("single", 1), (key, rank_ms)
            # the timed parts add up to the step by the throughput clock (left out: logging, the loop, and
            # preemptions between spans; PS: rank 0's logging asks the servers for statistics, not in a step)
            assert (0.85 if key[0] != "ps-sync" else 0.6) < row["breakdown_coverage"] < 1.1, row
    for name in ("report.md", "throughput.png", "efficiency.png", "breakdown.png"):
        assert (out / name).stat().st_size > 500, name
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    # the output folder is never overwritten
    again = paratrain("bench", "tiny.toml", "--data-dir", tiny_data, "--out", out, cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_predict_from_a_measured_step(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("predict", "tiny.toml", "--nproc", "16", "--interconnect", "eth25", "--steps", "12",
                  "--data-dir", tiny_data, "--plot", tmp_path / "curve.png", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 4, 8, 16]
    eff = [float(row[5]) for row in rows]
    assert eff[0] == 1.0 and all(a >= b for a, b in zip(eff, eff[1:]))
    assert "bucket size it would pick" in r.stdout
    # a flat network preset is priced as paratrain plan prices it (tests/unit/test_plan_two_level.py)
    assert "every device its own machine and NIC: all-reduce on NCCL's rings and trees" in r.stdout, r.stdout
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    bad = paratrain("predict", "tiny.toml", "--nproc", "0", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    # said before the measurement, in predict's own flags (it has no --warmup; buckets are MiB)
    for args, said in ((("--steps", "1"), "--steps 1: predict times the one-device step over --steps steps"),
                       (("--bucket-mb", "-1"), "--bucket-mb -1: give DDP's bucket size in MiB, > 0")):
        bad = paratrain("predict", "tiny.toml", *args, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, bad.stderr
        assert "measuring one device" not in bad.stdout
    # the exposed communication of one device is 0.00, not -0.00; a row's bucket only where DDP buckets
    assert " -0.00 " not in r.stdout


@pytest.mark.parametrize("interconnect, said", [
    ("nvlink+ib400", "--interconnect 'nvlink+ib400': a cluster of machines (INTRA+INTER) is priced by paratrain "
                     "plan CONFIG --interconnect nvlink+ib400; paratrain predict takes one link: use one of nvlink"),
    ("carrier-pigeon", "--interconnect 'carrier-pigeon' is unknown; use one of nvlink, pcie5, ib400, eth25, measured"),
])
def test_predict_refuses_an_interconnect_it_does_not_price_in_one_line(tmp_path, interconnect, said):
    (tmp_path / "tiny.toml").write_text(TINY)
    bad = paratrain("predict", "tiny.toml", "--interconnect", interconnect, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and list(tmp_path.iterdir()) == [tmp_path / "tiny.toml"]


def test_predict_learns_the_compressed_payload_of_a_comm_hook(tmp_path, tiny_data):
    """``--comm-hook fp16`` measures the hook's payload in a 2-process run: the float64 tiny model's
    gradients travel as 2-byte values, a ratio of exactly 0.25, and the table adds the uncompressed
    words/s and the gain (1 at N = 1, where nothing is sent)."""
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("predict", "tiny.toml", "--nproc", "8", "--interconnect", "eth25", "--steps", "6",
                  "--comm-hook", "fp16", "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(ratio 0.2500, measured from the hook" in r.stdout, r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 4, 8]
    gains = [float(row[-1]) for row in rows]
    assert gains[0] == 1.0 and all(g >= 1.0 for g in gains)
    bad = paratrain("predict", "tiny.toml", "--comm-hook", "fp16", "--algorithm", "ps", cwd=tmp_path)
    assert bad.returncode == 2 and "parameter server" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_predict_prices_a_bf16_hook_by_its_own_measurement_on_this_cpu(tmp_path, tiny_data):
    """``--comm-hook bf16 --interconnect measured`` on a CPU (float32 gradients) times torch's
    bf16_compress_hook here and prices each bucket by it (as ``paratrain plan`` does), instead of the
    payload run's count of bytes; N = 1 sends nothing (gain 1). A float64 recipe (the measurement's
    buckets are float32) and the tree algorithm measure the payload as before."""
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("predict", "tiny.toml", "--nproc", "4", "--steps", "6", "--comm-hook", "bf16", "--set",
                  'dist.device="cpu"', "--set", 'train.dtype="float32"', "--data-dir", tiny_data, cwd=tmp_path,
                  timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "each bucket priced by that measurement" in r.stdout and "measuring the payload" not in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 4] and float(rows[0][-1]) == 1.0
    for other in (["--set", 'dist.device="cpu"'], ["--set", 'dist.device="cpu"', "--set", 'train.dtype="float32"',
                                                   "--algorithm", "tree"]):
        r = paratrain("predict", "tiny.toml", "--nproc", "2", "--steps", "6", "--comm-hook", "bf16", *other,
                      "--data-dir", tiny_data, cwd=tmp_path, timeout=400)
        assert r.returncode == 0 and "measuring the payload" in r.stdout and "priced by that" not in r.stdout, other


@pytest.mark.parametrize("strategy, ns", [("fsdp", [1, 2, 4]), ("zero1", [1, 2, 4]), ("pipeline", [2, 4])])
def test_predict_covers_the_sharded_and_pipeline_strategies(tmp_path, tiny_data, strategy, ns):
    """``--strategy`` predicts zero1, fsdp and pipeline from the same single-device step (a pipeline
    of 2 stages at N = 2, 4 processes); on one device nothing is communicated (N = 1: the measured
    step: nothing exposed; more processes expose communication)."""
    from .test_pipeline_cli import GPT

    (tmp_path / "gpt.toml").write_text(GPT)
    r = paratrain("predict", "gpt.toml", "--nproc", "4", "--interconnect", "eth25", "--steps", "6",
                  "--strategy", strategy, "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"strategy {strategy};" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == ns
    # a sharded optimizer's DTensor dispatch is plan's alone: predict says it leaves it out
    assert ("what stepping it on DTensor shards costs beyond that is not in this curve" in r.stdout) == (
        strategy != "pipeline")
    if strategy == "pipeline":  # the stages' measured shares, which the prediction is paced by
        assert "2 stages (dist.pipeline_split 'even'): share of a micro-batch's forward + backward" in r.stdout
    if ns[0] == 1:
        assert float(rows[0][2]) == 0.0  # one device: nothing exposed
    assert all(float(row[2]) > 0 for row in rows if int(row[0]) > 1)
    # a bucket where DDP buckets (zero1 is DDP with a sharded optimizer), none for fsdp or a pipeline
    assert all((row[6] == "-") == (strategy != "zero1" or int(row[0]) == 1) for row in rows), rows


def test_predict_refuses_a_pipeline_before_measuring_anything(tmp_path, tiny_data):
    """A pipeline the recipe cannot run is refused in one line before the one-device measurement: the
    digits CNN has BatchNorm (the stages' statistics would differ from one device's), and predict's N
    (the powers of 2 up to --nproc, and --nproc) must hold a multiple of the recipe's stages."""
    from pathlib import Path

    from .test_pipeline_cli import GPT

    pytest.importorskip("sklearn")
    digits = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    bad = paratrain("predict", digits, "--strategy", "pipeline", "--nproc", "4", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--strategy pipeline: strategy 'pipeline' does not run a model with BatchNorm" in bad.stderr, bad.stderr
    assert "measuring one device" not in bad.stdout and "Traceback" not in bad.stderr
    (tmp_path / "gpt.toml").write_text(GPT)
    for args, said in ((("--nproc", "1"), "--nproc 1: a pipeline of 2 stages runs on a multiple of 2 processes"),
                       (("--nproc", "4", "--set", "dist.pipeline_stages=3", "--set", "dist.nproc=3"),
                        "--nproc 4: a pipeline of 3 stages runs on a multiple of 3 processes, and predict's N "
                        "(1, 2, 4: the powers of 2 up to --nproc, and --nproc) hold none; give --nproc a "
                        "multiple of 3")):
        bad = paratrain("predict", "gpt.toml", "--strategy", "pipeline", *args, "--data-dir", tiny_data, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, bad.stderr
        assert "measuring one device" not in bad.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "gpt.toml"]
