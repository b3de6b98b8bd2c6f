"""Config loading: precedence CLI > TOML > defaults, --help, and every error path."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from titan_contrastive.config import ConfigError, JobConfig, parse_args
from titan_contrastive.parallelisms import gradient_accumulation_steps

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_anything() -> None:
    assert parse_args([]) == JobConfig()


def test_precedence_cli_over_toml_over_defaults(tmp_path: Path) -> None:
    f = write(tmp_path, "[training]\nsteps = 7\nlocal_batch_size = 3\n[optimizer]\nlr = 0.5\n")
    cfg = parse_args(["--job.config_file", f, "--training.steps=9", "--optimizer.lr", "0.25"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.optimizer.lr == 0.25
    assert cfg.training.local_batch_size == 3  # TOML beats default
    assert cfg.training.max_norm == JobConfig().training.max_norm  # default kept


def test_both_cli_spellings_and_types(tmp_path: Path) -> None:
    cfg = parse_args(
        ["--training.deterministic=true", "--training.seed", "5", "--loss.negatives", "microbatch", "--data.path=/x y"]
    )
    assert cfg.training.deterministic is True and cfg.training.seed == 5 and cfg.data.path == "/x y"
    assert parse_args(["--training.deterministic", "False"]).training.deterministic is False
    assert parse_args(["--training.local-batch-size=4"]).training.local_batch_size == 4


def test_lists_split_at_commas_on_the_command_line_only(tmp_path: Path) -> None:
    """One CLI value of a list splits at commas (`--model.freeze=a,b`); a TOML list never does, nor do
    several CLI values (a prompt with a comma)."""
    f = write(tmp_path, '[data]\nquery_prompts = ["Given a query, retrieve"]\ndoc_prompts = "a,b"\n')
    cfg = parse_args(["--job.config_file", f, "--model.freeze=text,image"])
    assert cfg.data.query_prompts == ["Given a query, retrieve"] and cfg.data.doc_prompts == ["a", "b"]
    assert cfg.model.freeze == ["text", "image"]
    cfg = parse_args(["--data.query_prompts", "q, 1: ", "", "--data.doc_prompts="])
    assert cfg.data.query_prompts == ["q, 1: ", ""] and cfg.data.doc_prompts == []


def test_a_toml_array_on_the_command_line_is_read_as_the_config_file_reads_it() -> None:
    """`--a.b='["x", "y"]'` is a list of two texts, not three comma-split pieces with brackets and quotes in them; a
    prompt in brackets (`[Q] `) stays a text; an unquoted bracketed list is a one-line error with both fixes."""
    cfg = parse_args(
        [
            '--data.pairs_columns=["query", "positive_passages", "negative_passages"]',
            "--loss.matryoshka_dims=[64, 32]",
            "--loss.matryoshka_weights",
            "[1, 0.5]",
            "--data.query_prompts=[Q] ",
            "--data.doc_prompts=[D],[E]",
            "--model.freeze=[]",
        ]
    )
    assert cfg.data.pairs_columns == ["query", "positive_passages", "negative_passages"]
    assert cfg.loss.matryoshka_dims == [64, 32] and cfg.loss.matryoshka_weights == [1.0, 0.5]
    assert cfg.data.query_prompts == ["[Q] "] and cfg.data.doc_prompts == ["[D]", "[E]"] and cfg.model.freeze == []
    with pytest.raises(ConfigError) as info:
        parse_args(["--data.pairs_columns=[query, pos]"])
    message = str(info.value)
    assert "\n" not in message and "data.pairs_columns='[query, pos]'" in message, message
    assert """--data.pairs_columns='["a", "b"]'""" in message and "--data.pairs_columns=query,pos" in message, message
    with pytest.raises(ConfigError, match=r"data.pairs_columns=3 is invalid: expected a string"):
        parse_args(['--data.pairs_columns=["q", 3]'])


def test_shipped_configs_parse() -> None:
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.stepz=3"], ["training.stepz", "did you mean 'steps'", "valid keys in [training]"]),
        (["--trainin.steps=3"], ["trainin.steps", "training.steps"]),
        (["--training.steps=abc"], ["training.steps='abc'", "an integer"]),
        (["--optimizer.lr=fast"], ["optimizer.lr='fast'", "a number"]),
        (["--training.deterministic=maybe"], ["training.deterministic='maybe'", "true or false"]),
        (["--loss.negatives=all"], ["loss.negatives='all'", "microbatch, global"]),
        (["--data.dataset=imagenet"], ["data.dataset='imagenet'", "fashion_mnist, emoji"]),
        (["--training.local_batch_size=0"], ["training.local_batch_size=0", "out of range", ">= 1"]),
        (["--training.global_batch_size=0"], ["training.global_batch_size=0", "-1"]),
        (["--optimizer.beta2=1.5"], ["optimizer.beta2=1.5", "[0, 1)"]),
        (["--training.steps"], ["--training.steps needs a value"]),
        (
            ["--data.path", "shards/part-0.jsonl", "shards/part-1.jsonl"],  # `--data.path shards/*.jsonl`, expanded
            [
                "data.path=['shards/part-0.jsonl', 'shards/part-1.jsonl']",
                "quote a pattern",
                "--data.path='dir/*.jsonl'",
            ],
        ),
        (["stray"], ["unexpected argument 'stray'"]),
        (["--job.config_file=/nonexistent.toml"], ["/nonexistent.toml", "does not exist"]),
        (
            ["--profiling.enable=true", "--training.steps=5", "--profiling.start_step=6"],
            ["profiling.start_step=6", "training.steps=5", "nothing would be profiled", "start_step <= 5"],
        ),
        (
            ["--profiling.memory_snapshot=true", "--profiling.steps=3", "--profiling.freq=3"],
            ["profiling.freq=3 <= profiling.steps=3", "profiling.freq > 3"],
        ),
    ],
)
def test_cli_errors_name_key_value_and_choices(argv: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    "toml, expected",
    [
        ("[trainin]\nsteps = 3\n", ["cfg.toml", "trainin.steps", "sections"]),
        ("[training]\nlr = 0.1\n", ["cfg.toml", "training.lr", "valid keys in [training]"]),
        ('[training]\nsteps = "ten"\n', ["cfg.toml", "training.steps='ten'", "an integer"]),
        ("[training]\nsteps = 1.5\n", ["training.steps=1.5", "an integer"]),
        ("[training]\nsteps = true\n", ["training.steps=True", "an integer"]),
        ('[loss]\nnegatives = "some"\n', ["loss.negatives='some'", "microbatch, global"]),
        ("[training]\nsteps = -2\n", ["training.steps=-2", "out of range"]),
        ("steps = 3\n", ["top-level key 'steps' must be a [section]"]),
        ("[training\n", ["not valid TOML"]),
    ],
)
def test_toml_errors(tmp_path: Path, toml: str, expected: list[str]) -> None:
    f = write(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        parse_args(["--job.config_file", f])
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


def test_help_lists_every_option_and_exits_zero(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_contrastive.train import main

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    cfg = JobConfig()
    for section in vars(cfg):
        for key in vars(getattr(cfg, section)):
            assert f"--{section}.{key}" in out, f"--{section}.{key} missing from --help"
    assert "Samples per process per forward/backward" in out  # field docs are shown


def test_bad_input_exits_nonzero_with_one_line_before_compute(tmp_path: Path) -> None:
    """The process itself: exit code 2, one stderr line, nothing written."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_contrastive.train",
            "--training.stepz=1",
            f"--job.dump_folder={tmp_path / 'dump'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.stepz" in lines[0], out.stderr
    assert not (tmp_path / "dump").exists()  # nothing was written


