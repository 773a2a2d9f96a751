#!/usr/bin/env bash
# Scaling runs of issue 7 on one node of 8 (or 4) H200s: the layouts, weak scaling and NCCL loss
# matches. Every figure lands in $OUT/bench_gpt.jsonl and $OUT/layout_match.jsonl (or ./bench_out/).
#
#   bash bench/scaling.sh [NGPUS]      (default 8; 4 runs the layouts that fit)
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/pack_out.sh  # pack $OUT into results.tgz on exit
N="${1:-8}"
# A layout that fails (for example out of memory) is reported and the next one runs.
B="try python3 bench/bench_gpt.py --iters 20 --warmup 5 --breakdown"  # + step-time breakdown (idle, exposed comm)
mkdir -p "${OUT:-bench_out}"
nvidia-smi topo -m > "${OUT:-bench_out}/topo.txt" 2>&1 || true  # how the GPUs are connected (NVLink or not)
try() { "$@" || echo "FAILED (exit $?): $*" | tee -a "${OUT:-bench_out}/scaling_failures.txt"; }

# 1. Layouts on N GPUs, llama-3b and Llama-3-8B (global batch = micro-batch x DP unless given).
for cfg in llama-3b llama3-8b; do
  $B --configs "$cfg" --nproc "$N" --extra="--overlap-grad-reduce"                                        # dpN
  # Llama-3-8B under pure DP needs ~144 GB per GPU with a replicated optimizer: shard it.
  [ "$cfg" = llama3-8b ] && $B --configs "$cfg" --nproc "$N" --tag _distopt --extra="--overlap-grad-reduce --use-distributed-optimizer"
  [ "$cfg" = llama3-8b ] && $B --configs "$cfg" --nproc "$N" --tag _distopt_opg \
      --extra="--overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather"
  [ "$cfg" = llama3-8b ] && $B --configs "$cfg" --nproc "$N" --tag _tp2_distopt_opg \
      --extra="--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather"
  $B --configs "$cfg" --nproc "$N" --extra="--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce"
  $B --configs "$cfg" --nproc "$N" --extra="--tensor-model-parallel-size 4 --sequence-parallel --overlap-grad-reduce"
  [ "$N" -ge 8 ] && $B --configs "$cfg" --nproc "$N" --extra="--tensor-model-parallel-size 8 --sequence-parallel"
  $B --configs "$cfg" --nproc "$N" --extra="--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --global-batch-size $((4 * N))"
  # tp2 x pp4 with two virtual stages per rank. llama-3b's 26 layers do not split evenly over 4 ranks:
  # 6 / 8 / 8 / 4 (the last stage also holds the 128k-vocabulary output layer, worth ~4 layers of GEMMs).
  vpp="--num-layers-per-virtual-pipeline-stage 2"
  [ "$cfg" = llama-3b ] && vpp="--virtual-pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 4"
  [ "$N" -ge 8 ] && $B --configs "$cfg" --nproc "$N" --extra="--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4 $vpp --global-batch-size $((8 * N))"
done

# 2. Weak scaling: the same per-GPU work on 1, 2, 4, 8 GPUs (dp, then tp2 x dp).
for n in 1 2 4 8; do
  [ "$n" -le "$N" ] || continue
  $B --configs llama-3b --nproc "$n" --extra="--overlap-grad-reduce"
  [ "$n" -ge 2 ] && $B --configs llama-3b --nproc "$n" --extra="--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce"
done

# 3. Correctness on NCCL: every layout against one GPU over 50 bf16 steps (a smaller model).
G="--global-batch-size 32"  # divisible by micro-batch 4 x every DP degree below
try python3 bench/layout_match.py --iters 50 --layouts "1:$G;$N:$G;$N:$G --tensor-model-parallel-size 2 --sequence-parallel;$N:$G --tensor-model-parallel-size 4 --sequence-parallel;$N:$G --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"

# Every figure of the run, in the few kilobytes of output that come back.
python3 bench/summary.py "${OUT:-bench_out}" || true
