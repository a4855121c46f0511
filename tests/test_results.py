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


def test_summary_line_leads_with_the_model_and_names_the_mix():
    from lychee_exp.job.results import summary_line

    mixed = {
        "model_ndcg@10": 0.6308,
        "initial_model_ndcg@10": 0.4012,
        "model_mrr@10": 0.5561,
        "mix": "the teacher at 0.7",
        "ndcg@10": 0.6731,
        "initial_ndcg@10": 0.6458,
        "mrr@10": 0.5878,
        "bm25_ndcg@10": 0.5551,
        "teacher_ndcg@10": 0.6678,
    }
    assert summary_line(mixed, "bm25") == (
        "dev ndcg@10: model 0.6308 (untrained 0.4012); mixed with the teacher at 0.7: 0.6731 (untrained 0.6458); "
        "BM25 0.5551; teacher 0.6678. mrr@10: model 0.5561, mix 0.5878"
    )
    # the model alone: no mix named (its unprefixed figures repeat the model's), a dense first stage by its name
    alone = {"model_ndcg@10": 0.5, "model_mrr@10": 0.4, "mix": "", "ndcg@10": 0.5, "mrr@10": 0.4}
    line = summary_line({**alone, "bm25_ndcg@10": 0.3, "dense_ndcg@10": 0.45}, "dense")
    assert line == "dev ndcg@10: model 0.5000; BM25 0.3000; first stage (dense) 0.4500. mrr@10: model 0.4000"


def test_the_mix_is_named_by_its_weights():
    from lychee_exp.ir.fusion import describe_mix

    assert describe_mix(0.7, 0.0, "bm25") == "the teacher at 0.7"
    assert describe_mix(0.0, 0.3, "bm25") == "the first stage (bm25) at 0.3"
    assert describe_mix(0.2, 0.3, "dense") == "the teacher at 0.2 and the first stage (dense) at 0.3"
    assert describe_mix(0.0, 0.0, "bm25") == ""


def test_model_and_mix_figures_read_runs_of_either_layout():
    from lychee_exp.ir.metrics import mix_figure, model_figure

    # written by this lychee_exp: model_* always, `mix` names the mix or is ""
    assert (
        model_figure({"model_ndcg@10": 0.5, "ndcg@10": 0.6, "mix": "x"}),
        mix_figure({"ndcg@10": 0.6, "mix": "x"}),
    ) == (0.5, 0.6)
    assert mix_figure({"model_ndcg@10": 0.5, "ndcg@10": 0.5, "mix": ""}) is None
    # written before: model_* only beside a mix
    assert mix_figure({"model_ndcg@10": 0.5, "ndcg@10": 0.6}) == 0.6
    assert (model_figure({"ndcg@10": 0.4}), mix_figure({"ndcg@10": 0.4})) == (0.4, None)
