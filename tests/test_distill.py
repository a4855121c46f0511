"""FlagEmbedding's data in full: per-example prompts, teacher scores through sampling into the batch, the
distillation terms, unknown keys reported once per file, and the bad inputs that end with one line."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch
from conftest import TINY_QWEN2, run_tiny
from transformers import AutoTokenizer

from lychee_exp.config.schema import PromptConfig
from lychee_exp.data.groups import GroupCollator, TrainGroups, build_dev_pairs
from lychee_exp.data.prompt import PromptEncoder
from lychee_exp.data.queries import check_teacher_scores, load_queries
from lychee_exp.errors import UserError
from lychee_exp.ir.evaluate import bm25_scores, ranking_metrics
from lychee_exp.job.in_process import run_job
from lychee_exp.train import losses


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def scored_record(i, n_neg=6, prompt=None):
    """Teacher score of a document = its number, so a score can be checked against the document it follows."""
    record = {
        "query": f"query {i}",
        "pos": [f"doc {i}00"],
        "neg": [f"doc {i}{j:02d}" for j in range(1, n_neg + 1)],
        "pos_scores": [float(f"{i}00")],
        "neg_scores": [float(f"{i}{j:02d}") for j in range(1, n_neg + 1)],
    }
    if prompt is not None:
        record["prompt"] = prompt
    return record


@pytest.fixture(scope="module")
def tiny_tok():
    return AutoTokenizer.from_pretrained(str(TINY_QWEN2))


def test_prompt_per_example_is_what_the_encoder_sees(tmp_path, tiny_tok):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"query": "alpha query", "pos": ["p1"], "neg": ["n1"], "prompt": "Find the module documentation"},
            {"query": "beta query", "pos": ["p2"], "neg": ["n2"]},
            {"query": "gamma query", "pos": ["p3"], "neg": ["n3"], "instruction": "Retrieve a test case"},
        ],
    )
    queries = load_queries(str(path), "data.train_file")
    groups = TrainGroups(queries, group_size=2, instruction="Default instruction here", seed=0)
    encoder = PromptEncoder(tiny_tok, PromptConfig(), "left")
    batch = GroupCollator(encoder)([groups[i] for i in range(3)])
    texts = tiny_tok.batch_decode(batch["input_ids"], skip_special_tokens=True)
    expected = ["Find the module documentation", "Default instruction here", "Retrieve a test case"]
    for group, instruction in enumerate(expected):
        for row in (2 * group, 2 * group + 1):  # both documents of the group
            assert f"Instruct: {instruction} Query: {queries[group].query} Document:" in texts[row]
        others = [other for other in expected if other != instruction]
        assert not any(other in texts[2 * group] for other in others)


@pytest.mark.parametrize(("n_neg", "group_size", "random_negatives"), [(6, 4, 0), (2, 6, 0), (6, 5, 2)])
def test_teacher_scores_follow_their_documents_into_the_batch(tmp_path, tiny_tok, n_neg, group_size, random_negatives):
    path = write_jsonl(tmp_path / "train.jsonl", [scored_record(i, n_neg) for i in range(1, 6)])
    groups = TrainGroups(load_queries(str(path), "k"), group_size, "i", seed=3, random_negatives=random_negatives)
    for epoch in range(3):
        groups.set_epoch(epoch)
        items = [groups[i] for i in range(len(groups))]
        for _, _, docs, scores in items:
            assert len(scores) == len(docs) == group_size
            hard = group_size - random_negatives
            assert scores[:hard] == [float(doc.split()[1]) for doc in docs[:hard]]
            assert all(math.isnan(s) for s in scores[hard:])  # other queries' positives: no teacher score here
        batch = GroupCollator(PromptEncoder(tiny_tok, PromptConfig(), "left"))(items)
        assert batch["teacher_scores"].shape == (len(items), group_size)
        assert batch["input_ids"].shape[0] == len(items) * group_size


def test_no_teacher_scores_no_batch_key(tmp_path, tiny_tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"query": "q", "pos": ["p"], "neg": ["n"]}])
    groups = TrainGroups(load_queries(str(path), "k"), 2, "i", seed=0)
    assert "teacher_scores" not in GroupCollator(PromptEncoder(tiny_tok, PromptConfig(), "left"))([groups[0]])
    with pytest.raises(UserError, match="no teacher scores|has none"):
        check_teacher_scores(groups.queries, "data.train_file")


BAD_SCORES = {
    "neg_scores_short": ({"neg_scores": [1.0]}, "'neg_scores' has 1 values but 'neg' has 3"),
    "pos_scores_long": ({"pos_scores": [1.0, 2.0]}, "'pos_scores' has 2 values but 'pos' has 1"),
    "not_numbers": ({"neg_scores": ["a", "b", "c"]}, "'neg_scores' must be a list of numbers"),
    "one_side_only": ({"neg_scores": None}, "'pos_scores' without 'neg_scores'"),
    "labels_not_int": ({"pos_labels": [1.5]}, "'pos_labels' must be a list of integers"),
    "labels_zero": ({"pos_labels": [0]}, "'pos_labels' must be integer gains >= 1"),
    "prompt_not_string": ({"prompt": 3}, "'prompt' must be a string"),
}


@pytest.mark.parametrize("name", list(BAD_SCORES))
def test_bad_scores_are_one_line_naming_file_and_line(name, tmp_path):
    change, fragment = BAD_SCORES[name]
    good = {"query": "q", "pos": ["p"], "neg": ["a", "b", "c"], "pos_scores": [3.0], "neg_scores": [1.0, 2.0, 0.5]}
    bad = {k: v for k, v in {**good, **change}.items() if v is not None}
    path = write_jsonl(tmp_path / "t.jsonl", [good, good, bad])
    with pytest.raises(UserError) as info:
        load_queries(str(path), "data.train_file")
    assert f"{path}:3: " in str(info.value) and fragment in str(info.value) and "\n" not in str(info.value)


def test_unknown_keys_warned_once_per_file_naming_them(tmp_path, caplog):
    records = [{"query": f"q{i}", "pos": ["p"], "neg": ["n"], "scores": [1], "query_id": i} for i in range(5)]
    records[3]["passage_prompt"] = "x"
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="lychee_exp.data.groups"):
        load_queries(str(path), "data.train_file")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "passage_prompt, query_id, scores" in warnings[0]
    caplog.clear()
    load_queries(str(write_jsonl(tmp_path / "clean.jsonl", [scored_record(1, 2, prompt="p")])), "k")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# --------------------------------------------------------------------------------------------- the terms
def test_listwise_distill_is_flagembedding_cross_entropy_to_teacher_softmax():
    student = torch.tensor([2.0, -1.0, 0.5, 0.1, -0.3, 0.7, 1.5, 0.0])
    teacher = torch.tensor([[96.7, 90.5, 93.3, 89.0], [80.0, 81.0, 85.0, 79.0]])
    for temperature in (1.0, 2.0):
        expected = []
        for s, t in zip(student.view(2, 4).tolist(), teacher.tolist()):
            zt = sum(math.exp(v / temperature) for v in t)
            zs = sum(math.exp(v / temperature) for v in s)
            expected.append(
                -sum(math.exp(tv / temperature) / zt * (sv / temperature - math.log(zs)) for sv, tv in zip(s, t))
            )
        got = losses.listwise_distill(student, teacher, temperature)
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)


def test_pointwise_distill_is_soft_target_bce():
    student = torch.tensor([2.0, -1.0, 0.5, 0.1])
    teacher = torch.tensor([[3.0, -2.0, 0.0, 1.0]])

    def sig(x):
        return 1 / (1 + math.exp(-x))

    expected = (
        sum(
            -(sig(t) * math.log(sig(s)) + (1 - sig(t)) * math.log(1 - sig(s)))
            for s, t in zip(student.tolist(), teacher[0].tolist())
        )
        / 4
    )
    torch.testing.assert_close(losses.pointwise_distill(student, teacher), torch.tensor([expected]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["listwise", "pointwise"])
def test_distill_leaves_out_unscored_documents(name):
    student = torch.tensor([1.0, 0.2, -0.5, 3.0], requires_grad=True)
    teacher = torch.tensor([[2.0, 1.0, 0.0, math.nan]])
    got = losses.DISTILL[name](student, teacher)
    reference = losses.DISTILL[name](student[:3].detach(), teacher[:, :3])
    torch.testing.assert_close(got.detach(), reference)
    got.sum().backward()
    assert torch.isfinite(student.grad).all() and student.grad[3] == 0


def _listwise_by_hand(student: list[float], teacher: list[float] | None, temperature: float = 1.0) -> float:
    """-log softmax(student)[0] (teacher None), else -sum_i softmax(teacher/T)_i log softmax(student/T)_i."""
    s = [v / temperature for v in student] if teacher is not None else student
    log_z = math.log(sum(math.exp(v) for v in s))
    if teacher is None:
        return log_z - s[0]
    t = [v / temperature for v in teacher]
    z_t = sum(math.exp(v) for v in t)
    return -sum(math.exp(tv) / z_t * (sv - log_z) for sv, tv in zip(s, t))


def test_ranking_loss_adds_weighted_term():
    """Expected values written out by hand, not through the functions the loss calls."""
    student = [[2.0, -1.0, 0.5, 0.1], [-0.3, 0.7, 1.5, 0.0]]
    teacher = [[3.0, 1.0, 2.0, 0.0], [1.0, 4.0, 0.5, 2.0]]
    loss = losses.RankingLoss("listwise", 4, distill_weight=0.5, distill_temperature=2.0)
    total, distill = loss(torch.tensor(student).view(-1), torch.tensor(teacher))
    terms = [_listwise_by_hand(s, t, 2.0) for s, t in zip(student, teacher)]
    expected = [_listwise_by_hand(s, None) + 0.5 * term for s, term in zip(student, terms)]
    torch.testing.assert_close(total, torch.tensor(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(distill, torch.tensor(terms), atol=1e-5, rtol=0)
    assert losses.RankingLoss("listwise", 4)(torch.tensor(student).view(-1), None)[1] is None


# --------------------------------------------------------------------------------------------------- runs
def _scored_files(tmp_path, n=10):
    train = write_jsonl(tmp_path / "train.jsonl", [scored_record(i, prompt=f"Instruction {i}") for i in range(1, n)])
    return train


def test_run_with_distillation_reports_finite_distill_loss(tmp_path):
    train = _scored_files(tmp_path)
    _, metrics = run_tiny(
        tmp_path / "run",
        "data=jsonl",
        f"data.train_file={train}",
        f"data.dev_file={train}",
        "loss=listwise",
        "loss.distill_weight=1",
        "data.max_dev_queries=3",
        "trainer.max_steps=1",
    )
    assert math.isfinite(metrics["train_distill_loss"]) and metrics["train_distill_loss"] > 0
    _, plain = run_tiny(
        tmp_path / "plain",
        "data=jsonl",
        f"data.train_file={train}",
        f"data.dev_file={train}",
        "loss=listwise",
        "data.max_dev_queries=3",
        "trainer.max_steps=1",
    )
    assert "train_distill_loss" not in plain
    # one step from the same weights on the same batch: the distilled loss is the plain one plus the term
    total = plain["train_loss"] + metrics["train_distill_loss"]
    assert metrics["train_loss"] == pytest.approx(total, rel=1e-5)


def test_distillation_without_teacher_scores_is_one_line(tmp_path):
    """A user error before any training: in-process (the CLI's exit 2 and one line for a user error are tested
    once, in tests/test_data.py and tests/test_config.py)."""
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"query": f"q{i}", "pos": ["p"], "neg": ["n", "m"]} for i in range(4)]
    )
    run_dir = tmp_path / "run"
    overrides = ["model=tiny_lychee", "loss=pointwise", "data=jsonl", f"data.train_file={train}"]
    overrides += [f"data.dev_file={train}", "data.train_group_size=2", "loss.distill_weight=1"]
    with pytest.raises(UserError) as info:
        run_job([*overrides, "parallel=single", "gpus=1", "logger=none"], run_dir)
    message = str(info.value)
    assert "\n" not in message and "loss.distill_weight" in message and "pos_scores" in message, message
    assert not (run_dir / "metrics.json").exists()


def test_sample_data_carries_teacher_scores_that_rank_above_bm25():
    train = load_queries("pkg://lychee_exp.assets/sample/train.jsonl", "data.train_file")
    dev = load_queries("pkg://lychee_exp.assets/sample/dev.jsonl", "data.dev_file")
    assert all(q.has_teacher_scores for q in train + dev)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(TINY_QWEN2)), PromptConfig(), "left")
    pairs = build_dev_pairs(dev, encoder, "i", seed=0)
    teacher = ranking_metrics(pairs.teacher_scores, pairs.labels, pairs.query_index)
    bm25 = ranking_metrics(bm25_scores(pairs), pairs.labels, pairs.query_index)
    assert teacher["ndcg@10"] > bm25["ndcg@10"] + 0.05  # a teacher worth distilling from


@pytest.mark.parametrize("name", ["listwise", "pointwise"])
def test_training_distills_each_document_towards_its_own_teacher_score(tmp_path, name):
    """Through the trainer's own data path (length bucketing reorders queries, easy negatives from other
    queries): every row's teacher score is the one its document text carries, and the distillation loss of the
    first step equals the term computed here from the initial model's logits with teacher scores looked up by
    document text, written out by hand."""
    from conftest import TINY_OVERRIDES, compose_config

    from lychee_exp.config.schema import to_run_config
    from lychee_exp.parallel.devices import plan_devices
    from lychee_exp.parallel.distributed import DistEnv
    from lychee_exp.train.trainer import Trainer

    def teacher_of(number: int) -> float:  # varied signs and sizes, so that a score in the wrong row shows
        return ((number * 37) % 11 - 5) / 2

    # documents of different lengths (so that bucketing has something to sort)
    records = []
    for i in range(1, 9):
        record = scored_record(i, n_neg=5)
        record["neg"] = [f"{doc} {'word ' * (3 * ((i + j) % 4))}" for j, doc in enumerate(record["neg"])]
        record["pos_scores"] = [teacher_of(i * 100)]
        record["neg_scores"] = [teacher_of(i * 100 + j) for j in range(1, 6)]
        records.append(record)
    train = write_jsonl(tmp_path / "train.jsonl", records)
    group = 4
    overrides = [
        *TINY_OVERRIDES,
        "data=jsonl",
        f"data.train_file={train}",
        f"data.dev_file={train}",
        f"loss={name}",
        "loss.distill_weight=1",
        f"data.train_group_size={group}",
        "data.random_negatives=1",
        "data.bucket_by_length=true",
        "data.bucket_pool_batches=4",
        "trainer.max_steps=1",
        "trainer.evaluate=false",
        "trainer.save_model=false",
    ]
    cfg = to_run_config(compose_config(overrides, tmp_path))
    trainer = Trainer(cfg, DistEnv(), plan_devices("single", 1, cuda_count=0, cpu_threads_per_rank=1), tmp_path)
    trainer.setup()
    trainer.data.sampler.set_epoch(0)
    trainer.data.train_set.set_epoch(0)
    batch = next(iter(trainer.data.loader))
    texts = trainer.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    numbers = [int(re.search(r"Document: doc (\d+)", text).group(1)) for text in texts]
    by_text = torch.tensor([teacher_of(n) for n in numbers], dtype=torch.float32).view(-1, group)
    by_text[:, -1] = math.nan  # the easy negative: another query's positive, no score for this query
    torch.testing.assert_close(batch["teacher_scores"], by_text, equal_nan=True)

    with torch.no_grad():
        logits = trainer.model(batch["input_ids"], batch["attention_mask"]).view(-1, group).tolist()
    terms = []
    for student, teacher in zip(logits, by_text.tolist()):
        scored = [(s, t) for s, t in zip(student, teacher) if not math.isnan(t)]
        if name == "listwise":
            terms.append(_listwise_by_hand([s for s, _ in scored], [t for _, t in scored]))
        else:  # mean over scored documents of BCE(sigmoid(s), sigmoid(t))
            sig = [(1 / (1 + math.exp(-s)), 1 / (1 + math.exp(-t))) for s, t in scored]
            terms.append(-sum(q * math.log(p) + (1 - q) * math.log(1 - p) for p, q in sig) / len(sig))
    expected = sum(terms) / len(terms)
    summary = trainer.fit()
    trainer.cleanup()
    assert summary["steps"] == 1
    assert summary["train_distill_loss"] == pytest.approx(expected, rel=1e-4)
