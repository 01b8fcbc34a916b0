#!/usr/bin/env python3
"""Makes the tiny Hugging Face MoE fixtures of tests/data/hf/ (the serve/ engine's reference).

For each family (Mixtral, Qwen2-MoE, OLMoE) a random checkpoint of a few tens of KB is built with the transformers
model classes, saved as config.json + safetensors, and run in float32 with eager attention to record:
  - the prefill logits of every prompt position,
  - 8 greedy decode steps with the KV cache (the logits of each step and the chosen tokens),
  - the same tokens from generate() (EOS off), checked equal to the manual loop.
The weights are rounded to the dtype they are stored in (bf16, f16 or f32) BEFORE the reference runs, so the
expected values are exactly what a float32 engine computes from the stored file.

Storage covers every path of the loader: Mixtral in bf16 (one file), Qwen2-MoE in f32 split over two shards with
model.safetensors.index.json, OLMoE in f16 (one file).

A seed is kept only when every greedy choice wins by a clear margin (top-1 minus top-2 logit) and every router
top-k choice is clear, so an engine that sums in another order still picks the same tokens and experts.

Recipe (Debian): apt-get install -y python3-torch; /usr/bin/python3 -m pip install --break-system-packages
"transformers==4.46.3" safetensors; then /usr/bin/python3 scripts/make_hf_fixtures.py [OUT_DIR].
"""
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file
import transformers
from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM)

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf")
VOCAB = 96
DECODE_STEPS = 8
PROMPTS = [[3, 17, 42, 5, 77], [11, 2, 90, 33, 64, 8, 51, 29, 70]]
MARGIN = 2e-3  # smallest accepted gap between the winner and the runner-up (logits and router logits)


def families():
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    yield ("mixtral", "bf16", 1, MixtralForCausalLM,
           MixtralConfig(**common, num_key_value_heads=2, intermediate_size=16, num_local_experts=4,
                         num_experts_per_tok=2, rope_theta=10000.0, sliding_window=None,
                         router_aux_loss_coef=0.0))
    yield ("qwen2_moe", "f32", 2, Qwen2MoeForCausalLM,
           Qwen2MoeConfig(**common, num_key_value_heads=2, intermediate_size=40, moe_intermediate_size=12,
                          shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2,
                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0], rope_theta=50000.0,
                          use_sliding_window=False, router_aux_loss_coef=0.0))
    yield ("olmoe", "f16", 1, OlmoeForCausalLM,
           OlmoeConfig(**common, num_key_value_heads=4, intermediate_size=12, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=False, rope_theta=10000.0, clip_qkv=None, router_aux_loss_coef=0.0))


TORCH_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def randomize(model, seed):
    """Weights with a spread large enough for clear decisions: N(0, 1/fan_in) matrices, norms near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "bias" not in name:  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # q/k/v biases
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[1]
                scale = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
                if name.endswith("gate.weight") and "proj" not in name:
                    scale *= 3.0  # routers: decisive top-k
                p.copy_(scale * torch.randn(p.shape, generator=g))


def round_to(model, dtype):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(TORCH_DTYPE[dtype]).to(torch.float32))


def gap(values, k):
    top = torch.topk(values, k + 1, dim=-1).values
    return float((top[..., k - 1] - top[..., k]).min())


def run_reference(model, top_k):
    """Prefill logits, 8 greedy steps with the cache, and the smallest decision margin seen."""
    cases, margin = [], float("inf")
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, use_cache=True, output_router_logits=True)
        prefill = out.logits[0]
        margin = min(margin, min(gap(r, top_k) for r in out.router_logits))
        past, step_logits, tokens = out.past_key_values, [], []
        next_token = int(prefill[-1].argmax())
        margin = min(margin, gap(prefill[-1], 1))
        for _ in range(DECODE_STEPS):
            tokens.append(next_token)
            out = model(input_ids=torch.tensor([[next_token]]), past_key_values=past, use_cache=True,
                        output_router_logits=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            step_logits.append(logits)
            margin = min(margin, gap(logits, 1), min(gap(r, top_k) for r in out.router_logits))
            next_token = int(logits.argmax())
        generated = model.generate(ids, max_new_tokens=DECODE_STEPS, do_sample=False, synced_gpus=False,
                                   eos_token_id=None, pad_token_id=0, min_new_tokens=DECODE_STEPS)
        gen_tokens = generated[0, len(prompt):].tolist()
        assert gen_tokens == tokens, f"generate() {gen_tokens} differs from the cached loop {tokens}"
        cases.append({"prompt": prompt, "prefill_logits": prefill.tolist(),
                      "decode_tokens": tokens,  # token fed at decode step i (the greedy choice before it)
                      "decode_logits": torch.stack(step_logits).tolist(),
                      "generated": gen_tokens})
    return cases, margin


def save(model, config, dtype, shards, folder):
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(folder):
        os.remove(os.path.join(folder, f))
    config_dict = config.to_dict()
    config_dict["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2, sort_keys=True)
    state = {k: v.to(TORCH_DTYPE[dtype]).contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    if shards == 1:
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s * len(names) // shards:(s + 1) * len(names) // shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, os.path.join(folder, file), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = file
            total += state[k].numel() * state[k].element_size()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, dtype, shards, cls, config in families():
        config.architectures = [cls.__name__]
        for seed in range(1, 200):
            torch.manual_seed(seed)
            model = cls(config).eval()
            randomize(model, seed)
            round_to(model, dtype)
            with torch.no_grad():
                cases, margin = run_reference(model, config.num_experts_per_tok)
            if margin >= MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no seed gives clear decisions")
        folder = os.path.join(OUT, name)
        save(model, config, dtype, shards, folder)
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump({"family": name, "seed": seed, "dtype_on_disk": dtype, "min_margin": margin,
                       "generator": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                                    "float32, eager attention",
                       "cases": cases}, f)
        print(f"{name}: seed {seed}, margin {margin:.4f}, {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
