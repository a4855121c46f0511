"""Conformance of `hydra/sweeper=lychee_optuna` with hydra-optuna-sweeper, as read from facebookresearch/hydra
`plugins/hydra_optuna_sweeper/{tests/test_optuna_sweeper_plugin.py,example/}` at upstream commit 2c03d1b925fe:
its module surface (`_impl` helpers, `config.MOTPESamplerConfig`, `optuna_sweeper.OptunaSweeper`), its examples
(sphere, grid, multi-objective, custom search space, failures, the removed motpe sampler) with the sweeper's name
changed only, and a lightning-hydra-template-shaped mnist_optuna.yaml. Each assertion states upstream's expected
value; where this sweeper differs on purpose, the test is named `test_deviation_*` and says what upstream does.
The apps in tests/sweep_apps are plain Hydra apps (no `trial` key) that return their objective; each sweep is a
short subprocess (trials run in it through Hydra's basic launcher).
"""

from __future__ import annotations

import os
import re
import runpy
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra_in_process import run_in_process
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from lychee_exp.errors import UserError
from lychee_exp.sweep.space import build_space

APPS = Path(__file__).resolve().parent / "sweep_apps"


def _argv(tmp_path: Path, app: str, args: tuple[str, ...], multirun: bool) -> list[str]:
    flags = [a for a in args if a.startswith("--")]  # argparse wants them before the overrides
    return [
        str(APPS / f"{app}.py"),
        *(["-m"] if multirun else []),
        *flags,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *(a for a in args if a not in flags),
    ]


@pytest.fixture
def run(tmp_path, capfd, monkeypatch):
    """run(app, *args): `python tests/sweep_apps/<app>.py -m <args>` in tmp_path, run in this process (the
    sweeper's behaviour, without a process start); cli=True: as a real process (the end-to-end tests)."""
    monkeypatch.syspath_prepend(str(APPS))  # as `python <app>.py` has it: custom_search_space.configure imports

    def run(app: str, *args: str, multirun: bool = True, cli: bool = False) -> subprocess.CompletedProcess:
        argv = _argv(tmp_path, app, args, multirun)
        if cli:
            env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
            command = [sys.executable, *argv]
            return subprocess.run(command, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=180)
        script = lambda: runpy.run_path(argv[0], run_name="__main__")  # noqa: E731
        return run_in_process(script, argv, tmp_path, capfd, monkeypatch)

    return run


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _results(tmp_path: Path) -> dict:
    return yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())


def _study(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    """The sweeper's fatal lines: on stderr, each starting `error: `."""
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def _sampler(proc: subprocess.CompletedProcess) -> str:
    """The sampler class the sweeper built, from its start line (a loaded study does not keep its sampler)."""
    [sampler] = [
        m[1]
        for line in _lines(proc)
        if (m := re.search(r"\] (?:new|resuming) study \S+ in .* \((\w+)\): \d+ of", line))
    ]
    return sampler


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------- distributions (in-process)
DISTRIBUTIONS = [
    # upstream's own table
    ("key=choice(1,2)", CategoricalDistribution([1, 2])),
    ("key=choice(true, false)", CategoricalDistribution([True, False])),
    ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"])),
    ("key=shuffle(range(1,3))", CategoricalDistribution([1, 2])),
    ("key=range(1,3)", IntDistribution(1, 3)),
    ("key=interval(1, 5)", FloatDistribution(1, 5)),
    ("key=int(interval(1, 5))", IntDistribution(1, 5)),
    ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True)),
    ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True)),
    ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1)),
    # the other forms of the grammar
    ("key=int(interval(-5.0, 5.0))", IntDistribution(-5, 5)),
    ("key=range(1, 5, step=2)", IntDistribution(1, 5, step=2)),
    ("key=float(range(1, 3))", FloatDistribution(1.0, 3.0, step=1.0)),
    ("key=str(choice(1, 2))", CategoricalDistribution(["1", "2"])),
    ("key=1,2,3", CategoricalDistribution([1, 2, 3])),
    ("key=sort(choice(3, 1, 2))", CategoricalDistribution([1, 2, 3])),
    ("key=tag(int, interval(1, 5))", IntDistribution(1, 5)),  # added here (upstream: a float interval)
    ("group=glob(*)", CategoricalDistribution(["a", "b"])),  # added here (upstream: NotImplementedError)
]


