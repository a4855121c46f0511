"""Writes assets/architectures/<org>/<name>/config.json: the architecture keys of public rerankers' config.json
(no weights, no tokenizer), so that `python -m lychee_exp.plan` can size them offline. The figures are those
the models' Hugging Face cards publish; each file's parameter count is checked against the published total.

    python -m tools.build_architectures
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lychee_exp" / "assets" / "architectures"
QWEN = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 32768}
QWEN25_1P5B = {
    **QWEN, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}  # fmt: skip
QWEN3 = {**QWEN, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 128}
# repo id -> (keys, published parameter count in billions, to 2 decimals)
ARCHITECTURES = {
    # Lychee Rerank is Qwen2.5-1.5B-Instruct fine-tuned: the same shape
    "Qwen/Qwen2.5-1.5B-Instruct": (QWEN25_1P5B, 1.54),
    "vec-ai/lychee-rerank": (QWEN25_1P5B, 1.54),
    "Qwen/Qwen3-Reranker-0.6B": (
        {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
         "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True}, 0.60),
    "Qwen/Qwen3-Reranker-4B": (
        {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
         "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True}, 4.02),
    "Qwen/Qwen3-Reranker-8B": (
        {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
         "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}, 8.19),
    "BAAI/bge-reranker-v2-gemma": (
        {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "vocab_size": 256000, "hidden_size": 2048,
         "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
         "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": True}, 2.51),
}  # fmt: skip


def main() -> None:
    import torch
    import transformers

    for repo, (keys, billions) in ARCHITECTURES.items():
        config = transformers.AutoConfig.for_model(**keys)
        with torch.device("meta"):
            count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        assert round(count / 1e9, 2) == billions, (repo, count)
        out = ROOT / repo / "config.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(keys, indent=2, sort_keys=True) + "\n")
        print(f"{repo}: {count:,} parameters")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0]).parse_args()
    main()
