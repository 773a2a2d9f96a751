"""megatron.core.utils as Megatron-Core 0.19.2 documents it, and megatron.core's lazy names."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from megatron.core import utils
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


def test_version_checks() -> None:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert utils.is_torch_min_version(f"{major}.{minor}") and utils.is_torch_min_version("2.6a0")
    assert not utils.is_torch_min_version(f"{major + 1}.0")
    assert not utils.is_torch_min_version(str(utils.get_torch_version()), check_equality=False)


def test_transformer_engine_absent_reads_version_zero() -> None:
    try:
        import transformer_engine  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        assert str(utils.get_te_version()) == "0.0.0"
        assert not utils.is_te_min_version("1.0") and not utils.is_te_min_version("0.0.1")
    else:
        pytest.skip("Transformer Engine is installed")


def test_divide() -> None:
    assert utils.divide(12, 4) == 3
    with pytest.raises(AssertionError, match="not divisible"):
        utils.divide(10, 4)
    assert utils.round_up_to_nearest_multiple(10, 4) == 12


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.config = "the config"
        self.model_type = "encoder_or_decoder"


def _ddp(inner: torch.nn.Module) -> DistributedDataParallel:
    return DistributedDataParallel(None, DistributedDataParallelConfig(), inner)


def test_unwrap_model_sees_through_ddp_and_float16_module() -> None:
    net = _Net()
    ddp = _ddp(net)
    assert utils.unwrap_model(ddp) is net and utils.unwrap_model([ddp, net]) == [net, net]
    assert utils.unwrap_model(net) is net
    assert utils.unwrap_model(ddp, module_instances=(torch.nn.Linear,)) is ddp  # only the classes given
    try:
        from megatron.core.transformer.module import Float16Module  # type: ignore[attr-defined]
    except ImportError:
        return
    wrapped = Float16Module.__new__(Float16Module)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = ddp
    assert utils.unwrap_model(wrapped) is net


def test_get_model_config_and_wrapped_attributes() -> None:
    net = _Net()
    outer = torch.nn.Module()
    outer.module = net
    assert (
        utils.get_model_config(outer) == "the config" and utils.get_model_type(outer) == "encoder_or_decoder"
    )
    assert utils.get_attr_wrapped_model(outer, "lin", return_model_obj=True) is net
    assert utils.get_model_xattn(outer) is False
    with pytest.raises(RuntimeError, match="couldn't find attribute"):
        utils.get_attr_wrapped_model(outer, "no_such_attribute")
    with pytest.raises(RuntimeError, match="list"):
        utils.get_attr_wrapped_model([outer], "config")
    net.config = None  # allow_none=False (get_model_config) looks past a None config
    with pytest.raises(RuntimeError):
        utils.get_model_config(outer)


def test_process_group_helpers_without_torch_distributed() -> None:
    assert utils.get_pg_size(None) == 1 and utils.get_pg_rank(None) == 0 and utils.get_pg_src_rank(None) == 0
    assert utils.get_tensor_model_parallel_group_if_none(None) is None


def test_make_viewless_tensor() -> None:
    base = torch.arange(6.0, requires_grad=True)
    view = (base * 1).view(2, 3)
    assert view._base is not None
    out = utils.make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert out._base is None and out.data_ptr() == view.data_ptr() and out.shape == (2, 3)
    out.sum().backward()
    assert torch.equal(base.grad, torch.ones(6))
    plain = torch.zeros(3)
    assert utils.make_viewless_tensor(plain, False, False) is plain
    assert utils.assert_viewless_tensor(out) is out
    with pytest.raises(AssertionError, match="view"):
        utils.assert_viewless_tensor(view)


def test_init_methods_have_megatrons_standard_deviations() -> None:
    torch.manual_seed(0)
    w = torch.empty(400, 400)
    utils.init_method_normal(0.02)(w)
    assert abs(w.std().item() - 0.02) < 1e-3
    utils.scaled_init_method_normal(0.02, num_layers=8)(w)
    assert abs(w.std().item() - 0.02 / 4.0) < 3e-4  # sigma / sqrt(2 * num_layers)


def test_log_single_rank(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("mcore-utils-test")
    with caplog.at_level(logging.INFO, logger="mcore-utils-test"):
        utils.log_single_rank(logger, logging.INFO, "on rank zero")
        utils.log_single_rank(logger, logging.INFO, "on rank one", rank=1)
    assert "on rank zero" in caplog.text and "on rank one" not in caplog.text


def test_global_memory_buffer_reuses_its_storage() -> None:
    buf = utils.GlobalMemoryBuffer()
    a = buf.get_tensor((4, 4), torch.float32, "x")
    b = buf.get_tensor((2, 3), torch.float32, "x")
    assert a.shape == (4, 4) and b.shape == (2, 3) and a.data_ptr() == b.data_ptr()
    from megatron.core import parallel_state

    assert parallel_state.get_global_memory_buffer() is parallel_state.get_global_memory_buffer()


def test_megatron_core_names_load_lazily_without_torch() -> None:
    code = "import sys, megatron.core as c; assert 'torch' not in sys.modules and c.__version__ == '0.19.2'"
    subprocess.run([sys.executable, "-c", code], check=True)
    import megatron.core as core

    assert core.mpu is core.parallel_state and core.utils is utils
    assert core.ModelParallelConfig.__name__ == "ModelParallelConfig"
    assert core.DistributedDataParallel is DistributedDataParallel
    assert core.tensor_parallel.__name__ == "megatron.core.tensor_parallel"
    with pytest.raises(AttributeError):
        _ = core.no_such_name