class _Loader:
    """The one call the parser makes to the config loader, for glob over a config group."""

    def get_group_options(self, group, results_filter=None):
        return ["a", "b", "c"][:2] if group == "group" else []


def _space(*arguments: str, params: dict | None = None, custom: str | None = None):
    config = OmegaConf.create(
        {"key": 0, "key1": 0, "key2": 0, "z": 0, "hydra": {"runtime": {"choices": {"group": "a"}}}}
    )
    return build_space(params, list(arguments), config, custom, OverridesParser.create(config_loader=_Loader()))


UPSTREAM_FORMS = 10  # DISTRIBUTIONS[:10] is upstream's table


@pytest.mark.parametrize("line, expected", DISTRIBUTIONS, ids=[line for line, _ in DISTRIBUTIONS])
def test_every_grammar_form_gives_upstreams_distribution(line, expected):
    [(key, actual)] = _space(line).distributions.items()
    assert key == line.split("=")[0] and type(actual) is type(expected)
    if "shuffle" in line:  # shuffle() randomises the order of the choices
        assert set(actual.choices) == set(expected.choices)
    else:
        assert actual == expected


# ------------------------------------------------------------------- upstream's module surface, renamed
@pytest.mark.parametrize(
    "line, expected", DISTRIBUTIONS[:UPSTREAM_FORMS], ids=[line for line, _ in DISTRIBUTIONS[:UPSTREAM_FORMS]]
)
def test_impl_create_optuna_distribution_from_override(line, expected):
    from hydra_plugins.lychee_optuna_sweeper import _impl

    [override] = OverridesParser.create().parse_overrides([line])
    actual = _impl.create_optuna_distribution_from_override(override)
    assert type(actual) is type(expected)
    assert set(actual.choices) == set(expected.choices) if "shuffle" in line else actual == expected


@pytest.mark.parametrize(
    "arguments, expected",
    [  # upstream's cases: (distributions, fixed values as strings, deletion lines)
        (["key=choice(1,2)"], ({"key": CategoricalDistribution([1, 2])}, {}, [])),
        (["key=5"], ({}, {"key": "5"}, [])),
        (["key1=choice(1,2)", "key2=5"], ({"key1": CategoricalDistribution([1, 2])}, {"key2": "5"}, [])),
        (
            ["key1=choice(1,2)", "key2=5", "key3=range(1,3)"],
            ({"key1": CategoricalDistribution([1, 2]), "key3": IntDistribution(1, 3)}, {"key2": "5"}, []),
        ),
        (["~z"], ({}, {}, ["~z"])),
        (["~z=10"], ({}, {}, ["~z=10"])),
    ],
)
def test_impl_create_params_from_overrides(arguments, expected):
    from hydra_plugins.lychee_optuna_sweeper import _impl

    assert _impl.create_params_from_overrides(arguments) == expected


def test_impl_refuses_a_sweep_it_cannot_map():
    from hydra_plugins.lychee_optuna_sweeper import _impl

    [override] = OverridesParser.create().parse_overrides(["key=range(5, 1)"])
    with pytest.raises(ValueError, match=r"range\(5, 1, step=1\) needs start <= stop"):
        _impl.create_optuna_distribution_from_override(override)


def test_motpe_sampler_config_raises_that_it_was_removed():
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from hydra_plugins.lychee_optuna_sweeper.config import MOTPESamplerConfig

    with pytest.raises(InstantiationException, match="The 'motpe' sampler was removed in Optuna 4.0"):
        instantiate(OmegaConf.structured(MOTPESamplerConfig))


def test_optuna_sweeper_is_the_same_sweeper_under_upstreams_name():
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    from hydra_plugins.lychee_optuna_sweeper.optuna_sweeper import OptunaSweeper
    from hydra_plugins.lychee_optuna_sweeper.sweeper import LycheeOptunaSweeper

    # by name, not identity: Hydra's plugin scan executes plugin modules again, so after a scan earlier in this
    # process the two modules may hold different copies of the same class
    parent, lychee = OptunaSweeper.__mro__[1], LycheeOptunaSweeper
    assert (parent.__module__, parent.__qualname__) == (lychee.__module__, lychee.__qualname__)
    assert OptunaSweeper.__name__ == "OptunaSweeper"
    discovered = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)}
    assert {
        "hydra_plugins.lychee_optuna_sweeper.optuna_sweeper.OptunaSweeper",
        "hydra_plugins.lychee_optuna_sweeper.sweeper.LycheeOptunaSweeper",
    } <= discovered
    assert not any(name.startswith("hydra_plugins.hydra_optuna_sweeper") for name in discovered)  # nothing forged


