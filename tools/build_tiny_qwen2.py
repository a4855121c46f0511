"""Build the tiny Qwen2 config + byte-level BPE tokenizer in ``lychee_exp/assets/tiny_qwen2/``.

Run (from the repo root, after ``python -m tools.build_sample_data``)::

    python -m tools.build_tiny_qwen2 [--sample DIR] [--out DIR]

The tokenizer is trained on the sample set's queries and documents plus the
reranker prompt words, so tests can run a real tokenise -> forward -> "yes"/"no"
logit path quickly. Only ``config.json`` is written, no weights: the framework
initialises the model randomly from it with a seed. The output is deterministic.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

ASSETS = Path(__file__).resolve().parents[1] / "lychee_exp" / "assets"
VOCAB_SIZE, MIN_FREQUENCY = 4096, 2
EOS = "<|endoftext|>"  # also the pad token, as in Qwen2
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
PROMPT_TEXT = (
    "Given the instruction and query, judge whether the document is relevant "
    "to the query (yes/no). Instruct: Query: Document:"
)
ANSWER_WORDS = ["yes", "no"]  # the reranker reads the logits of these two tokens


def training_texts(sample_dir: Path) -> list[str]:
    """Unique queries and documents of train+dev (sorted), plus the prompt text."""
    texts = set()
    for name in ("train.jsonl", "dev.jsonl"):
        for line in (sample_dir / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            texts.update([row["query"], *row["pos"], *row["neg"]])
    # Negatives repeat documents; a set keeps each text's weight at one.
    return sorted(texts) + [PROMPT_TEXT]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # AutoTokenizer loads any tokenizer next to a qwen2 config.json as Qwen2Tokenizer,
    # which rebuilds the pipeline as NFC + Qwen2 split regex + ByteLevel(use_regex=False).
    # Train with exactly that pipeline so every loader gives the same ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # "yes"/"no" must be single tokens. If BPE did not learn one, add it as a regular
    # token; single_word=True keeps it from being cut out of words like "know"/"eyes".
    missing = [w for w in ANSWER_WORDS if len(tok.encode(w, add_special_tokens=False).ids) != 1]
    if missing:
        tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in missing])
    return tok


def verify(out: Path, texts: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert all(tok(t, add_special_tokens=False).input_ids == raw.encode(t).ids for t in texts)
    config = AutoConfig.from_pretrained(out)
    for word in ANSWER_WORDS:
        ids = tok(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, (word, ids)
    assert tok.pad_token == tok.eos_token == EOS and tok.padding_side == "left"
    assert config.vocab_size == len(tok) and config.pad_token_id == tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = f"{PROMPT_TEXT} Return the number of bytes in a file.\n<|im_start|>yes"
    batch = tok([prompt, "short one"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch.input_ids.shape, config.vocab_size)
    assert torch.isfinite(logits).all()
    # round trip through the byte-level decoder
    assert tok.decode(tok(prompt, add_special_tokens=False).input_ids) == prompt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=Path, default=ASSETS / "sample", help="the sample set the tokenizer is trained on")
    ap.add_argument("--out", type=Path, default=ASSETS / "tiny_qwen2", help="the directory to write")
    args = ap.parse_args(argv)

    texts = training_texts(args.sample)
    tok = train_tokenizer(texts)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=EOS, eos_token=EOS, padding_side="left")
    args.out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(args.out)
    eos_id = fast.convert_tokens_to_ids(EOS)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=eos_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    config.save_pretrained(args.out)  # config only: weights are initialised by the framework

    verify(args.out, texts)
    ids = {w: fast(w, add_special_tokens=False).input_ids for w in ANSWER_WORDS}
    print(f"vocab_size={len(fast)} eos/pad id={eos_id} yes/no ids={ids} -> {args.out}")


if __name__ == "__main__":
    main()
