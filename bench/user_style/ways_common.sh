# Sourced by ways_in_gpu.sh and ways_in_2gpu.sh: OUTDIR made absolute ($out), the repository ($here), a
# temporary folder removed at the end ($work, the current folder), the environment the user's scripts run in,
# and `way NAME SECONDS COMMAND...`: the console to OUTDIR/NAME.txt (its last line the exit code), the
# report the command wrote to $work/NAME/report.json to OUTDIR/NAME_report.json.
set -u
out="${1:?usage: $(basename "$0") OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
here="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=80
export VLMDOCTOR_EXAMPLES_CACHE="$work/checkpoints" TQDM_DISABLE=1
cd "$work" || exit 1
way() {
    local name="$1" limit="$2"
    shift 2
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "$name: exit $?" >>"$out/$name.txt"
    cp "$work/$name/report.json" "$out/${name}_report.json" 2>/dev/null || echo "$name: no report" >>"$out/$name.txt"
}
