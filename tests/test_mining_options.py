"""Mining with sentence-transformers' options: relative_margin, max_score and absolute_margin drop exactly the
candidates their definitions drop (each counted once), sampling=top writes the best-ranked candidates in order,
rank_by=teacher takes the rank range over the teacher's ranking of the first stage's top range_max, and a
command with first_stage=dense teacher=dense writes what the options promise."""

from __future__ import annotations

import json

import pytest
from beir_helpers import fruit_dataset, mining, ranked_dataset

from lychee_exp.ir.mining import mine

# the run ranks d00..d39 in order; positives d03, d12, d25 (lowest teacher score: d12's 4.0)
POSITIVES = {"d03": 5.0, "d12": 4.0, "d25": 6.0}
ELIGIBLE = [f"d{r:02d}" for r in range(10, 30) if r not in (12, 25)]  # ranks [10, 30) less the positives


def _teacher(score: dict[str, float]):
    return lambda pairs: [score[d] for _, d in pairs]


def _cycle_scores() -> dict[str, float]:
    """Candidates score 0..6 in turn (d10 -> 3, d11 -> 4, ...); positives as above."""
    return POSITIVES | {f"d{i:02d}": float(i % 7) for i in range(40) if f"d{i:02d}" not in POSITIVES}


@pytest.mark.parametrize(
    ("guard", "kept_at_most"),
    [
        ({"relative_margin": 0.5}, 2.0),  # 4.0 * (1 - 0.5); absolute's 4.0 - 0.5 would keep 3.0 too
        ({"max_score": 1.0}, 1.0),  # the bar itself is kept
        ({"absolute_margin": 1.0}, 3.0),
    ],
)
def test_each_guard_drops_exactly_the_candidates_above_its_bar(tmp_path, ir_cache, guard, kept_at_most):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    score = _cycle_scores()
    lines, summary = mine(corpus, split, run, mining(10, 30, 50, **guard), _teacher(score))
    expected = sorted(d for d in ELIGIBLE if score[d] <= kept_at_most)
    assert sorted(lines[0]["neg_ids"]) == expected and any(score[d] == kept_at_most for d in expected)
    assert summary.dropped == {next(iter(guard)): len(ELIGIBLE) - len(expected)}
    assert f"{len(ELIGIBLE) - len(expected)} candidates dropped by {next(iter(guard))}" in summary.line()


def test_guards_together_count_each_drop_once_in_sentence_transformers_order(tmp_path, ir_cache):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    score = _cycle_scores()
    settings = mining(10, 30, 50, absolute_margin=1.0, relative_margin=0.5, max_score=1.0)
    lines, summary = mine(corpus, split, run, settings, _teacher(score))
    count = {s: sum(score[d] == s for d in ELIGIBLE) for s in range(7)}
    # absolute drops 4-6, relative then 3, max_score then 2
    assert summary.dropped == {
        "absolute_margin": count[4] + count[5] + count[6],
        "relative_margin": count[3],
        "max_score": count[2],
    }
    assert sorted(lines[0]["neg_ids"]) == sorted(d for d in ELIGIBLE if score[d] <= 1.0)


def test_sampling_top_writes_the_best_ranked_candidates_in_rank_order(tmp_path, ir_cache):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    (line,), _ = mine(corpus, split, run, mining(10, 30, 5, sampling="top"))
    assert line["neg_ids"] == ["d10", "d11", "d13", "d14", "d15"]  # d12 is a positive
    # after a guard: the best ranked of what is left (scores of d10.. are 3, 4, 6, 0, 1, 2, 3, 4, ...)
    settings = mining(10, 30, 4, max_score=2.0, sampling="top")
    (line,), _ = mine(corpus, split, run, settings, _teacher(_cycle_scores()))
    assert line["neg_ids"] == ["d14", "d15", "d16", "d21"]
    assert line["neg_scores"] == [0.0, 1.0, 2.0, 0.0]


def test_rank_by_teacher_takes_the_range_over_the_teachers_ranking_of_the_first_stages_top(tmp_path, ir_cache):
    corpus, split, run, _ = ranked_dataset(tmp_path)
    # the teacher prefers later first-stage ranks; d30..d39 would score highest but lie past range_max
    score = {f"d{i:02d}": float(i) for i in range(40)} | {"d03": 103.0, "d12": 112.0, "d25": 125.0}
    asked = []

    def teacher(pairs):
        asked.extend(pairs)
        return [score[d] for _, d in pairs]

    settings = mining(4, 30, 4, sampling="top", rank_by="teacher")
    (line,), _ = mine(corpus, split, run, settings, teacher)
    # the teacher's ranking of d00..d29: d25, d12, d03, d29, d28, d27, d26, d24, ...; ranks 4.. start at d28
    assert line["neg_ids"] == ["d28", "d27", "d26", "d24"]
    assert line["neg_scores"] == [28.0, 27.0, 26.0, 24.0]
    assert sorted(asked) == sorted(("q1", f"d{i:02d}") for i in range(30))  # each pair of the top-30 once
    by_first_stage, _ = mine(corpus, split, run, mining(4, 30, 4, sampling="top"), teacher)
    assert by_first_stage[0]["neg_ids"] == ["d04", "d05", "d06", "d07"]
    with pytest.raises(ValueError, match="need a teacher"):
        mine(corpus, split, run, settings)


def test_a_dense_first_stage_and_teacher_with_topk_percpos_writes_what_it_promises(tmp_path, ir_cache):
    """NV-Retriever's TopK-PercPos through the command: each negative scores at most 95% of the query's lowest
    positive, and they are the best ranked such candidates (a dense first stage ranks by the teacher's cosine)."""
    from lychee_exp.cli import command_config
    from lychee_exp.config.commands import MineConfig, register_ir_schemas
    from lychee_exp.mine import mine_command

    root = fruit_dataset(tmp_path / "fruit")
    out = tmp_path / "train.jsonl"
    register_ir_schemas()
    args = [f"dataset={root}", f"out={out}", "first_stage=dense", "teacher=dense", "range_min=0", "range_max=20"]
    args += ["relative_margin=0.05", "sampling=top", "num_negatives=3", "progress_bar=false"]
    mine_command(command_config("mine", args, MineConfig))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines
    for line in lines:
        bar = min(line["pos_scores"]) * 0.95
        assert all(s <= bar + 1e-3 for s in line["neg_scores"]) and len(line["neg_ids"]) == 3
        assert line["neg_scores"] == sorted(line["neg_scores"], reverse=True)