def test_fixed_values_and_deletions_go_to_every_trial_and_the_command_line_wins():
    space = _space("key1=choice(1,2)", "key2=5", "~z", "+w=3", params={"key2": "choice(7, 8)", "key": 4})
    assert space.distributions == {"key1": CategoricalDistribution([1, 2])}
    assert space.fixed == {"key": "key=4", "key2": "key2=5", "~z": "~z", "+w": "+w=3"}
    assert space.overrides({"key1": 2}) == ["key=4", "key2=5", "~z", "+w=3", "key1=2"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("key=range(1, 5, step=0)", "needs start <= stop and step > 0"),
        ("key=range(5, 1, step=-1)", "needs start <= stop and step > 0"),
        ("key=glob(*)", "has no values"),
        ("key=choice([1, 2], [3])", "is not a number, string, bool or null"),
        ("key=interval(5, 1)", "needs low < high"),
        ("key=tag(log, interval(0, 1))", "a log interval needs low > 0"),
        ("nokey=choice(1, 2)", "'nokey' is not a key of the composed config"),
    ],
)
def test_bad_search_spaces_are_user_errors(line, message):
    with pytest.raises(UserError, match=message):
        _space(line)


def test_the_grid_holds_every_value_of_each_distribution():
    space = _space("key=range(1, 3)", "key1=range(-1.0, 1.0, step=1)", "key2=choice('a', 'b')")
    assert space.grid() == {"key": [1, 2, 3], "key1": [-1.0, 0.0, 1.0], "key2": ["a", "b"]}
    with pytest.raises(UserError, match="grid sampler needs a finite set"):
        _space("key=interval(0, 1)").grid()


