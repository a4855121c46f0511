"""lychee_exp: train and sweep Lychee-style rerankers with Hydra, on one device or many."""
