"""Kimi-family config.json: both spellings (checkpoint and transformers re-save) give the same
layer kinds; what cannot be served is refused naming the field."""
from __future__ import annotations

import copy

import pytest

from hybrid_models import K3_CONFIG
from splitspec.models.config import ConfigError, ModelConfig


def test_checkpoint_and_transformers_spellings_agree():
    a = ModelConfig.from_dict(K3_CONFIG).hybrid
    raw = copy.deepcopy(K3_CONFIG)
    lac = raw.pop("linear_attn_config")
    raw.update(layer_types=["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention"
                            for i in range(raw["num_hidden_layers"])],
               mlp_layer_types=["dense"] + ["sparse"] * (raw["num_hidden_layers"] - 1),
               linear_num_heads=lac["num_heads"], linear_head_dim=lac["head_dim"],
               gate_lower_bound=lac["gate_lower_bound"], use_full_rank_gate=True)
    b = ModelConfig.from_dict(raw).hybrid
    assert a.layer_types == b.layer_types == ("kda", "kda", "kda", "mla", "kda", "kda", "mla", "mla")
    assert a.mlp_types == b.mlp_types and a.gate_lower_bound == b.gate_lower_bound == -5.0
    assert (a.num_experts, a.top_k, a.n_shared_experts) == (8, 2, 2)
    cfg = ModelConfig.from_dict(K3_CONFIG)
    assert cfg.max_position_embeddings == 1024 and cfg.eos_token_ids == (0,)


@pytest.mark.parametrize("change, words", [
    ({"linear_attn_config": {**K3_CONFIG["linear_attn_config"], "kda_layers": [1, 2, 3, 5]}}, "(1-based)"),
    ({"linear_attn_config": {**K3_CONFIG["linear_attn_config"], "full_attn_layers": [4, 7, 9]}},
     "linear_attn_config.full_attn_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_token": 9}, "top-9"),
    ({"num_expert_group": 3}, "groups"),
    ({"mla_use_nope": False, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type"),
    ({"aux_hidden_stream": "middle"}, "aux_hidden_stream"),
])
def test_unservable_configs_are_refused_naming_the_field(change, words):
    with pytest.raises(ConfigError, match="config.json") as err:
        ModelConfig.from_dict({**K3_CONFIG, **change})
    assert words in str(err.value)
