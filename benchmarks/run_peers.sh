#!/usr/bin/env bash
# Peer comparison: paratrain allreduce against the same training written as a plain
# hand-written DDP loop, with Hugging Face Accelerate and with Lightning Fabric
# (benchmarks/peers/). Runs them alternately, R repeats, and prints words/s min/median/max
# per program, paratrain/peer ratios and every program's validation perplexity.
#
# The peers need the benchmark extras (not runtime dependencies of paratrain):
#   pip install -e ".[peers]"
#
# Usage: benchmarks/run_peers.sh [compare_peers.py flags, e.g. --repeats 1 --steps 40 --only plain,paratrain]
# Defaults: --repeats 5 --steps 400 --nproc 2; later flags override them. Data: $PARATRAIN_DATA
# (default ../shared/data, relative to the repository root). Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PARATRAIN_DATA="${PARATRAIN_DATA:-../shared/data}"
exec python benchmarks/peers/compare_peers.py --repeats 5 --steps 400 --nproc 2 "$@"
