"""Ranking data: JSONL queries (queries), training groups and dev pairs (groups), samplers with length
bucketing (sampling), and one rank's DataLoader (loader). May import: lychee_exp."""
