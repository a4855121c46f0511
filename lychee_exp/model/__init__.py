"""The reranker and its files: the transformers backbone with its yes/no head (reranker, answer_head), the bi-encoder
and the packed cross-encoder kinds, precision (dtype maps and autocast, in one module), speed levers, and a model
directory's card and files."""