def test_the_plugin_shell_is_cheap_and_the_sweeper_does_not_import_the_training_stack():
    # Hydra imports the plugin's public modules on every start (not _impl): none may import optuna
    shell = [f"hydra_plugins.lychee_optuna_sweeper.{m}" for m in ("sweeper", "optuna_sweeper", "config", "_impl")]
    code = (
        f"import sys, {', '.join(shell)}; shell = 'optuna' in sys.modules; "
        "import lychee_exp.sweep.sweeper; "
        "print(shell, 'optuna' in sys.modules, [m for m in ('torch', 'lychee_exp.config.schema', "
        "'lychee_exp.train.trainer', 'lychee_exp.run') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, check=True).stdout
    assert out.split() == ["False", "True", "[]"]


# ------------------------------------------------------------------------------------ the examples, ported
@pytest.mark.parametrize("with_commandline", [True, False])
def test_sphere_example(run, tmp_path, with_commandline):
    args = [
        "hydra.job.chdir=True",
        "hydra.sweeper.n_trials=20",
        "hydra/sweeper/sampler=tpe",
        "hydra.sweeper.sampler.seed=123",
        "~z",
    ]
    if with_commandline:
        args += ["x=choice(0, 1, 2)", "y=0"]  # y: a fixed value
    _ok(run("sphere", *args))
    results, best = _results(tmp_path), _study(tmp_path, "sphere").best_trial
    assert results["name"] == "optuna" and results["best_value"] == best.value
    assert results["best_params"]["x"] == best.params["x"]
    if with_commandline:
        assert "y" not in results["best_params"] and "y" not in best.params
    else:
        assert results["best_params"]["y"] == best.params["y"]
    assert results["best_value"] <= 2.27  # upstream's bound for TPE on this function


def test_a_plain_app_gets_ten_tpe_trials_with_integer_values(run, tmp_path):
    proc = run("sphere", "hydra.sweeper.n_trials=10", "x=int(interval(-5.0, 5.0))", cli=True)  # end to end
    _ok(proc)
    study = _study(tmp_path, "sphere")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 10
    assert all(type(t.params["x"]) is int for t in study.trials)
    for trial in study.trials:  # each job got an int on its command line, and returned x**2 + y**2
        overrides = yaml.safe_load((tmp_path / "sweep" / str(trial.number) / ".hydra" / "overrides.yaml").read_text())
        assert f"x={trial.params['x']}" in overrides
        assert trial.value == trial.params["x"] ** 2 + trial.params["y"] ** 2
    results = _results(tmp_path)
    assert results["name"] == "optuna" and results["best_value"] == min(t.value for t in study.trials)
    assert results["best_params"] == study.best_trial.params
    assert (tmp_path / "sweep" / "optimization_history.html").is_file()


def test_deviation_a_grid_over_range_includes_its_stop(run, tmp_path):
    # upstream's grid: [1, 2] (range's stop left out); its other samplers include 3, as every sampler here
    _ok(run("sphere", "hydra/sweeper/sampler=grid", "x=range(1,3)", "y=0"))
    assert sorted(t.params["x"] for t in _study(tmp_path, "sphere").trials) == [1, 2, 3]


def test_launch_jobs_with_nothing_to_search_runs_the_fixed_config(run, tmp_path):
    # upstream's test_launch_jobs: no params, n_trials=8, n_jobs=3 on the basic launcher; sweep() returns None
    proc = run("sphere", "hydra.sweeper.params=null", "hydra.sweeper.n_trials=8", "hydra.sweeper.n_jobs=3")
    _ok(proc)
    trials = _study(tmp_path, "sphere").trials
    assert [(t.state, t.params, t.value) for t in trials] == [(TrialState.COMPLETE, {}, 2.0)] * 8  # x=1, y=1
    [nothing] = [line for line in _lines(proc) if "nothing to search" in line]
    assert "8 trial(s) of the fixed config" in nothing
    [one_at_a_time] = [line for line in _lines(proc) if "n_jobs=3" in line]
    assert "runs trials one at a time" in one_at_a_time
    assert _results(tmp_path)["best_params"] == {} and _results(tmp_path)["best_value"] == 2.0


def test_sweep_returns_none_in_process(hydra_sweep_runner):
    # upstream's test_launch_jobs as written: Hydra's own test app and config, in this process
    sweep = hydra_sweep_runner(
        calling_file=None,
        calling_module="hydra.test_utils.a_module",
        config_path="configs",
        config_name="compose.yaml",
        task_function=None,
        overrides=[
            "hydra/sweeper=lychee_optuna",
            "hydra/launcher=basic",
            "hydra.sweeper.n_trials=8",
            "hydra.sweeper.n_jobs=3",
            "hydra.job.chdir=False",
        ],
    )
    with sweep:
        assert sweep.returns is None
        study = optuna.load_study(study_name=Path(sweep.temp_dir).name, storage=f"sqlite:///{sweep.temp_dir}/optuna.db")
        assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 8


class _Uncaptured:
    """capfd's stand-in for a module-scoped run, whose output no test reads."""

    @staticmethod
    def readouterr() -> tuple[str, str]:
        return "", ""


@pytest.fixture(scope="module")
def grid_of_20(tmp_path_factory) -> Path:
    """The grid example with n_trials=20 (more than its 12 points), swept once for the two tests that read it."""
    where = tmp_path_factory.mktemp("grid_of_20")
    argv = _argv(where, "sphere", ("--config-name=grid", "hydra.sweeper.n_trials=20"), True)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(APPS))
        script = lambda: runpy.run_path(argv[0], run_name="__main__")  # noqa: E731
        _ok(run_in_process(script, argv, where, _Uncaptured(), patch))
    return where


@pytest.mark.parametrize("n_trials", [20, 10, 1])
def test_grid_example(run, tmp_path, request, n_trials):
    if n_trials == 20:
        tmp_path = request.getfixturevalue("grid_of_20")
    else:
        _ok(run("sphere", "--config-name=grid", f"hydra.sweeper.n_trials={n_trials}"))
    results = _results(tmp_path)
    bv, x, y, z = results["best_value"], *(results["best_params"][k] for k in "xyz")
    if n_trials >= 12:  # upstream's expected values
        assert bv == 1 and abs(x) == 1 and y == 0
    assert x in (-1, 1) and z in ("foo", "bar")
    trials = _study(tmp_path, "sphere").trials
    assert len({tuple(t.params.values()) for t in trials}) == len(trials)  # each grid point at most once


