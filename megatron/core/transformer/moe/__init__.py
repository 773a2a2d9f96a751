"""Mixture of experts: the router, the experts, the token dispatchers and the MoE layer that joins
them, plugged into the decoder layer through its ``mlp`` slot (``gpt_layer_specs``).

Modules: ``groups`` (the process groups an MoE layer talks over), ``expert_params`` (how expert
parameters are tagged for initialisation, gradient reduction and checkpoints), ``router``,
``moe_utils`` (auxiliary losses, capacity, the loss tracker), ``experts``, ``token_dispatcher``,
``shared_experts``, ``moe_layer``.
"""
