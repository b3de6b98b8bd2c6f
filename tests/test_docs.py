"""The docs (README.md and docs/*.md) against the code: what they tell a user to run must exist.

For every fenced bash/sh block: each `python -m titan_contrastive.X` / `-m benchmarks.X` module,
each `benchmarks/…`, `scripts/…` script and `run_train.sh` exists; each `CONFIG_FILE=…` and
`--job.config_file …` path exists; `pip install '.[extra]'` names a real extra and `pytest -m`
a declared marker. Everywhere (fenced shell blocks and inline code): every `--section.key[=value]`
flag, every `[section] key` and `section.key` mention names a real `JobConfig` field (values are
checked with the config's own coercion when they are not placeholders), and every repository file
path exists. Every fenced toml block parses and its sections and keys exist (values coerced as the
TOML loader does). Every relative markdown link resolves, anchors included. Python blocks'
`from titan_contrastive… import …` names exist. The argparse entry points the docs run answer
`--help`; the others import. `test_the_checker_catches_*` feed it wrong docs, so it cannot pass
by checking nothing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.config.manager import CLI, coerce

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell"}
# titan_contrastive's subpackages: docs name their files relative to the package (`steps/pixel.py`)
PACKAGE_DIRS = (
    "steps",
    "components",
    "grad_cache",
    "batching",
    "kernels",
    "parallelisms",
    "checkpoint",
    "config",
    "models",
    "datasets",
)
FILE_EXTS = tuple("py toml sh md json jsonl png csv log safetensors bin pt pth txt tsv tar parquet".split())


# ---------------------------------------------------------------- the config schema


@functools.cache
def schema() -> dict[str, dict[str, typing.Any]]:
    """{section: {key: type}}, exactly what `config/manager.py` resolves keys against."""
    return {name: typing.get_type_hints(cls) for name, cls in typing.get_type_hints(JobConfig).items()}


@functools.cache
def pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def check_key(section: str, key: str | None, where: str) -> list[str]:
    if section not in schema():
        return [f"{where}: [{section}] is not a config section (sections: {', '.join(schema())})"]
    if key is not None and key.replace("-", "_") not in schema()[section]:
        return [f"{where}: {section}.{key} is not a config key (keys of [{section}]: {', '.join(schema()[section])})"]
    return []


def is_placeholder(value: str) -> bool:
    """`N`, `L`, `$X`, `<x>`, `...`: a value the reader fills in."""
    return bool(re.fullmatch(r"[A-Z][A-Z_0-9]*", value)) or any(c in value for c in "$<…") or "..." in value


def check_flag(section: str, key: str, value: str | None, where: str) -> list[str]:
    errors = check_key(section, key, where)
    if errors or not value or is_placeholder(value):
        return errors
    name = key.replace("-", "_")
    try:
        coerce(f"{section}.{name}", [value], schema()[section][name], CLI)
    except ConfigError as e:
        return [f"{where}: --{section}.{key}={value}: {e}"]
    return []


# ---------------------------------------------------------------- markdown


def blocks_and_prose(text: str) -> tuple[list[tuple[str, str, int]], str]:
    """([(language, body, first line number)], the text outside fenced blocks)."""
    blocks, prose, body, lang, start = [], [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if body is None:
                body, lang, start = [], line.strip()[3:].strip().split(" ")[0].lower(), number + 1
            else:
                blocks.append((lang, "\n".join(body), start))
                body = None
            continue
        (prose if body is None else body).append(line)
    return blocks, "\n".join(prose)


def code_spans(prose: str) -> list[str]:
    """Inline code spans; a span may wrap onto the next line of its paragraph."""
    return [span.strip() for span in re.findall(r"`([^`]+)`", prose.replace("\n", " "))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    return headings(blocks_and_prose(path.read_text(encoding="utf-8"))[1])


def headings(prose: str) -> frozenset[str]:
    """The anchors of the headings in a page's prose (duplicates get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return frozenset(out)


def shell_lines(body: str) -> list[str]:
    """Logical command lines: continuations joined, comments dropped."""
    lines, current = [], ""
    for raw in body.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


