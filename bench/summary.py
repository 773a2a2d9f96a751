#!/usr/bin/env python3
"""One short table per result file a bench run left in a folder (default ``$OUT`` or ./bench_out/).

    python bench/summary.py [DIR]

bench/issue6.sh prints it last, so that the few kilobytes of a GPU job's output that come back
carry every figure even when the files themselves do not.
"""

from __future__ import annotations

import json
import os
import sys


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def bench_gpt(rows: list[dict]) -> list[str]:
    out = [
        "bench_gpt: config nproc | step ms | tok/s/GPU | MFU | peak GiB | baseline tok/s (ratio) | SM MHz | extra"
    ]
    for r in rows:
        base = r.get("baseline_compile_tokens_per_s")
        ratio = f"{base:.0f} ({r['tokens_per_s_per_gpu'] / base:.3f})" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        out.append(
            f"  {r['config']}{r.get('tag', '')} x{r['nproc']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:.0f} | {mfu} | "
            f"{r['peak_gib']:.1f} | {ratio} | {_fmt(r.get('sm_clock_mhz_median'), '.0f')} | {r.get('extra', '')}"
        )
        bd = r.get("breakdown")
        if bd:
            cats = ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(bd["by_category_ms"].items(), key=lambda kv: -kv[1])
            )
            host = "/".join(f"{ms:.0f}" for ms in bd.get("host_ops_ms") or []) or "-"
            wait = bd.get("exposed_pipeline_wait_ms")
            wait = f" (of it pipeline wait {wait:.1f})" if wait else ""
            out.append(
                f"    ms/step: {cats}; idle {_fmt(bd.get('idle_ms'))}; exposed comm "
                f"{_fmt(bd.get('exposed_communication_ms'))}{wait}; host ops per thread {host}"
            )
    return out


def fp8_loss(rows: list[dict]) -> list[str]:
    out = ["fp8_loss: run | max moving-avg gap | last-50 mean (bf16) | pass | tok/s vs bf16"]
    for r in rows:
        if r["run"] == "bf16":
            out.append(f"  bf16 | - | - | - | {_fmt(r.get('tokens_per_s'), '.0f')} tok/s")
            continue
        out.append(
            f"  {r['run']} | {100 * r['max_rel_diff_moving_avg']:.2f}% | {r['last_mean']:.4f} "
            f"({r['bf16_last_mean']:.4f}) | {r['pass']} | {_fmt(r.get('speedup'), '.3f')}"
        )
    return out


def generic(name: str, keys: tuple[str, ...]):
    def table(rows: list[dict]) -> list[str]:
        out = [f"{name}: " + " | ".join(keys)]
        for r in rows:
            out.append(
                "  "
                + " | ".join(
                    _fmt(r.get(k), ".3f") if isinstance(r.get(k), float) else _fmt(r.get(k)) for k in keys
                )
            )
        return out

    return table


TABLES = {
    "bench_gpt.jsonl": bench_gpt,
    "fp8_loss.jsonl": fp8_loss,
    "bench_cross_entropy.jsonl": generic("cross entropy pass", ("shape", "variant", "ms", "max_grad_err")),
    "bench_swiglu.jsonl": generic("swiglu backward", ("shape", "variant", "ms", "max_rel_err")),
    "bench_liger.jsonl": generic(
        "liger vs ours", ("case", "variant", "ms", "peak_extra_gib", "rel_err_out", "rel_err_grad")
    ),
    "bench_fp8_linear.jsonl": generic(
        "fp8 linears", ("bench", "shape", "variant", "ms", "rel_err_out", "error")
    ),
    "layout_match.jsonl": generic("layout match", ("nproc", "extra", "max_rel_diff", "final")),
}
NOTES = (
    "nccl_transport.txt",
    "topo.txt",
)  # short text files printed as they are (how the GPUs are connected)


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else (os.environ.get("OUT") or "bench_out")
    for name, table in TABLES.items():
        path = os.path.join(folder, name)
        if os.path.exists(path):
            try:
                print("\n".join(table(_rows(path))), flush=True)
            except (KeyError, TypeError, ValueError) as exc:  # a format this script does not know: say so
                print(f"{name}: could not summarise ({type(exc).__name__}: {exc})")
    for name in NOTES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            print(f"{name}:\n" + open(path).read()[-2000:], flush=True)


if __name__ == "__main__":
    main()
