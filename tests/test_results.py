"""The end of a run says when the trained model alone ranks its dev split below the first stage it reranks."""

from lychee_exp.ir.metrics import standing_below_first_stage


def test_a_model_below_its_first_stage_says_so_with_the_teacher_beside():
    metrics = {"ndcg@10": 0.48, "model_ndcg@10": 0.33, "bm25_ndcg@10": 0.44, "teacher_ndcg@10": 0.46}
    line = standing_below_first_stage(metrics, "bm25")
    assert line.startswith("the model alone ranks dev below its first stage: ndcg@10 0.3300 vs bm25 0.4400")
    assert "teacher 0.4600" in line
    # the mix (ndcg@10) above BM25 does not hide the model alone; a model alone at or above it says nothing
    assert standing_below_first_stage({**metrics, "model_ndcg@10": 0.44}, "bm25") is None
    # without a teacher mix, ndcg@10 is the model alone; another first stage's key is read by its name
    assert "vs dense 0.5000" in standing_below_first_stage({"ndcg@10": 0.4, "dense_ndcg@10": 0.5}, "dense")
    assert standing_below_first_stage({"ndcg@10": 0.4}, "bm25") is None  # no first-stage figure: nothing to say
