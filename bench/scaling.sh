#!/usr/bin/env bash
# Scaling runs of issue 7 on one node of 8 (or 4) H200s, in stages that each fit one 10-minute device
# call (a run is ~1.5-2 min, most of it compilation). Every figure lands in $OUT/bench_gpt.jsonl and
# $OUT/layout_match.jsonl (or ./bench_out/), and the summary is printed last.
#
#   NGPUS=8 bash bench/scaling.sh STAGE...      (NGPUS defaults to 8; with 4, runs needing 8 are skipped;
#                                                with 2, a check of the scripts: dp2, tp2 and their match)
#
#   weak-dp      llama-3b, the same per-GPU work on 1, 2, 4, 8 GPUs, dp with bf16 gradient reduction  ~8 min
#   weak-tp2     llama-3b, tp2 (+SP) x dp1/2/4 on 2, 4, 8 GPUs (efficiency against the tp2 pair)        ~6 min
#   weak-fp32    llama-3b, dp on 2, 4, 8 GPUs with fp32 gradient reduction (the default)              ~6 min
#   8b-best      Llama-3-8B: distributed optimizer + overlapped param gather, dp and tp2 x dp          ~8 min
#   8b-layouts   Llama-3-8B: tp4 x dp, tp8, tp2 x pp2 x dp, tp2 x pp4 with virtual stages (on 4: pp4)   ~8 min
#   3b-layouts   llama-3b: tp4 x dp, tp8, tp2 x pp2 x dp, tp2 x pp4 with virtual stages (on 4: pp4)     ~8 min
#   match        every layout above against one GPU over 50 bf16 steps of a smaller model, on NCCL    ~7 min
#   recheck      one GPU, dp at NGPUS and Llama-3-8B's best layout again, after the twelfth pass's fixes ~6 min
#
# Priority for a short session: weak-dp, weak-tp2, 8b-best (the issue's three targets), then the rest;
# on four GPUs, where those ran in the twelfth pass: recheck, 3b-layouts, weak-fp32.
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/pack_out.sh  # pack $OUT into results.tgz on exit
N="${NGPUS:-8}"
OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
nvidia-smi topo -m > "$OUT_DIR/topo.txt" 2>&1 || true  # how the GPUs are connected (NVLink or not)
# A run that fails (for example out of memory) is reported and the next one runs.
try() { "$@" || echo "FAILED (exit $?): $*" | tee -a "$OUT_DIR/scaling_failures.txt"; }
# + step-time breakdown (idle, exposed communication) of every run
B="try python3 bench/bench_gpt.py --iters 16 --warmup 4 --breakdown"
SP="--sequence-parallel"
DP="--overlap-grad-reduce"
BF16R="--overlap-grad-reduce --grad-reduce-in-bf16"
DISTOPT="--use-distributed-optimizer --overlap-param-gather"

# layouts CONFIG: tp4 x dp, tp8, tp2 x pp2 x dp, tp2 x pp4 with two virtual stages per rank.
layouts() {
  local cfg="$1" vpp="--num-layers-per-virtual-pipeline-stage 2"
  # llama-3b's 26 layers do not split evenly over 4 ranks: 6 / 8 / 8 / 4 (the last stage also holds
  # the 128k-vocabulary output layer, worth ~4 layers of GEMMs).
  [ "$cfg" = llama-3b ] && vpp="--virtual-pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 4"
  [ "$N" -ge 4 ] || { echo "layouts: tp4, tp8, tp2 x pp2 and tp2 x pp4 need 4 or 8 GPUs (NGPUS=$N)"; return 0; }
  $B --configs "$cfg" --nproc "$N" --tag _tp4 --extra="--tensor-model-parallel-size 4 $SP $BF16R"
  [ "$N" -ge 8 ] && $B --configs "$cfg" --nproc "$N" --tag _tp8 --extra="--tensor-model-parallel-size 8 $SP"
  $B --configs "$cfg" --nproc "$N" --tag _tp2pp2 \
      --extra="--tensor-model-parallel-size 2 $SP --pipeline-model-parallel-size 2 $BF16R --global-batch-size $((4 * N))"
  [ "$N" -ge 8 ] && $B --configs "$cfg" --nproc "$N" --tag _tp2pp4vpp \
      --extra="--tensor-model-parallel-size 2 $SP --pipeline-model-parallel-size 4 $vpp --global-batch-size $((8 * N))"
  # On 4 GPUs the virtual-stage layout is pp4 without tensor parallelism (tp2 x pp4 needs 8).
  [ "$N" = 4 ] && $B --configs "$cfg" --nproc "$N" --tag _pp4vpp \
      --extra="--pipeline-model-parallel-size 4 $vpp --global-batch-size $((8 * N))"
  # The 8B's last stage also runs the 128k-vocabulary output layer and the loss (~2 layers of GEMMs):
  # 9 / 9 / 9 / 5 layers without virtual stages, and with two virtual stages per rank 9 / 9 / 8 / 6
  # (chunks 5+4, 5+4, 4+4, 3+3), against pp4vpp's equal split (twelfth pass: 20% of the step waiting).
  if [ "$N" = 4 ] && [ "$cfg" = llama3-8b ]; then
    $B --configs "$cfg" --nproc "$N" --tag _pp4_last5 \
        --extra="--pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 5 --global-batch-size $((8 * N))"
    $B --configs "$cfg" --nproc "$N" --tag _pp4vpp_balanced \
        --extra="--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout Et*5|t*5|t*4|t*3|t*4|t*4|t*4|t*3L --global-batch-size $((8 * N))"
  fi
  return 0
}

