"""Entry point: `python -m lychee_exp.run [overrides]` (or `lychee-run`), a Hydra app.

The story of a run: Hydra composes the config groups (conf/), the job checks the config and its inputs, plans
the devices, launches the ranks (lychee_exp.launch), which train with the recipe (lychee_exp.train), writes
metrics.json from rank 0's results, and returns the optimized metric to whichever sweeper asked. A user mistake
ends here as one line and exit code 2, a failed run as one line and exit code 1, Ctrl-C as one line and 130.

The job (and through it torch and the training stack) is imported by the task function, once the config has
composed: a misspelt key, `--help` or `--cfg job` is answered without loading torch.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig

from lychee_exp.cli import HELP_FLAGS, check_override_keys, command_help, composition_error, hydra_help_args
from lychee_exp.config.schema import CONF_DIR
from lychee_exp.errors import (
    INTERRUPTED,
    RunFailed,
    UserError,
    ctrl_c_raises,
    stop_code,
    stop_line,
    storage_error,
    storage_line,
)
from lychee_exp.job.context import in_sweep, register_config

log = logging.getLogger("lychee_exp")

_said: list[BaseException] = []  # errors a job of this process has already said in one line

register_config()


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


RUN_FLAGS = """--multirun, -m        a sweep: each combination of comma-separated values, or hparams_search=<search>
--cfg job|hydra|all   print the composed config as YAML and exit (nothing runs); --resolve resolves it
--hydra-help          Hydra's own flags"""


def run_help(args: list[str]) -> str:
    """`--help`: the run's config groups and keys with their defaults and the schema's comments, as the other
    commands' (cli.command_help); the footer is conf/config.yaml's hydra.help.footer."""
    from lychee_exp.config.schema import RunConfig

    overrides = hydra_help_args(args)
    return command_help("config", overrides, RunConfig, module=__name__, flags=RUN_FLAGS, hydra_app=True)


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
        if any(arg in HELP_FLAGS for arg in sys.argv[1:]):  # laid out as mine's, rerank's and plan's (cli)
            print(run_help(sys.argv[1:]))
            return
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


if __name__ == "__main__":
    main()
