"""Load a `JobConfig`: defaults, then TOML (`--job.config_file`), then `--section.key` overrides.

Order of operations in `parse_args`:
1. split argv into `--section.key` options and their values (`--a.b=v`, `--a.b v`, and for
   list fields `--a.b v1 v2`, `--a.b=v1,v2` or a TOML array `--a.b='[v1, v2]'`); check every key and value against the
   dataclass types;
2. read the TOML named by `--job.config_file`, check it the same way, apply it to the defaults;
3. apply the checked command-line values over that; with `--help`, hand the normalised argv to
   tyro with the TOML-merged config as its default, so the help shows the effective values;
4. check per-field ranges (`metadata["check"]` on each field), then the combinations of fields
   a run cannot train with (`_check_combinations`). What needs the process count (the size of
   a contrastive problem) is checked by the trainer with `check_contrastive_problem`; what is
   legitimate but surprising is only warned about (`log_config_warnings`, at start).

Why check before tyro: tyro prints multi-line panels and does not see TOML values at all; a
user sweeping configs wants one line naming the key, the bad value and the valid choices, the
same for both sources. tyro still owns `--help` and the construction of the dataclass tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import logging
import math
import sys
import types
import typing
from typing import Any

import tyro

from titan_contrastive.config.evaluation import EVAL_SETS
from titan_contrastive.config.job_config import MAX_FIXED_LOGIT_SCALE, MAX_LOGIT_SCALE, JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib


CLI = "command line"  # the origin of values from argv, in error messages


class ConfigError(ValueError):
    """A bad config: the message is one line naming the key, the value and the fix."""


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@functools.cache  # evaluating the annotations is most of a parse's time; the classes never change
def _sections() -> dict[str, type]:
    """{section name: section dataclass}, in declaration order (read only)."""
    return typing.get_type_hints(JobConfig)


@functools.cache
def _fields_of(section: str) -> dict[str, Any]:
    """{field name: type} of one section (read only)."""
    return typing.get_type_hints(_sections()[section])


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s in _sections() for k in _fields_of(s)]


def _resolve_key(key: str, origin: str) -> tuple[str, str, Any]:
    """Map 'section.key' to its (section, field, type), or raise naming the valid choices."""
    sections = _sections()
    section, _, name = key.partition(".")
    if section not in sections or not name:
        raise ConfigError(
            f"{origin}: unknown option '{key}'; {_suggest(key, _all_keys())}"
            f"options are section.key with sections: {', '.join(sections)} (see --help)"
        )
    fields = _fields_of(section)
    if name not in fields:
        raise ConfigError(
            f"{origin}: unknown key '{key}'; {_suggest(name, list(fields)) or _suggest(key, _all_keys())}"
            f"valid keys in [{section}]: {', '.join(fields)}"
        )
    return section, name, fields[name]


def coerce(key: str, value: Any, tp: Any, origin: str) -> Any:
    """Convert a TOML value or CLI string(s) to `tp`, or raise a one-line ConfigError."""
    origin_ = typing.get_origin(tp)

    def bad(expect: str) -> ConfigError:
        return ConfigError(f"{origin}: {key}={value!r} is invalid: expected {expect}")

    if origin_ in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):  # `X | None`: "none" unsets
        one = value[0] if isinstance(value, list) and len(value) == 1 else value
        if one is None or (isinstance(one, str) and one.lower() in ("none", "null")):
            return None
        (inner,) = [t for t in typing.get_args(tp) if t is not type(None)]
        return coerce(key, value, inner, origin)
    if origin_ is typing.Literal:
        choices = typing.get_args(tp)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value not in choices:
            return_choices = ", ".join(map(str, choices))
            raise ConfigError(f"{origin}: {key}={value!r} is not a valid choice; choose one of: {return_choices}")
        return value
    if origin_ in (list, tuple):
        (item_tp, *_) = typing.get_args(tp)
        items = value if isinstance(value, list) else [value]
        # `--a.b=` empties a list; one CLI value (or TOML string) splits at commas, a TOML list never does
        toml_list = isinstance(value, list) and origin != CLI
        array = _cli_array(key, items[0]) if origin == CLI and len(items) == 1 and isinstance(items[0], str) else None
        if array is not None:  # `--a.b='["x", "y"]'`: a TOML array, as the config file writes it
            items = array
        elif not toml_list and len(items) == 1 and isinstance(items[0], str) and ("," in items[0] or not items[0]):
            items = [v for v in items[0].split(",") if v]
        return [coerce(key, v, item_tp, origin) for v in items]
    if isinstance(value, list):  # the command line gives every value as a list of strings; a TOML list is not a scalar
        if len(value) != 1 or origin != CLI:
            several = origin == CLI and tp is str  # `--data.path a/*.jsonl`: the shell gave each file its own word
            hint = "; quote a pattern the shell would expand: --{key}='dir/*.jsonl'" if several else ""
            raise bad(
                f"one value of type {getattr(tp, '__name__', tp)}"
                + (", not a list" if origin != CLI else "")
                + hint.format(key=key)
            )
        value = value[0]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad("true or false")
    if tp is int:
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if not str(value).isascii():  # int() would also take other scripts' digits ("５")
            raise bad("an integer in ASCII digits")
        try:
            return int(str(value))
        except ValueError:
            raise bad("an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise bad("a number")
        try:
            number = float(value) if str(value).isascii() else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise bad("a number")
        if not math.isfinite(number):
            raise bad("a finite number (inf and nan are not settings)")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    raise bad(f"a value of type {tp}")  # pragma: no cover - only for new field types


def _cli_array(key: str, text: str) -> list[Any] | None:
    """A command-line value written as a TOML array (`["query", "pos"]`, `[768, 256]`): its items; None for a value
    that is no list in brackets (`[Q] `, a prompt); a ConfigError for one that is, but not in TOML (`[query, pos]`:
    its commas would split it into bracketed pieces)."""
    inner = text.strip()
    if not (inner.startswith("[") and inner.endswith("]")) or "[" in inner[1:-1] or "]" in inner[1:-1]:
        return None
    try:
        items = tomllib.loads(f"v = {inner}")["v"]
    except tomllib.TOMLDecodeError:
        if not any(c in inner for c in ",'\""):
            return None
        bare = ",".join(v.strip().strip("'\"") for v in inner[1:-1].split(","))
        raise ConfigError(
            f"{CLI}: {key}={text!r} is invalid: a list in brackets is read as a TOML array; quote its texts "
            f'(--{key}=\'["a", "b"]\') or give the items comma-separated (--{key}={bare})'
        ) from None
    return items


def split_cli(argv: list[str]) -> dict[str, list[str]]:
    """Group argv into {'section.key': [values]}; values may be given as '--k=v' or '--k v'."""
    options: dict[str, list[str]] = {}
    current: str | None = None
    for token in argv:
        if token.startswith("--"):
            key, eq, value = token[2:].partition("=")
            key = key.replace("-", "_")  # tyro spells options either way
            current = key
            if key in options:  # the last wins, as in tyro and argparse, but never silently
                print(
                    f"warning: {CLI}: --{key} is given more than once ({' '.join(options[key]) or 'no value'}, then "
                    f"{value if eq else 'the values after it'}); the last one is used",
                    file=sys.stderr,
                )
            options[key] = [value] if eq else []
        elif current is None:
            raise ConfigError(f"command line: unexpected argument {token!r}; options look like --section.key=value")
        else:
            options[current].append(token)
    return options


def check_cli(argv: list[str]) -> dict[tuple[str, str], Any]:
    """Validate every CLI option; return {(section, field): typed value}."""
    out: dict[tuple[str, str], Any] = {}
    for key, values in split_cli(argv).items():
        section, name, tp = _resolve_key(key, CLI)
        if not values:
            raise ConfigError(f"command line: --{key} needs a value, e.g. --{key}=VALUE")
        out[(section, name)] = coerce(key, values, tp, CLI)
    return out


def load_toml(path: str) -> dict[tuple[str, str], Any]:
    """Read and validate a TOML config; return {(section, field): typed value}."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"job.config_file={path!r} does not exist; pass an existing TOML file, e.g. train_configs/debug.toml"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"job.config_file={path!r} is a folder; pass a TOML file, e.g. train_configs/debug.toml"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"job.config_file={path!r} is not readable (permission denied); fix its permissions"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"job.config_file={path!r} is not UTF-8 text; save it as UTF-8 TOML") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file={path!r} is not valid TOML: {e}") from None
    if isinstance(raw.get("job"), dict) and "config_file" in raw["job"]:
        raise ConfigError(
            f"{path}: job.config_file inside a TOML is not read (configs do not include others); remove it and "
            "pass the file with --job.config_file"
        )
    out: dict[tuple[str, str], Any] = {}
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: top-level key '{section}' must be a [section]; sections: {', '.join(_sections())}"
            )
        for name, value in table.items():
            sec, fld, tp = _resolve_key(f"{section}.{name}", path)
            out[(sec, fld)] = coerce(f"{section}.{name}", value, tp, path)
    return out


