"""The GPU check's inputs: a model directory (an architecture's config.json with the tiny BPE tokenizer, weights
drawn at random by every system from the same seed) and JSONL training files of two length mixes.

equal: every prompt exactly `max_len` tokens (documents longer than what the prompt budget leaves them).
long_tailed: documents of 32..4096 tokens, log-normal around the range's geometric mean (~360), each drawn on
its own, so a query's candidates differ in length as retrieved candidates do. Words come from the sample set's
documents; the tiny BPE makes ~1.7 tokens of a word, so a document of n tokens gets ~n / 1.7 words and its
tokenized length is measured, not assumed (tokens/s counts the real tokens of the batches the run drew).
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu.flops import QWEN25_1P5B

ASSETS = Path(__file__).resolve().parents[2] / "lychee_exp" / "assets"
TINY_QWEN2 = ASSETS / "tiny_qwen2"
SAMPLE_TRAIN = ASSETS / "sample" / "train.jsonl"
TOKENS_PER_WORD = 1.7


@dataclass(frozen=True)
class Mix:
    name: str
    max_len: int  # model.prompt.max_len: the widest prompt
    queries_per_step: int  # data.batch_size
    group: int  # data.train_group_size: rows per step = queries_per_step x group
    doc_tokens: tuple[int, int] | None  # long_tailed: (shortest, longest) document; None: every document overflows
    # data.max_tokens_per_batch where the config has it: the equal mixes' step (queries x group x max_len, which
    # is the 16384 that experiment=lychee_lora ships); long_tailed: the smallest multiple of 4096 that holds any
    # of its groups (8 x 4224 tokens at worst), so that no group stops the run at preflight
    token_budget: int


def full_mixes() -> dict[str, Mix]:
    return {
        "lora_1p5b_512": Mix("equal_512", 512, 4, 8, None, 16384),
        "lora_1p5b_2048": Mix("equal_2048", 2048, 1, 8, None, 16384),
        "long_tailed": Mix("long_tailed", 4224, 2, 8, (32, 4096), 36864),  # 4096-token documents plus the prompt
    }


def tiny_mixes() -> dict[str, Mix]:
    return {
        "lora_1p5b_512": Mix("equal_512", 80, 2, 4, None, 640),
        "lora_1p5b_2048": Mix("equal_2048", 128, 1, 4, None, 512),
        "long_tailed": Mix("long_tailed", 200, 2, 4, (8, 128), 800),
    }


def model_dir(work: Path, tiny: bool) -> Path:
    """Qwen2.5-1.5B's shape (tiny: the 2-layer Qwen2 of the package) with the tiny tokenizer, no weights."""
    path = work / ("tiny_qwen2_shape" if tiny else "qwen25_1p5b_shape")
    if not path.exists():
        path.mkdir(parents=True)
        config = json.loads((TINY_QWEN2 / "config.json").read_text()) if tiny else QWEN25_1P5B
        (path / "config.json").write_text(json.dumps(config, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_QWEN2 / name, path / name)
    return path


def queries_per_step(mix: Mix) -> int:
    """The most queries a step should hold: the fixed batch, or on long_tailed under its token budget twice what
    groups of typical documents (the geometric mean) would fill."""
    if mix.doc_tokens is None:
        return mix.queries_per_step
    typical = math.sqrt(mix.doc_tokens[0] * mix.doc_tokens[1])
    return max(mix.queries_per_step, math.ceil(2 * mix.token_budget / (mix.group * typical)))


def write_mix(mix: Mix, steps: int, path: Path, seed: int = 0) -> Path:
    """Enough queries for `steps` optimizer steps (one epoch, fixed or token-budget batches), 1 positive +
    (group - 1) negatives each."""
    words = " ".join(json.loads(line)["pos"][0] for line in SAMPLE_TRAIN.read_text().splitlines()).split()
    rng = random.Random(seed)
    longest = mix.doc_tokens[1] if mix.doc_tokens else mix.max_len

    def document() -> str:
        if mix.doc_tokens is None:
            tokens = longest  # at least as many words as tokens allowed: the prompt budget cuts it to max_len
            return " ".join(rng.choices(words, k=tokens))
        low, high = mix.doc_tokens
        tokens = min(high, max(low, int(rng.lognormvariate(math.log(math.sqrt(low * high)), 1.0))))
        return " ".join(rng.choices(words, k=max(1, int(tokens / TOKENS_PER_WORD))))

    with path.open("w") as out:
        for q in range((steps + 1) * queries_per_step(mix)):
            docs = [document() for _ in range(mix.group)]
            out.write(json.dumps({"query": f"query {q}: " + " ".join(rng.choices(words, k=8)),
                                  "pos": docs[:1], "neg": docs[1:]}) + "\n")  # fmt: skip
    return path
