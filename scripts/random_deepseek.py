#!/usr/bin/python3
"""scripts/random_deepseek.py: a DeepSeek-V2 checkpoint of random weights, to serve MLA at its real attention shapes.

    /usr/bin/python3 scripts/random_deepseek.py OUT_DIR [--layers N] [--hidden H] [--seed S]

Writes OUT_DIR/config.json and OUT_DIR/model.safetensors (float32) in the layout Hugging Face's DeepseekV2ForCausalLM
loads: DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128, no q_lora_rank), a smaller model around it (default hidden 1024, 2 layers, the first dense of width
1024, then 8 routed experts top-2 of width 256 and 2 shared ones, vocabulary 1024: 111 MiB). Matrices N(0, 1/fan_in),
the embedding N(0, 1), norms 1. The engine serves it like any checkpoint (moe_infer, moe_simulate --measure --hf,
scripts/validate_serving.sh TRAINED=OUT_DIR, bench/serve_step_pieces --hf): its greedy tokens mean nothing, its step
times are DeepSeek's latent attention over a cache of 576 floats a position. Needs numpy (Debian: python3-numpy,
which scripts/setup.sh's python3-matplotlib brings).
"""
import argparse
import json
import os
import struct

import numpy as np

HEADS, RKV, ROPE, NOPE, V = 16, 512, 64, 128, 128


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if a.layers < 1 or a.hidden < 1:
        ap.error(f"--layers {a.layers} --hidden {a.hidden}: both must be positive")
    h, experts, top_k, width, shared, dense, vocab = a.hidden, 8, 2, 256, 2, 1024, 1024
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "torch_dtype": "float32",
        "hidden_size": h, "num_hidden_layers": a.layers, "vocab_size": vocab, "max_position_embeddings": 4096,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "kv_lora_rank": RKV, "q_lora_rank": None,
        "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE, "v_head_dim": V, "head_dim": ROPE,
        "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "intermediate_size": dense,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": width, "n_shared_experts": shared, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax"}
    rng = np.random.default_rng(a.seed)
    tensors = {}

    def matrix(name, rows, cols):  # [out, in], N(0, 1/in)
        tensors[name] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def ones(name, n):
        tensors[name] = np.ones(n, np.float32)

    def ffn(prefix, f):
        matrix(prefix + "gate_proj.weight", f, h)
        matrix(prefix + "up_proj.weight", f, h)
        matrix(prefix + "down_proj.weight", h, f)

    tensors["model.embed_tokens.weight"] = rng.standard_normal((vocab, h)).astype(np.float32)
    matrix("lm_head.weight", vocab, h)
    ones("model.norm.weight", h)
    for layer in range(a.layers):
        p = f"model.layers.{layer}."
        ones(p + "input_layernorm.weight", h)
        ones(p + "post_attention_layernorm.weight", h)
        matrix(p + "self_attn.q_proj.weight", HEADS * (NOPE + ROPE), h)
        matrix(p + "self_attn.kv_a_proj_with_mqa.weight", RKV + ROPE, h)
        ones(p + "self_attn.kv_a_layernorm.weight", RKV)
        matrix(p + "self_attn.kv_b_proj.weight", HEADS * (NOPE + V), RKV)
        matrix(p + "self_attn.o_proj.weight", h, HEADS * V)
        if layer == 0:
            ffn(p + "mlp.", dense)
            continue
        matrix(p + "mlp.gate.weight", experts, h)
        for e in range(experts):
            ffn(f"{p}mlp.experts.{e}.", width)
        ffn(p + "mlp.shared_experts.", shared * width)
    # safetensors: an 8-byte little-endian header length, the JSON header (padded to 8), the tensors' bytes.
    header, at = {}, 0
    for name in sorted(tensors):
        size = tensors[name].nbytes
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(a.out, exist_ok=True)
    weights = os.path.join(a.out, "model.safetensors")
    with open(weights + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(tensors):
            f.write(tensors[name].tobytes())
    os.replace(weights + ".tmp", weights)
    config_path = os.path.join(a.out, "config.json")
    with open(config_path + ".tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(config_path + ".tmp", config_path)
    print(f"{a.out}: DeepSeek-V2 of random weights, {a.layers} layers, hidden {h}, {at / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
