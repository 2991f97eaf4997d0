"""Tiny random-weight checkpoints of each supported architecture, built with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
}

_SWA = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
# Architectures only the transformers backend runs (and the native ones again, under their names),
# with the sliding windows (8 tokens), soft-capping, sinks, MoE and MLA of each made small.
BACKEND_ARCHS = {
    "llama": ARCHS["llama"],
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ARCHS["qwen2"],
    "qwen3": ARCHS["qwen3"],
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 32, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 10.0, **_SWA}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "query_pre_attn_scalar": 32, **_SWA}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    # Phi-4-mini's shape of RoPE: LongRoPE (short factors only within the original context) on
    # half of each head; its 8-token window as Phi-3-mini's 2047 on every layer.
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {
        "pad_token_id": 0, "partial_rotary_factor": 0.5, "sliding_window": 8,
        "original_max_position_embeddings": 256, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 256, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [2.0] * 8}}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "logits_scaling": 2.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.2}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 32}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {  # a shared expert; layer 1 dense
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96, "mlp_only_layers": [1]}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
        "v_head_dim": 24, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 32, "intermediate_size": 128, **_MOE, **_SWA}),
    # MoE whose modelling code uses its router linear as more than a linear: PhiMoE's router is
    # an nn.Linear subclass returning (logits, weights, experts); HunYuan's gate reads wg.weight.
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {**_MOE, "router_jitter_noise": 0.0}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {
        "head_dim": 32, "num_experts": 4, "moe_topk": 2}),
    # Llama 4's text model: chunked local attention (8-token chunks) on its RoPE layers (0, 2),
    # NoPE layers (1, 3) with full attention and temperature tuning (floor_scale 4, so it
    # changes within the prompts), L2 q/k norms, top-1 sigmoid-routed MoE with a shared expert
    # on layers 1 and 3, dense MLPs on 0 and 2.
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32, "intermediate_size": 64,
        "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 8,
        "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5,
        "use_qk_norm": True}),
    # Differential attention: two attention calls per layer over one K, each with half of V.
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {}),
    # Attention that does not call AttentionInterface (models/transformers/inline/): ALiBi
    # (BLOOM, Falcon's alibi variant), Falcon's RoPE with multi-query and new-decoder K/V
    # groups, GPT-Neo's unscaled local (8-token) and global layers, OpenAI-GPT, MPT (ALiBi,
    # clipped q/k/v).
    "bloom": ("BloomConfig", "BloomForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True,
                                                     "num_kv_heads": 2}),
    "falcon-mqa": ("FalconConfig", "FalconForCausalLM", {"multi_query": True,
                                                         "parallel_attn": True}),
    "falcon-alibi": ("FalconConfig", "FalconForCausalLM", {
        "alibi": True, "multi_query": False, "parallel_attn": False}),
    # Falcon's sequential layer with RoPE and biases (native: models/arch/falcon.py)
    "falcon-seq": ("FalconConfig", "FalconForCausalLM", {
        "multi_query": False, "parallel_attn": False, "bias": True}),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", {
        "attention_types": [[["global", "local"], 1]], "window_size": 8}),
    "openai-gpt": ("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", {}),
    "mpt": ("MptConfig", "MptForCausalLM", {"attn_config": {"clip_qkv": 4.0}}),
    # XGLM and TrOCR's decoder (fairseq's attention; TrOCR's learned positions from the step's),
    # GPT-NeoX-Japanese (RoPE on half of each head, the last layer's dense bias), Megatron-BERT
    # as a decoder (its LM head's transform before the output embeddings).
    "xglm": ("XGLMConfig", "XGLMForCausalLM", {"ffn_dim": 256}),
    "trocr": ("TrOCRConfig", "TrOCRForCausalLM", {"decoder_ffn_dim": 256}),
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", "GPTNeoXJapaneseForCausalLM", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5}}),
    "megatron-bert": ("MegatronBertConfig", "MegatronBertForCausalLM", {"is_decoder": True}),
    # RoFormer as a decoder: rotary positions inside its attention, on the values too.
    "roformer": ("RoFormerConfig", "RoFormerForCausalLM", {"is_decoder": True,
                                                           "rotary_value": True}),
    # Windows their masks apply while their attention calls do not pass them (WINDOW_FROM_MASK).
    "phimoe-window": ("PhimoeConfig", "PhimoeForCausalLM", {
        **_MOE, "router_jitter_noise": 0.0, "sliding_window": 8}),
    "doge": ("DogeConfig", "DogeForCausalLM", {"sliding_window": 8}),
    # Layers of different KV shapes in one cache (attention.fit_cache): MiMo-V2-Flash's full
    # layers with 2 KV heads beside sliding ones with 4; Gemma 4's full layers with 32-wide
    # heads beside sliding ones of 16 (and K reused as V).
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", {
        "head_dim": 32, "v_head_dim": 24, "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "dense"]}),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        "head_dim": 16, "global_head_dim": 32, "attention_k_eq_v": True,
        "num_global_key_value_heads": 1, **_SWA}),
    # DeepSeek-V3.2's indexed (DSA) attention: its indexer's top-k (8) selects on the cache
    # past 8 tokens (dense within them); 16 indexer heads keep exact ties of its ReLU'd scores
    # (which transformers' topk and ours may break apart) unlikely.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "index_topk": 8, "index_n_heads": 16,
        "index_head_dim": 32}),
    # GLM-MoE-DSA: the same selection with interleaved RoPE in its indexer, and layers that
    # reuse the previous layer's top-k ("shared"); a V head as wide as K, so the cache widens
    # for the indexer's keys.
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {
        "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 64, "mlp_layer_types": ["dense", "sparse", "sparse"],
        "n_group": 1, "topk_group": 1, "index_topk": 8, "index_n_heads": 16,
        "index_head_dim": 32, "indexer_types": ["full", "shared", "full"]}),
    # Gemma 3n's text model: per-layer MLP widths, its last two layers reusing the K/V of the
    # last earlier layer of their kind, AltUp, Laurel and per-layer inputs, activation sparsity
    # on the first layer.
    "gemma3n_text": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32, "intermediate_size": [256, 128, 256, 128],
        "num_kv_shared_layers": 2, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "vocab_size_per_layer_input": 512,
        "hidden_size_per_layer_input": 8}),
    # Encoders as decoders (is_decoder, as their causal-LM classes ask): BERT's LM head
    # transform, RoBERTa's positions after the padding index and its lm_head module, Electra's
    # generator head before its output embeddings, ModernBERT-decoder's prediction head.
    "bert": ("BertConfig", "BertLMHeadModel", {"is_decoder": True}),
    "roberta": ("RobertaConfig", "RobertaForCausalLM", {"is_decoder": True, "pad_token_id": 1}),
    "electra": ("ElectraConfig", "ElectraForCausalLM", {"is_decoder": True,
                                                        "embedding_size": 64}),
    "modernbert-decoder": ("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", {
        "local_attention": 8, "global_attn_every_n_layers": 2}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {
        "partial_rotary_factor": 0.25, "qk_layernorm": True, "use_qkv_bias": True}),
    # StableLM's other shape (native: models/arch/stablelm.py): the parallel residual (no
    # post-attention norm), rotary over the whole head, tied embeddings.
    "stablelm-parallel": ("StableLmConfig", "StableLmForCausalLM", {
        "partial_rotary_factor": 1.0, "use_parallel_residual": True, "tie_word_embeddings": True}),
}

# Models whose layers keep recurrent state (models/transformers/stateful.py): hidden 128 gives
# Mamba's inner width 256 (expand 2); untied embeddings keep its greedy tokens from repeating.
STATE_ARCHS = {
    "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 8, "conv_kernel": 4,
                                                  "expand": 2}),
    # inner width 256 = 8 heads of 32; chunks of 8 positions, so prompts span several
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {"state_size": 8, "conv_kernel": 4,
                                                    "expand": 2, "num_heads": 8, "head_dim": 32,
                                                    "n_groups": 2, "chunk_size": 8}),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {
        "state_size": 8, "conv_kernel": 4, "expand": 2}),
    # Mamba mixers (norms on dt, B and C) and one attention layer in four, MoE in every other
    "jamba": ("JambaConfig", "JambaForCausalLM", {
        "num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
        "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": 8}),
    # Mamba-2 mixers with one attention layer in four
    "bamba": ("BambaConfig", "BambaForCausalLM", {
        "num_hidden_layers": 4, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 32,
        "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_expand": 2, "mamba_chunk_size": 8}),
    # Granite 4's hybrid: Mamba-2 layers, one attention layer, MoE feed-forwards and Granite's
    # multipliers
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_n_groups": 2, "mamba_d_state": 8,
        "mamba_expand": 2, "mamba_chunk_size": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "shared_intermediate_size": 64, "logits_scaling": 2.0,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5}),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, muP multipliers
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {
        "head_dim": 32, "mamba_d_ssm": 256, "mamba_n_heads": 8, "mamba_d_head": 32,
        "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_chunk_size": 8,
        "ssm_multipliers": [1.5, 0.5, 1.2, 0.8, 1.1], "ssm_in_multiplier": 0.7,
        "ssm_out_multiplier": 1.3, "key_multiplier": 0.9, "embedding_multiplier": 1.5}),
    # LFM2: gated short convolutions (3 positions) and one attention layer in four
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
        "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
        "conv_L_cache": 3}),
    # Nemotron-H: one block kind a layer (Mamba-2, attention, MLP). Its time-step floor binds
    # transformers' forward (its chunked scan) but not generate's one-token decode update; the
    # engine applies it everywhere, as the forward does, so where it binds generate's text is
    # not the reference (test_state_models holds that case to the forward). Here the floor is
    # set where random weights never reach it, so generate is.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "layers_block_type": ["mamba", "attention", "mlp", "mamba"], "head_dim": 32,
        "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 8,
        "chunk_size": 8, "time_step_min": 1e-9}),
}

# Hybrids whose stateful layers run natively (models/arch/), with their tiny shapes.
NATIVE_STATE_ARCHS = {
    # Qwen3-Next: gated delta rule layers (2 key heads of 32 for 4 value heads of 32) around one
    # gated full-attention layer (partial rotary), MoE with a shared expert but on layer 1
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "linear_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96, "mlp_only_layers": [1]}),
    # Qwen3.5's text model: the same layers, the mixer's projections stored apart, dense MLPs
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "linear_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}),
}


_GATED_DELTA = {"num_hidden_layers": 4, "head_dim": 32,
                "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                "linear_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}
_GATED_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
              "shared_expert_intermediate_size": 64}
# Gated DeltaNet (linear attention with the delta rule) beside gated full attention: Qwen3-Next
# (MoE with a shared expert, its first layer dense), Qwen3.5 dense and MoE, OLMo-Hybrid (beta
# up to 2: negative eigenvalues)
STATE_ARCHS.update({
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_GATED_DELTA, **_GATED_MOE, "mlp_only_layers": [0]}),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_GATED_DELTA)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        **_GATED_DELTA, **_GATED_MOE}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", {
        **_GATED_DELTA, "linear_allow_neg_eigval": True}),
    # Kimi Linear: delta attention decaying per key channel, MLA full attention, MoE
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", {
        "num_hidden_layers": 4, "num_key_value_heads": 4, "layer_types": _GATED_DELTA["layer_types"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense"], "linear_num_heads": 4,
        "linear_head_dim": 32, "linear_conv_kernel_dim": 4, "kv_lora_rank": 32,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "num_experts": 4,
        "num_experts_per_token": 2, "moe_intermediate_size": 64}),
    # MiniMax: lightning attention (a decaying key-value state) beside full attention, MoE,
    # its residual alpha / beta factors away from 1
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32, "layer_types": [
            "linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 8,
        "linear_attn_alpha_factor": 0.9, "linear_attn_beta_factor": 1.1,
        "mlp_alpha_factor": 0.8, "mlp_beta_factor": 1.2}),
    # Zamba 2: Mamba-2 layers, two of them hybrid with one shared attention block (its
    # per-layer adapters) over the hidden state and the embeddings
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", {
        "num_hidden_layers": 4, "num_key_value_heads": 4,
        "layer_types": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "hybrid_layer_ids": [1, 3], "num_mem_blocks": 1, "mamba_d_state": 8,
        "mamba_headdim": 32, "n_mamba_heads": 8, "mamba_ngroups": 2, "chunk_size": 8,
        "adapter_rank": 8, "use_shared_attention_adapter": True, "time_step_min": 1e-9}),
    # Zamba: Mamba mixers of two heads (each its own x_proj and dt_proj), the shared attention
    # block in layers 1 and 3
    "zamba": ("ZambaConfig", "ZambaForCausalLM", {
        "num_hidden_layers": 4, "num_key_value_heads": 4, "attn_layer_period": 2,
        "attn_layer_offset": 1, "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_dt_rank": 8,
        "attention_head_dim": 64, "attention_hidden_size": 256}),
    # RecurrentGemma (Griffin): RG-LRU recurrent blocks and local attention (8-token window)
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 32, "num_key_value_heads": 1, "lru_width": 128,
        "attention_window_size": 8, "conv1d_width": 4, "final_w_init_variance_scale": 1.0,
        "block_types": ["recurrent", "attention", "recurrent"]}),
    # RWKV (v4): time and channel mixing, no attention; its eval forward halves the hidden
    # state every 2 layers (rescale_every) and rescales two weights to match
    "rwkv": ("RwkvConfig", "RwkvForCausalLM", {"num_hidden_layers": 4, "rescale_every": 2,
                                               "context_length": 256}),
    # xLSTM (mLSTM blocks, no attention): its chunkwise kernel in float32 as the model (its
    # default, bfloat16, would make transformers' own reference round where the engine does not)
    "xlstm": ("xLSTMConfig", "xLSTMForCausalLM", {"num_heads": 4, "chunk_size": 8,
                                                  "autocast_kernel_dtype": "float32"}),
})


def make_tiny(arch: str, path: Path, seed: int = 0, archs: dict = ARCHS, **overrides):
    """Save a tiny random model to `path`; returns the transformers model (fp32, eval).
    `overrides` change its config (vocab_size to match a real tokenizer, say); `archs` is the
    table `arch` names an entry of (BACKEND_ARCHS for the transformers backend's)."""
    import transformers

    cfg = tiny_config(arch, archs, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, archs[arch][1])(cfg).eval()
    if arch in RANDOM_NORMS:
        randomise_norms(model)
    model.save_pretrained(path)
    return model


# Architectures whose checkpoints get random norm weights and biases: transformers initialises
# a LayerNorm to weight 1, bias 0, where a bias never loaded or a per-head weight loaded into
# the wrong head would give the same output.
RANDOM_NORMS = {"stablelm", "stablelm-parallel", "bloom", "falcon", "falcon-mqa", "falcon-seq",
                "gpt_neo", "qwen3_next", "qwen3_5"}


@torch.no_grad()
def randomise_norms(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.weight.uniform_(0.5, 1.5)
            if module.bias is not None:
                module.bias.uniform_(-0.5, 0.5)
        elif "RMSNorm" in type(module).__name__:  # (1 + w) norms start at w = 0: move off it
            module.weight.add_(torch.rand_like(module.weight) - 0.5)


def tiny_config(arch: str, archs: dict = ARCHS, **overrides):
    """The transformers config make_tiny builds `arch` from (no weights)."""
    import transformers

    cfg_cls, _, extra = archs[arch]
    options = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False)
    options.update(extra)
    options.update(overrides)
    cfg = getattr(transformers, cfg_cls)(**options)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    return cfg


class IdTokenizer:
    """Stands in for a tokenizer where tests only need ids: token i decodes to "<i>"."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == 2))


def calibrate_int8_on_random_tokens(monkeypatch, vocab_size: int = 512) -> None:
    """--quantization int8 calibrates on the shipped text through the model's tokenizer; a tiny
    model has none (nor its vocabulary): it calibrates on four random 64-token windows instead."""
    import torch

    from batchrun.models.quant import calibration

    gen = torch.Generator().manual_seed(9)
    windows = [torch.randint(3, vocab_size, (64,), generator=gen).tolist() for _ in range(4)]
    monkeypatch.setattr(calibration, "token_windows", lambda path: windows)
