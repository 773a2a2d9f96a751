#!/usr/bin/env bash
# Train a small byte-level BPE on the bundled corpus and preprocess the corpus with it.
#
#   bash examples/prepare_corpus.sh [OUTDIR] [VOCAB_SIZE] [WORKERS]
#
# writes OUTDIR/vocab.json, OUTDIR/merges.txt and OUTDIR/corpus_text_document.{bin,idx}
# (defaults: OUTDIR=data/prepared, VOCAB_SIZE=4096, WORKERS=2). No network access is needed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-$ROOT/data/prepared}"
VOCAB_SIZE="${2:-4096}"
WORKERS="${3:-2}"
CORPUS="$ROOT/data/python_docs.jsonl.gz"
PYTHON="${PYTHON:-python3}"

mkdir -p "$OUTDIR"
"$PYTHON" - "$CORPUS" "$OUTDIR" "$VOCAB_SIZE" <<'PY'
import gzip, json, sys
from tokenizers import ByteLevelBPETokenizer

corpus, outdir, vocab_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
texts = [json.loads(line)["text"] for line in gzip.open(corpus, "rt", encoding="utf-8")]
tok = ByteLevelBPETokenizer(add_prefix_space=False)
tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                        special_tokens=["<|endoftext|>"], show_progress=False)
tok.save_model(outdir)
print(f"trained a byte-level BPE of {tok.get_vocab_size()} tokens -> {outdir}/vocab.json, {outdir}/merges.txt")
PY

"$PYTHON" "$ROOT/tools/preprocess_data.py" \
    --input "$CORPUS" \
    --output-prefix "$OUTDIR/corpus" \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$OUTDIR/vocab.json" \
    --merge-file "$OUTDIR/merges.txt" \
    --append-eod --workers "$WORKERS" --log-interval 100000

echo
echo "Data flags for pretrain_gpt.py:"
echo "  --data-path $OUTDIR/corpus_text_document --split 949,50,1 \\"
echo "  --tokenizer-type GPT2BPETokenizer --vocab-file $OUTDIR/vocab.json --merge-file $OUTDIR/merges.txt"
echo "(On these 399 documents 949,50,1 leaves the test split empty: training says so and skips the test"
echo " evaluation; --split 90,5,5 gives every split documents.)"
