"""bench/step_floor.py replays a step's GEMMs and attention: checked on the CPU with the tiny shape."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import step_floor  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm", "aten::_scaled_mm")


def outer_gemms(prof) -> list[str]:
    """GEMM ops not called from inside another GEMM op (the CPU's _scaled_mm multiplies through matmul)."""

    def inside_gemm(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name in GEMMS:
                return True
            p = p.cpu_parent
        return False

    return [e.name for e in prof.events() if e.name in GEMMS and not inside_gemm(e)]


def test_floor_runs_every_gemm_of_a_step_and_nothing_else():
    s = step_floor.shape_of("tiny")
    assert (s["layers"], s["hidden"], s["bias"], s["gated"], s["ffn"]) == (4, 256, True, False, None)
    s.update(ffn=4 * s["hidden"], seq=64, batch=2, vocab=512)
    floor = step_floor.Floor(s, torch.device("cpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        floor.step()
    ops = outer_gemms(prof)
    # per layer: 4 forward GEMMs (with bias: addmm) and 8 backward; the output layer: 3
    assert ops.count("aten::addmm") == 4 * s["layers"]
    assert ops.count("aten::mm") == 8 * s["layers"] + 3
    attention = [
        e.name for e in prof.events() if "scaled_dot_product" in e.name and "backward" not in e.name.lower()
    ]
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


def test_fp8_floor_runs_the_layers_gemms_in_fp8_and_the_output_layer_in_bf16():
    s = step_floor.shape_of("llama-3b")
    s.update(layers=2, hidden=96, heads=6, groups=2, ffn=128, seq=32, batch=2, vocab=256)
    floor = step_floor.Floor(s, torch.device("cpu"), fp8=True)
    assert (
        floor.w8[0]["fc1"][0].dtype == torch.float8_e4m3fn and floor.dy8["fc2"][0].dtype == torch.float8_e5m2
    )
    assert floor.w8[0]["fc1"][1].shape == floor.weights[0]["fc1"].t().shape
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        floor.step()
    ops = outer_gemms(prof)
    assert ops.count("aten::_scaled_mm") == 12 * s["layers"]
    assert ops.count("aten::mm") == 3 and ops.count("aten::addmm") == 0
