"""The minimal-change API against plain DDP, on the same script: speed and loss.

``examples/lm_paratrain.py`` (the word-level LSTM script ported to paratrain in 10 lines) under
``paratrain launch --nproc P --strategy allreduce`` against ``benchmarks/peers/lm_ddp.py`` (the same
script ported to plain DistributedDataParallel by hand) under ``python -m torch.distributed.run
--nproc-per-node P``, alternating, R repeats, the same arguments, OMP_NUM_THREADS = cores // P and
gloo on the loopback interface for both.

Words/s: both scripts print the global words/s of every ``--log-interval`` batches (training only);
the first interval (warm-up) is left out, a run's value is the median of the others, and the
program's value the median over its runs. The ratio paratrain / DDP is of those medians (also the
smallest and largest ratio of one repeat's two runs). Loss: both print the validation loss after the
epoch and the test loss at the end; they compute the same mathematics (same data split over the
ranks, initialisation, seed), so they agree to float32 rounding.

Usage (an otherwise idle machine):
  python benchmarks/compare_ports.py --data-dir ../shared/data --repeats 5 --max-batches 400
Writes ``--json`` (default runs/compare_ports-<time>.json) and every run's log beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import REPO, run_cmd  # noqa: E402

INTERVAL = re.compile(r"\| epoch +\d+ \| +(\d+) batches .*?\| +(\d+) words/s \| loss +([\d.]+)")
VALID = re.compile(r"valid loss +([\d.]+)")
TEST = re.compile(r"test loss +([\d.]+)")


def programs(nproc: int, script_args: list[str]) -> dict[str, list[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1"]
    return {"ddp": [*torchrun, str(REPO / "benchmarks" / "peers" / "lm_ddp.py"), *script_args],
            "paratrain": [sys.executable, "-m", "paratrain.cli", "launch", "--nproc", str(nproc), "--strategy",
                          "allreduce", str(REPO / "examples" / "lm_paratrain.py"), *script_args]}


def parse(text: str) -> dict:
    intervals = [(int(b), int(w), float(loss)) for b, w, loss in INTERVAL.findall(text)]
    rates = [w for _, w, _ in intervals[1:]]  # the first interval is warm-up
    valid, test = VALID.findall(text), TEST.findall(text)
    return {"words_per_s": statistics.median(rates) if rates else float("nan"), "intervals": intervals,
            "valid_loss": float(valid[-1]) if valid else float("nan"), "test_loss": float(test[-1]) if test else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PARATRAIN_DATA", "../shared/data"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-batches", type=int, default=400)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.json or REPO / "runs" / f"compare_ports-{stamp}.json"
    logs = out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // args.nproc)), "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("PARATRAIN_STRATEGY", None)
    script_args = ["--data", str(Path(args.data_dir).resolve() / "ptb"), "--epochs", "1", "--max-batches",
                   str(args.max_batches), "--log-interval", str(args.log_interval), "--save", ""]
    runs: dict[str, list[dict]] = {"ddp": [], "paratrain": []}
    for r in range(args.repeats):
        for name, cmd in programs(args.nproc, script_args).items():
            cmd = [c if c else str(logs / f"{name}-{r}.pt") for c in cmd]
            log = logs / f"{name}-{r}.log"
            rc, wall = run_cmd(cmd, log, 1800, env)
            rec = {"repeat": r, "rc": rc, "wall_s": wall, **parse(log.read_text())}
            runs[name].append(rec)
            print(f"[{name:9s} r{r}] rc {rc}  {rec['words_per_s']:8.0f} words/s  valid loss {rec['valid_loss']:.4f}  "
                  f"test loss {rec['test_loss']:.4f}  ({wall:.0f} s)", flush=True)
    med = {n: statistics.median(x["words_per_s"] for x in v) for n, v in runs.items()}
    pairs = [a["words_per_s"] / b["words_per_s"] for a, b in zip(runs["paratrain"], runs["ddp"])]
    loss_diff = max(abs(a["valid_loss"] - b["valid_loss"]) for a, b in zip(runs["paratrain"], runs["ddp"]))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": cores, "nproc": args.nproc, "args": script_args,
              "median_words_per_s": med, "ratio_of_medians": med["paratrain"] / med["ddp"],
              "ratio_min": min(pairs), "ratio_max": max(pairs), "max_valid_loss_diff": loss_diff, "runs": runs}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"paratrain / DDP words/s: {result['ratio_of_medians']:.3f} (medians {med['paratrain']:.0f} / "
          f"{med['ddp']:.0f}; per repeat {min(pairs):.3f}-{max(pairs):.3f}); largest valid-loss difference "
          f"{loss_diff:.2e}; {out}")
    return 0 if all(x["rc"] == 0 for v in runs.values() for x in v) else 1


if __name__ == "__main__":
    sys.exit(main())
