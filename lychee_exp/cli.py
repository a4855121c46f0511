"""The command-line helpers that the entry points share (run, mine, rerank, plan), so that no entry point imports
another, and one grammar for all of them: key=value overrides (config groups as group=option), `--help` (what the
command does, its config groups and every key with its default and the schema's comment: config.key_docs),
`--cfg job` (the composed config as YAML, nothing run), an unknown flag or a Hydra composition error as one line,
and a command that writes into its `out=` run to its one-line end (lychee_exp.errors.command_main)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import sys
import textwrap
from typing import Any, Callable

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lychee_exp.config.schema import CONF_DIR
from lychee_exp.errors import UserError, command_main
from lychee_exp.model.files import model_choice, resolve_model

log = logging.getLogger("lychee_exp")

# the module whose docstring opens a command's --help, by its conf/<name>.yaml (plan composes a run's config.yaml)
COMMAND_MODULES = {"mine": "lychee_exp.mine", "rerank": "lychee_exp.rerank", "config": "lychee_exp.plan"}
HELP_FLAGS = ("--help", "-h")
CFG_FLAGS = ("--cfg", "-c")
# what --cfg prints: these commands are not Hydra apps, so there is no hydra: node and `all` is the job's config
CFG_PARTS = ("job", "all")
CFG_FLAG_LINE = "--cfg job, -c job     print the composed config as YAML and exit (nothing runs)"
# Hydra's flags that take a value (run is a Hydra app): skipped when its --help composes the overrides it was given
HYDRA_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir")


@dataclasses.dataclass
class Flags:
    """The flags of a command that takes key=value overrides (Hydra's spelling, where run is a Hydra app)."""

    help: bool = False
    cfg: str | None = None  # --cfg job: print the composed config and exit
    resolve: bool = False  # --resolve: accepted as Hydra's; the printed config is resolved either way


def split_flags(args: list[str], command: str) -> tuple[Flags, list[str]]:
    """The flags among a command's arguments, and the key=value overrides; an unknown flag or a --cfg without a
    part this command prints is a UserError (one line), not Hydra's lexer error on a '-' it cannot parse."""
    flags, overrides, rest = Flags(), [], iter(args)
    for arg in rest:
        name, eq, value = arg.partition("=")
        if arg in HELP_FLAGS:
            flags.help = True
        elif name in CFG_FLAGS:
            part = value if eq else next(rest, "")
            if part not in CFG_PARTS:
                raise UserError(
                    f"{name} {part}: this command prints --cfg job (its composed config); --help lists its keys"
                )
            flags.cfg = part
        elif arg == "--resolve":
            flags.resolve = True
        elif arg.startswith("-"):
            raise UserError(f"{arg}: no such flag ({command} takes key=value overrides, --cfg job and --help)")
        else:
            overrides.append(arg)
    return flags, overrides


def command_config(config_name: str, argv: list[str] | None, schema: type, own_keys: dict[str, tuple] | None = None):
    """The typed config of a command other than training (mine, rerank, plan): conf/<config_name>.yaml composed
    with the command line's key=value overrides (config groups such as model= included), as a plain dataclass; the
    model as model.files.resolve_model reads it (a model.path's card, without model=). `--help` prints the command's
    help (own_keys: the keys it reads itself, key -> (default, comment)) and `--cfg job` its composed config, each
    exiting 0. A misspelt key, a wrong type, an unknown flag or a preset that contradicts the model directory: one
    line naming the key, exit 2."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    command = COMMAND_MODULES.get(config_name, config_name)
    try:
        flags, overrides = split_flags(list(sys.argv[1:] if argv is None else argv), f"python -m {command}")
        if flags.help:
            print(command_help(config_name, overrides, schema, own_keys=own_keys or {}))
            sys.exit(0)
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        cfg = _compose(config_name, overrides)
        container = OmegaConf.to_container(cfg, resolve=True)
        if "model" in container:  # a model directory's own description (its card) wins over the default preset
            container["model"] = resolve_model(container["model"], model_choice(overrides))
        merged = OmegaConf.merge(OmegaConf.structured(schema), container)
        if flags.cfg:
            print(OmegaConf.to_yaml(merged), end="")
            sys.exit(0)
        return OmegaConf.to_object(merged)
    except (ConfigCompositionException, OverrideParseException) as err:
        print(f"error: {composition_error(err)}", file=sys.stderr)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
    except OmegaConfBaseException as err:
        print(f"error: {err.full_key or 'config'}: {str(err).splitlines()[0]}", file=sys.stderr)
    sys.exit(2)


def _compose(config_name: str, overrides: list[str], with_hydra: bool = False):
    """conf/<config_name>.yaml with the overrides; with_hydra: the hydra: node too (its runtime.choices)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_override_keys(overrides)
    GlobalHydra.instance().clear()  # a process that composed before (a test, a notebook)
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=with_hydra)
        if not with_hydra:
            return cfg
        loader = GlobalHydra.instance().config_loader()
        choices = {
            group: (str(choice), loader.get_group_options(group))
            for group, choice in cfg.hydra.runtime.choices.items()
            if not group.startswith("hydra/")
        }
    return cfg, choices


