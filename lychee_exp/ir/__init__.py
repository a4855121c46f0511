"""Information-retrieval data and evaluation in the field's formats: BEIR datasets (beir), TREC qrels and runs
(trec), trec_eval metrics (metrics), first-stage retrieval (first_stage), hard-negative mining (mining), the
candidates a reranker scores (candidates) and the on-disk cache they share (cache). May import: lychee_exp."""
