"""JSONL loading errors name file:line; training groups; bad inputs through the CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import output_lines, run_cli

from lychee_exp.data.groups import TrainGroups
from lychee_exp.data.queries import RankingQuery, load_queries
from lychee_exp.errors import UserError
from lychee_exp.job.in_process import run_job

GOOD = {"query": "what is a lychee", "pos": ["a tropical fruit"], "neg": ["a car", "a boat", "a plane"]}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_line(i=0):
    return json.dumps({**GOOD, "query": f"{GOOD['query']} {i}"})


# name -> (file lines or None for a missing file, expected line number or None, message fragment)
BAD_INPUTS = {
    "malformed_json": ([good_line(0), good_line(1), '{"query": "x", "pos": ["y"'], 3, "not valid JSON"),
    "malformed_after_blank": ([good_line(0), "", "", "{oops}"], 4, "not valid JSON"),
    "no_positive": ([good_line(0), json.dumps({"query": "q", "pos": [], "neg": ["n"]})], 2, "no positive"),
    "missing_positive": ([json.dumps({"query": "q", "neg": ["n"]})], 1, "pos"),
    "pos_not_list": (
        [good_line(0), good_line(1), json.dumps({"query": "q", "pos": "a doc"})],
        3,
        "'pos' must be a list",
    ),
    "neg_not_strings": ([json.dumps({"query": "q", "pos": ["p"], "neg": [1, 2]})], 1, "'neg' must be a list"),
    "empty_query": ([json.dumps({"query": " ", "pos": ["p"]})], 1, "query"),
    "not_an_object": ([good_line(0), "[1, 2]"], 2, "JSON object"),
    "empty_file": ([], None, "no queries"),
    "only_blank_lines": (["", "  "], None, "no queries"),
    "missing_file": (None, None, "does not exist"),
}


def make_input(tmp_path, name):
    lines, line_no, fragment = BAD_INPUTS[name]
    path = tmp_path / f"{name}.jsonl"
    if lines is not None:
        write_lines(path, lines)
    where = f"{path}:{line_no}" if line_no else str(path)
    return path, where, fragment


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_user_error_naming_file_and_line(name, tmp_path):
    path, where, fragment = make_input(tmp_path, name)
    with pytest.raises(UserError) as info:
        load_queries(str(path), "data.train_file")
    message = str(info.value)
    assert "\n" not in message
    assert where in message
    assert fragment in message
    if BAD_INPUTS[name][1]:
        # the line number is exactly right: not the next or previous one
        assert f"{path}:{BAD_INPUTS[name][1]}:" in message


def test_directory_is_user_error(tmp_path):
    with pytest.raises(UserError, match="directory"):
        load_queries(str(tmp_path), "data.dev_file")


def test_unknown_keys_ignored_and_fields_read(tmp_path):
    path = write_lines(
        tmp_path / "ok.jsonl",
        [
            json.dumps({**GOOD, "score": 3.5, "meta": {"a": 1}}),
            "",
            json.dumps({"query": "q2", "pos": ["p2"], "instruction": "Find it", "qid": "Q-2"}),
        ],
    )
    queries = load_queries(str(path), "data.train_file")
    assert len(queries) == 2
    assert queries[0].query == GOOD["query"] and queries[0].pos == GOOD["pos"] and queries[0].neg == GOOD["neg"]
    assert queries[0].instruction is None
    assert queries[1].neg == [] and queries[1].instruction == "Find it" and queries[1].qid == "Q-2"


def test_limit_reads_a_prefix(tmp_path):
    path = write_lines(tmp_path / "ok.jsonl", [good_line(i) for i in range(5)])
    assert [q.query for q in load_queries(str(path), "k", limit=2)] == [f"{GOOD['query']} {i}" for i in range(2)]


def test_sample_data_loads():
    train = load_queries("pkg://lychee_exp.assets/sample/train.jsonl", "data.train_file")
    dev = load_queries("pkg://lychee_exp.assets/sample/dev.jsonl", "data.dev_file")
    assert len(train) > 100 and len(dev) > 10
    assert all(q.pos and q.neg for q in train + dev)


def _queries(n_neg):
    return [RankingQuery(f"q{i}", [f"pos{i}"], [f"neg{i}-{j}" for j in range(n_neg)], qid=str(i)) for i in range(6)]


def test_group_is_positive_then_negatives():
    groups = TrainGroups(_queries(10), group_size=5, instruction="default instr", seed=1)
    assert len(groups) == 6
    for i in range(len(groups)):
        instruction, query, docs, scores = groups[i]
        assert scores is None  # no teacher scores in these queries
        assert instruction == "default instr" and query == f"q{i}"
        assert len(docs) == 5
        assert docs[0] == f"pos{i}"
        assert all(d.startswith(f"neg{i}-") for d in docs[1:])
        assert len(set(docs[1:])) == 4  # enough negatives: sampled without replacement


def test_query_instruction_overrides_default():
    q = RankingQuery("q", ["p"], ["n"], instruction="own instruction")
    assert TrainGroups([q], 2, "default", seed=0)[0][0] == "own instruction"


def test_too_few_negatives_resampled_with_replacement():
    groups = TrainGroups(_queries(2), group_size=8, instruction="i", seed=0)
    _, _, docs, _ = groups[0]
    assert len(docs) == 8 and docs[0] == "pos0"
    counts = Counter(docs[1:])
    assert set(counts) <= {"neg0-0", "neg0-1"}
    assert max(counts.values()) > 1


def test_no_negatives_with_group_size_above_one_is_user_error():
    with pytest.raises(UserError, match="train_group_size"):
        TrainGroups([RankingQuery("q", ["p"], [], qid="7")], group_size=2, instruction="i", seed=0)
    assert TrainGroups([RankingQuery("q", ["p"], [])], group_size=1, instruction="i", seed=0)[0][2] == ["p"]


def test_groups_deterministic_per_seed_epoch_index():
    a = TrainGroups(_queries(30), group_size=6, instruction="i", seed=11)
    b = TrainGroups(_queries(30), group_size=6, instruction="i", seed=11)
    for epoch in (0, 3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        # independent of access order
        assert [a[i] for i in range(6)] == [b[i] for i in reversed(range(6))][::-1]
    c = TrainGroups(_queries(30), group_size=6, instruction="i", seed=12)
    assert [a[i] for i in range(6)] != [c[i] for i in range(6)]


def test_groups_differ_across_epochs():
    groups = TrainGroups(_queries(30), group_size=6, instruction="i", seed=0)
    seen = []
    for epoch in range(3):
        groups.set_epoch(epoch)
        seen.append([groups[i][2] for i in range(len(groups))])
    assert seen[0] != seen[1] and seen[1] != seen[2] and seen[0] != seen[2]
    # each epoch still keeps the positive first
    assert all(docs[0] == f"pos{i}" for epoch in seen for i, docs in enumerate(epoch))


# every kind of bad train file, and the dev file through the same path twice
BAD_FILE_CASES = [
    (name, "train") for name in ("malformed_json", "no_positive", "pos_not_list", "empty_file", "missing_file")
] + [("malformed_json", "dev"), ("missing_file", "dev")]
# Through the CLI as a subprocess (seconds each, for its imports): one line-level and one file-level error show
# that a user error of the job ends as exit 2, one line, no traceback; the others check that message in-process.
CLI_CASES = [("malformed_json", "train"), ("missing_file", "dev")]


def _bad_file_job(tmp_path, name, which, *extra):
    """The job's overrides with one bad input file (the other file good), and what its one line must hold."""
    path, where, fragment = make_input(tmp_path, name)
    good = write_lines(tmp_path / "good.jsonl", [good_line(i) for i in range(4)])
    train, dev = (path, good) if which == "train" else (good, path)
    overrides = [
        "model=tiny_lychee",
        "loss=pointwise",
        "data=jsonl",
        f"data.train_file={train}",
        f"data.dev_file={dev}",
        "data.train_group_size=2",
        "trainer.progress_bar=false",
        *extra,
    ]
    expected = [where, fragment]
    if BAD_INPUTS[name][1] is None:  # file-level errors name the key as well as the file
        expected.append(f"data.{which}_file")
    return overrides, expected


