"""What a rank spends tokenizing before step 1: every train prompt (data.pretokenize) and every dev pair, encoded
one prompt at a time (four tokenizer calls each: the three fields, then the whole text) vs in batches
(PromptEncoder.encode_many: one tokenizer call per field per batch of 4096, each distinct text once).

    python -m benchmarks.tokenize_startup [--rounds 3] [overrides, e.g. model=tiny_lychee]

Same prompts, same ids (checked); the two ways alternate their order between rounds; medians printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import harness
from lychee_exp.config.schema import to_run_config
from lychee_exp.job.in_process import compose_job
from lychee_exp.train.inputs import load_inputs


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both ways (medians)")
    args, overrides = parser.parse_known_args()
    cfg = to_run_config(compose_job(overrides, "/tmp/lychee_tokenize_startup"))
    inputs = load_inputs(cfg)
    default = cfg.data.instruction or cfg.model.prompt.default_instruction
    prompts = [
        (q.instruction or default, q.query, doc)
        for q in inputs.train_queries + inputs.dev_queries
        for doc in (*q.pos, *q.neg)
    ]
    encoder = inputs.encoder
    ways = {
        "one at a time": lambda: [encoder.encode(*prompt) for prompt in prompts],
        "batched": lambda: encoder.encode_many(prompts),
    }
    results = {}

    def timed(name: str, round_: int) -> float:
        began = time.perf_counter()
        results[name] = ways[name]()
        return time.perf_counter() - began

    seconds = harness.in_rounds(list(ways), args.rounds, timed)  # the two ways take turns at going first
    assert results["one at a time"] == results["batched"], "the two ways gave different ids"
    print(f"{len(prompts)} prompts ({cfg.model.name}), {args.rounds} rounds, medians:")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"  {name:14s} {median:6.2f} s  {len(prompts) / median:8.0f} prompts/s")
    ratio = statistics.median(seconds["one at a time"]) / statistics.median(seconds["batched"])
    print(f"  batched is {ratio:.2f}x faster")


if __name__ == "__main__":
    main()
