"""Ranking data and how it becomes batches: JSONL queries (queries), prompts (prompt, pair_prompt), training groups
and dev pairs (groups), length-bucketed samplers (sampling), token budgets (budget), padded chunks and packed rows
(packing), the tokenized train set (token_cache) and one rank's DataLoader (loader). May import: config, io, errors."""