# ---------------------------------------------------------------- the checks

FLAG = re.compile(r"(?<![\w.-])--([A-Za-z_][\w-]*)\.([A-Za-z_][\w-]*)(?:=(?:'([^']*)'|(\S*)))?")
PATH = re.compile(
    r"(?<![\w./{<$-])((?:titan_contrastive|train_configs|benchmarks|scripts|tests|docs|results|"
    + "|".join(PACKAGE_DIRS)
    + r")/[\w./-]*\w\.(?:"
    + "|".join(FILE_EXTS)
    + r"))(?![\w{])"
)


def check_path(token: str, where: str) -> list[str]:
    token = token.removeprefix("./")
    candidates = [REPO / token]
    if token.split("/")[0] in PACKAGE_DIRS:
        candidates.append(REPO / "titan_contrastive" / token)
    if token.startswith("results/"):
        candidates.append(REPO / "benchmarks" / token)
    if any(c.exists() for c in candidates):
        return []
    return [f"{where}: {token} does not exist"]


def check_text_mentions(text: str, where: str) -> list[str]:
    """Flags (a quoted value read whole, as a shell reads it), config keys and file paths in a code span or command."""
    errors = []
    for section, key, quoted, value in FLAG.findall(text):
        errors += check_flag(section, key, quoted or value.rstrip("'\";),") or None, where)
    for path in PATH.findall(text):
        errors += check_path(path, where)
    return errors


def check_span(span: str, where: str) -> list[str]:
    errors = check_text_mentions(span, where)
    bracket = re.match(r"\[([A-Za-z_]\w*)\](?:\s+([A-Za-z_]\w*))?", span)
    if bracket:
        section, key = bracket.groups()
        extras = pyproject()["project"]["optional-dependencies"]
        if not (key is None and section in extras):  # `[hf]`: a pip extra, not a section
            errors += check_key(section, key, where)
    sections = "|".join(map(re.escape, schema()))
    # not `optimizer.step()`
    for section, key in re.findall(rf"(?<![\w./\[-])({sections})\.([A-Za-z_]\w*)(?![\w(])", span):
        if key not in FILE_EXTS:  # `metrics.jsonl`, `loss.py`, `model.safetensors` are files
            errors += check_key(section, key, where)
    return errors


