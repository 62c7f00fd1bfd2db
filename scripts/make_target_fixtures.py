#!/usr/bin/env python3
"""Parity fixtures for the target plugin's hybrid and MoE architectures, computed by transformers.

For each architecture a tiny random model is built with transformers' own classes, every
parameter drawn at random (norm gains, decay rates and conv weights included, so that no term
hides behind an identity initialisation), saved with `save_pretrained` as sharded safetensors,
and run forward on fixed token ids. Each fixture is an HF folder under tests/fixtures/ that the
plugin loads like any checkpoint:

  target_qwen3_5/      Qwen3_5ForConditionalGeneration (multimodal layout: the language model under
                       `model.language_model.*`, a one-block vision tower to be ignored); layers
                       3 Gated DeltaNet + 1 gated attention in the order linear, linear, full, linear
  target_qwen3_5_moe/  Qwen3_5MoeForCausalLM (text-only layout, `model_type` qwen3_5_moe_text):
                       layers linear, full, linear; 8 experts, top-2, a shared expert with its
                       sigmoid gate
  target_qwen3_moe/    Qwen3MoeForCausalLM: 3 layers, 8 experts, top-3, norm_topk_prob false,
                       layer 1 dense (`mlp_only_layers`); its config names the expert count
                       `num_local_experts`, as transformers 5 writes it

  target_llama_rope/   LlamaForCausalLM, 2 layers, run under each RoPE scaling (see make_rope)

Each of the first three folders holds config.json, model-*.safetensors + model.safetensors.index.json (as transformers
writes them), tokenizer.json (a word-level placeholder: the ids are what is tested) and
reference.safetensors:
  in.input_ids [2, 66] i64     fixed random ids (two chunks of the chunked delta rule: 64 + 2)
  out.layer.{i} [2, 66, H]     the output of decoder layer i (a forward hook), f32
  out.logits [2, 66, V]        the causal LM's logits, f32
  gen.prompt [1, 12] i64       row 0's first 12 ids
  gen.ids [1, N] i64           transformers' greedy `generate` continuation of it (its
                               KV / recurrent cache; stops at the EOS id or after 10 tokens)
and metadata `transformers_version`, `torch_version`, `architecture`.

Everything runs on the CPU in float32 with one thread and deterministic algorithms. transformers
has no FLA / causal-conv1d kernels here, so its own torch fallbacks run
(`torch_chunk_gated_delta_rule`, `torch_causal_conv1d_update`, `torch_recurrent_gated_delta_rule`).

target_llama_rope/ holds one set of weights (model.safetensors), tokenizer.json, and per RoPE kind
K (default, linear, dynamic, yarn, yarn_mscale, llama3) a config `config.K.json` and, in
reference.safetensors, `K.logits` [1, 96, V] and `K.layer.0` [1, 96, H] of the same ids
(`in.input_ids`). 96 positions are past every scaling's context (32, or 64 for llama3), so
dynamic NTK rescales and the scaled frequencies are all used. The configs are written the ways
checkpoints write them: transformers 5's `rope_parameters` (linear without any `rope_theta`:
transformers' default applies), and llama3 as Llama 3.1's config.json has it (`rope_scaling`
and a top-level `rope_theta`).

Usage (torch 2.11, transformers 5.8.1, safetensors):
    python3 scripts/make_target_fixtures.py --out tests/fixtures [--only qwen3_5 ...]
"""

import argparse
import json
import math
import os
import shutil

import torch
import transformers
from safetensors.torch import save_file

VOCAB = 64
EOS = 63
PROMPT, NEW = 12, 10

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)
GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head: the repeat is tested
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)

PLACEHOLDER_TOKENIZER = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(VOCAB)}, "unk_token": "t0"},
}


