"""The reranker and its files: the transformers backbone with its speed levers (reranker), the yes/no head
(answer_head), the bi-encoder kind (bi_encoder), packed rows through the model (packed), precision: resolution,
dtypes and every autocast region (precision), a model directory's card and files (files) and its Hugging Face
model card, README.md (model_card). May import: data,
config, io, errors."""
