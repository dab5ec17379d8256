"""Where a checkpoint keeps its routed experts, and which vLLM decoder layer each set belongs to.

The one place that knows the naming schemes. Decoder layers are numbered as vLLM
numbers them in its layer names (`...layers.{N}.mlp.experts`):

- Qwen3-MoE and most text-only checkpoints: `model.layers.{L}.mlp.experts.{E}.*`, decoder layer L;
- Qwen4Exp (Qwen3.8-Flash-Next) and other Qwen3.5-style multimodal checkpoints:
  `model.language_model.layers.{L}.mlp.experts.{E}.*`, decoder layer L (vLLM's
  `hf_to_vllm_mapper` strips `model.language_model.` at load);
- their multi-token-prediction head: `mtp.layers.{i}.mlp.experts.{E}.*`, which vLLM's
  Qwen4ExpMTP builds as `mtp.layers.{num_hidden_layers + i}` (mtp.py's mtp_start_layer_idx).

Nothing here imports vLLM or reads files; callers pass tensor names and config numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

MAIN_SCHEMES = (
    "model.layers.{layer}.mlp.experts.{expert}.",
    "model.language_model.layers.{layer}.mlp.experts.{expert}.",
)
"""Expert name templates of the main model; a checkpoint uses one of them."""
MTP_SCHEME = "mtp.layers.{layer}.mlp.experts.{expert}."
"""Expert name template of the MTP head; checkpoint layer i is vLLM decoder layer num_hidden_layers + i."""

_VLLM_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertNameError(ValueError):
    """Expert tensors that fit no known scheme, or a vLLM layer name without a layer number; one line."""


@dataclass(frozen=True)
class ExpertNames:
    """A checkpoint's routed experts: the name template of each decoder layer that has them."""

    heads: dict[int, str]
    """vLLM decoder layer -> name template with {expert} left to fill (e.g. 'mtp.layers.0.mlp.experts.{expert}.')."""
    num_experts: int
    """Experts per layer (largest id named + 1)."""
    mtp_layers: tuple[int, ...]
    """The decoder layers among `heads` that belong to the MTP head."""

    @property
    def layers(self) -> list[int]:
        """Decoder layers with experts, ascending (main model first, then the MTP head)."""
        return sorted(self.heads)

    @property
    def main_layers(self) -> list[int]:
        return [layer for layer in self.layers if layer not in self.mtp_layers]

    def head(self, layer: int, expert: int) -> str:
        """The name prefix of one expert's tensors ('...experts.{E}.'); suffixes are gate_proj.weight and so on."""
        return self.heads[layer].format(expert=expert)


def discover(names: Iterable[str], num_hidden_layers: int | None = None) -> ExpertNames:
    """The experts named in `names` (a checkpoint's tensor names).

    num_hidden_layers: the model's decoder layers (config.json), where vLLM starts numbering MTP
    layers; None (no config at hand) numbers them after the last main layer with experts.
    """
    found: dict[str, dict[int, int]] = {}
    for scheme in (*MAIN_SCHEMES, MTP_SCHEME):
        found[scheme] = {}
    patterns = {scheme: _pattern(scheme) for scheme in found}
    for name in names:
        for scheme, rx in patterns.items():
            m = rx.match(name)
            if m:
                layer, expert = int(m["layer"]), int(m["expert"])
                found[scheme][layer] = max(found[scheme].get(layer, -1), expert)
                break
    main = [s for s in MAIN_SCHEMES if found[s]]
    if len(main) > 1:
        raise ExpertNameError(
            f"the checkpoint names experts both as {main[0].format(layer='L', expert='E')}* and "
            f"{main[1].format(layer='L', expert='E')}*; expected one scheme"
        )
    heads: dict[int, str] = {}
    experts = -1
    if main:
        for layer, top in found[main[0]].items():
            heads[layer] = main[0].format(layer=layer, expert="{expert}")
            experts = max(experts, top)
    base = mtp_base(num_hidden_layers, heads)
    mtp = []
    for i, top in sorted(found[MTP_SCHEME].items()):
        heads[base + i] = MTP_SCHEME.format(layer=i, expert="{expert}")
        mtp.append(base + i)
        experts = max(experts, top)
    return ExpertNames(heads=heads, num_experts=experts + 1, mtp_layers=tuple(mtp))


def mtp_base(num_hidden_layers: int | None, main_heads: dict[int, str]) -> int:
    """vLLM's decoder layer number of MTP layer 0: num_hidden_layers, else one past the last main layer."""
    if num_hidden_layers is not None:
        return int(num_hidden_layers)
    return max(main_heads) + 1 if main_heads else 0


def vllm_decoder_layer(layer_name: str) -> int:
    """The decoder layer of a vLLM MoE layer name: 'model.layers.5.mlp.experts' -> 5,
    'language_model.model.layers.5.mlp.experts' -> 5, 'mtp.layers.48.mlp.experts' -> 48."""
    found = _VLLM_LAYER.findall(layer_name + ".")
    if not found:
        raise ExpertNameError(f"bigmoe: cannot tell the decoder layer of MoE layer {layer_name!r}")
    return int(found[-1])


def is_mtp_layer(layer_name: str) -> bool:
    """Whether a vLLM layer name belongs to the MTP draft model (Qwen4ExpMTP builds it under 'mtp.')."""
    return "mtp" in layer_name.split(".")


def describe_schemes() -> str:
    """The schemes as one line, for error messages."""
    return ", ".join(s.format(layer="L", expert="E") + "*" for s in (*MAIN_SCHEMES, MTP_SCHEME))


def _pattern(scheme: str) -> re.Pattern:
    text = re.escape(scheme).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(text)
