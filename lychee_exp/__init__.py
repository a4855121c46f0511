"""lychee_exp: train and sweep Lychee-style rerankers with Hydra, on one device or many.

Layers, lower to higher (a module imports its own layer or lower ones only; tests/test_layering.py checks it):
core < tracking < sweep < recipe < launch < job < the entry points (run, report, dashboard) < testing < bench.
"""