def _apply(cfg: JobConfig, values: dict[tuple[str, str], Any]) -> JobConfig:
    for (section, name), value in values.items():
        setattr(getattr(cfg, section), name, value)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Run the per-field range checks declared in `job_config.py`."""
    for section in dataclasses.fields(cfg):
        sec = getattr(cfg, section.name)
        for f in dataclasses.fields(sec):
            check, expect = f.metadata.get("check", (None, ""))
            value = getattr(sec, f.name)
            if check is not None and not check(value):
                raise ConfigError(
                    f"{section.name}.{f.name}={value!r} is out of range: expected {expect} "
                    f"(set --{section.name}.{f.name}=... or [{section.name}] {f.name} in the TOML)"
                )
    _check_combinations(cfg)
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:  # an optional extra
        raise ConfigError(
            "metrics.enable_wandb=true needs the wandb package, which is not installed: pip install -e '.[wandb]' "
            "(or set metrics.enable_wandb=false)"
        )


def _check_combinations(cfg: JobConfig) -> None:
    """Values that are valid alone but not together. A decay ratio needs a decay; a memory plan a budget; keep_best an
    evaluation at each checkpoint (`check_keep_best`). The logit scale's range depends on whether it
    is learned: a learned one is clamped to [0, log 100] after every step, so an init outside would
    silently change at step 1; a fixed one is never clamped, but past exp(+-9.2) it overflows or
    carries no signal, and the run would fail at step 1 with a non-finite loss whose message points
    at the lr."""
    sched = cfg.lr_scheduler
    if sched.decay_ratio is not None and sched.decay_type == "none":
        raise ConfigError(
            f"lr_scheduler.decay_ratio={sched.decay_ratio!r} with lr_scheduler.decay_type='none': nothing decays; "
            "set decay_type to 'cosine', 'linear' or 'sqrt', or remove decay_ratio"
        )
    if cfg.memory.plan and not cfg.memory.budget_gib:
        raise ConfigError("memory.plan=true needs memory.budget_gib > 0 (the per-device budget to plan for)")
    check_keep_best(cfg)
    check_profiling(cfg, None if cfg.training.epochs else cfg.training.steps)  # epochs: `epochs.run_steps` checks
    if cfg.eval.beir_pool_factor != 1 and not (cfg.eval.enable and cfg.eval.beir_path):
        raise ConfigError(
            f"eval.beir_pool_factor={cfg.eval.beir_pool_factor!r} pools the documents of eval.beir_path, and this run "
            "evaluates no BEIR folder; set eval.beir_path (and eval.enable=true) or leave the factor at 1"
        )
    scale = cfg.loss.init_logit_scale
    if scale is None:
        return
    if cfg.loss.learn_logit_scale and not 0 <= scale <= MAX_LOGIT_SCALE:
        raise ConfigError(
            f"loss.init_logit_scale={scale!r} is out of range for a learned scale: expected a number in "
            f"[0, {MAX_LOGIT_SCALE:.4f}] (the clamp applied after every step, temperature exp(t') <= 100); "
            f"to train at exp({scale!r}) = {math.exp(scale):.4g} set loss.learn_logit_scale=false"
        )
    if not cfg.loss.learn_logit_scale and abs(scale) > MAX_FIXED_LOGIT_SCALE:
        raise ConfigError(
            f"loss.init_logit_scale={scale!r} is out of range: expected a number in [-{MAX_FIXED_LOGIT_SCALE:.4f}, "
            f"{MAX_FIXED_LOGIT_SCALE:.4f}] (a fixed temperature exp(t') between 1e-4 and 1e4; beyond, the logits "
            "overflow float16 or no longer tell pairs apart)"
        )


def check_keep_best(cfg: JobConfig) -> None:
    """`checkpoint.keep_best` compares checkpoints by the evaluation at their steps: it needs
    checkpoints, an evaluation at each of them and something to evaluate (the metric's name itself
    is checked against the first evaluation's, `checkpoint/best.py`); `eval.patience` watches its metric.
    Intervals given in epochs are checked once `epochs.run_steps` knows the steps."""
    best, ckpt, ev, data = cfg.checkpoint.keep_best, cfg.checkpoint, cfg.eval, cfg.data
    if ev.patience_threshold and not ev.patience:
        raise ConfigError(f"eval.patience_threshold={ev.patience_threshold!r} with eval.patience=0: set eval.patience")
    if ev.patience and not best:
        raise ConfigError(
            f"eval.patience={ev.patience} stops the run when checkpoint.keep_best's metric stops improving, and "
            "keep_best is empty; set checkpoint.keep_best (e.g. 'loss' or 'beir/ndcg@10'): its checkpoint is the one "
            "to use"
        )
    if not best:
        return
    if not (ckpt.enable and ev.enable):
        raise ConfigError(
            f"checkpoint.keep_best={best!r} keeps the best checkpoint by its evaluation: set checkpoint.enable=true "
            "and eval.enable=true"
        )
    in_epochs = ev.every_epoch or ckpt.every_epoch  # checked when the steps are known
    if not in_epochs and (not ev.freq or ckpt.interval % ev.freq):
        raise ConfigError(
            f"checkpoint.keep_best={best!r} needs an evaluation at every checkpoint, and eval.freq={ev.freq} does not "
            f"divide checkpoint.interval={ckpt.interval}: set eval.freq={ckpt.interval} (or a divisor of it)"
        )
    bundled = data.dataset in ("fashion_mnist", "emoji", "wordnet")  # they bring their test split
    if not (bundled or data.val_path or ev.zero_shot_path or any(getattr(ev, f"{s.name}_path") for s in EVAL_SETS)):
        raise ConfigError(
            f"checkpoint.keep_best={best!r}: this run evaluates nothing; set data.val_path (or eval.beir_path)"
        )
    for s in EVAL_SETS:
        if best.startswith(f"{s.name}/") and not getattr(ev, f"{s.name}_path"):
            raise ConfigError(
                f"checkpoint.keep_best={best!r} is {s.kind} metric and eval.{s.name}_path is empty; set it"
            )


def check_profiling(cfg: JobConfig, steps: int | None) -> None:
    """Windows of `[profiling]` that would trace nothing (past the run's `steps`; None: not known yet), or overlap."""
    prof = cfg.profiling
    if not (prof.enable or prof.memory_snapshot):
        return
    if steps is not None and prof.start_step > steps:
        raise ConfigError(
            f"profiling.start_step={prof.start_step} is after the run's last step (training.steps={steps}): nothing "
            f"would be profiled; set profiling.start_step <= {steps}"
        )
    if prof.freq and prof.freq <= prof.steps:
        raise ConfigError(
            f"profiling.freq={prof.freq} <= profiling.steps={prof.steps}: each window would run into the next; set "
            f"profiling.freq > {prof.steps} (or 0 for one window)"
        )


def check_contrastive_problem(
    cfg: JobConfig, dp_degree: int, global_batch_size: int, *, contrastive: bool = True
) -> None:
    """A contrastive step needs at least two pairs in each problem: with one, the clip loss and its
    gradient are exactly 0 (siglip's has no negatives), and the run trained nothing, silently.
    A problem is the microbatches of all DP ranks (`negatives = "microbatch"`, chunked by GradCache
    or not) or the whole global batch (`negatives = "global"`). `contrastive=False`: a family with
    its own step (vae's pixel loss), where one sample per batch is fine."""
    local = cfg.training.local_batch_size
    problem = global_batch_size if cfg.loss.negatives == "global" else local * dp_degree
    if problem >= 2 or not contrastive:
        return
    fix = (
        "raise training.global_batch_size"
        if cfg.loss.negatives == "global"
        else (
            "raise training.local_batch_size (loss.negatives=global with a larger training.global_batch_size makes the "
            "whole global batch one problem instead)"
        )
    )
    raise ConfigError(
        f"training.local_batch_size={local} with loss.negatives={cfg.loss.negatives} on {dp_degree} process"
        f"{'es' if dp_degree > 1 else ''}: each contrastive problem holds one pair, whose loss and gradient "
        f"carry no negatives (clip: exactly 0); {fix}"
    )


def log_config_warnings(cfg: JobConfig) -> list[str]:
    """Log (and return) the settings a run can train with but that are rarely meant; never an error.

    warmup_steps >= training.steps: the lr rises for the whole run and never reaches its peak or
    decays. A warning, not an error: a smoke run (`--training.steps=2` with a config's warmup) is
    legitimate and common, and a resumed run may extend training.steps past the warmup. A decay
    reaching into warmup; CoSENT alone with a learned scale."""
    out = []
    warmup, steps = cfg.lr_scheduler.warmup_steps, cfg.training.steps
    ratio = cfg.lr_scheduler.decay_ratio
    if ratio is not None and warmup < steps and warmup + max(round(ratio * steps), 1) > steps:
        out.append(
            f"lr_scheduler.decay_ratio={ratio} over training.steps={steps} asks for {max(round(ratio * steps), 1)} "
            f"decay steps, which reach into the {warmup} warmup steps; the decay starts at the end of warmup, "
            "with no stable phase"
        )
    loss = cfg.loss
    if loss.distill == "cosent" and not loss.contrastive_weight and loss.learn_logit_scale:
        out.append(
            "loss.distill=cosent alone with a learned logit scale: the scale then trains to sharpen the ranking "
            "(up to the clamp, 100), where sentence-transformers' CoSENTLoss fixes it at 20; set "
            "loss.learn_logit_scale=false to train as it does (bi_encoder starts at 20)"
        )
    if warmup >= steps:
        out.append(
            f"lr_scheduler.warmup_steps={warmup} >= training.steps={steps}: the lr rises for the whole run, reaching "
            f"{steps / (warmup + 1):.2g} x optimizer.lr at the last step, and never decays; lower warmup_steps for a "
            "full schedule"
        )
    for line in out:
        logging.getLogger("titan_contrastive").warning(f"warning: {line}")
    return out


def _tyro_argv(cli: dict[tuple[str, str], Any]) -> list[str]:
    argv: list[str] = []
    for (section, name), value in cli.items():
        argv.append(f"--{section}.{name}")
        argv.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    return argv


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults < TOML < CLI. Raises ConfigError on bad input;
    `--help` prints every option with its doc and effective default and exits 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    rest = [a for a in argv if a not in ("-h", "--help")]
    cli = check_cli(rest)
    cfg = JobConfig()
    config_file = cli.get(("job", "config_file"), "")
    if config_file:
        cfg = _apply(cfg, load_toml(config_file))
    if wants_help:  # tyro prints every option with its doc and effective default, and exits 0
        tyro.cli(
            JobConfig,
            args=[*_tyro_argv(cli), "--help"],
            default=cfg,
            prog="python -m titan_contrastive.train",
            config=(tyro.conf.FlagConversionOff,),
            use_underscores=True,
        )
    cfg = _apply(cfg, cli)  # check_cli has typed every value
    validate(cfg)
    return cfg
