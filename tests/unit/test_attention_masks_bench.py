"""bench/bench_attention_masks.py --smoke runs every section on the CPU (fp32 math paths, tiny shapes)
and writes one JSON row per measurement."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_attention_masks  # noqa: E402  (bench/ is not a package)


def test_smoke_writes_every_section(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = bench_attention_masks.main(["--smoke"])
    assert {r["bench"] for r in rows} == {"masks", "blocks", "ring"}
    masks = next(r for r in rows if r["bench"] == "masks")
    assert all(masks[f"{n}_fwd_bwd_ms"] > 0 for n in ("causal", "document_mask", "dense_mask_sdpa"))
    assert masks["documents"] > 1
    assert {r["block"] for r in rows if r["bench"] == "blocks"} == {"full", "causal", "documents"}
    ring = next(r for r in rows if r["bench"] == "ring")
    assert ring["cp"] == 2 and ring["ring_rank_compute_ms"] > 0 and ring["cp1_same_tokens_ms"] > 0
    written = (tmp_path / "bench_attention_masks.jsonl").read_text().splitlines()
    assert [json.loads(line)["bench"] for line in written] == [r["bench"] for r in rows]
