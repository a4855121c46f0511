"""Benchmarks: scaling over device counts (`python -m lychee_exp.bench`) and peers side by side
(`python -m lychee_exp.bench.peers`). May import every layer, test support included."""
