"""The command-line helpers that the entry points share (run, mine, rerank, plan), so that no entry point imports
another: a command's typed config composed from conf/ with the command line's overrides, its `--help`, a Hydra
composition error as one line, and a command that writes into its `out=` run to its one-line end
(lychee_exp.errors.command_main)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lychee_exp.config.schema import CONF_DIR
from lychee_exp.errors import UserError, command_main
from lychee_exp.model.files import model_choice, resolve_model

log = logging.getLogger("lychee_exp")


def command_config(config_name: str, argv: list[str] | None, schema: type):
    """The typed config of a command other than training (mine, rerank): conf/<config_name>.yaml composed with
    the command line's key=value overrides (config groups such as model= included), as a plain dataclass; the
    model as model.files.resolve_model reads it (a model.path's card, without model=). A misspelt key, a
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
    from lychee_exp.io.outputs import POLICY_LINE

    keys = f"Keys (key=value, config groups as group=option): conf/{config_name}.yaml and its schema."
    return f"{doc}\n\n{keys}\n{POLICY_LINE}"


def run_output_command(config_name: str, argv: list[str] | None, schema: type, command: Callable) -> None:
    """A command that writes into its `out=` (mine, rerank): its typed config, then command(cfg); a user mistake
    or a failed run ends as one line, and Ctrl-C as one line saying what `out=` was left as (errors)."""
    from lychee_exp.io.outputs import interrupted_line

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
