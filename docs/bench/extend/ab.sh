#!/usr/bin/env bash
# A/B of two checkouts through the services, taking turns: `auto` vs target-only at T=1, where
# drafting rarely pays, at 1 and 16 streams, short (64) and long (512-token) generations.
#   docs/bench/extend/ab.sh OLD_CHECKOUT NEW_CHECKOUT OUT_DIR [ROUNDS]
set -euo pipefail
old=$1 new=$2 out=$3 rounds=${4:-2}
mkdir -p "$out"
py=${PYTHON:-$(pwd)/.venv/bin/python}
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    dir=$([ $side = old ] && echo "$old" || echo "$new")
    for len in 64 512; do
      n=$([ $len = 64 ] && echo 8 || echo 3)
      (cd "$dir" && PYTHONPATH="$dir" "$py" -m splitspec_tools.bench --configs target,auto-grpc --num-prompts $n \
        --max-new-tokens $len --max-prompt-tokens 512 --temperatures 1.0 --draft-sampling greedy --repeats 1 \
        --concurrency 16 --sweep-configs target,auto-grpc --sweep-temperatures 1.0 \
        --out "$out/r$r-$side-$len" --no-plots) > "$out/r$r-$side-$len.log" 2>&1
      echo "round $r $side $len done $(date +%T)"
    done
  done
done
