"""expert_names: every naming scheme the SSD tier reads, and vLLM's layer names, give the same decoder layers."""

from __future__ import annotations

import pytest
from bigmoe_pager.core.expert_names import ExpertNameError, discover, is_mtp_layer, vllm_decoder_layer

SUFFIXES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _names(template: str, layers, experts: int) -> list[str]:
    return [template.format(layer=l, expert=e) + s for l in layers for e in range(experts) for s in SUFFIXES]


SCHEMES = {
    "qwen3-moe": "model.layers.{layer}.mlp.experts.{expert}.",
    "qwen4exp": "model.language_model.layers.{layer}.mlp.experts.{expert}.",
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_main_layers_keep_their_numbers(scheme):
    names = discover(_names(SCHEMES[scheme], [1, 2, 3], 4) + ["model.norm.weight", "lm_head.weight"])
    assert names.layers == [1, 2, 3] and names.num_experts == 4 and names.mtp_layers == ()
    assert names.head(2, 3) == SCHEMES[scheme].format(layer=2, expert=3)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("hidden_layers, base", [(48, 48), (None, 4)])
def test_mtp_layers_follow_the_main_model_as_vllm_numbers_them(scheme, hidden_layers, base):
    ckpt = _names(SCHEMES[scheme], range(4), 8) + _names("mtp.layers.{layer}.mlp.experts.{expert}.", [0], 8)
    names = discover(ckpt, hidden_layers)
    assert names.mtp_layers == (base,)
    assert names.main_layers == [0, 1, 2, 3]
    assert names.head(base, 5) == "mtp.layers.0.mlp.experts.5."


def test_shared_expert_and_gate_are_not_experts():
    ckpt = _names(SCHEMES["qwen4exp"], [0], 2) + [
        "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight",
        "model.language_model.layers.0.mlp.shared_expert_gate.weight",
        "model.language_model.layers.0.mlp.gate.weight",
    ]
    names = discover(ckpt)
    assert names.layers == [0] and names.num_experts == 2


def test_two_main_schemes_are_refused():
    with pytest.raises(ExpertNameError, match="both as"):
        discover(_names(SCHEMES["qwen3-moe"], [0], 2) + _names(SCHEMES["qwen4exp"], [1], 2))


@pytest.mark.parametrize(
    "layer_name, layer, mtp",
    [
        ("model.layers.5.mlp.experts", 5, False),
        ("language_model.model.layers.47.mlp.experts", 47, False),
        ("mtp.layers.48.mlp.experts", 48, True),
        ("model.layers.12.mlp.experts.routed_experts", 12, False),
    ],
)
def test_vllm_layer_names(layer_name, layer, mtp):
    assert vllm_decoder_layer(layer_name) == layer
    assert is_mtp_layer(layer_name) == mtp


def test_a_layer_name_without_a_number_is_one_line():
    with pytest.raises(ExpertNameError, match="cannot tell the decoder layer"):
        vllm_decoder_layer("model.experts")
