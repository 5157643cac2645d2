# Sourced by the bench scripts: their common set-up, and one `vlmdoctor profile` run under a time
# limit, so that a device call with a fixed length gets every run it can finish and a line for each
# one it cannot.
#
#   bench_setup OUT
#
# makes OUT, puts this checkout first on PYTHONPATH, and gives the runs one Inductor/Triton cache
# under OUT/compile-cache, so that later compiled runs reuse what earlier ones compiled.
#
#   timed_profile NAME OUT PROFILE_ARGS...
#
# runs `$PY -m vlmdoctor profile PROFILE_ARGS --json OUT/NAME.json --force` under `timeout`. The
# limit is RUN_TIMEOUT (default 300 s) or what is left before DEADLINE (epoch seconds), whichever
# is less; with less than MIN_LEFT (default 30) seconds left the run is skipped. The console goes
# to OUT/NAME.txt; a skip or a timeout is its last line, which the scripts' tables show.
bench_setup() {
  mkdir -p "$1"
  PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH PYTHONUNBUFFERED=1
  export TORCHINDUCTOR_CACHE_DIR="$1/compile-cache/inductor" TRITON_CACHE_DIR="$1/compile-cache/triton"
}

timed_profile() {
  local name=$1 out=$2 limit=${RUN_TIMEOUT:-300} left start rc
  shift 2
  if [ -n "${DEADLINE:-}" ]; then
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt "${MIN_LEFT:-30}" ]; then
      echo "   skipped, past DEADLINE"; echo "skipped: past DEADLINE" > "$out/$name.txt"; return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  start=$(date +%s)
  timeout "$limit" "${PY:-python3}" -m vlmdoctor profile "$@" --json "$out/$name.json" --force > "$out/$name.txt" 2>&1
  rc=$?
  echo "   exit $rc, $(( $(date +%s) - start )) s (limit $limit s)"
  [ "$rc" = 124 ] && echo "stopped after $limit s (timeout)" >> "$out/$name.txt"
  return 0
}
