"""Child of test_pager_qwen4exp.py: vLLM builds and loads a Qwen4Exp model and its MTP draft with the expert pager.

    python pager_qwen4exp_child.py CHECKPOINT OUT.json

As vLLM's worker does (gpu_model_runner.load_model): the target model first, then the MTP
drafter, in one process, each through vLLM's own loader. The pager is on with fewer RAM slots
than experts, so every paged layer opens the SSD tier over the checkpoint. OUT.json gets, per
paged layer: vLLM's layer name, the pager's MoE index and decoder layer, and whether each
expert's RAM record (filled by vLLM's loader through vLLM's name mapping) equals what the
SSD tier reads for that expert (through bigmoe's expert_names mapping).
"""

import json
import os
import socket
import sys

os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.update(BIGMOE_PAGER="1", BIGMOE_VRAM_SLOTS="12", BIGMOE_RAM_SLOTS="20")


def main() -> None:
    import torch
    from bigmoe_pager import plugin
    from bigmoe_pager.adapters.vllm import glue, process
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    checkpoint, out = sys.argv[1], sys.argv[2]
    plugin.register_experts()
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
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
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
        for model_config in (config.model_config, config.speculative_config.draft_model_config):
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                model = initialize_model(vllm_config=config, model_config=model_config)
            get_model_loader(config.load_config).load_weights(model, model_config)
        count = glue.paged_layer_count(config)
    layers = [describe(layer) for layer in process.current().layers()]
    with open(out, "w") as f:
        json.dump({"paged_layer_count": count, "layers": layers}, f)


def describe(layer) -> dict:
    import torch

    pager, source = layer.pager, layer._ssd_source
    record = pager.layout.record_bytes
    buf = torch.zeros(pager.layout.pitch, dtype=torch.uint8)
    same = []
    for expert, slot in sorted(pager.ram_of.items()):
        buf.zero_()
        source.read_record(expert, buf)
        same.append(bool(torch.equal(pager.ram[slot][:record], buf[:record])))
    pager.check_loaded()
    return {
        "name": layer.layer_name,
        "moe_index": layer._moe_index,
        "decoder_layer": layer._decoder_layer,
        "store_layer": source.layer,
        "ram_experts": sorted(pager.ram_of),
        "ram_equals_ssd": same,
    }


if __name__ == "__main__":
    main()
