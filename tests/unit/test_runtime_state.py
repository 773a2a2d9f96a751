"""The process's runtime state (megatron/core/runtime.py): one object, the only ``global`` statement,
and nothing of one parallel layout left after ``destroy_model_parallel``: the setters' overrides,
the unbound RNG tracker, the memory buffer, the warmed-up pipeline groups. Process settings (the
micro-batch calculator, NVTX, Megatron-LM's args) go with ``reset_runtime``. One process, no
communication."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import num_microbatches_calculator as nmc
from megatron.core import parallel_state as ps
from megatron.core import utils
from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state import ParallelLayoutError, ParallelState, RankGrid, make_grid
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedule_steps import PipelineGroups
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.runtime import Runtime, WarmedGroups, get_runtime, reset_runtime, set_runtime
from megatron.core.tensor_parallel import rng_api
from megatron.training import global_vars

ROOT = Path(__file__).resolve().parents[2]
# The files whose module state this runtime absorbed: none of them may hold a global statement.
FOLDED = [
    "megatron/core/parallel_state_init.py",
    "megatron/core/parallel_state_api.py",
    "megatron/core/utils.py",
    "megatron/core/num_microbatches_calculator.py",
    "megatron/core/tensor_parallel/rng_api.py",
    "megatron/core/pipeline_parallel/p2p_communication.py",
    "megatron/training/global_vars.py",
    "megatron/training/initialize.py",
]
GLOBAL = re.compile(r"^\s*global\s", re.M)


@pytest.fixture(autouse=True)
def fresh_runtime():
    """Each test runs under a runtime of its own; the process's is put back afterwards."""
    previous = set_runtime(Runtime())
    with torch.random.fork_rng():
        yield
    set_runtime(previous)


def test_the_runtime_holds_the_only_global_statement() -> None:
    assert len(GLOBAL.findall((ROOT / "megatron/core/runtime.py").read_text())) == 1
    for path in FOLDED:
        assert not GLOBAL.findall((ROOT / path).read_text()), path


def test_set_and_reset_runtime_swap_the_whole_state() -> None:
    mine = get_runtime()
    utils.configure_nvtx_profiling(True)
    assert mine.nvtx_enabled
    previous = reset_runtime()
    assert previous is mine and get_runtime() is not mine and not get_runtime().nvtx_enabled
    assert set_runtime(mine) is not mine and get_runtime() is mine


def test_destroy_model_parallel_forgets_the_layout() -> None:
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_pipeline_model_parallel_rank(1)
    buffer = ps.get_global_memory_buffer()
    tracker = rng_api.get_cuda_rng_tracker()
    old_layout = get_runtime().layout
    old_layout.warmed_p2p_groups.add(object())
    assert ps.get_tensor_model_parallel_world_size() == 4 and ps.get_global_memory_buffer() is buffer

    ps.destroy_model_parallel()

    layout = get_runtime().layout
    assert layout is not old_layout
    assert (
        layout.parallel_state,
        layout.initialized,
        layout.overrides,
        layout.unbound_rng_tracker,
        layout.memory_buffer,
    ) == (None, False, {}, None, None)
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_rank() == 0
    assert ps.get_global_memory_buffer() is not buffer
    assert rng_api.get_cuda_rng_tracker() is not tracker
    assert len(layout.warmed_p2p_groups) == 0


def test_the_rng_tracker_of_one_layout_is_not_handed_out_in_the_next() -> None:
    unbound = rng_api.get_cuda_rng_tracker()
    seeded = rng_api.model_parallel_cuda_manual_seed(7)
    assert seeded is unbound and ps.get_parallel_state().rng_tracker is seeded and seeded.is_initialized()
    assert rng_api.get_cuda_rng_tracker() is seeded

    ps.destroy_model_parallel()

    fresh = rng_api.get_cuda_rng_tracker()
    assert fresh is not seeded and not fresh.is_initialized()
    assert rng_api.model_parallel_cuda_manual_seed(7) is fresh  # the new layout's seeding fills that one