@pytest.mark.parametrize(("name", "which"), [c for c in BAD_FILE_CASES if c not in CLI_CASES], ids=lambda v: v)
def test_bad_input_file_stops_the_job_with_one_line_naming_it(name, which, tmp_path):
    overrides, expected = _bad_file_job(tmp_path, name, which, "logger=none")
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as info:
        run_job(overrides, run_dir)
    message = str(info.value)
    assert "\n" not in message and all(part in message for part in expected), (message, expected)
    assert not (run_dir / "metrics.json").exists()


@pytest.mark.parametrize(("name", "which"), CLI_CASES, ids=lambda v: v)
def test_cli_bad_input_exit_2_one_line_no_metrics(name, which, tmp_path):
    overrides, expected = _bad_file_job(tmp_path, name, which)
    run_dir = tmp_path / "run"
    proc = run_cli(overrides, run_dir, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    lines = output_lines(proc)
    assert len(lines) == 1, lines
    assert all(part in lines[0] for part in expected), (lines, expected)
    assert not (run_dir / "metrics.json").exists()


def test_train_query_without_negatives_stops_one_process_with_one_line(tmp_path):
    """The same check as the DDP case below, which goes through the CLI: here in-process, in one process."""
    train = write_lines(tmp_path / "train.jsonl", [good_line(0), json.dumps({"query": "q", "pos": ["p"]})])
    run_dir = tmp_path / "run"
    overrides = ["model=tiny_lychee", "loss=pointwise", "data=jsonl", f"data.train_file={train}"]
    overrides += [f"data.dev_file={train}", "data.train_group_size=4", "parallel=single", "logger=none"]
    with pytest.raises(UserError, match="train_group_size") as info:
        run_job(overrides, run_dir)
    assert "\n" not in str(info.value)
    assert not (run_dir / "metrics.json").exists()


def test_cli_train_query_without_negatives_exit_2(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [good_line(0), json.dumps({"query": "q", "pos": ["p"]})])
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "model=tiny_lychee",
            "loss=pointwise",
            "data=jsonl",
            f"data.train_file={train}",
            f"data.dev_file={train}",
            "data.train_group_size=4",
            "trainer.progress_bar=false",
            "parallel=ddp",
        ],
        run_dir,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert len(output_lines(proc)) == 1, out
    assert "train_group_size" in out
    assert not (run_dir / "metrics.json").exists()
