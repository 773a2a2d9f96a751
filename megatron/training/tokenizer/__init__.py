"""Megatron-LM's ``megatron.training.tokenizer`` import path, for code written against it."""
