"""A trainer's ignored layers (verl's ``ignored_layers`` / ``SGLANG_FP8_IGNORED_LAYERS``) on the engine: verl's matching
rule, applied to each SGLang module's checkpoint names (sglang_fp8rl/layers/ignored.py).

verl's own ``_matches_ignored_layer`` is the reference where verl is installed (the SGLang 0.5.12 test env); the rule
is also pinned by examples, so the other envs test it too.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_fp8rl.layers.ignored import (
    IGNORED_LAYERS_ENV,
    checkpoint_names,
    ignored_layers_from,
    ignored_match,
    matches_ignored_layer,
)

VERL = importlib.util.find_spec("verl") is not None

EXAMPLES = [  # (parameter name, ignored layer, verl's answer)
    ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp", True),  # prefix
    ("model.layers.0.mlp.gate_proj.weight", "gate_proj", True),  # suffix of the module name
    ("model.layers.0.mlp.gate_proj.weight", "layers.0", True),  # infix
    ("model.layers.10.mlp.gate_proj.weight", "layers.1", False),  # dotted: 1 is not 10
    ("model.layers.0.mlp.gate_up_proj.weight", "gate", False),  # verl #7519's pitfall is not a match
    ("model.layers.0.MLP.gate_proj.weight", "mlp.GATE_PROJ", True),  # case-insensitive
    ("model.layers.2.self_attn.q_proj.weight", r"re:model\.layers\.2\.self_attn\.[qkv]_proj", True),
    ("model.layers.2.self_attn.o_proj.weight", r"re:model\.layers\.2\.self_attn\.[qkv]_proj", False),
    ("model.layers.2.self_attn.q_proj.weight", r"re:self_attn", False),  # re.match: anchored at the start
    ("lm_head.weight", "lm_head", True),
    ("model.layers.0.mlp.gate_proj.weight", "  ", False),
]


@pytest.mark.parametrize("name,ignored,want", EXAMPLES)
def test_verls_rule_on_examples(name, ignored, want):
    assert matches_ignored_layer(name, ignored) is want


NAME = st.lists(st.sampled_from(["model", "layers", "0", "1", "10", "mlp", "self_attn", "q_proj", "gate_proj",
                                 "gate", "experts", "weight", "MLP"]), min_size=1, max_size=6).map(".".join)


@pytest.mark.skipif(not VERL, reason="verl is installed in the SGLang 0.5.12 env only (requirements/verl-0.9.1.txt)")
@settings(max_examples=400, deadline=None)
@given(name=NAME, ignored=st.one_of(NAME, NAME.map(lambda n: "re:" + n.replace(".", r"\.")),
                                    NAME.map(lambda n: "." + n + ".")))
def test_same_answers_as_verls_own_function(name, ignored):
    from verl.utils.sglang.sglang_fp8_utils import _matches_ignored_layer

    assert matches_ignored_layer(name, ignored) == _matches_ignored_layer(name, ignored)


def test_sources_are_verls_config_keys_then_the_environment_deduplicated():
    config = {"ignored_layers": ["model.layers.0.mlp", "LM_HEAD"], "modules_to_not_convert": "lm_head,mlp.gate"}
    got = ignored_layers_from(config, {IGNORED_LAYERS_ENV: " layers.3 , model.layers.0.MLP ,,"})
    assert got == ("model.layers.0.mlp", "LM_HEAD", "mlp.gate", "layers.3")
    assert ignored_layers_from(None, {}) == ()
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ignored_layers_from({"ignored_layers": ["re:("]}, {})


def test_checkpoint_names_of_fused_and_expert_modules():
    assert checkpoint_names("model.layers.3.self_attn.qkv_proj") == [
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight"]
    assert checkpoint_names("model.layers.3.mlp.gate_up_proj") == [
        "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"]
    assert checkpoint_names("model.layers.3.mlp.down_proj") == ["model.layers.3.mlp.down_proj.weight"]
    assert len(checkpoint_names("model.layers.1.mlp.experts", num_experts=4)) == 12


def test_a_module_is_bf16_when_all_its_names_match_and_refused_when_only_some_do():
    assert ignored_match("model.layers.0.self_attn.qkv_proj", ["self_attn"]) == "self_attn"
    assert ignored_match("model.layers.0.self_attn.o_proj", ["q_proj"]) is None
    with pytest.raises(ValueError, match="match only some.*q_proj.*k_proj"):
        ignored_match("model.layers.0.self_attn.qkv_proj", ["q_proj"])
    assert ignored_match("model.layers.1.mlp.experts", ["layers.1.mlp"], num_experts=4) == "layers.1.mlp"
    with pytest.raises(ValueError, match="match only some"):
        ignored_match("model.layers.1.mlp.experts", ["experts.0"], num_experts=4)
    assert ignored_match("model.layers.1.mlp.down_proj", []) is None