def build(arch):
    if arch == "qwen3_5":
        cfg = transformers.Qwen3_5Config(
            text_config=dict(TEXT, intermediate_size=32, **GDN),
            vision_config=dict(depth=1, hidden_size=8, intermediate_size=8, num_heads=2, out_hidden_size=32,
                               num_position_embeddings=16, patch_size=2),
        )
        return transformers.Qwen3_5ForConditionalGeneration(cfg)
    if arch == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(
            **dict(TEXT, num_hidden_layers=3), **dict(GDN, layer_types=GDN["layer_types"][1:]), num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=16,
        )
        return transformers.Qwen3_5MoeForCausalLM(cfg)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **dict(TEXT, num_hidden_layers=3), intermediate_size=32, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=8,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=10000.0,
        )
        return transformers.Qwen3MoeForCausalLM(cfg)
    if arch in ("mistral", "ministral"):
        # Llama's layout with a sliding window (8 of the 66 positions): every layer (mistral) or
        # the layers `layer_types` names (ministral).
        extra = dict(layer_types=["sliding_attention", "full_attention"] * 2) if arch == "ministral" else {}
        cls = transformers.MistralConfig if arch == "mistral" else transformers.MinistralConfig
        cfg = cls(**TEXT, intermediate_size=48, sliding_window=8, rope_theta=10000.0, **extra)
        model = transformers.MistralForCausalLM if arch == "mistral" else transformers.MinistralForCausalLM
        return model(cfg)
    if arch == "gemma3_text":
        # Gemma 3's text model as its 4B+ checkpoints are: sliding layers with their own base,
        # linear scaling on the global ones; a query scale other than head_dim's.
        cfg = transformers.Gemma3TextConfig(
            **dict(TEXT, tie_word_embeddings=True), intermediate_size=48, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        )
        return transformers.Gemma3ForCausalLM(cfg)
    if arch == "gemma2":
        # Soft-capped scores and logits (eager attention: transformers' SDPA path ignores the cap).
        cfg = transformers.Gemma2Config(
            **dict(TEXT, tie_word_embeddings=True), intermediate_size=48, sliding_window=8, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=10000.0, attn_implementation="eager",
        )
        return transformers.Gemma2ForCausalLM(cfg)
    if arch == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **TEXT, intermediate_size=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 16, "rope_theta": 150000.0},
        )
        return transformers.GptOssForCausalLM(cfg)
    if arch == "lfm2":
        # LFM2 / LFM2.5: short-conv layers and attention layers; the MLP width adjusted from
        # `intermediate_size` as the config's block_* keys say (int(2 * 48 / 3) * 1.5 -> 48).
        cfg = transformers.Lfm2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, norm_eps=1e-5, eos_token_id=EOS, tie_word_embeddings=True, conv_L_cache=3,
            block_multiple_of=16, block_ffn_dim_multiplier=1.5, block_auto_adjust_ff_dim=True,
            layer_types=["conv", "conv", "full_attention", "conv", "full_attention"], rope_theta=1e6,
        )
        return transformers.Lfm2ForCausalLM(cfg)
    if arch == "deepseek_v3":
        # MLA with both LoRA ranks, YaRN with mscale (so the softmax scale grows too), grouped
        # routing (4 groups, 2 kept), layer 0 dense.
        cfg = transformers.DeepseekV3Config(
            **dict(TEXT, num_hidden_layers=3, num_key_value_heads=4, head_dim=4), intermediate_size=48, moe_intermediate_size=8,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "rope_theta": 10000.0},
        )
        return transformers.DeepseekV3ForCausalLM(cfg)
    if arch == "glm4_moe":
        # GLM-4.5: half the head rotated, q/k/v biases, (here) q/k norms, layer 0 dense.
        cfg = transformers.Glm4MoeConfig(
            **dict(TEXT, num_hidden_layers=3), intermediate_size=48, moe_intermediate_size=8, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
            partial_rotary_factor=0.5, rope_theta=10000.0,
        )
        return transformers.Glm4MoeForCausalLM(cfg)
    if arch == "longcat_flash":
        # Two MLA sublayers and two dense MLPs a layer, the MoE on a shortcut; 4 zero-computation
        # (identity) experts beside the 8 routed ones.
        cfg = transformers.LongcatFlashConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, eos_token_id=EOS,
            tie_word_embeddings=False, ffn_hidden_size=48, expert_ffn_hidden_size=8, n_routed_experts=8,
            zero_expert_num=4, moe_topk=3, routed_scaling_factor=6.0, q_lora_rank=16, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4, v_head_dim=6, rms_norm_eps=1e-5,
            rope_theta=10000000.0,
        )
        return transformers.LongcatFlashForCausalLM(cfg)
    raise ValueError(arch)


# The families whose fixtures predate the per-family rules below (their draws stay as they were).
QWEN = ("qwen3_5", "qwen3_5_moe_text", "qwen3_moe")


@torch.no_grad()
def randomise(model):
    """Every parameter at random: matrices ~ N(0, 1/fan_in) so activations stay O(1); norm gains
    and gate biases off their identity values; A = exp(A_log) in [1, 16] as transformers draws it."""
    model_type = model.config.model_type
    if model_type not in QWEN:
        return randomise_family(model)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(1, 16).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))  # plain gain (the gated norm is not 1-centred)
        elif p.dim() == 1:
            p.copy_(0.2 * torch.randn_like(p))  # (1 + w) gains of the Qwen3.5 norms; Qwen3's plain gains
            if "qwen3_moe" in model_type:
                p.add_(1.0)
        elif "conv1d" in name:
            p.copy_(torch.randn_like(p) * 0.5)
        elif p.dim() == 3:  # fused experts [E, out, in]
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))


