"""bench/bench_moe.py --smoke runs the MoE layer (loop and grouped GEMM, both dispatchers) and the
dense MLP on the CPU at tiny shapes and writes one JSON row per measurement."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_moe  # noqa: E402  (bench/ is not a package)


def test_smoke_writes_every_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = bench_moe.main(["--smoke"])
    layers = [r for r in rows if r["bench"] == "layer"]
    assert {(r["experts_impl"], r["dispatcher"]) for r in layers} == {
        (impl, d) for impl in ("loop", "grouped") for d in ("allgather", "alltoall")
    }
    assert not any(r["grouped_gemm_ran"] for r in layers if r["experts_impl"] == "loop")
    dense = [r for r in rows if r["bench"] == "dense"]
    assert len(dense) == 1 and dense[0]["dense_ffn"] == bench_moe.SMOKE["topk"] * bench_moe.SMOKE["ffn"]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens"] == bench_moe.SMOKE["seq"] * bench_moe.SMOKE["batch"]
    assert all(r["load_max_over_mean"] >= 1.0 and r["routing_only_fwd_bwd_ms"] > 0 for r in layers)
    written = (tmp_path / "bench_moe.jsonl").read_text().splitlines()
    assert [json.loads(line)["bench"] for line in written] == [r["bench"] for r in rows]
