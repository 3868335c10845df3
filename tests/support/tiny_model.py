"""Build a tiny random-weight causal LM with a real byte-level BPE tokenizer and chat template.

Tests use it instead of downloading a model: about 100k parameters, a vocabulary of 320,
saved with `save_pretrained` so every loading path in slime is the real one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    AutoTokenizer,
    Glm4MoeConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "What is 12 + 34? The answer is \\boxed{46}.",
    "user assistant system: think step by step, then answer.",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ?",
    "the quick brown fox jumps over the lazy dog",
] * 20


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|pad|>",
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# 2026 families the FSDP trainer and the CPU engine run (the Megatron backend refuses them, naming why): HF
# model_type -> what the tiny config sets beyond the common shape. Each has two layers of different kinds.
_LINEAR_ATTENTION = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip
# DeepSeek-V3.2 / GLM-5: multi-latent attention whose lightning indexer lets each query attend to its top 4 keys. Its
# score per key sums ReLU'd heads, so with few heads many keys score exactly 0 and which tied key makes the top 4
# depends on the sequence's length: a full forward and cached decoding then attend to different keys. 16 heads (the
# real models have 32-64) make such ties as rare as in the real models.
_DSA = dict(
    num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
    topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, index_topk=4, index_head_dim=16, index_n_heads=16,
)  # fmt: skip
NEW_FAMILIES: dict[str, dict] = {
    "deepseek_v32": dict(_DSA, head_dim=8),
    "glm_moe_dsa": dict(_DSA, head_dim=8, indexer_types=["full", "full"]),
    "qwen3_next": dict(
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        **_LINEAR_ATTENTION,
    ),  # fmt: skip
    "qwen3_5_text": dict(_LINEAR_ATTENTION),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),  # fmt: skip
}


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Save a random-weight `arch` model and its tokenizer to `path`.

    `arch`: "llama", "qwen3", "qwen3_moe" (8 experts, top 2), a key of `NEW_FAMILIES`, or "glm4_moe" (GLM-4.5: layer
    0 dense, then 8 routed
    experts in 2 groups, 2 per token from the better group, plus a shared expert; rotary on half of each head; QKV
    bias, q/k norms; random biases, norms and router bias, so a layout or routing error shows in the logits).
    """
    path = Path(path)
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(head_dim=hidden_size // num_heads, **common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            head_dim=hidden_size // num_heads,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            norm_topk_prob=True,
            **common,
        )
    elif arch == "glm4_moe":
        common.pop("rope_theta")
        config = Glm4MoeConfig(
            head_dim=hidden_size // num_heads, moe_intermediate_size=hidden_size // 2, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
            num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **common,
        )  # fmt: skip
    elif arch in NEW_FAMILIES:
        config = CONFIG_MAPPING[arch](**{"head_dim": hidden_size // num_heads, **common, **NEW_FAMILIES[arch]})
    else:
        raise ValueError(
            f"unknown arch {arch!r}; use 'llama', 'qwen3', 'qwen3_moe', 'glm4_moe' or one of {NEW_FAMILIES}"
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init so attention is far from uniform and RoPE/positional errors show in logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # MoE experts are 3-D
                decisive_routing = arch == "glm4_moe" and name.endswith("mlp.gate.weight")
                param.normal_(0.0, 0.5 if decisive_routing else 0.2)
            elif arch == "glm4_moe" and name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
            elif arch == "glm4_moe":  # RMSNorms: distinct weights, so a swapped or skipped norm shows
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def teach_tiny_model(model_dir: Path, out_dir: Path, pieces: list[tuple[str, int]], max_steps: int = 200) -> Path:
    """A copy of the tiny model trained until it writes the trainable pieces of one trajectory by heart.

    `pieces` are (text, trainable) chunks, each tokenized on its own as a multi-turn sample is built (the prompt,
    model turns, observations). Greedy or low-temperature decoding then replays the model turns, so an example's
    tool loop runs for real on a model that would otherwise never write an action. Takes about a second.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, labels = [], []
    for text, trainable in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trainable else [-100] * len(piece)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    assert loss.item() < 1e-3, f"the tiny model did not learn the trajectory (loss {loss.item():.4f})"
    shutil.copytree(model_dir, out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
