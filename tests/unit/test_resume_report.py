"""The resume block (what a load resumes, the layouts, every flag that differs, allowed or refused; the
refusals before any tensor is read) and the batch fingerprint (the same under every data-parallel
size and micro-batch size, different for other tokens)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.core.dist_checkpointing import CheckpointError, ShardedTensor
from megatron.training import batch_fingerprint as bf
from megatron.training import checkpointing as ckpt
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler
from megatron.training.loop_utils import model_args_for_check
from megatron.training.resume_report import ResumeReport, layout_text
from megatron.training.run_config import parse_run_config

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --train-iters 10 --mock-data --vocab-size 128"
).split()
SAVED_LAYOUT = {
    "world_size": 4,
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2,
    "virtual_pipeline_model_parallel_size": 1,
    "data_parallel_size": 1,
    "sequence_parallel": False,
    "use_distributed_optimizer": True,
    "use_torch_fsdp2": False,
}
NOW_LAYOUT = {**SAVED_LAYOUT, "world_size": 2, "tensor_model_parallel_size": 1}
NOW_LAYOUT.update(pipeline_model_parallel_size=1, data_parallel_size=2, use_distributed_optimizer=False)


def _args(flags: list[str], layout: dict = SAVED_LAYOUT, vocab_size: int = 128) -> dict:
    """``args`` as TrainerCheckpointing.save writes them for a run of ``flags``."""
    cfg = parse_run_config(TINY + flags)
    checks = model_args_for_check(cfg, 128)
    args = {flag.lstrip("-").replace("-", "_"): value for flag, value in checks.items()}
    return {**args, "config": cfg.to_dict(), "vocab_size": vocab_size, "layout": layout}


def _common(flags: list[str], **kw) -> dict:
    return {
        "iteration": 3,
        "consumed_train_samples": 12,
        "consumed_valid_samples": 4,
        "args": _args(flags, **kw),
    }


def _report(saved: dict, flags: list[str], vocab_size: int = 128, finetune: bool = False) -> ResumeReport:
    cfg = parse_run_config(TINY + flags)
    checks = model_args_for_check(cfg, 128)
    return ResumeReport.build(
        saved, "/ck/iter_0000003", cfg.to_dict(), checks, NOW_LAYOUT, vocab_size, finetune
    )


def test_block_lists_the_changed_flags_and_both_layouts():
    saved = _common(["--seed", "1234", "--save", "/a", "--log-interval", "5"])
    report = _report(saved, ["--seed", "7", "--micro-batch-size", "1", "--save", "/b", "--train-iters", "20"])
    lines = report.lines()
    assert lines[0] == "resuming from /ck/iter_0000003: iteration 3, consumed samples 12 (valid 4)"
    assert lines[1] == (
        "  layout      checkpoint tp2 pp2 dp1 (4 ranks, distributed optimizer)   now tp1 pp1 dp2 (2 ranks)"
    )
    assert lines[2] == "  flags that differ (2):"
    assert set(lines[3:]) == {
        "    --micro-batch-size: 2 -> 1 (allowed: same global batch)",
        "    --seed: 1234 -> 7 (allowed: the RNG states are the checkpoint's; the data order is the new seed's)",
    }  # paths, logging and the run's length are not listed
    report.raise_if_refused()  # nothing refused


def test_unchanged_run_says_so():
    report = _report(_common([], layout=NOW_LAYOUT), [])
    assert report.lines()[1:] == ["  layout      tp1 pp1 dp2 (2 ranks), as saved", "  flags       as saved"]
    assert layout_text(None) == "not recorded"


def test_shape_and_tokenizer_refusals_keep_the_one_line_per_flag_error():
    report = _report(_common([]), ["--hidden-size", "64", "--global-batch-size", "8"], vocab_size=100)
    lines = "\n".join(report.lines())
    assert "--hidden-size: 32 -> 64 (refused: the checkpoint's tensors are of another model)" in lines
    assert "--global-batch-size: 4 -> 8 (allowed: the data continues at sample 12)" in lines
    assert (
        "vocabulary size (the tokenizer's): 128 -> 100 (refused: the token ids would mean other tokens)"
        in lines
    )
    with pytest.raises(CheckpointError) as err:
        report.raise_if_refused()
    msg = str(err.value)
    assert "was saved for a different model:\n  --hidden-size: checkpoint 32 vs current 64" in msg
    assert "vocabulary size" in msg and "--global-batch-size" not in msg


def test_finetune_allows_another_vocabulary_but_not_another_shape():
    report = _report(_common([]), [], vocab_size=100, finetune=True)
    assert report.lines()[0].startswith("finetuning from /ck/iter_0000003 (--finetune)")
    report.raise_if_refused()
    with pytest.raises(CheckpointError, match="--num-layers: checkpoint 2 vs current 3"):
        _report(_common([]), ["--num-layers", "3"], finetune=True).raise_if_refused()


def test_refusal_stops_the_load_before_any_tensor_is_read(tmp_path, monkeypatch):
    model = nn.Linear(4, 4)
    sd = {n: ShardedTensor(n, p, tuple(p.shape), (0,) * p.dim()) for n, p in model.named_parameters()}
    extra = _common([])
    ckpt.save_checkpoint(str(tmp_path), 3, sd, extra_state=extra, save_optim=False, save_rng=False, log=print)

    def no_read(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(ckpt.dist_checkpointing, "load", no_read)
    printed: list[str] = []

    def check(common: dict, ckpt_dir: str) -> None:
        report = _report(common, ["--hidden-size", "64"])
        printed.extend(report.lines())
        report.raise_if_refused()

    with pytest.raises(CheckpointError, match="--hidden-size: checkpoint 32 vs current 64"):
        ckpt.load_checkpoint(str(tmp_path), sd, check_common=check, load_rng=False, log=lambda _: None)
    assert printed[0].startswith("resuming from") and "(refused" in printed[-1]


# ---------------------------------------------------------------- fingerprints


def _loader(tokens: torch.Tensor, consumed: int, mbs: int, rank: int, dp: int):
    """The micro-batches dp rank ``rank`` reads, as the pretraining sampler hands them out."""
    sampler = MegatronPretrainingSampler(len(tokens), consumed, mbs, rank, dp)
    return iter([{"tokens": tokens[idx]} for idx in sampler])


def _fingerprints(tokens, consumed: int, mbs: int, dp: int, gbs: int, steps: int, monkeypatch) -> list[str]:
    """Each step's fingerprint on dp rank 0 of a ``dp``-rank run, the gather done in the test."""
    ranks = [bf.BatchFingerprints(True, dp, mbs) for _ in range(dp)]
    iters = [ranks[r].wrap([_loader(tokens, consumed, mbs, r, dp)])[0] for r in range(dp)]
    out = []
    for _ in range(steps):
        for it in iters:
            for _ in range(gbs // (mbs * dp)):
                next(it)
        locals_ = [torch.tensor([fp.pending.popleft() for _ in range(gbs // dp)]) for fp in ranks[1:]]

        def gather(parts, local, group=None, others=locals_):
            for part, value in zip(parts, [local, *others]):
                part.copy_(value)

        monkeypatch.setattr(bf.dist, "all_gather", gather)
        out.append(ranks[0].step(gbs))
    return out


def test_fingerprint_is_the_same_under_any_dp_and_micro_batch_size(monkeypatch):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (64, 16), generator=g)
    reference = [bf.fingerprint(tokens[s : s + 8]) for s in (8, 16, 24)]  # steps after 8 consumed samples
    for mbs, dp in ((8, 1), (2, 1), (1, 2), (2, 2), (1, 4)):
        assert _fingerprints(tokens, 8, mbs, dp, 8, 3, monkeypatch) == reference, (mbs, dp)
    other = tokens.clone()
    other[13, 5] += 1  # one token of the first step's batch (samples 8..15)
    changed = _fingerprints(other, 8, 2, 2, 8, 3, monkeypatch)
    assert changed[0] != reference[0] and changed[1:] == reference[1:]
    swapped = tokens.clone()
    swapped[[8, 9]] = swapped[[9, 8]]  # the same samples in another order
    assert _fingerprints(swapped, 8, 1, 2, 8, 1, monkeypatch)[0] != reference[0]


def test_stopped_fingerprints_hash_nothing():
    fp = bf.BatchFingerprints(True, 1, 2)
    it = fp.wrap([iter([{"tokens": torch.zeros(2, 4, dtype=torch.int64)}] * 3), None])
    next(it[0])
    assert len(fp.pending) == 2 and it[1] is None
    fp.stop()
    next(it[0])
    assert len(fp.pending) == 0
    assert bf.BatchFingerprints(False, 1, 2).step(4) is None


def test_layout_names_the_expert_grid_of_a_model_with_experts():
    dense = {
        "world_size": 4,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "data_parallel_size": 4,
    }
    assert layout_text(dense) == "tp1 pp1 dp4 (4 ranks)"
    ep2 = {**dense, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}
    ep4 = {**ep2, "expert_model_parallel_size": 4}
    assert layout_text(ep2) == "tp1 pp1 dp4 ep2 etp1 (4 ranks)"
    assert layout_text(ep2) != layout_text(ep4)  # an ep change is not "as saved"


def test_a_model_with_other_experts_is_refused_before_its_tensors_are_read():
    moe = "--num-experts 4 --moe-router-topk 2 --moe-layer-freq [0,1]".split()
    saved = _common(moe)
    assert saved["args"]["num_experts"] == 4 and saved["args"]["moe_layer_freq"] == [0, 1]
    _report(saved, moe).raise_if_refused()  # the same experts: nothing refused
    for other in (["--num-experts", "8"], ["--moe-layer-freq", "1"], ["--moe-ffn-hidden-size", "48"]):
        report = _report(saved, moe + other)
        flag = other[0]
        assert any(line.startswith(f"    {flag}:") and "refused" in line for line in report.lines()), flag
        with pytest.raises(CheckpointError, match=flag):
            report.raise_if_refused()
