"""bench/step_floor.py replays a step's GEMMs and attention: checked on the CPU with the tiny shape."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import step_floor  # noqa: E402


def test_floor_runs_every_gemm_of_a_step_and_nothing_else():
    s = step_floor.shape_of("tiny")
    assert (s["layers"], s["hidden"], s["bias"], s["gated"], s["ffn"]) == (4, 256, True, False, None)
    s.update(ffn=4 * s["hidden"], seq=64, batch=2, vocab=512)
    floor = step_floor.Floor(s, torch.device("cpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        floor.step()
    gemm = ("aten::mm", "aten::addmm")
    ops = [e.name for e in prof.events() if e.name in gemm and (e.cpu_parent is None or e.cpu_parent.name not in gemm)]
    # per layer: 4 forward GEMMs (with bias: addmm) and 8 backward; the output layer: 3
    assert ops.count("aten::addmm") == 4 * s["layers"]
    assert ops.count("aten::mm") == 8 * s["layers"] + 3
    attention = [e.name for e in prof.events() if "scaled_dot_product" in e.name and "backward" not in e.name.lower()]
    assert attention, "attention forward did not run"
    assert all(torch.isfinite(g).all() for layer in floor.wgrads for g in layer.values())


def test_floor_optimizer_updates_every_weight():
    s = step_floor.shape_of("llama-3b")
    assert s["gated"] and not s["bias"] and s["groups"] == 8 and s["heads"] == 24
    s.update(layers=2, hidden=96, heads=6, groups=2, ffn=128, seq=32, batch=2, vocab=256)
    floor = step_floor.Floor(s, torch.device("cpu"))
    floor.step()
    opt = step_floor.Optimizer(floor)
    before = [w.clone() for layer in floor.weights for w in layer.values()]
    opt.step()
    after = [w for layer in floor.weights for w in layer.values()]
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
