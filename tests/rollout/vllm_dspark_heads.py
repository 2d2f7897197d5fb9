"""Run by tests/rollout/test_vllm_dspark.py in its own process (vLLM's parallel state is process-wide): vLLM's
DSpark heads loaded class-level from our export, against ours. Prints one JSON line."""

import json
import sys

import torch
from rollout_helpers import make_policy
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead

from lightning_codraft.models.dspark import DSparkDraft


def main(out_dir: str, port: int) -> None:
    torch.manual_seed(1)
    policy = make_policy(seed=0, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6)
    ours = DSparkDraft.from_policy(policy, taps=(2, 3, 5), block_size=4, mask_token_id=0, markov_rank=16)
    for p in ours.parameters():
        p.data.normal_(0, 0.3)
    ours.save_pretrained(out_dir)
    cfg = json.load(open(f"{out_dir}/config.json"))
    state = load_file(f"{out_dir}/model.safetensors")
    V, H, r = cfg["vocab_size"], cfg["hidden_size"], cfg["markov_rank"]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        markov = DSparkMarkovHead(V, V, r, prefix="markov_head")
        conf = DSparkConfidenceHead(H, prefix="confidence_head", bias=True, with_markov=cfg["confidence_head_with_markov"])
        processor = LogitsProcessor(V)
    loaded = []
    for prefix, module in (("markov_head.", markov), ("confidence_head.", conf)):
        for name, param in module.named_parameters():
            loader = getattr(param, "weight_loader", None)
            loader(param, state[prefix + name]) if loader else param.data.copy_(state[prefix + name])
            loaded.append(prefix + name)
        for m in module.modules():  # what vLLM runs after loading (the CPU linears pack their weights)
            if getattr(m, "quant_method", None) is not None:
                m.quant_method.process_weights_after_loading(m)
    g = torch.Generator().manual_seed(2)
    ids, hidden = torch.randint(0, V, (16,), generator=g), torch.randn(16, H, generator=g)
    with torch.no_grad():
        bias = (markov.bias(markov.embed(ids), processor) - ours.markov_head.bias(ids)).abs().max()
        prob = torch.sigmoid(conf(hidden, markov.embed(ids)))
        want = torch.sigmoid(ours.confidence_logits(hidden, ids))
    print(json.dumps({"loaded": loaded, "expected": sorted(k for k in state if "_head." in k),
                      "markov_diff": float(bias), "confidence_diff": float((prob - want).abs().max()),
                      "gate": hasattr(markov, "gate_proj")}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
