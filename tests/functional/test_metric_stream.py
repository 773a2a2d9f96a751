"""One metric stream: the log line, the metrics file, TensorBoard and W&B hold the same values for every
logged step; a run resumed from an older checkpoint continues the same W&B run and TensorBoard's step
axis without duplicate steps; --timing-log-level prints Megatron's timer block (issue 30)."""

from __future__ import annotations

import glob
import json
import os
import re
import struct

import numpy as np
from launch import torchrun_many

from megatron.training.metrics import TIMER_KEYS, line_fields
from megatron.training.timers import TIMER_LEVELS

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 "
    "--mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0 --pipeline-model-parallel-size 2 "
    "--wandb-project metric-stream"
).split()
LINE = re.compile(r"iteration\s+(\d+)/")
TIMER = re.compile(r"^    (\S+) \.*: (.*)$")


def wandb_records(path: str):
    """The protobuf records of a W&B run file (``run-<id>.wandb``: a LevelDB-style log of 32 KiB
    blocks, each record cut into chunks with a 7-byte header: CRC, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_run(run_dir: str) -> tuple[str, dict[int, dict]]:
    """(the run id, {step: the values logged}) of one offline W&B run directory."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run_id, history = None, {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            row = {
                item.key or ".".join(item.nested_key): json.loads(item.value_json)
                for item in rec.history.item
            }
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert run_id is not None
    return run_id, history


def tensorboard(path: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard shows it (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: duplicate steps {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def printed(stdout: str) -> dict[int, tuple[str, dict[str, str]]]:
    """{iteration: (its log line, {timer: the figures of the block after it})}."""
    out: dict[int, tuple[str, dict[str, str]]] = {}
    current = None
    for line in stdout.splitlines():
        if m := LINE.search(line):
            current = int(m.group(1))
            assert current not in out, f"iteration {current} printed twice"  # by one rank only
            out[current] = (line, {})
        elif (m := TIMER.match(line)) and current is not None:
            out[current][1][m.group(1)] = m.group(2)
    return out


def check_line(rec: dict, line: str, timer_block: dict[str, str]) -> None:
    """The log line (and timer block) shows every value of the record, rounded as printed."""
    shown = set()
    for key, label, text in line_fields(rec):
        assert f"| {label}: {text} |" in line, (label, text, line)
        shown.add(key)
    for name, figures in timer_block.items():  # in the record with --log-timers-to-tensorboard
        if f"{name}-time" in rec:
            assert figures.split(", ")[-1].rstrip(")") == f"{rec[f'{name}-time'] * 1000:.2f}", (name, figures)
            shown.add(f"{name}-time")
    assert set(rec) - shown == {"expert_load_imbalance_max"} & set(rec), set(rec) - shown


def test_four_sinks_hold_one_stream_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tb, ck, wb = tmp_path / "tb", tmp_path / "ck", tmp_path / "wandb"
    sinks = f"--tensorboard-dir {tb} --wandb-save-dir {wb}".split()
    first, resumed = torchrun_many(
        2,
        [
            TINY
            + sinks
            + f"--train-iters 8 --exit-interval 6 --save {ck} --save-interval 3 --timing-log-level 1".split()
            + ["--log-timers-to-tensorboard"],
            # From the older checkpoint (3, not 6): steps 4-6 are trained and logged again.
            TINY
            + sinks
            + f"--train-iters 8 --load {ck} --ckpt-step 3 --timing-log-level 2 --timing-log-option max".split(),
        ],
    )
    # The metrics file: one record per logged step and run, written by the last rank only.
    records = [json.loads(line) for line in open(tb / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    runs = [records[:6], records[6:]]
    (dir_a, dir_b) = sorted(glob.glob(str(wb / "wandb" / "offline-run-*")))
    (id_a, hist_a), (id_b, hist_b) = wandb_run(dir_a), wandb_run(dir_b)
    assert id_a == id_b  # the resumed run continues the W&B run the checkpoint names
    scalars = tensorboard(str(tb))
    vs_samples = tensorboard(str(tb / "vs-samples"))
    for out, recs, history in ((first.stdout, runs[0], hist_a), (resumed.stdout, runs[1], hist_b)):
        lines = printed(out)
        assert sorted(history) == [r["iteration"] for r in recs] == sorted(lines)
        for full in recs:
            it, samples = full["iteration"], full["consumed_samples"]
            rec = {k: v for k, v in full.items() if k not in ("iteration", "consumed_samples", "time")}
            assert samples == rec["consumed-samples"] == 4 * it
            assert history[it] == rec, it  # W&B: the same values, float64 and ints
            check_line(rec, *lines[it])
            if recs is runs[1] or it <= 3:  # TensorBoard shows the resumed run's values from step 4
                assert {k for k in scalars if it in scalars[k]} == set(rec), it
                for k, v in rec.items():  # float32 is TensorBoard's precision
                    assert scalars[k][it] == float(np.float32(v)), (k, it)
                    assert vs_samples[f"{k} vs samples"][samples] == float(np.float32(v)), (k, it)
    assert sorted(scalars["lm loss"]) == list(range(1, 9))  # the step axis continued, no duplicates
    assert sorted(vs_samples["lm loss vs samples"]) == [4 * i for i in range(1, 9)]
    # The timers: level 1's names in the first run (max over ranks in the sinks), level 2's in the second.
    level1 = {n for n, lv in TIMER_LEVELS.items() if lv == 1}
    assert "(min, max) time across ranks (ms):" in first.stdout
    assert set(printed(first.stdout)[2][1]) == level1
    assert "max time across ranks (ms):" in resumed.stdout
    assert set(printed(resumed.stdout)[5][1]) == set(TIMER_LEVELS)
    assert all(f"{n}-time" in runs[0][1] for n in level1) and not TIMER_KEYS & set(runs[1][0])
