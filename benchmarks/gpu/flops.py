"""What a LoRA step must compute (model FLOPs, for MFU) and what the hardware computes (padding and recomputation
included, for hardware utilisation), from the model's shape and the rows of the timed batches.

Model FLOPs per real token of a row of L tokens (the project's formula plus the adapters): the frozen weights get
no weight gradients, so 2N forward + 2N backward through the activations for the N non-embedding weights;
attention 4·layers·hidden·L forward (QK^T and AV over the whole row, causal half not subtracted, as before), twice
that backward; the LoRA adapters' P weights 2P forward + 2P activation gradient + 2P weight gradient. The answer
head (model.answer_head) runs once per scored row (a prompt, not a token) on one row of the frozen LM head
(w_yes - w_no, or w_yes): 2·hidden forward + 2·hidden gradient to the hidden state, as FlopCounterMode counts its
matmul (the row's difference and the bias are not matmuls); the rest of the vocabulary is never projected. Hardware
FLOPs: the same per token slot computed (padding included, each forward chunk at its own width) plus one more
forward (2N + attention + 2P) per slot when gradient checkpointing recomputes the layers (not the head: it is
outside them); a packed row's rounding pad is computed but not scored.
"""

from __future__ import annotations

from dataclasses import dataclass

# Qwen2.5-1.5B-Instruct's architecture (its config.json); the tiny tokenizer is used with it: ids stay below vocab.
QWEN25_1P5B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "pad_token_id": 0,
    "eos_token_id": 0,
}

# Dense bf16 tensor-core peak (vendor spec sheets, no sparsity), by a substring of the device name.
BF16_PEAK_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "A10G": 125.0,
    "RTX 4090": 165.2,
}


def bf16_peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    kv: int  # key/value width: hidden x kv heads / heads

    @classmethod
    def of(cls, config: dict) -> Shape:
        d = config["hidden_size"]
        return cls(d, config["intermediate_size"], config["num_hidden_layers"],
                   d * config["num_key_value_heads"] // config["num_attention_heads"])  # fmt: skip

    @property
    def non_embedding(self) -> int:
        d = self.hidden
        return self.layers * (2 * d * d + 2 * d * self.kv + 3 * d * self.ffn)  # q, o; k, v; gate, up, down

    def lora_params(self, r: int, targets: list[str]) -> int:
        d, kv, ffn = self.hidden, self.kv, self.ffn
        dims = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
                "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}  # fmt: skip
        return self.layers * sum(r * (dims[t][0] + dims[t][1]) for t in targets if t in dims)

    @property
    def answer_head(self) -> int:
        """FLOPs per scored row of the one-row answer head, frozen: forward and gradient to the hidden state."""
        return 4 * self.hidden

    def attention(self, length: float) -> float:
        """Attention FLOPs per token of a row `length` tokens wide, forward."""
        return 4 * self.layers * self.hidden * length


def step_flops(
    shape: Shape, lora: int, rows: list[tuple[list[int], list[int]]], checkpointing: bool
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a list of forward passes, each (real row lengths, computed widths per row:
    the width of the chunk the row went through, or its own length when nothing was padded)."""
    n = shape.non_embedding
    model = hardware = 0.0
    for lengths, widths in rows:
        for length, width in zip(lengths, widths):
            head = shape.answer_head if length else 0  # forward_rows' packing pad has length 0: not scored
            model += length * (4 * n + 6 * lora + 3 * shape.attention(length)) + head
            hardware += width * (4 * n + 6 * lora + 3 * shape.attention(width)) + head
            if checkpointing:
                hardware += width * (2 * n + 2 * lora + shape.attention(width))
    return model, hardware