def command_help(
    config_name: str,
    overrides: list[str] | None = None,
    schema: type | None = None,
    *,
    module: str | None = None,
    own_keys: dict[str, tuple] | None = None,
    flags: str = "",
    hydra_app: bool = False,
) -> str:
    """`--help` of a command composed from conf/<config_name>.yaml, laid out as every command's (run's too): its
    module's docstring; its config groups with the chosen option and the others; every key as key=default (the
    defaults as the overrides given before --help compose them; ??? = required) with the schema's comment; its
    flags; the output policy it follows (a Hydra app's: its hydra.help.footer)."""
    import importlib

    from lychee_exp.io.outputs import POLICY_LINE

    module = module or COMMAND_MODULES.get(config_name)
    doc = (importlib.import_module(module).__doc__ or "").strip() if module else ""
    cfg, choices = _compose(config_name, list(overrides or []), with_hydra=True)
    values = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True, throw_on_missing=False)
    values.pop("hydra", None)
    width = max(80, min(120, shutil.get_terminal_size((120, 24)).columns))
    lines = [doc, "", "== Configuration groups ==", "Choose an option as group=option (* = the default here)"]
    for group, (choice, options) in sorted(choices.items()):
        shown = ", ".join(f"{o}*" if o == choice else o for o in options) or f"{choice}*"
        lines += textwrap.wrap(f"{group}: {shown}", width, subsequent_indent="    ", break_on_hyphens=False)
    lines += [
        "",
        "== Keys ==",
        "Override any key as key=value (group.key=value inside a group); shown: its value, ??? = required",
    ]
    rows = [(f"{key}={override_value(default)}", comment) for key, (default, comment) in (own_keys or {}).items()]
    rows += _key_rows(schema, values) if schema is not None else []
    lines += _columns(rows, width)
    lines += ["", "== Flags ==", "--help, -h            this help", flags or CFG_FLAG_LINE, ""]
    lines.append(cfg.hydra.help.footer if hydra_app else POLICY_LINE)
    return "\n".join(lines)


def hydra_help_args(args: list[str]) -> list[str]:
    """The overrides among a Hydra app's arguments (run's): its flags and their values left out."""
    overrides, rest = [], iter(args)
    for arg in rest:
        if arg in HYDRA_VALUE_FLAGS:
            next(rest, None)
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides


def _key_rows(schema: type, values: dict) -> list[tuple[str, str]]:
    """(key=value or group.*, comment) for each key of the schema that the composed config holds."""
    from lychee_exp.config.key_docs import key_docs

    rows = []
    for doc in key_docs(schema):
        node: Any = values
        for part in doc.key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError:
            continue
        rows.append((f"{doc.key}.*", doc.comment) if doc.nested else (f"{doc.key}={override_value(node)}", doc.comment))
    return rows


def _columns(rows: list[tuple[str, str]], width: int) -> list[str]:
    """key=value then its comment, wrapped beside it (or under it, where key=value is wider than the column)."""
    column = 34
    lines = []
    for left, comment in rows:
        wrapped = textwrap.wrap(comment, width - column - 2, break_on_hyphens=False) or [""]
        if len(left) > column:
            lines.append(left)
            lines += [" " * (column + 2) + part for part in wrapped if part]
        else:
            lines.append(f"{left:<{column}}  {wrapped[0]}".rstrip())
            lines += [" " * (column + 2) + part for part in wrapped[1:]]
    return lines


def override_value(value: Any) -> str:
    """A value as a command-line override spells it (Hydra's grammar): null, true, [a,b], a string quoted where
    it holds a character the grammar reads (in quotes a backslash is literal, except before a quote or at the end).
    A newline or tab is shown as \\n, \\t, for reading: the grammar has no escape for them."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = text and not any(c in text for c in " \t\n'\"=,[]{}()\\") and not text.startswith(("$", "~", "+"))
    if text == "???" or plain:
        return text
    quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    quoted = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted)
    return "'" + quoted.replace("\n", "\\n").replace("\t", "\\t") + "'"


def library_module(name: str, doc: str, *commands: str) -> None:
    """What a module that is part of other commands (a benchmark's systems, a tool's helper) says when run: its
    docstring and the commands that use it under --help; run without it, one line naming them, exit 2."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"python -m {name}",
        description=" ".join(doc.split("\n\n")[0].split()),
        epilog=f"A part of {', '.join(f'python -m {c}' for c in commands)}: it runs nothing by itself.",
    )
    parser.parse_args()
    parser.error(f"not a command: run {' or '.join(f'python -m {c}' for c in commands)}")


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
