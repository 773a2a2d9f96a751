#!/usr/bin/env python3
"""FP8 against bf16 on the bundled corpus: loss curves over 300 steps (issue 6's 1% criterion).

    bash examples/prepare_corpus.sh                   # once, on any machine: data/prepared/
    python bench/fp8_loss.py --iters 300 [--recipes hybrid:tensorwise,hybrid:delayed]

Trains the same Llama-style model (12 layers, hidden 1024, GQA, SwiGLU, RoPE; vocab of the bundled
corpus's 4096-token BPE) from the same seed on the same data order, once in bf16 and once per FP8
recipe, through pretrain_gpt.py on one GPU. Reports, per recipe, the largest relative difference of
the 20-step moving-average loss from bf16's after the first 20 steps, the difference of the mean loss
over the last 50 steps, PASS when both are within ``--tolerance`` (1%), and its tokens/s against
bf16's (median after the first 10 steps; a small model's GEMMs say little about FP8 at scale: use
bench_gpt.py for speed). ``--bf16-repeat`` trains bf16 a second time, same seed and data, and
compares it like a recipe: on a GPU at 1024-token sequences the runs differ from the first step
(cuDNN's attention backward is not deterministic there; at 256 they came out bit-identical), so that
row is the noise floor of the comparison itself. ``--seeds 1,2,3``
runs everything once per seed and also compares the mean curves over the seeds, where that noise
averages out; ``--combine a.jsonl,b.jsonl`` computes that mean from invocations that ran different
seeds (one per GPU). On a CPU, ``MEGATRON_FP8_EMULATE=1 python bench/fp8_loss.py --model tiny --iters 60``
checks the script (FP8 emulated in fp32; FP8 itself needs a Hopper GPU).

Your own model and data instead (a short bf16-against-FP8 A/B before a long run): ``--args`` takes
pretrain_gpt.py's flags (model, data, tokenizer, batch, parallel layout; not --save / --load, not
--train-iters) and ``--nproc`` the GPUs, e.g.

    python bench/fp8_loss.py --iters 200 --recipes hybrid:delayed --nproc 8 --args "$(cat my_run.flags)"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import tempfile

from layout_match import ROOT, run_command

MODELS = {
    "small": (
        "--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --group-query-attention "
        "--num-query-groups 4 --ffn-hidden-size 2816 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 8 --global-batch-size 8"
    ),
    "tiny": (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 176 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 4 "
        "--global-batch-size 4"
    ),
}
COMMON = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --bf16 "
    "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 "
    "--adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 "
    "--log-interval 1 --eval-iters 0 --num-workers 1 --tokenizer-type GPT2BPETokenizer --split 100,0,0"
)


def moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def compare(ref: dict[int, float], other: dict[int, float], window: int = 20, tail: int = 50) -> dict:
    """The curve gap (moving average over ``window`` steps, after the first ``window``) and the gap of the
    mean over the last ``tail`` steps; a run shorter than 5 windows / 2 tails uses shorter ones."""
    steps = sorted(ref)
    window, tail = max(1, min(window, len(steps) // 5)), max(1, min(tail, len(steps) // 2))
    a, b = [ref[s] for s in steps], [other[s] for s in steps]
    ma, mb = moving_average(a, window), moving_average(b, window)
    curve = (
        max(abs(x - y) / abs(x) for x, y in list(zip(ma, mb))[window:])
        if len(steps) > window
        else float("nan")
    )
    last_a, last_b = statistics.fmean(a[-tail:]), statistics.fmean(b[-tail:])
    return {
        "max_rel_diff_moving_avg": curve,
        "rel_diff_last_mean": abs(last_b - last_a) / abs(last_a),
        "bf16_last_mean": last_a,
        "last_mean": last_b,
        "window": window,
        "tail": tail,
    }


def tokens_per_s(metrics: str, skip: int = 10) -> float | None:
    """Median tokens/s per GPU of a run's metrics file over the steps after the first ``skip``
    (compilation and warm-up); None when the run was too short."""
    with open(metrics) as f:
        rates = [r["tokens-per-sec-per-gpu"] for r in map(json.loads, f) if "tokens-per-sec-per-gpu" in r]
    return statistics.median(rates[skip:]) if len(rates) > skip else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument(
        "--recipes",
        default="hybrid:tensorwise,hybrid:delayed",
        help="comma-separated FORMAT:RECIPE pairs; empty runs bf16 only",
    )
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument(
        "--data",
        default=os.path.join(ROOT, "data", "prepared"),
        help="folder written by examples/prepare_corpus.sh",
    )
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="sequences per step (gradient accumulation over micro-batches of 8; default 8). The bundled "
        "corpus is ~0.46M tokens: at 32, 300 steps are ~20 passes over it and every run, a "
        "second bf16 one included, memorises it at its own pace (curves 7%% apart)",
    )
    ap.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per sequence (default 1024 for the small model). At 8 sequences of 1024 the 300 steps "
        "are ~5 passes over the bundled corpus and two bf16 runs of one seed end up to 3%% apart; "
        "at 256, ~1.3 passes",
    )
    ap.add_argument(
        "--seeds",
        default="1234",
        help="comma-separated seeds: every run once per seed, each compared with bf16 of its seed, "
        "and with several, the mean curves over the seeds (run-to-run noise averages out)",
    )
    ap.add_argument(
        "--bf16-repeat",
        action="store_true",
        help="train bf16 twice and report the repeat like a recipe (the run-to-run noise floor)",
    )
    ap.add_argument(
        "--args",
        default=None,
        help="pretrain_gpt.py flags of your own run (model, data, tokenizer, batch, layout) instead of "
        "--model and the bundled corpus; without --save / --load / --train-iters",
    )
    ap.add_argument(
        "--nproc", type=int, default=1, help="processes (GPUs) per run, for --args with a parallel layout"
    )
    ap.add_argument(
        "--combine",
        default=None,
        metavar="JSONL[,JSONL...]",
        help="train nothing: the mean-over-seeds comparison of the rows these fp8_loss.jsonl files hold "
        "(invocations that ran different seeds, one per GPU)",
    )
    args = ap.parse_args()
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    if args.combine:
        combine(args.combine.split(","), args.tolerance, out_dir)
        return
    if args.args is not None:
        given = set(shlex.split(args.args))
        clash = sorted(given & {"--save", "--load", "--train-iters", "--train-samples"})
        if clash:
            ap.error(
                f"--args: drop {', '.join(clash)} (every run of the A/B starts from scratch, trains --iters "
                "steps and saves nothing)"
            )
        base = f"{args.args} --train-iters {args.iters}"
    else:
        d = args.data
        data = f"--data-path {d}/corpus_text_document --vocab-file {d}/vocab.json --merge-file {d}/merges.txt"
        base = f"{MODELS[args.model]} {COMMON} {data} --train-iters {args.iters}"
    if args.global_batch_size:
        base += f" --global-batch-size {args.global_batch_size}"  # the last occurrence wins
    if args.seq_length:
        base += f" --seq-length {args.seq_length} --max-position-embeddings {args.seq_length}"
    seeds = [int(v) for v in args.seeds.split(",")]
    model = args.model if args.args is None else args.args  # what the rows name as the model
    runs = [("bf16", base)]
    for spec in filter(None, args.recipes.split(",")):
        fmt, recipe = spec.split(":")
        runs.append((spec, f"{base} --fp8-format {fmt} --fp8-recipe {recipe}"))
    runs += [("bf16-repeat", base)] if args.bf16_repeat else []  # last: the noise floor matters least
    # Each run's row is written as soon as it has run (bf16 first), so a run cut short by a time limit
    # keeps the ones before it.
    curves: dict[str, list[dict[int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(out_dir, "fp8_loss.jsonl"), "a") as f:
        for seed in seeds:
            ref: dict = {}
            ref_rate = None
            tag = f" (seed {seed})" if len(seeds) > 1 else ""
            for i, (name, flags) in enumerate(runs):
                metrics = os.path.join(tmp, f"{seed}_{i}.jsonl")
                curve = run_command(args.nproc, f"{flags} --seed {seed}", metrics)  # (the last --seed wins)
                curves.setdefault(name, []).append(curve)
                rate = tokens_per_s(metrics)
                row = {
                    "run": name,
                    "seed": seed,
                    "iters": args.iters,
                    "model": model,
                    "nproc": args.nproc,
                    "tokens_per_s": rate,
                }
                if name == "bf16":
                    ref, ref_rate = curve, rate
                    print(
                        f"bf16{tag}: {len(ref)} steps, loss {ref[min(ref)]:.4f} -> {ref[max(ref)]:.4f}, "
                        f"{rate or float('nan'):.0f} tokens/s"
                    )
                    f.write(json.dumps({**row, "losses": ref}) + "\n")
                else:
                    ratio = rate / ref_rate if rate and ref_rate else None
                    res = _report(f"{name}{tag}", compare(ref, curve), args.tolerance, ratio)
                    f.write(json.dumps({**row, **res, "speedup": ratio, "losses": curve}) + "\n")
                f.flush()
        if len(seeds) > 1:
            _write_means(f, curves, seeds, args.iters, model, args.tolerance)


def _write_means(
    f, curves: dict[str, list[dict[int, float]]], seeds: list[int], iters: int, model: str, tolerance: float
) -> None:
    """Each recipe's mean curve over the seeds against bf16's mean curve (paired: the same seeds), so
    that each seed's run-to-run differences average out; printed and written as rows to ``f``."""
    mean_ref = _mean_curve(curves["bf16"])
    for name, runs_of in curves.items():
        if name != "bf16":
            if len(runs_of) != len(seeds):  # e.g. a bf16 repeat cut short by a time limit
                print(f"{name}: {len(runs_of)} of {len(seeds)} seeds ran; left out of the mean")
                continue
            res = _report(
                f"{name} (mean of {len(seeds)} seeds)",
                compare(mean_ref, _mean_curve(runs_of)),
                tolerance,
                None,
            )
            f.write(json.dumps({"run": name, "seeds": seeds, "iters": iters, "model": model, **res}) + "\n")