def check_shell(body: str, where: str, modules: set[str]) -> list[str]:
    errors = []
    for line in shell_lines(body):
        errors += check_text_mentions(line, where)
        try:
            words = shlex.split(line)
        except ValueError as e:
            errors.append(f"{where}: cannot parse {line!r}: {e}")
            continue
        for word in words:  # `srun bash -c '... ./run_train.sh --x.y=1'`: the quoted command too
            if " " in word:
                errors += check_shell(word, where, modules)
        for i, word in enumerate(words):
            if word.startswith("CONFIG_FILE="):
                errors += check_config_file(word.partition("=")[2], where)
            elif word.startswith("--job.config_file="):
                errors += check_config_file(word.partition("=")[2], where)
            elif word == "--job.config_file" and i + 1 < len(words):
                errors += check_config_file(words[i + 1], where)
            elif word.endswith("run_train.sh") and not os.access(REPO / "run_train.sh", os.X_OK):
                errors.append(f"{where}: run_train.sh is missing or not executable")
            elif word == "-m" and i + 1 < len(words):
                target = words[i + 1]
                if target.startswith("titan_contrastive"):
                    if importlib.util.find_spec(target) is None:
                        errors.append(f"{where}: python -m {target}: no such module")
                    else:
                        modules.add(target)
                elif target.startswith("benchmarks"):
                    if not (REPO / (target.replace(".", "/") + ".py")).is_file():
                        errors.append(f"{where}: python -m {target}: no such benchmark module")
                elif "pytest" in words[:i] and target != "pytest":
                    markers = {m.split(":")[0].strip() for m in pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
                    for name in re.findall(r"\w+", target):
                        if name not in markers | {"not", "and", "or"}:
                            errors.append(
                                f"{where}: pytest -m {target}: {name} is not a declared marker "
                                f"({', '.join(sorted(markers))})"
                            )
            elif re.fullmatch(r"(?:\./)?(?:benchmarks|scripts)/[\w/.-]+", word) and not (REPO / word).exists():
                errors.append(f"{where}: {word} does not exist")
        if "pip install" in line:
            extras = pyproject()["project"]["optional-dependencies"]
            for group in re.findall(r"\.\[([\w,-]+)\]", line):
                for extra in group.split(","):
                    if extra not in extras:
                        errors.append(f"{where}: pip extra [{extra}] is not in pyproject.toml ({', '.join(extras)})")
    return errors


def check_config_file(path: str, where: str) -> list[str]:
    if is_placeholder(path) or (REPO / path).is_file():
        return []
    return [f"{where}: config file {path} does not exist"]


def check_toml(body: str, where: str) -> list[str]:
    try:
        raw = tomllib.loads(body)
    except tomllib.TOMLDecodeError as e:
        return [f"{where}: not valid TOML: {e}"]
    errors = []
    for section, table in raw.items():
        if not isinstance(table, dict):
            errors.append(f"{where}: top-level key {section!r} is not a [section]")
            continue
        for key, value in table.items():
            problems = check_key(section, key, where)
            if not problems:
                try:
                    coerce(f"{section}.{key}", value, schema()[section][key], where)
                except ConfigError as e:
                    problems = [f"{where}: {e}"]
            errors += problems
        if not table:
            errors += check_key(section, None, where)
    return errors


def check_python(body: str, where: str) -> list[str]:
    errors = []
    for module, names in re.findall(r"^\s*from\s+(titan_contrastive[\w.]*)\s+import\s+([\w, ]+)", body, re.M):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{where}: from {module} import ...: {e}")
            continue
        errors += [
            f"{where}: {module} has no {n}" for n in map(str.strip, names.split(",")) if n and not hasattr(mod, n)
        ]
    return errors


def check_links(prose: str, doc: Path, where: str) -> list[str]:
    own = headings(prose)
    errors = [  # a target broken by a line wrap or a space is no link at all, and would escape the checks below
        f"{where}: link target {target!r} holds a space or a line break"
        for target in re.findall(r"\]\(((?:\.{0,2}/)?[\w./-]*\.md(?:#[^)]*)?|#[^)]*)\)", prose)
        if re.search(r"\s", target)
    ]
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose.replace("\n", " ")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in own:
                errors.append(f"{where}: link {target}: no heading #{anchor} in this page")
            continue
        file = (doc.parent / path).resolve()
        if not file.exists():
            errors.append(
                f"{where}: link {target} -> {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not "
                "exist"
            )
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            errors.append(f"{where}: link {target}: no heading #{anchor} in {file.name}")
    return errors


def check_doc(doc: Path, text: str, modules: set[str]) -> list[str]:
    """Every problem in one markdown file, as 'file:line: message' strings."""
    name = doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc
    blocks, prose = blocks_and_prose(text)
    errors = []
    for lang, body, start in blocks:
        where = f"{name}:{start}"
        if lang in SHELL:
            errors += check_shell(body, where, modules)
        elif lang == "toml":
            errors += check_toml(body, where)
        elif lang == "python":
            errors += check_python(body, where)
    for span in code_spans(prose):
        errors += check_span(span, f"{name}: `{span}`")
    errors += check_links(prose, doc, str(name))
    return list(dict.fromkeys(errors))


@functools.cache
def all_results() -> tuple[tuple[str, ...], frozenset[str]]:
    modules: set[str] = set()
    errors = []
    for doc in DOCS:
        errors += check_doc(doc, doc.read_text(encoding="utf-8"), modules)
    return tuple(errors), frozenset(modules)


# ---------------------------------------------------------------- the tests


def test_docs_name_only_what_exists() -> None:
    errors, _ = all_results()
    assert not errors, "\n".join(errors)


def test_every_docs_page_is_linked_from_the_readme_and_says_what_it_covers() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for page in DOCS[1:]:
        assert f"(docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
        _, prose = blocks_and_prose(page.read_text(encoding="utf-8"))
        paragraphs = [p.strip() for p in prose.split("\n\n") if p.strip()]
        assert paragraphs[0].startswith("# "), f"docs/{page.name} does not start with a title"
        assert not paragraphs[1].startswith(("#", "|", "-")), (
            f"docs/{page.name}: no sentence under the title saying what it covers"
        )


# `python -m MODULE --help` for each module named after it, in one interpreter (runpy runs a module as `-m` does): per
# module a JSON line of its name, its exit code and what it printed.
HELP = """import contextlib, io, json, runpy, sys
for module in sys.argv[1:]:
    sys.argv, out, code = [module, "--help"], io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    print(json.dumps([module, code, out.getvalue()]))
"""


def test_the_modules_the_docs_run_answer_help_or_import() -> None:
    _, modules = all_results()
    assert "titan_contrastive.train" in modules and "titan_contrastive.export" in modules, modules
    helped = []
    for module in sorted(modules):
        source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
        if "argparse" in source:  # cheap: argparse entry points import their heavy parts after parsing
            helped.append(module)
        else:  # the trainer's tyro --help costs a full import and tyro's rendering: importing is the check
            importlib.import_module(module)
    run = subprocess.run([sys.executable, "-c", HELP, *helped], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    answers = {m: (code, out) for m, code, out in map(json.loads, run.stdout.splitlines())}
    assert list(answers) == helped, (answers.keys(), helped, run.stderr[-2000:])
    for module, (code, out) in answers.items():
        assert code in (0, None) and "usage:" in out, f"{module} --help: exit {code}\n{out[-1000:]}"


WRONG = """\
# A page

This page covers mistakes.

```bash
./run_train.sh --training.stepz=1
./run_train.sh --loss.negatives=globl --loss.matryoshka_dims='[64, "x"]'
CONFIG_FILE=train_configs/nope.toml ./run_train.sh
python -m titan_contrastive.nope
python benchmarks/nope.py
pip install -e '.[nope]'
.venv/bin/python -m pytest -m fast
```

```toml
[training]
stepz = 5

[nope]
x = 1
```

```python
from titan_contrastive.config import Nope
```

Set `[loss] negativez`, or `training.stepz`, see `components/nope.py` and [x](nope.md), [y](#nope).
"""


def test_the_checker_catches_wrong_keys_paths_and_links() -> None:
    errors = check_doc(REPO / "docs" / "wrong.md", WRONG, set())
    text = "\n".join(errors)
    for needle in [
        "training.stepz is not a config key",
        "loss.negatives=globl",
        "loss.matryoshka_dims='x' is invalid",  # a quoted value, read whole
        "train_configs/nope.toml does not exist",
        "titan_contrastive.nope: no such module",
        "benchmarks/nope.py does not exist",
        "[nope] is not in pyproject",
        "fast is not a declared marker",
        "[nope] is not a config section",
        "has no Nope",
        "loss.negativez is not a config key",
        "components/nope.py does not exist",
        "link nope.md",
        "no heading #nope",
    ]:
        assert needle in text, f"the checker missed {needle!r}; it reported:\n{text}"
    assert sum("training.stepz is not a config key" in e for e in errors) == 3, text  # the flag, the TOML key, the span


def test_the_checker_accepts_what_is_right() -> None:
    right = """\
# Fine

This page covers nothing wrong.

```bash
NGPU=2 ./run_train.sh --training.local_batch_size=64 --optimizer.lr 1e-3 --model.freeze= --checkpoint.load_step=N
CONFIG_FILE=train_configs/debug.toml ./run_train.sh
python -m titan_contrastive.export --help
```

```toml
[checkpoint]
enable = true
```

`[loss] kernel`, `[hf]`, `data.image_size`, `metrics.jsonl`, `steps/pixel.py`, `results/loss_bench_cpu.json`,
[config](config.md#errors).
"""
    assert check_doc(REPO / "docs" / "right.md", right, set()) == []