def test_deviation_the_grid_includes_ranges_stop(grid_of_20):
    # upstream's grid leaves range's stop out: y=range(-1.0, 1.0, step=1) is {-1, 0} there (2 x 2 x 2 = 8 points,
    # and upstream asserts best y in [-1, 0] for fewer trials); here every sampler, the grid too, includes it
    trials = _study(grid_of_20, "sphere").trials
    assert len(trials) == 12 and {t.params["y"] for t in trials} == {-1.0, 0.0, 1.0}


@pytest.mark.parametrize("sampler, with_commandline", [("random", True), ("random", False), ("nsgaii", False)])
def test_multi_objective_example(run, tmp_path, sampler, with_commandline):
    args = [
        "hydra.job.chdir=True",
        "hydra.sweeper.n_trials=10",
        f"hydra/sweeper/sampler={sampler}",
        "hydra.sweeper.sampler.seed=123",
    ]
    if with_commandline:
        args += ["x=range(0, 5)", "y=range(0, 3)"]
    proc = run("multi_objective", *args)
    _ok(proc)
    results = _results(tmp_path)
    assert results["name"] == "optuna" and "best_value" not in results and results["solutions"]
    study = _study(tmp_path, "multi-objective")
    assert _sampler(proc) == {"random": "RandomSampler", "nsgaii": "NSGAIISampler"}[sampler]
    assert len(study.trials) == 10
    for a in results["solutions"]:
        x, y = a["params"]["x"], a["params"]["y"]
        assert a["values"] == [4 * x**2 + 4 * y**2, (x - 5) ** 2 + (y - 5) ** 2]  # the returned tuple
        assert (x % 1, y % 1) == (0, 0) if with_commandline else {x % 1, y % 1} <= {0, 0.5}
        assert not any(_dominates(b["values"], a["values"]) for b in results["solutions"])


def test_custom_search_space_example(run, tmp_path):
    _ok(
        run(
            "custom_search_space",
            "hydra.job.chdir=True",
            "hydra/sweeper/sampler=random",
            "hydra.sweeper.sampler.seed=123",
            "max_z_difference_from_x=0.3",
        )
    )
    best = _results(tmp_path)["best_params"]
    assert abs(best["x"] - best["z"]) <= 0.3 and 0 <= best["+w"] <= 1


@pytest.mark.parametrize("max_failure_rate", [0.5, 1.0])
def test_failure_rate(run, tmp_path, max_failure_rate):
    # upstream's case: 20 trials, n_jobs=2, every trial raises; 0.5: the trial's error is on stderr; 1.0: it is not
    proc = run(
        "sphere",
        "hydra.job.chdir=True",
        "hydra.sweeper.n_trials=20",
        "hydra.sweeper.n_jobs=2",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=123",
        f"hydra.sweeper.max_failure_rate={max_failure_rate}",
        "error=true",
    )
    trials = _study(tmp_path, "sphere").trials
    assert all(t.user_attrs["fail_reason"] == "crashed: RuntimeError: cfg.error is True" for t in trials)
    assert all(t.state == TrialState.FAIL for t in trials)
    [error] = _errors(proc)
    assert proc.returncode == 1  # upstream: 1 too (the trial's exception, or "No trials are completed yet")
    if max_failure_rate < 1.0:  # stops once failures exceed the rate x n_trials: 11 > 0.5 x 20
        assert "RuntimeError: cfg.error is True" in proc.stderr
        assert len(trials) == 11 and "max_failure_rate=0.5" in error and "RuntimeError: cfg.error is True" in error
    else:
        assert "RuntimeError: cfg.error is True" not in proc.stderr
        assert len(trials) == 20 and error.startswith("error: no trial completed: 20 of 20 failed")
        assert "best_value" not in _results(tmp_path)


