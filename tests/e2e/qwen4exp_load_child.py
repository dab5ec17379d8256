"""Child process of test_qwen4exp_vllm.py: build vLLM's Qwen4ExpForCausalLM for a checkpoint and run its loader.

    python qwen4exp_load_child.py CHECKPOINT OUT.json

vLLM's own loader maps every checkpoint name (hf_to_vllm_mapper, the packed q/k/v/indexer,
gate/up, in_proj and hyper-connection projections, the n-gram shards) and checks every
shape; for an unquantized checkpoint it also fails when a parameter was never loaded.
OUT.json gets the loaded parameters (name -> shape, dtype, all finite, meta when paged). vLLM's model
runner is not used: on CPU it cannot run this model's forward (see the test's docstring).
"""

import json
import os
import socket
import sys

os.environ.setdefault("VLLM_PLUGINS", "")


def main() -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    checkpoint, out, mtp = sys.argv[1], sys.argv[2], "--mtp" in sys.argv[3:]
    # cpu_offload False: vLLM's default pins the n-gram table in host RAM, which needs an accelerator.
    args = EngineArgs(
        model=checkpoint,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=2,
        distributed_executor_backend="uni",
        engram_config={"cpu_offload": False},
        seed=0,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1} if mtp else None,
    )
    config = args.create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        parallel_state.initialize_model_parallel(1, 1)
        # The MTP head is its own vLLM model (Qwen4ExpMTP) built from the draft model config.
        model_config = config.speculative_config.draft_model_config if mtp else config.model_config
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = initialize_model(vllm_config=config, model_config=model_config)
        get_model_loader(config.load_config).load_weights(model, model_config)
    text = model_config.hf_text_config
    params = {name: describe(name, p, text.hc_lowrank + text.hc_count) for name, p in model.named_parameters()}
    with open(out, "w") as f:
        json.dump({"architecture": type(model).__name__, "params": params}, f)


def describe(name: str, param, hc_rows: int) -> dict:
    """Shape, dtype and whether every loaded value is finite (vLLM pads the merged HC projection to 16 rows
    with uninitialized memory the checkpoint never fills: those rows are left out)."""
    import torch

    values = param[:hc_rows] if name.endswith("input_mix_weight_down_block_inject.weight") else param
    meta = param.device.type == "meta"  # a paged tensor (bigmoe's n-gram pager): no values in memory
    finite = True if meta or not values.numel() else bool(torch.isfinite(values.float()).all())
    return {
        "shape": list(param.shape),
        "dtype": str(param.dtype).removeprefix("torch."),
        "finite": finite,
        "meta": meta,
    }


if __name__ == "__main__":
    main()
