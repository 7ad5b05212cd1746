"""The command line: Hydra config groups composed from `configs/`, with errors a user can act on.

`python scripts/train.py task=geoqa model=qwen2.5-vl-7b trainer.lr=1e-6 --cfg job`
`python scripts/train.py +experiment=geoqa-paper` (a paper recipe: its task, model and settings)
"""

from __future__ import annotations

import os
import re
import sys
import time
import typing
from datetime import datetime
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from gpg_vl.config import names
from gpg_vl.config.keys import declared
from gpg_vl.config.rules import value_type
from gpg_vl.config.schema import TrainSchema, register_schema, schemas_with
from gpg_vl.config.validate import check_values
from gpg_vl.errors import Interrupted, UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ("task", "model", "algorithm")
QUIET_RANK_WAIT_S = 30.0  # the most a launch's other processes wait for the first to fail on a bad config

if not OmegaConf.has_resolver("now"):
    OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), use_cache=True)


def group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml") if not path.stem.startswith("_"))


def _valid_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, DictConfig) and len(value) > 0:
            keys += _valid_keys(value, full + ".")
        else:
            keys.append(full)
    return keys


# the option maps: the schema's keys of a dict (or any value) named *options, whose keys a plugin declares
# task=mix's maps too: task.mixture ({task: weight}), task.rollout, task.data and task.teacher (each entry's own)
OPTION_MAPS = tuple(name for name, item in declared(TrainSchema)
                    if (name.endswith("options") or name in ("task.mixture", "task.rollout", "task.data",
                                                             "task.teacher"))
                    and value_type(item)[0] in (dict, typing.Any))


def _option_map(key: str) -> bool:
    """Whether `key` (as typed, without `+`) is an option map (OPTION_MAPS: a dict of a loss's, a correction's or a
    task's own keyword arguments, declared by the plugin, not the schema) or a key inside one."""
    return any(key == name or key.startswith(name + ".") for name in OPTION_MAPS)


def _check_override(cfg: DictConfig, override: str) -> None:
    """Raise a UserError naming the valid keys when `key=value` sets a key the config does not have."""
    key = override.split("=", 1)[0].lstrip("~")
    parts = key.split(".")
    if override.startswith("+") or key in GROUPS or parts[0] == "hydra" or _option_map(key):
        return  # task options are the task constructor's keywords, loss options the loss's: each checks its own
    node = cfg
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig) or part not in node:
            parent = ".".join(parts[:depth])
            scope = node if isinstance(node, DictConfig) else cfg
            valid = _valid_keys(scope, parent + "." if parent else "")
            where = f" under {parent}" if parent else ""
            raise UserError(f"unknown config key {key!r}; valid keys{where}: {', '.join(valid)}.")
        node = node[part]


class _Repeated(Exception):
    """A key a typed map names twice (raised while Hydra's parse tree is walked)."""


def _refuse_repeated_keys(override: str) -> None:
    """A map typed on the command line that names a key twice (`'task.mixture={shapes: 1, shapes: 2}'`, at any
    depth): one sentence, where Hydra would keep the last value without a word. The override is read with Hydra's
    own grammar; one that does not parse is left to Hydra, which says why."""
    key, _, value = override.partition("=")
    if "{" not in value:
        return
    from hydra.core.override_parser.overrides_parser import create_functions
    from hydra.core.override_parser.overrides_visitor import HydraOverrideVisitor
    from hydra.grammar.gen.OverrideLexer import CommonTokenStream, InputStream, OverrideLexer
    from hydra.grammar.gen.OverrideParser import OverrideParser

    class Visitor(HydraOverrideVisitor):
        def visitDictContainer(self, ctx):  # Hydra's, without letting a later pair replace an earlier one
            pairs = [self.visitDictKeyValuePair(ctx.getChild(i)) for i in range(1, ctx.getChildCount() - 1, 2)]
            names = [name for name, _ in pairs]
            repeated = next((name for name in names if names.count(name) > 1), None)
            if repeated is not None:
                raise _Repeated(repeated)
            return dict(pairs)

    lexer = OverrideLexer(InputStream(override))
    parser = OverrideParser(CommonTokenStream(lexer))
    lexer.removeErrorListeners()
    parser.removeErrorListeners()
    try:
        Visitor(create_functions()).visit(parser.override())
    except _Repeated as repeated:
        raise UserError(f"{key.lstrip('+~')} names {repeated.args[0]!r} twice ({value}); give each key once.") \
            from None
    except Exception:  # not an override Hydra can read: composing it says why
        return


# (key, the key it replaces when set, why): where one setting decides for another, a value typed on the
# command line is never replaced by a config group's without a word (`_typed_values_win`)
REPLACES = (("trainer.epochs", "trainer.max_steps", "passes over the train split decide the run's length"),)