def test_nan_and_exceptions_fail_their_trial_and_the_sweep_goes_on(run, tmp_path):
    proc = run(
        "sphere",
        "hydra.sweeper.n_trials=8",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.max_failure_rate=1.0",
        "nan_below=0",
    )
    _ok(proc)
    trials = _study(tmp_path, "sphere").trials
    assert len(trials) == 8
    for t in trials:
        assert (t.state == TrialState.FAIL) == (t.params["x"] < 0)
        assert t.state == TrialState.COMPLETE or t.user_attrs["fail_reason"] == "nan: the metric is [nan]"
    assert _results(tmp_path)["best_value"] == min(t.value for t in trials if t.state == TrialState.COMPLETE)


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "nsgaii", "grid", "gp", "qmc"])
def test_every_sampler_of_the_group_runs(run, tmp_path, sampler):
    proc = run(
        "sphere",
        f"hydra/sweeper/sampler={sampler}",
        "hydra.sweeper.n_trials=3",
        "x=range(-2, 2)",
        "y=choice(-1, 0, 1)",
    )
    _ok(proc)
    study = _study(tmp_path, "sphere")
    assert _sampler(proc).lower().startswith(sampler.replace("nsgaii", "nsga"))
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 3


def test_lightning_hydra_template_config_drives_an_app_of_its_shape(run, tmp_path):
    # conf/mnist_like/hparams_search/mnist_optuna.yaml: the template's file with hydra_optuna_sweeper ->
    # lychee_optuna_sweeper and optuna -> lychee_optuna, nothing else; hydra.mode MULTIRUN in the file, so no -m
    proc = run("mnist_like", "hparams_search=mnist_optuna", multirun=False, cli=True)  # end to end
    _ok(proc)
    study = _study(tmp_path, "sweep")  # study_name null: the sweep directory's name
    values = [t.value for t in study.trials]
    assert len(values) == 20 and all(t.state == TrialState.COMPLETE for t in study.trials)
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE]
    assert {t.params["datamodule.batch_size"] for t in study.trials} <= {32, 64, 128, 256}
    assert all(1e-4 <= t.params["model.optimizer.lr"] <= 0.1 for t in study.trials)
    results = _results(tmp_path)
    assert results["best_value"] == max(values) and results["best_params"] == study.best_trial.params


def test_deviation_n_trials_is_the_studys_total_and_a_rerun_resumes(run, tmp_path):
    # upstream: n_trials more trials on every invocation, job directories numbered from 0 again (overwritten)
    _ok(run("sphere", "hydra.sweeper.n_trials=3"))
    _ok(run("sphere", "hydra.sweeper.n_trials=3"))  # the study has its 3: no trial runs
    assert len(_study(tmp_path, "sphere").trials) == 3
    _ok(run("sphere", "hydra.sweeper.n_trials=5"))  # 2 more, in new directories
    assert [t.number for t in _study(tmp_path, "sphere").trials] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1", "2", "3", "4"]


def test_deviation_a_study_is_always_stored(run, tmp_path):
    # upstream: storage null keeps the study in memory, study_name null is a random name
    _ok(
        run(
            "sphere",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.storage=null",
            "hydra.sweeper.study_name=null",
        )
    )
    assert len(_study(tmp_path, "sweep").trials) == 2  # sqlite:///<sweep dir>/optuna.db, named after the sweep dir


def test_deviation_the_failure_rate_default_is_a_quarter():
    # upstream's default is 0.0 (its examples set 0.0 and keep it here); counted over the study, not per batch
    from hydra_plugins.lychee_optuna_sweeper.config import LycheeOptunaSweeperConf

    assert LycheeOptunaSweeperConf.max_failure_rate == 0.25
    assert OmegaConf.load(APPS / "conf" / "sphere.yaml").hydra.sweeper.max_failure_rate == 0.0


def test_deviation_upstreams_module_path_is_not_provided(run, tmp_path):
    # upstream's own `_target_` (hydra_plugins.hydra_optuna_sweeper...) needs the rename: nothing stands in for it
    old = "hydra.sweeper._target_=hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    proc = run("mnist_like", "hparams_search=mnist_optuna", old, multirun=False)
    assert proc.returncode != 0 and "hydra_plugins.hydra_optuna_sweeper" in proc.stderr
    assert not (tmp_path / "sweep" / "optuna.db").exists()


