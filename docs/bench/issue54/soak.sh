#!/bin/bash
# The mixed soak of issue 54 item 8 (docs/prefix-caching.md#memory-the-stated-plateau-and-a-soak):
# the bundled code pair (target, DFlash draft, gateway) on loopback, then `splitspec loadtest`
# with 24 streams, a quarter of the requests JSON-schema constrained on one shared 256-token
# prefix, the services' RSS sampled every 15 s; the report is OUT_DIR/report.json.
# CODE_DIR is the source tree the services run from (a checkout of the version under test:
# `git archive REV | tar -x -C DIR`), so two versions can be soaked from one checkout.
# usage: docs/bench/issue54/soak.sh CODE_DIR OUT_DIR DURATION_S BASEPORT
CODE=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); DUR=$3; P=$4
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd $ROOT && . .venv/bin/activate
export PYTHONPATH=$CODE
M=$ROOT/models
splitspec-target --model-path $M/splitspec-code-target --port $P --torch-threads 1 > $OUT/target.log 2>&1 &
TP=$!
splitspec-draft --method dflash --model-path $M/splitspec-code-draft --target-model-path $M/splitspec-code-target --port $((P+1)) --torch-threads 1 > $OUT/draft.log 2>&1 &
DP=$!
splitspec-gateway --target 127.0.0.1:$P --draft 127.0.0.1:$((P+1)) --speculative-algorithm DFLASH --port $((P+2)) > $OUT/gateway.log 2>&1 &
GP=$!
echo "$TP $DP $GP" > $OUT/pids
python - <<PY
import time, sys
sys.path.insert(0, "$ROOT")
from splitspec_tools.ops.launch import health_status
for a in ("127.0.0.1:$P", "127.0.0.1:$((P+1))", "127.0.0.1:$((P+2))"):
    t = time.time()
    while health_status(a) != 1:
        time.sleep(0.5)
        assert time.time() - t < 300, a
print("up")
PY
PYTHONPATH=$ROOT splitspec loadtest --gateway 127.0.0.1:$((P+2)) --target 127.0.0.1:$P --draft 127.0.0.1:$((P+1)) \
  --streams 24 --duration-s $DUR --schema-share 0.25 --memory-every-s 15 --json > $OUT/report.json 2> $OUT/loadtest.err
echo "rc $?" >> $OUT/loadtest.err
kill $TP $DP $GP
wait
