# Sourced by the benchmarks/*_runs.sh scripts after they set OUT (kept results) and RUNS (run dirs):
# makes both folders and defines keep NAME, which copies run NAME's metrics.jsonl and its last
# summary record into $OUT.
mkdir -p "$OUT" "$RUNS"
keep() {
  cp "$RUNS/$1/metrics.jsonl" "$OUT/$1.metrics.jsonl"
  grep '"kind": "summary"' "$RUNS/$1/metrics.jsonl" | tail -1 > "$OUT/$1.summary.json"
}
