"""Entry point: `python -m lychee_exp.run [overrides]` (or `lychee-run`), a Hydra app.

The story of a run: Hydra composes the config groups (conf/), the job checks the config and its inputs, plans
the devices, launches the ranks (lychee_exp.launch), which train with the recipe (lychee_exp.recipe), writes
metrics.json from rank 0's results, and returns the optimized metric to whichever sweeper asked. A user mistake
ends here as one line and exit code 2, a failed run as one line and exit code 1, Ctrl-C as one line and 130.

The job (and through it torch and the training stack) is imported by the task function, once the config has
composed: a misspelt key, `--help` or `--cfg job` is answered without loading torch.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

import hydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lychee_exp.core.cli import INTERRUPTED, command_main, ctrl_c_raises, stop_code, stop_line
from lychee_exp.core.config import register_schema
from lychee_exp.core.errors import RunFailed, UserError
from lychee_exp.core.model_card import model_choice, resolve_model
from lychee_exp.core.outputs import storage_error, storage_line
from lychee_exp.job.context import in_sweep, run_stamp

log = logging.getLogger("lychee_exp")

# absolute: `lychee-run` imports this module by name, and Hydra would read a relative path as a python package
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
_said: list[BaseException] = []  # errors a job of this process has already said in one line

register_schema()
OmegaConf.register_new_resolver("lychee_stamp", run_stamp, use_cache=True, replace=True)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    from lychee_exp.job.training_job import train_job

    try:
        return train_job(cfg)
    except (UserError, RunFailed, OSError) as caught:
        err = caught
        if isinstance(caught, OSError):  # a full disk under the job: a failed run, said in one line
            if storage_error(caught) is None:
                raise
            err = RunFailed(storage_line(caught), "crashed")
        log.error("error: %s", err)
        _said.append(err)
        if in_sweep():  # the sweeper records the trial as failed, with this reason, and goes on
            if err is caught:
                raise
            raise err from None
        # A user mistake (2) or a failed run (1) gets one line, not a traceback.
        sys.exit(2 if isinstance(err, UserError) else 1)


def main() -> None:
    """The CLI (`python -m lychee_exp.run`, `lychee-run`). A config that does not compose (a misspelt key, a
    wrong type, a value outside a closed choice) is a user mistake too: one line naming the key, exit 2.
    Hydra would print several lines, so it is asked to raise instead of printing (HYDRA_FULL_ERROR)."""
    from lychee_exp.job.run_dir import RunAlreadyFinished, RunDirRefused, finish_run_dir, release_sweep_dir

    os.environ["HYDRA_FULL_ERROR"] = "1"
    finished = False
    try:
        ctrl_c_raises()
        check_override_keys(sys.argv[1:])
        hydra_main()
        finished = True
    except (ConfigCompositionException, OverrideParseException) as err:
        print(f"error: {composition_error(err)}", file=sys.stderr)
        sys.exit(2)
    except RunDirRefused as err:  # raised before Hydra set up logging, by the run directory's check
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunAlreadyFinished as done:  # a restarted job whose run had finished: nothing to do
        print(done, file=sys.stderr)
    except (UserError, RunFailed) as err:  # a launcher's check, or a job's error that Hydra's basic sweeper raises
        if not any(err is said for said in _said):  # a submitit job said it in its own log, not here
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2 if isinstance(err, UserError) else 1)
    except KeyboardInterrupt as stop:  # the ranks are stopped already (launch.launcher); the run keeps its files
        from lychee_exp.launch.slurm_jobs import cancel_in_flight

        print(stop_line(stop, INTERRUPTED) + cancel_in_flight(), file=sys.stderr)
        sys.exit(stop_code(stop))
    except OSError as err:  # the storage failed under the job (a full disk): one line, as a failed run
        if storage_error(err) is None:
            raise
        print(f"error: {storage_line(err)}", file=sys.stderr)
        sys.exit(1)
    finally:
        finish_run_dir(finished)
        release_sweep_dir()


def command_config(config_name: str, argv: list[str] | None, schema: type):
    """The typed config of a command other than training (mine, rerank): conf/<config_name>.yaml composed with
    the command line's key=value overrides (config groups such as model= included), as a plain dataclass; the
    model as core.model_card.resolve_model reads it (a model.path's card, without model=). A misspelt key, a
    wrong type or a preset that contradicts the model directory: one line naming the key, exit 2."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    os.environ["HYDRA_FULL_ERROR"] = "1"
    if any(arg in ("--help", "-h") for arg in (sys.argv[1:] if argv is None else argv)):
        print(command_help(config_name))
        sys.exit(0)
    GlobalHydra.instance().clear()  # a process that composed before (a test, a notebook)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        overrides = list(sys.argv[1:] if argv is None else argv)
        check_override_keys(overrides)
        with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
            cfg = compose(config_name, overrides=overrides)
        container = OmegaConf.to_container(cfg, resolve=True)
        if "model" in container:  # a model directory's own description (its card) wins over the default preset
            container["model"] = resolve_model(container["model"], model_choice(overrides))
        merged = OmegaConf.merge(OmegaConf.structured(schema), container)
        return OmegaConf.to_object(merged)
    except (ConfigCompositionException, OverrideParseException) as err:
        print(f"error: {composition_error(err)}", file=sys.stderr)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
    except OmegaConfBaseException as err:
        print(f"error: {err.full_key or 'config'}: {str(err).splitlines()[0]}", file=sys.stderr)
    sys.exit(2)


def command_help(config_name: str) -> str:
    """`--help` of a command composed from conf/<config_name>.yaml: its module's docstring, where its keys live, and
    the output policy that every command follows."""
    import importlib

    module = {"mine": "lychee_exp.mine", "rerank": "lychee_exp.rerank", "config": "lychee_exp.plan"}.get(config_name)
    doc = (importlib.import_module(module).__doc__ or "").strip() if module else ""
    from lychee_exp.core.outputs import POLICY_LINE

    keys = f"Keys (key=value, config groups as group=option): conf/{config_name}.yaml and its schema."
    return f"{doc}\n\n{keys}\n{POLICY_LINE}"


def run_output_command(config_name: str, argv: list[str] | None, schema: type, command: Callable) -> None:
    """A command that writes into its `out=` (mine, rerank): its typed config, then command(cfg); a user mistake
    or a failed run ends as one line, and Ctrl-C as one line saying what `out=` was left as (core.cli)."""
    from lychee_exp.core.outputs import interrupted_line

    cfg = command_config(config_name, argv, schema)

    def write() -> None:  # what the command returns (its summary) is no exit status
        command(cfg)

    code = command_main(write, lambda: interrupted_line(cfg.out), say=lambda line: log.error("%s", line))
    if code:
        sys.exit(code)


def check_override_keys(args: list[str]) -> None:
    """An override without a key (`=5`, `+=x`) is refused here: Hydra takes its empty key for a config group and
    fails with a ValueError (a traceback), or suggests appending it to the defaults list."""
    keyless = next((arg for arg in args if arg.lstrip("+~").startswith("=")), None)
    if keyless is not None:
        raise OverrideParseException(keyless, f"{keyless}: an override is key=value, and this one has no key")


def composition_error(err: Exception) -> str:
    """Hydra's multi-line composition error as one line: the key, then what is wrong with it."""
    if isinstance(err, MissingConfigException) and err.options:
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        return f"{group}={name}: no such option in conf/{group}; options: {', '.join(sorted(err.options))}"
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return f"{cause.full_key}: {str(cause).splitlines()[0]}"
    return " ".join(str(err).split())


if __name__ == "__main__":
    main()
