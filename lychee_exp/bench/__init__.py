"""Benchmarks: scaling over device counts (`python -m lychee_exp.bench`) and peers side by side
(`python -m lychee_exp.bench.peers`, identical batches for every system), and peers each batching the data
file its own way (`python -m lychee_exp.bench.own_batching`). May import every layer, test support included."""
