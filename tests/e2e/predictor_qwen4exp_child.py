"""Child of test_live_predictor_vllm.py: which router the live predictor takes for each paged layer of Qwen4Exp.

    python predictor_qwen4exp_child.py CHECKPOINT OUT.json

vLLM (CPU build) builds and loads the Qwen4Exp model and its MTP drafter in one process, exactly as
pager_qwen4exp_child.py does (its main is reused; only what is written per layer differs): OUT.json
gets, per paged layer, vLLM's layer name, the next paged layer's name, and what
predictor.next_router found for it (the router's [E, H] shape, and whether it is the very gate of the MoERunner
vLLM registered for that layer: its `weight`, or its own product where vLLM repacked it), or null where no layer
follows.
"""

import sys

import pager_qwen4exp_child as build


def describe(layer) -> dict:
    import torch
    from bigmoe_pager.adapters.vllm import process
    from bigmoe_pager.adapters.vllm.predictor import NextRouter, next_router

    nxt = process.current().layer_after(layer._moe_index)
    hidden = torch.zeros(1, layer.moe_config.hidden_dim, dtype=torch.bfloat16)
    found = next_router(layer, nxt, hidden, 0)
    out = {"name": layer.layer_name, "next": getattr(nxt, "layer_name", None), "router": None}
    if isinstance(found, NextRouter):
        gate = layer._runners[nxt.layer_name].gate
        if isinstance(found.router, torch.Tensor):
            shape, is_gate = list(found.router.shape), found.router is gate.weight
        else:  # a gate vLLM repacked: the predictor calls its own product, of the gate's sizes
            logits = found.router(hidden)
            shape, is_gate = [logits.shape[-1], hidden.shape[-1]], gate.weight.numel() == 0
        out["router"] = {"shape": shape, "top": found.top, "is_gate": is_gate}
    elif found is not None:
        out["router"] = found  # the reason it was refused
    return out


if __name__ == "__main__":
    build.describe = describe  # the per-layer record pager_qwen4exp_child.main writes
    sys.exit(build.main())
