# Sourced by the bench scripts that run on the device machine. The device tool brings back at most 8
# files from $OUT: on exit (also after a failure), everything written there is packed into
# $OUT/results.tgz. Only a folder given from outside (the tool's $OUT) is packed, never a local default.
PACK_DIR="${OUT:-}"
pack_out() {
  if [ -n "$PACK_DIR" ] && [ -d "$PACK_DIR" ]; then
    (cd "$PACK_DIR" && files=$(ls -A | grep -v '^results.tgz$' || true) && [ -n "$files" ] && \
      tar czf results.tgz $files && rm -f $files) || true
  fi
}
trap pack_out EXIT