# ------------------------------------------------------------------------------------------- bad inputs
BAD = [
    ("sphere", ["hydra.sweeper.max_failure_rate=2.0"], "hydra.sweeper.max_failure_rate=2.0: must be in [0, 1]"),
    ("sphere", ["x=range(1,5,step=0)"], "x (command line): range(1, 5, step=0) needs start <= stop and step > 0"),
    ("sphere", ["x=glob(*)"], "x (command line): 'glob(*)' has no values"),
    ("sphere", ["hydra.sweeper.direction=up"], "hydra.sweeper.direction=['up']: use maximize or minimize"),
    (
        "sphere",
        ["hydra.sweeper.sampler._target_=optuna.samplers.Nope"],
        "hydra.sweeper.sampler._target_=optuna.samplers.Nope: no such class",
    ),
    (
        "sphere",
        ["hydra/sweeper/sampler=grid", "x=interval(0, 1)"],
        "hydra.sweeper.params.x: the grid sampler needs a finite set of values",
    ),
    ("sphere", ["hydra.sweeper.objectives=[a]"], "hydra.sweeper.objectives names metrics.json keys"),
    ("sphere", ["nokey=choice(1,2)"], "nokey (command line): 'nokey' is not a key of the composed config"),
    (
        "sphere",
        ["hydra.sweeper.search_space={x: {type: float, low: -1, high: 1}, y: {type: categorical, choices: [0, 5]}}"],
        "hydra.sweeper.search_space was removed from hydra-optuna-sweeper (1.2 deprecated it); write it as "
        "hydra.sweeper.params: x: interval(-1.0, 1.0); y: choice(0, 5)",
    ),
    (
        "custom_search_space",
        ["z=1"],
        "hydra.sweeper.custom_search_space=custom_search_space.configure suggests "
        "['z'], which the command line or params fix",
    ),
    (
        "multi_objective",
        ["--config-name=motpe"],
        "hydra.sweeper.sampler: the 'motpe' sampler was removed in Optuna 4.0 (MOTPESampler); use "
        "hydra/sweeper/sampler=tpe",
    ),
]


@pytest.mark.parametrize(
    "app, args, expected",
    BAD,
    ids=[
        "failure-rate",
        "range-step-0",
        "glob",
        "direction",
        "sampler",
        "grid-interval",
        "objectives",
        "unknown-key",
        "legacy-search-space",
        "custom-overlap",
        "motpe",
    ],
)
def test_every_bad_sweep_input_is_one_line_and_exit_2(run, tmp_path, app, args, expected):
    proc = run(app, *args)
    lines = _lines(proc)
    assert proc.returncode == 2, lines
    assert lines == _errors(proc) and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), lines
    assert not (tmp_path / "sweep" / "optuna.db").exists()  # no study, no trial


def test_a_bad_sweep_input_on_a_real_command_line_is_one_line_and_exit_2(run, tmp_path):
    # the cases above run in this process; this one is the process itself: nothing else on stdout or stderr
    app, args, expected = BAD[0]
    proc = run(app, *args, cli=True)
    assert proc.returncode == 2 and _lines(proc) == _errors(proc) == [f"error: {expected}"], _lines(proc)
    assert not (tmp_path / "sweep" / "optuna.db").exists()


# a re-run against the study with another search space (lychee_exp's own: upstream mixes the spaces in one study)
ANOTHER_SPACE = {
    # optuna's own refusal (another kind), which came from inside the first new trial and left it in the study
    "another-kind": (
        ["x=choice(1, 2)"],
        "x is choice(1, 2) here, but study 'sphere' drew it from float in [-5.5, 5.5] step 0.5",
    ),
    "another-range": (
        ["x=interval(-1, 1)"],
        "x is float in [-1.0, 1.0] here, but study 'sphere' drew it from float in",
    ),
    "fewer-choices": (["y=choice(-5, 5)"], "y is choice(-5, 5) here, but study 'sphere' drew it from choice(-5, 0, 5)"),
    "added": (
        ["z=choice(1, 2)"],
        "search space: this sweep adds z, against the 2 parameter(s) of study 'sphere' (x, y)",
    ),
    "dropped": (["~hydra.sweeper.params.y"], "search space: this sweep drops y, against the 2 parameter(s)"),
}


