"""Compiled transformer layers under tensor and sequence parallelism equal the eager layers on the CPU.

``--torch-compile`` does not compile the layers of a tp > 1 run (``on`` is refused there): on two
H200s the compiled tp2 + SP layers ran but llama-3b's loss stayed at its initial value, while this
test (dynamo + AOTAutograd on gloo; Inductor's CPU code passes it too) finds them equal to eager.
It stays as the check to pass first when the CUDA defect is found. ``aot_eager`` runs dynamo and
AOTAutograd (what meets the collectives) without needing a C++ toolchain for Inductor's CPU code.
"""

from __future__ import annotations

import torch
import torch._dynamo
from harness import device, distributed_test

from megatron.core.fusions.compile import compile_layers
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


@distributed_test(world_size=2, tp=2)
def test_tp2_sequence_parallel_compiled_layers_match_eager(ps: ParallelState) -> None:
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", activation="swiglu",
                            position_embedding_type="rope", add_bias_linear=False, tensor_model_parallel_size=2,
                            sequence_parallel=True)
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, parallel_state=ps,
                         device=device(), seed=3)
        if compiled:
            assert compile_layers([model], TransformerLayer) == 2
            torch._dynamo.config.suppress_errors = False  # a tracing failure must fail the test
            for layer in model.modules():
                if isinstance(layer, TransformerLayer):
                    layer.compile(backend="aot_eager", dynamic=False)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).to(device())
        loss = model(ids, None, None, labels=ids)
        loss.sum().backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch._dynamo.reset()
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