def test_the_micro_batch_calculator_is_process_state() -> None:
    """Megatron-LM builds it before initialize_model_parallel: a layout's destroy keeps it, a
    runtime reset (or destroy_num_microbatches_calculator) drops it, and it can be built again."""
    nmc.init_num_microbatches_calculator(0, None, 16, 2, 2)
    ps.destroy_model_parallel()
    assert nmc.get_num_microbatches() == 4
    with pytest.raises(AssertionError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 16, 2, 2)
    reset_runtime()
    with pytest.raises(AssertionError, match="init_num_microbatches_calculator first"):
        nmc.get_num_microbatches()
    nmc.init_num_microbatches_calculator(0, None, 16, 2, 4)
    assert nmc.get_num_microbatches() == 2
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 16, 1, 1)
    assert nmc.get_num_microbatches() == 16


def test_megatron_lm_args_live_in_the_application_state() -> None:
    with pytest.raises(AssertionError, match="args is not initialized"):
        global_vars.get_args()
    args = object()
    global_vars.set_args(args)  # type: ignore[arg-type]
    assert global_vars.get_args() is args and get_runtime().app == global_vars.AppState(args=args)
    ps.destroy_model_parallel()  # the layout is not the application's
    assert global_vars.get_args() is args
    reset_runtime()
    with pytest.raises(AssertionError, match="args is not initialized"):
        global_vars.get_args()


def test_warmed_groups_hold_their_groups_so_ids_are_not_reused() -> None:
    class Group:
        pass

    warmed = WarmedGroups()
    group = Group()
    alive = weakref.ref(group)
    warmed.add(group)
    assert group in warmed and Group() not in warmed
    del group
    gc.collect()
    assert alive() is not None  # held: no new group can take its id while it is recorded
    warmed.clear()
    gc.collect()
    assert alive() is None and len(warmed) == 0


def test_a_pipeline_group_is_warmed_up_once_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: calls.append(group))
    group = object()

    def communicator() -> P2PCommunicator:
        return P2PCommunicator(group, [0, 1], 0, (2, 1, 3), torch.float32, torch.device("cpu"))  # type: ignore[arg-type]

    communicator()
    communicator()
    assert calls == [group]
    ps.destroy_model_parallel()  # a new layout: its communicators warm up again
    communicator()
    assert calls == [group, group]
    P2PCommunicator(None, [0], 0, (2, 1, 3), torch.float32, torch.device("cpu"))  # one stage: nothing to warm
    assert len(calls) == 2


def test_pipeline_groups_come_from_what_the_schedule_is_given() -> None:
    given = ParallelState(grid=RankGrid(), rank=0)
    assert PipelineGroups.of(given) == PipelineGroups(None, (0,), 0, 1)
    default = PipelineGroups.of(None)  # the entry point's default: the default ParallelState
    assert default == PipelineGroups(None, (0,), 0, 1) and ps.get_parallel_state() is not given
    with pytest.raises(ConfigError, match="pg_collection has no pp group") as err:
        PipelineGroups.of(ProcessGroupCollection())
    assert err.value.params == ("pg_collection",)


def test_layout_errors_are_config_errors_naming_the_parameters() -> None:
    with pytest.raises(ParallelLayoutError) as err:
        make_grid(6, tp=4)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, RuntimeError)
    assert err.value.params == (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    )
    assert "--" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        ps.initialize_model_parallel(gtp_remat_size=2, rank_offset=1)
    assert err.value.params == ("gtp_remat_size", "rank_offset")


def test_the_data_pipeline_does_not_import_the_model_stack() -> None:
    code = (
        "import sys, megatron.core.datasets.gpt_dataset; "
        "print(any(m.startswith(('megatron.core.transformer', 'megatron.core.distributed')) for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