def _typed_values_win(cfg: DictConfig, typed: set[str]) -> None:
    """For each (key, replaced, why) of REPLACES where `key` is set: a typed `replaced` wins over a `key` that
    came from a config file (task, experiment), which is unset; typed too, `key` wins and one line says so."""
    for key, replaced, why in REPLACES:
        value = OmegaConf.select(cfg, key)
        if value is None or replaced not in typed:
            continue
        if key in typed:
            print(f"note: {key}={value} replaces {replaced}={OmegaConf.select(cfg, replaced)}, both given on the "
                  f"command line: {why} (drop {key} to use {replaced}).", file=sys.stderr)
        else:
            OmegaConf.update(cfg, key, None)  # the config file's value gives way to the one typed


def load_config(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose `configs/<config_name>.yaml` with `key=value` overrides; unknown keys fail with the list."""
    # `model=/path/to/dir` evaluates or trains a local directory, its family read from its config.json.
    local = [o for o in overrides if o.startswith("model=") and o.split("=", 1)[1] not in group_options("model")
             and Path(o.split("=", 1)[1]).expanduser().is_dir()]
    overrides = [o if o not in local else "model=local" for o in overrides]
    if local:
        overrides.append(f"model.name_or_path='{Path(local[-1].split('=', 1)[1]).expanduser()}'")
    for override in overrides:
        if "=" not in override:
            raise UserError(f"cannot read argument {override!r}; write overrides as key=value.")
        _refuse_repeated_keys(override)
        key, value = override.split("=", 1)
        key = "experiment" if key == "+experiment" else key  # a paper recipe: configs/experiment/<name>.yaml
        if key in (*GROUPS, "experiment") and value not in group_options(key) and not (key == "task" and ":" in value):
            hint = " or a model directory" if key == "model" else ""
            raise UserError(f"unknown {key} {value!r}; known: {', '.join(group_options(key))}{hint} "
                            f"(files in configs/{key}/).")
    # `task=module:Name` loads an out-of-tree task; its config is the base task config with that name.
    plugin = [o for o in overrides if o.startswith("task=") and ":" in o.split("=", 1)[1]]
    overrides = [o if o not in plugin else "task=plugin" for o in overrides]
    if plugin:
        overrides.append(f"task.name='{plugin[-1].split('=', 1)[1]}'")
    # an option map holds a plugin's own keywords (checked by the plugin, which names its options): a key of it,
    # or the whole map (`'trainer.correction_options={cap: 2.0}'`), is added or set
    overrides = ["++" + o if _option_map(o.split("=", 1)[0]) else o for o in overrides]
    group_overrides = [o for o in overrides if o.split("=", 1)[0] in (*GROUPS, "+experiment")]
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            base = compose(config_name=config_name, overrides=group_overrides)
            schemas = _plugin_schemas(base, overrides)
            if schemas is not None:  # an out-of-tree engine or tool brings its own section of rollout.*
                register_schema(*schemas)
                base = compose(config_name=config_name, overrides=group_overrides)
            for override in overrides:
                _check_override(base, override)
            cfg = compose(config_name=config_name, overrides=overrides)
    except HydraException as error:
        raise UserError(_type_error(error) or f"bad command line: {str(error).splitlines()[0]}") from None
    finally:
        register_schema()  # the next config starts from the built-in sections
    _typed_values_win(cfg, {o.split("=", 1)[0].lstrip("+~") for o in overrides})
    check_values(cfg, *(schemas or ()))  # every value's range (types: the schema), before anything loads
    if config_name == "train":  # the variant names and the keys' agreement, as the typed settings check them
        trainer = OmegaConf.to_object(cfg.trainer)  # deprecated keys resolved here, once (one warning)
        cfg.trainer.advantage, cfg.trainer.baseline, cfg.trainer.std_normalize = trainer.advantage, None, None
    if "eval" in cfg:  # eval.samples against eval.temperature, in training and in scripts/eval.py
        OmegaConf.to_object(cfg.eval)
    _check_engine(OmegaConf.to_object(cfg.rollout))
    OmegaConf.to_object(cfg.reward)  # a judge without the key it needs (reward.judge.url, .model), train and eval
    return cfg


def _chosen(base: DictConfig, overrides: list[str], key: str):
    """The value `key` will have: its last `key=value` override, else the composed config's."""
    given = [o.split("=", 1)[1].strip("'\"") for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    return given[-1] if given else OmegaConf.select(base, key, default=None)


def _plugin_schemas(base: DictConfig, overrides: list[str]):
    """The train and eval schemas with the sections of the out-of-tree engine and tools the run uses, or None.

    An engine that is not built in (`rollout.engine=module:Name` / `path.py:Name`) is loaded now (its code runs),
    and its `settings_class` becomes `rollout.<its name>.*`. An override of `rollout.tools.<tool>.*` for a
    tool that is not built in loads the task (`task.name`) whose `tools` offer it, and that tool's `settings_class`
    becomes `rollout.tools.<tool>.*`. Built-in engines and tools have their sections in the schema already."""
    engines, tools = {}, {}
    engine = _chosen(base, overrides, "rollout.engine")
    if engine and engine not in names.ENGINE_SETTINGS and (":" in engine or names.imported("engines")):
        from gpg_vl.rollout.engine import ENGINES

        found = ENGINES.get(engine)  # an unknown name fails here, with the valid ones
        if vars(found).get("settings_class") is not None:  # declared by the engine itself, not inherited
            engines[found.name] = found.settings_class
    wanted = {o.split("=", 1)[0].split(".")[2] for o in overrides
              if o.startswith("rollout.tools.") and o.count(".") >= 3} - set(names.TOOL_SETTINGS)
    task = _chosen(base, overrides, "task.name")
    if wanted and task:
        from gpg_vl.data.task import TASKS
        from gpg_vl.rollout.multiturn.tools import TOOLS

        for name in getattr(TASKS.get(task), "tools", ()):
            tool = TOOLS.get(name)
            if tool.name in wanted and getattr(tool, "settings_class", None) is not None:
                tools[tool.name] = tool.settings_class
    return schemas_with(engines, tools) if engines or tools else None


def _check_engine(rollout) -> None:
    """The engine `rollout.engine` names can run here with these settings (else one sentence, before any model
    loads). The HF engine runs anywhere: it is left to build_engine, so that the config loads without torch."""
    if rollout.engine == "hf" and not names.imported("engines"):
        return
    from gpg_vl.rollout.engine import require_engine

    require_engine(rollout)


def _type_error(error: Exception) -> str | None:
    """One sentence for a value of the wrong type (OmegaConf's ValidationError under Hydra's exception)."""
    from omegaconf.errors import ValidationError

    cause = error
    while cause is not None and not isinstance(cause, ValidationError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    key, value = getattr(cause, "full_key", None), getattr(cause, "value", None)
    wanted = re.search(r"converted to (\w+)|is not a valid (\w+)|is not a (ListConfig|DictConfig)|to (Dict)\[",
                       str(cause))
    if not key or wanted is None:
        return None
    name = next(group for group in wanted.groups() if group)
    kind = {"Float": "a number", "Integer": "a whole number", "Boolean": "true or false", "bool": "true or false",
            "String": "a string", "ListConfig": "a list ([a, b, ...])",
            "DictConfig": "a map ({key: value, ...})", "Dict": "a map ({key: value, ...})"}.get(name, name)
    return (f"{key}={value} has the wrong type: {key} takes {kind} (see `python scripts/train.py --cfg job` for "
            "every setting and its default).")


def parse_argv(argv: list[str]) -> tuple[list[str], bool]:
    """Split `--cfg job` (print the resolved config and exit) from the overrides."""
    print_only = False
    rest = []
    skip = False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--cfg", "-c"):
            print_only = True
            skip = index + 1 < len(argv) and argv[index + 1] in ("job", "all")
            continue
        rest.append(arg)
    return rest, print_only


def run_cli(config_name: str, main, argv: list[str] | None = None) -> int:
    """Compose the config, then run `main(cfg)`; a UserError is printed as one sentence, exit code 2 (a config that
    does not compose, under a launch: by each machine's first process only, `LOCAL_RANK` 0). Ctrl-C
    prints one line (`Interrupted`'s, saying how to continue, when `main` gives one) and exits with 130."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        overrides, print_only = parse_argv(argv)
        try:
            cfg = load_config(config_name, overrides)
        except UserError:
            if os.environ.get("LOCAL_RANK", "0") != "0":  # a launch: the config is the same on every process, so
                time.sleep(QUIET_RANK_WAIT_S)  # its one sentence is said by each machine's first process alone,
                return 2  # which fails meanwhile, and the launcher then ends this one
            raise
        if print_only:
            print(OmegaConf.to_yaml(cfg, resolve=True))
            return 0
        main(cfg)
    except UserError as error:
        sys.stderr.write(f"error: {error}\n")  # one write: the processes of a launch each say it on their own line
        sys.stderr.flush()
        return 2
    except (Interrupted, KeyboardInterrupt) as error:
        print(str(error) if isinstance(error, Interrupted) else "interrupted.", file=sys.stderr)
        return Interrupted.exit_code
    return 0