def combine(paths: list[str], tolerance: float, out_dir: str) -> None:
    """``--combine``: the mean-over-seeds comparison of runs written by several invocations (one per
    GPU, say, each with its own seeds), read back from their ``fp8_loss.jsonl`` rows."""
    curves: dict[str, dict[int, dict[int, float]]] = {}
    iters, model = 0, ""
    for path in paths:
        with open(path) as src:
            for line in src:
                row = json.loads(line)
                if "seed" in row:  # a run's row (not an earlier mean)
                    curves.setdefault(row["run"], {})[row["seed"]] = {
                        int(k): v for k, v in row["losses"].items()
                    }
                    iters, model = row["iters"], row["model"]
    if "bf16" not in curves:
        raise SystemExit(f"--combine: no bf16 rows in {', '.join(paths)}")
    seeds = sorted(curves["bf16"])
    by_name = {name: [runs[s] for s in seeds if s in runs] for name, runs in curves.items()}
    with open(os.path.join(out_dir, "fp8_loss.jsonl"), "a") as f:
        _write_means(f, by_name, seeds, iters, model, tolerance)


def _mean_curve(curves: list[dict[int, float]]) -> dict[int, float]:
    """The step-wise mean of several runs' loss curves (over the steps they all have)."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return {s: statistics.fmean(c[s] for c in curves) for s in steps}


def _report(name: str, res: dict, tolerance: float, ratio: float | None) -> dict:
    """Print one comparison against bf16; returns it with its verdict (``pass``)."""
    ok = res["max_rel_diff_moving_avg"] <= tolerance and res["rel_diff_last_mean"] <= tolerance
    print(
        f"{name}: moving-average loss within {100 * res['max_rel_diff_moving_avg']:.2f}% of bf16, "
        f"last-{res['tail']} mean {res['last_mean']:.4f} vs {res['bf16_last_mean']:.4f} "
        f"({100 * res['rel_diff_last_mean']:.2f}%): {'PASS' if ok else 'FAIL'}"
        + (f"; tokens/s {ratio:.3f}x bf16" if ratio else "")
    )
    return {**res, "pass": ok}


if __name__ == "__main__":
    main()
