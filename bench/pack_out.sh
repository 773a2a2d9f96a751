# Sourced by the bench scripts that run on the device machine. The device tool brings back at most 8
# files from $OUT: on exit (also after a failure), everything written there is packed into
# $OUT/results.tgz. Only a folder given from outside (the tool's $OUT) is packed, never a local default.
PACK_DIR="${OUT:-}"
pack_out() {
  if [ -n "$PACK_DIR" ] && [ -d "$PACK_DIR" ]; then
    (cd "$PACK_DIR" && files=$(ls -A | grep -v '^results.tgz$' || true) && [ -n "$files" ] && \
      tar czf results.tgz $files && rm -rf $files) || true
  fi
}
trap pack_out EXIT

# run_stages RESULTS_DIR STAGE...: run_stage for each; a failing stage (a failed GPU test, say) is
# reported and does not stop the ones after it; then every figure in RESULTS_DIR (bench/summary.py),
# in the few kilobytes of output the device tool returns. Exits 1 when a stage failed.
run_stages() {
  local dir="$1" status=0 stage rc
  shift
  for stage in "$@"; do
    run_stage "$stage" || { rc=$?; echo "=== stage $stage failed (exit $rc)" >&2; status=1; }
  done
  python3 bench/summary.py "$dir" || true
  exit $status
}