@pytest.mark.parametrize(
    "arg, expected",
    [
        (
            "--model.name=resnet",
            "model.name='resnet' is not a registered model family; valid: bi_encoder, clip, hf_clip, lit, qwen_vl, "
            "static, vae, vlm",
        ),
        (
            "--model.flavor=huge",
            "model.flavor='huge' is not a flavor of 'clip'; valid: debug, vit_b32, vit_b16, vit_l14",
        ),
        ("--data.path=/no/such/folder", "/no/such/folder"),
        ("--loss.joint_directions=doc_to_doc", "loss.joint_directions=['doc_to_doc'] join each query's one softmax"),
    ],
)
def test_bad_values_give_code_2_and_one_line_before_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture, arg: str, expected: str
) -> None:
    """The trainer's own entry point in this process (the launch is tested above): each bad value
    found while building the trainer, before anything is written."""
    from titan_contrastive.train import main

    assert main([arg, f"--job.dump_folder={tmp_path / 'dump'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "dump").exists()  # nothing was written


def test_gradient_accumulation_steps() -> None:
    assert gradient_accumulation_steps(-1, 8, 2) == 1
    assert gradient_accumulation_steps(64, 2, 8) == 4
    assert gradient_accumulation_steps(16, 16, 1) == 1
    with pytest.raises(ConfigError) as info:
        gradient_accumulation_steps(100, 8, 2)
    message = str(info.value)
    for part in ["global_batch_size=100", "(8)", "(2)", "= 16", "96 or 112"]:
        assert part in message
    with pytest.raises(ConfigError, match="nearest valid global batch sizes: 16"):
        gradient_accumulation_steps(8, 8, 2)


def test_strict_parsing(tmp_path: Path) -> None:
    """What used to be taken leniently is a one-line error: a list for a number in TOML, non-ASCII
    digits, inf/nan, job.config_file inside a TOML, a folder or non-UTF-8 as config."""
    cases = {
        "list.toml": (
            "[training]\nsteps = [5]\n",
            "training.steps=[5] is invalid: expected one value of type int, not a list",
        ),
        "inf.toml": ("[optimizer]\nlr = inf\n", "optimizer.lr=inf is invalid: expected a finite number"),
        "nested.toml": ('[job]\nconfig_file = "other.toml"\n', "job.config_file inside a TOML is not read"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as err:
            parse_args([f"--job.config_file={tmp_path / name}"])
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    (tmp_path / "latin1.toml").write_bytes('[job]\ndescription = "caf\xe9"\n'.encode("latin-1"))
    for path, message in ((tmp_path, "is a folder"), (tmp_path / "latin1.toml", "is not UTF-8")):
        with pytest.raises(ConfigError, match=message):
            parse_args([f"--job.config_file={path}"])
    for argv, message in (
        (["--training.steps=５"], "expected an integer in ASCII digits"),
        (["--optimizer.lr=nan"], "expected a finite number"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_args(argv)
    assert parse_args(["--training.steps", "7"]).training.steps == 7  # the CLI's own list form still works


def test_repeated_flag_warns_and_the_last_wins(capsys: pytest.CaptureFixture) -> None:
    assert parse_args(["--training.steps=5", "--training.steps=6"]).training.steps == 6
    err = capsys.readouterr().err
    assert "warning: command line: --training.steps is given more than once (5, then 6); the last one is used" in err


def test_the_evaluation_sets_table_names_every_set(capsys: pytest.CaptureFixture) -> None:
    """`config.evaluation.EVAL_SETS`, which the checks naming every set read: each `[eval] *_path` but the zero-shot
    folder is in it, and each of its options is `evaluate`'s."""
    from titan_contrastive.config.evaluation import EVAL_SETS, Eval
    from titan_contrastive.evaluate import main

    paths = {field.name for field in dataclasses.fields(Eval) if field.name.endswith("_path")}
    assert paths - {f"{s.name}_path" for s in EVAL_SETS} == {"zero_shot_path"}
    assert {f"{s.name}_path" for s in EVAL_SETS} <= paths
    with pytest.raises(SystemExit):
        main(["--help"])
    options = capsys.readouterr().out
    assert all(f"{s.flag} " in options for s in EVAL_SETS), options
