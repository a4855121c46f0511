"""Forward chunks: within a batch, pairs of similar length go through the model together (Reranker.forward),
each chunk cut to its own longest pair, so fewer padding slots are computed."""

from __future__ import annotations

from lychee_exp.errors import UserError

# trainer.forward_chunks=auto. CPU: 4 chunks of a 32-pair micro-batch were 1.11x the tokens/s of one pass on the
# sample mix and 1.55x with bucketing on a long-tailed mix (python -m benchmarks.peers, 2-core machine,
# docs/benchmarks.md), with the same logits. CUDA: 1 until a GPU measurement says otherwise (small chunks can
# leave a GPU underused, and data.packing removes the padding there instead).
AUTO_FORWARD_CHUNKS = {"cpu": 4, "cuda": 1}


def forward_chunk_count(setting, device_type: str, strategy: str = "single") -> int:
    """trainer.forward_chunks as a number of chunks for this device type; a bad value is a UserError. fsdp: 1,
    since every rank must run the same forwards (parallel.sharding; other settings are refused by the config)."""
    if setting == "auto":
        if strategy == "fsdp":
            return 1
        return AUTO_FORWARD_CHUNKS.get(device_type, 1)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise UserError(f"trainer.forward_chunks must be auto or an integer >= 1, got {setting!r}")
    return setting


def length_chunks(lengths: list[int], chunks: int) -> list[tuple[list[int], int]]:
    """A batch's rows (by their real lengths) in `chunks` groups of equal size and similar length, each with its
    width (its longest row): forwarded apart they compute sum(rows x width) slots, not rows x the batch width.
    Equal sizes keep every chunk big enough to use a GPU well."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    count = max(1, min(chunks, len(order)))
    parts = [order[k * len(order) // count : (k + 1) * len(order) // count] for k in range(count)]
    return [(rows, max(lengths[r] for r in rows)) for rows in parts if rows]


def padded_slots(chunks: list[tuple[list[int], int]]) -> int:
    return sum(len(rows) * width for rows, width in chunks)
