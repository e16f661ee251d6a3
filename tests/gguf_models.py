"""Write tiny GGUF files the way llama.cpp's converter does, for the GGUF loader's tests.

`save_tiny_gguf(file, hf_model, tokenizer_json, qtype=...)` takes a tiny `transformers` model
(tiny_models.build_tiny_hf_model) and writes its weights under GGUF names, the Q and K rows of
`llama` permuted for llama.cpp's rotary layout, each 2-D weight quantized to `qtype` (norms and
biases stay F32, as the converter keeps them), with the tokenizer's vocabulary, merges, token
types and a ChatML template in the metadata. It returns the float32 state dict the loader must
reproduce: each tensor quantized and dequantized, in our (Hugging Face) layout."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's row order for llama Q/K (the fact its loaders undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tiny_gguf(file: Path, model, tokenizer_json: Path | None, *, qtype: str = "Q8_0",
                   arch: str | None = None, merges: bool = True, pre: str = "default", edit=None,
                   big_endian: bool = False) -> dict[str, torch.Tensor]:
    """`edit(writer)`, when given, runs after the metadata is added and before anything is
    written: it may overwrite a field (`writer.add_key_value`) or drop one
    (`del writer.kv_data[0][key]`), for the tests of malformed files."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    cfg = model.config
    arch = arch or ARCH[type(model).__name__]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(file), arch, endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer_json is not None:
        tok = json.loads(Path(tokenizer_json).read_text())
        vocab = dict(tok["model"]["vocab"])
        for added in tok.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
        specials = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in specials else 1 for t in tokens])
        if merges:
            w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
        w.add_eos_token_id(0)
        w.add_bos_token_id(0)
        w.add_chat_template(CHATML)
    expected = {}
    quant = getattr(Q, qtype)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if a.ndim == 2 and quant not in (Q.F32,):
            stored = quants.quantize(a, quant)
            back = quants.dequantize(stored, quant).reshape(a.shape)
        else:
            stored, back = a, a
        expected[name] = torch.from_numpy(np.array(back, dtype=np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            stored = llama_cpp_permute(stored if stored.dtype != np.uint8 else a, n)
            if a.ndim == 2 and quant != Q.F32:
                stored = quants.quantize(stored, quant)
        w.add_tensor(gguf_name(name), stored, raw_dtype=quant if stored is not a else None)
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