def randomise_family(model):
    """The other families: norm gains 1 + N(0, 0.2^2) (Gemma's, which scale by 1 + w, N(0, 0.2^2));
    biases N(0, 0.5^2), gpt-oss's expert gate/up biases N(0, 4^2) so that its clamp at 7 bites;
    attention sinks and the routers' score-correction biases (buffers) at random too; gpt-oss's
    experts are stored [E, in, out]."""
    gemma = model.config.model_type.startswith("gemma")
    gpt_oss = model.config.model_type == "gpt_oss"
    for name, p in model.named_parameters():
        if name.endswith("gate_up_proj_bias"):
            p.copy_(torch.randn_like(p) * 4.0)
        elif name.endswith("bias"):
            p.copy_(torch.randn_like(p) * 0.5)
        elif name.endswith("sinks"):
            p.copy_(torch.randn_like(p))
        elif p.dim() == 1:
            p.copy_(0.2 * torch.randn_like(p) + (0.0 if gemma else 1.0))
        elif name.endswith("conv.weight"):
            p.copy_(torch.randn_like(p) * 0.5)
        elif gpt_oss and p.dim() == 3:  # [E, in, out]
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn_like(b) * 0.2)


def text_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_moe", "mistral", "ministral", "gemma3_text", "gemma2", "gpt_oss", "lfm2",
            "deepseek_v3", "glm4_moe", "longcat_flash"]
SEEDS = {arch: i for i, arch in enumerate(FAMILIES)}


def make(arch, out_dir):
    torch.manual_seed(SEEDS[arch])
    model = build(arch).eval()
    randomise(model)
    ids = torch.randint(0, VOCAB - 1, (2, 66))  # EOS (63) only where the model says it

    layers = text_model(model).layers
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(layers)]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    # The hooks see what `output_hidden_states` reports (before the final norm).
    with torch.no_grad():
        hs = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    for i in range(len(layers) - 1):
        assert torch.equal(hs[i + 1], outs[i]), f"{arch}: hook and hidden_states[{i + 1}] differ"

    prompt = ids[:1, :PROMPT]
    with torch.no_grad():
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                             do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    gen = gen[:, PROMPT:]
    # Cached greedy decoding equals recomputing the whole sequence each step (the reference's
    # own consistency, so a mismatch in Rust is ours).
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(gen.shape[1]):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(seq[:, PROMPT:], gen), f"{arch}: cached generate differs from recomputation"

    folder = os.path.join(out_dir, f"target_{arch}")
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, max_shard_size="60KB")
    os.remove(os.path.join(folder, "generation_config.json"))
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(PLACEHOLDER_TOKENIZER, f)
    tensors = {"in.input_ids": ids, "out.logits": logits.contiguous(), "gen.prompt": prompt.clone(), "gen.ids": gen.contiguous()}
    for i, o in outs.items():
        tensors[f"out.layer.{i}"] = o.contiguous()
    meta = {"transformers_version": transformers.__version__, "torch_version": torch.__version__, "architecture": arch}
    save_file(tensors, os.path.join(folder, "reference.safetensors"), metadata=meta)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{folder}: {n_params} parameters, {size} bytes; generated {gen.tolist()[0]}")


ROPE_LEN = 96
ROPE_KINDS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                    "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def make_rope(out_dir):
    """One tiny Llama, the same weights under each RoPE scaling of ROPE_KINDS."""
    torch.manual_seed(3)
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, eos_token_id=EOS, tie_word_embeddings=False,
                max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / math.sqrt(p.shape[-1]))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, VOCAB - 1, (1, ROPE_LEN))
    folder = os.path.join(out_dir, "target_llama_rope")
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    for f in ["generation_config.json", "config.json"]:
        os.remove(os.path.join(folder, f))
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(PLACEHOLDER_TOKENIZER, f)
    tensors = {"in.input_ids": ids}
    for kind, scaling in ROPE_KINDS.items():
        theta = 500000.0 if kind == "llama3" else 10000.0
        cfg = transformers.LlamaConfig(**base, rope_theta=theta, rope_scaling=dict(scaling) if scaling else None)
        m = transformers.LlamaForCausalLM(cfg).eval()
        m.load_state_dict(state)
        with torch.no_grad():
            out = m(input_ids=ids, use_cache=False, output_hidden_states=True)
        tensors[f"{kind}.logits"] = out.logits.contiguous()
        tensors[f"{kind}.layer.0"] = out.hidden_states[1].contiguous()  # layer 0's output
        if kind == "default":
            default_logits = out.logits
        else:
            assert not torch.allclose(out.logits, default_logits, atol=1e-3), f"{kind}: scaling changes nothing"
        saved = cfg.to_dict()
        if kind == "linear":
            saved["rope_parameters"].pop("rope_theta")  # a config without any: the default applies
            assert theta == transformers.LlamaConfig.default_theta
        if kind == "llama3":
            saved.pop("rope_parameters")
            saved["rope_theta"], saved["rope_scaling"] = theta, scaling
        with open(os.path.join(folder, f"config.{kind}.json"), "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
    meta = {"transformers_version": transformers.__version__, "torch_version": torch.__version__, "architecture": "llama"}
    save_file(tensors, os.path.join(folder, "reference.safetensors"), metadata=meta)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{folder}: {size} bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", action="append", choices=FAMILIES + ["llama_rope"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    transformers.logging.set_verbosity_error()
    for arch in args.only or FAMILIES + ["llama_rope"]:
        make_rope(args.out) if arch == "llama_rope" else make(arch, args.out)


if __name__ == "__main__":
    main()