run_stage() {
  case "$1" in
    weak-dp)
      for n in 1 2 4 8; do
        [ "$n" -le "$N" ] || continue
        if [ "$n" = 1 ]; then $B --configs llama-3b --tag _1gpu; else $B --configs llama-3b --nproc "$n" --tag "_dp${n}_bf16r" --extra="$BF16R"; fi
      done ;;
    weak-tp2)
      for n in 2 4 8; do
        [ "$n" -le "$N" ] || continue
        $B --configs llama-3b --nproc "$n" --tag "_tp2dp$((n / 2))" --extra="--tensor-model-parallel-size 2 $SP $BF16R"
      done ;;
    weak-fp32)
      for n in 2 4 8; do
        [ "$n" -le "$N" ] || continue
        $B --configs llama-3b --nproc "$n" --tag "_dp${n}" --extra="$DP"
      done ;;
    8b-best)
      # Llama-3-8B under pure DP needs ~144 GB per GPU with a replicated optimizer: shard it.
      $B --configs llama3-8b --nproc "$N" --tag _distopt_opg --extra="$BF16R $DISTOPT"
      $B --configs llama3-8b --nproc "$N" --tag _tp2_distopt_opg --extra="--tensor-model-parallel-size 2 $SP $BF16R $DISTOPT"
      $B --configs llama3-8b --nproc "$N" --tag _tp2 --extra="--tensor-model-parallel-size 2 $SP $BF16R" ;;
    recheck)
      # The twelfth pass's two changes: gradients reduced where autograd left them (dp's 6 ms bucket copy)
      # and the loss all-reduce before the step (the 8B's 52 ms stall behind the weight broadcasts).
      $B --configs llama-3b --tag _1gpu
      $B --configs llama-3b --nproc "$N" --tag "_dp${N}_bf16r" --extra="$BF16R"
      $B --configs llama3-8b --nproc "$N" --tag _distopt_opg --extra="$BF16R $DISTOPT" ;;
    8b-layouts) layouts llama3-8b ;;
    3b-layouts) layouts llama-3b ;;
    match)
      # Global batch divisible by micro-batch 4 x every DP degree below; 8 query groups so that tp8 splits them.
      local g="--global-batch-size 32 --num-query-groups 8"
      local l="1:$g;$N:$g;$N:$g --tensor-model-parallel-size 2 $SP"
      [ "$N" -ge 4 ] && l="$l;$N:$g --tensor-model-parallel-size 4 $SP;$N:$g --tensor-model-parallel-size 2 $SP --pipeline-model-parallel-size 2"
      [ "$N" = 4 ] && l="$l;$N:$g --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1"
      [ "$N" -ge 8 ] && l="$l;$N:$g --tensor-model-parallel-size 8 $SP;$N:$g --tensor-model-parallel-size 2 $SP --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1"
      try python3 bench/layout_match.py --iters 50 --layouts "$l" ;;
    *) echo "unknown stage $1 (weak-dp, weak-tp2, weak-fp32, 8b-best, 8b-layouts, 3b-layouts, match, recheck)" >&2; return 2 ;;
  esac
}

[ "$#" -gt 0 ] || { echo "usage: NGPUS=8 bash bench/scaling.sh STAGE... (see the header)" >&2; exit 2; }
run_stages "$OUT_DIR" "$@"
