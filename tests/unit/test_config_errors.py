"""ConfigError carries the parameters its message names; the application rewrites them to flags."""

import pickle

from megatron.core.config_utils import ConfigError


def test_config_error_is_a_value_error_with_params():
    err = ConfigError("hidden_size (100) is not divisible by num_attention_heads (3)",
                      params=("hidden_size", "num_attention_heads"))
    assert isinstance(err, ValueError)
    assert err.params == ("hidden_size", "num_attention_heads")
    assert str(err) == "hidden_size (100) is not divisible by num_attention_heads (3)"
    assert ConfigError("plain message").params == ()


def test_config_error_keeps_params_across_pickling():
    err = pickle.loads(pickle.dumps(ConfigError("seq_length must be > 0, got 0", params=["seq_length"])))
    assert type(err) is ConfigError and err.params == ("seq_length",) and str(err) == "seq_length must be > 0, got 0"