@pytest.mark.parametrize("case", ANOTHER_SPACE)
def test_deviation_a_rerun_with_another_search_space_is_one_line_before_any_trial(run, tmp_path, case):
    """Before any trial: the study's trials are as they were (optuna's own refusal of another kind came from
    inside the first new trial and left it RUNNING or FAIL). Wrong code that would still pass: reading the
    distributions of the first trial only, or of COMPLETE trials only (the fixture's trials are all COMPLETE and
    share one space)."""
    args, expected = ANOTHER_SPACE[case]
    _ok(run("sphere", "hydra.sweeper.n_trials=2"))
    trials = [(t.number, t.state, t.params, t.distributions) for t in _study(tmp_path, "sphere").trials]
    proc = run("sphere", "hydra.sweeper.n_trials=4", *args)
    lines = _lines(proc)
    assert proc.returncode == 2 and lines == _errors(proc) and len(lines) == 1, lines
    assert lines[0].startswith("error: search space: ") and expected in lines[0], lines
    assert lines[0].endswith("use another hydra.sweeper.study_name (or storage) for another search space")
    # no phantom trial: the study holds the two trials it had, as they were
    assert [(t.number, t.state, t.params, t.distributions) for t in _study(tmp_path, "sphere").trials] == trials
    _ok(run("sphere", "hydra.sweeper.n_trials=3"))  # the same space resumes the study
    assert [t.state for t in _study(tmp_path, "sphere").trials] == [TrialState.COMPLETE] * 3


def test_deviation_a_rerun_with_another_fixed_config_is_one_line_before_any_trial(run, tmp_path):
    """Upstream resumes a stored study whatever the non-searched config (lychee_exp's sweep dir and study are named
    by the search config: another experiment= found the earlier study, counted its trials, reported its best).
    Here the study records its fixed config: another one is refused before any trial, naming the keys with both
    values and the study's storage; the same command resumes; another study_name is a study of its own."""
    _ok(run("sphere", "hydra.sweeper.n_trials=2"))
    trials = [(t.number, t.state, t.params) for t in _study(tmp_path, "sphere").trials]
    proc = run("sphere", "hydra.sweeper.n_trials=3", "z=2", "+w=5")
    db = (tmp_path / "sweep" / "optuna.db").resolve()
    assert proc.returncode == 2 and _lines(proc) == _errors(proc) == [
        f"error: fixed config: this sweep differs from study 'sphere' in sqlite:///{db}: z=2 (study: 1), "
        "w=5 (study: <absent>); use another hydra.sweeper.study_name=<name> (or storage) for another fixed config"
    ], _lines(proc)
    assert [(t.number, t.state, t.params) for t in _study(tmp_path, "sphere").trials] == trials  # no new trial
    _ok(run("sphere", "hydra.sweeper.n_trials=3"))  # the same command resumes the study
    assert [t.state for t in _study(tmp_path, "sphere").trials] == [TrialState.COMPLETE] * 3
    _ok(run("sphere", "hydra.sweeper.n_trials=1", "z=2", "+w=5", "hydra.sweeper.study_name=sphere_z2"))
    own = _study(tmp_path, "sphere_z2")
    assert len(own.trials) == 1 and own.user_attrs["fixed_config"]["keys"]["z"] == 2
    assert len(_study(tmp_path, "sphere").trials) == 3


def test_deviation_a_study_without_a_recorded_fixed_config_resumes_and_records_it(run, tmp_path):
    """A study created before fixed configs were recorded resumes (one warning) and from then on refuses another."""
    _ok(run("sphere", "hydra.sweeper.n_trials=1"))
    with sqlite3.connect(tmp_path / "sweep" / "optuna.db") as db:  # as an older sweeper left it
        db.execute("DELETE FROM study_user_attributes WHERE key = 'fixed_config'")
    assert "fixed_config" not in _study(tmp_path, "sphere").user_attrs
    proc = run("sphere", "hydra.sweeper.n_trials=2")
    _ok(proc)
    assert "study 'sphere' in sqlite:///" in proc.stdout and "has no record of its fixed config" in proc.stdout
    assert [t.state for t in _study(tmp_path, "sphere").trials] == [TrialState.COMPLETE] * 2
    assert run("sphere", "hydra.sweeper.n_trials=3", "z=2").returncode == 2
