"""Information retrieval in the field's formats: BEIR datasets (beir), TREC qrels and runs (trec), trec_eval metrics
(metrics), first stages (first_stage, dense), hard-negative mining (mining, pipeline), what data=beir gives a run
(training), score fusion (fusion), the candidates a reranker scores (candidates), dev evaluation (evaluate), a rank's
reranking of a split (rank_reranking) and the on-disk cache they share (cache). May import: parallel, model, data,
config, io, errors."""
