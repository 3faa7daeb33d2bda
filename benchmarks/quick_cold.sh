#!/bin/sh
# One cold run of the README's quick config from the source tree TREE (default: this clone),
# with fresh caches, workdir and registry, appending "TREE rc= wall= dir=" to
# ${QUICK_COLD_RESULTS:-/tmp/quick_cold.results}. Compare two trees in turn, e.g.
#   git worktree add --detach /tmp/base REV   # then, in it, link what the editable install maps:
#   (cd /tmp/base && ln -s ../flows tilecast/flows && ln -s ../tasks tilecast/tasks &&
#    ln -s ../kernels tilecast/_kernels && ln -s ../configs tilecast/_configs)
#   farm-bench -n 2 --warmup 0 --timeout 3000 --vs "benchmarks/quick_cold.sh /tmp/base" -- \
#       benchmarks/quick_cold.sh "$PWD"
# (run each tree once before timing it: a fresh tree's first run also byte-compiles it).
TREE=${1:-$(cd "$(dirname "$0")/.." && pwd)}
VENV=${TILECAST_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}
D=$(mktemp -d /tmp/quick-cold-XXXX)
export PYTHONPATH="$TREE" DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false \
       TILECAST_CACHE="$D/c" TILECAST_BUILD_CACHE="$D/b"
start=$(date +%s.%N)
"$VENV/bin/tilecast" run --config quick --workdir "$D/w" --registry "$D/r" >"$D/out.log" 2>"$D/err.log"
rc=$?
end=$(date +%s.%N)
echo "$TREE rc=$rc wall=$(echo "$end - $start" | bc) dir=$D" >> "${QUICK_COLD_RESULTS:-/tmp/quick_cold.results}"
exit $rc
