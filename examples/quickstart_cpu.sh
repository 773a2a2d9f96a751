#!/usr/bin/env bash
# A small end-to-end pretraining on the CPU: preprocess the bundled corpus, train a tiny GPT,
# stop half-way with a checkpoint, resume from it and finish.
#
#   bash examples/quickstart_cpu.sh [RUNDIR]        (default runs/quickstart)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN="${1:-$ROOT/runs/quickstart}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$RUN"

[ -f "$RUN/data/corpus_text_document.idx" ] || bash "$ROOT/examples/prepare_corpus.sh" "$RUN/data" 4096 2

ARGS=(
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --seq-length 128 --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 16
    --train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 6 --clip-grad 1.0
    --weight-decay 0.1 --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234
    --data-path "$RUN/data/corpus_text_document" --split 90,5,5 --data-cache-path "$RUN/cache"
    --tokenizer-type GPT2BPETokenizer --vocab-file "$RUN/data/vocab.json" --merge-file "$RUN/data/merges.txt"
    --num-workers 1 --log-interval 10 --eval-interval 30 --eval-iters 5
    --save "$RUN/checkpoints" --load "$RUN/checkpoints" --save-interval 30
    --tensorboard-dir "$RUN/tensorboard"
)

echo "== first launch: trains 30 iterations, saves, stops (--exit-interval 30)"
"$PYTHON" "$ROOT/pretrain_gpt.py" "${ARGS[@]}" --exit-interval 30
echo "== second launch: resumes from the checkpoint and finishes"
"$PYTHON" "$ROOT/pretrain_gpt.py" "${ARGS[@]}"
echo "== done: checkpoints in $RUN/checkpoints, metrics in $RUN/tensorboard/metrics.jsonl"
