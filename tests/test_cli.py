"""The command line: the shared option groups and their parsers, and what every command promises.

Every command has -o/--output and -q/--quiet with one meaning, a --help with at least two
examples, and an unknown flag or command is one error line with a did-you-mean.
"""

from __future__ import annotations

import argparse

import pytest

from onnx_opscope.cli import COMMANDS, build_parser, main
from onnx_opscope.cli.options import (
    add_feed_arguments,
    add_runtime_arguments,
    feed_spec_from_args,
    parse_dim,
    parse_range,
    parse_shape,
    parse_value,
    runtime_config_from_args,
)
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run.feeds import FeedSpec
from onnx_opscope.run.session import RuntimeConfig


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, the rewrite transforms included ('rewrite skip', ...)."""
    out = {}

    def visit(parser: argparse.ArgumentParser, name: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[name] = parser
        for action in subs:
            for child, sub in action.choices.items():
                visit(sub, f"{name} {child}".strip())

    visit(build_parser(), "")
    return out


def test_every_command_is_reachable_and_has_examples():
    commands = _commands()
    assert {c.split()[0] for c in commands} == set(COMMANDS)
    for name, parser in commands.items():
        text = parser.format_help()
        assert "examples:" in text, name
        examples = [
            line for line in text.split("examples:", 1)[1].splitlines() if line.strip().startswith("opscope ")
        ]
        assert len(examples) >= 2, (name, examples)


def test_output_and_quiet_mean_the_same_everywhere():
    for name, parser in _commands().items():
        flags = {s: a for a in parser._actions for s in a.option_strings}
        assert {"-o", "--output", "-q", "--quiet"} <= set(flags), name
        assert flags["-o"] is flags["--output"] and flags["-o"].dest == "output", name
        assert flags["-q"].dest == "quiet" and flags["-q"].nargs == 0, name
        if "--shape" in flags:  # one definition of the shape options
            assert flags["--shape"].metavar == "NAME:D0,D1,..." and flags["--dim"].metavar == "SYMBOL=N", name


def test_unknown_flag_and_command_get_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as e:
        main(["record", "model.onnx", "--shpae", "x:1,3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "did you mean '--shape'?" in err and "Traceback" not in err
    assert err.splitlines()[0].startswith("error: opscope record: unrecognized arguments")
    with pytest.raises(SystemExit) as e:
        main(["recrod", "model.onnx"])
    assert e.value.code == 2 and "did you mean 'record'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rewrite", "skip", "m.onnx", "--blokcs", "1"])
    assert "did you mean '--blocks'?" in capsys.readouterr().err


def test_set_help_lists_every_threshold_with_its_default():
    from onnx_opscope.findings import MineConfig, describe

    for name in ("mine", "report"):
        text = " ".join(_commands()[name].format_help().split())
        for field, default, why in describe():
            assert f"{field} {default} {' '.join(why.split())}" in text, (name, field)
    assert dict((f, d) for f, d, _ in describe())["density_max"] == f"{MineConfig().density_max:g}"


def test_shape_and_dim_parsing():
    """One parser for --shape / --dim everywhere: analyze keeps symbols, feeds need numbers."""
    assert parse_shape("x:1,3,224,224", symbols=True) == ("x", [1, 3, 224, 224])
    assert parse_shape("ids:2,seq", symbols=True) == ("ids", [2, "seq"])
    assert parse_dim("batch=4") == ("batch", 4) and parse_dim("seq = 128") == ("seq", 128)
    for bad in ("x", "x:1,,2", ":1", "x:0,2"):
        with pytest.raises(OpscopeError):
            parse_shape(bad, symbols=True)
    with pytest.raises(OpscopeError, match="not a number") as err:
        parse_shape("ids:2,seq")  # a run needs numbers: the hint names --dim
    assert "--dim seq=N" in err.value.hint
    with pytest.raises(OpscopeError):
        parse_dim("batch")


def test_parse_good_strings():
    assert parse_shape("x:1,3,48,320") == ("x", [1, 3, 48, 320])
    assert parse_shape("input:0:1, 512") == ("input:0", [1, 512])  # split on the last ':'
    assert parse_shape("sr:") == ("sr", [])
    assert parse_dim("batch=4") == ("batch", 4)
    assert parse_range("ids:0,100") == ("ids", (0, 100))
    assert parse_range("t:-5,5") == ("t", (-5, 5))
    assert parse_value("sr:16000") == ("sr", 16000)
    assert parse_value("s:1,2.5") == ("s", [1, 2.5])
    assert parse_value("flag:true") == ("flag", True)
    assert parse_value("t:-1e-3") == ("t", -0.001)


@pytest.mark.parametrize(
    "parse, text, words",
    [
        (parse_shape, "x1,3,48", ["NAME:D0,D1"]),
        (parse_shape, "x:1,a,48", ["'a'", "not a number"]),
        (parse_shape, "x:1,0,48", ["positive"]),
        (parse_shape, ":1,3", ["NAME:D0,D1"]),
        (parse_dim, "batch:4", ["SYMBOL=N"]),
        (parse_dim, "batch=0", ["positive"]),
        (parse_range, "ids:5,1", ["below"]),
        (parse_range, "ids:5", ["NAME:LO,HI"]),
        (parse_range, "ids:0,1.5", ["'1.5'"]),
        (parse_value, "sr:", ["no value"]),
        (parse_value, "sr:abc", ["'abc'", "not a number"]),
    ],
)
def test_parse_bad_strings(parse, text, words):
    with pytest.raises(OpscopeError) as e:
        parse(text)
    assert text in one_line(e) and all(w in one_line(e) for w in words)


def test_argument_group_round_trip():
    parser = argparse.ArgumentParser()
    add_feed_arguments(parser)
    args = parser.parse_args(
        [
            "--dist",
            "outlier",
            "--shape",
            "input:1,512",
            "--shape",
            "state:2,1,128",
            "--value",
            "sr:16000",
            "--dim",
            "batch=4,seq=8",
            "--range",
            "ids:0,9",
            "--seed",
            "5",
            "--batches",
            "3",
        ]
    )
    spec = feed_spec_from_args(args)
    assert spec.dist == "outlier" and spec.seed == 5 and spec.batches == 3 and spec.data is None
    assert spec.shapes == {"input": [1, 512], "state": [2, 1, 128]} and spec.values == {"sr": 16000}
    assert spec.dims == {"batch": 4, "seq": 8} and spec.ranges == {"ids": (0, 9)}
    defaults = feed_spec_from_args(parser.parse_args([]))
    assert defaults == FeedSpec()
    with pytest.raises(OpscopeError):
        feed_spec_from_args(parser.parse_args(["--shape", "x=1,2"]))
    for flag in ("--dist", "--data", "--shape", "--dim", "--range", "--value", "--seed", "--batches"):
        assert flag in parser.format_help()


def test_runtime_arguments():
    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    args = parser.parse_args(
        ["--provider", "cuda,cpu", "--fallback", "--opt-level", "disable", "--threads", "3"]
    )
    config = runtime_config_from_args(args)
    assert config == RuntimeConfig(providers="cuda,cpu", graph_opt="disable", threads=3, fallback=True)
    assert runtime_config_from_args(parser.parse_args([])) == RuntimeConfig()
    for flag in ("--provider", "--fallback", "--opt-level", "--threads"):
        assert flag in parser.format_help()


@pytest.mark.parametrize("command", ["analyze", "weights"])
def test_a_data_suffix_on_output_picks_the_format(command, tmp_path):
    """-o FILE.parquet / .csv / .json without --format writes that format (it used to write the terminal
    table's text into the .parquet file); another suffix gets the table; --format still wins."""
    import json

    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
    from conftest import generated_model_path

    model = str(generated_model_path("mlp"))
    for suffix in ("parquet", "csv", "json", "txt"):
        out = tmp_path / f"{command}.{suffix}"
        assert main([command, model, "-o", str(out), "-q"]) == 0
        if suffix == "parquet":
            assert pq.read_table(out).num_rows > 0
        elif suffix == "csv":
            assert pacsv.read_csv(out).num_rows > 0
        elif suffix == "json":
            assert json.loads(out.read_text())
        else:
            assert not out.read_text().lstrip().startswith(("{", "["))
    forced = tmp_path / "forced.parquet"
    assert main([command, model, "-o", str(forced), "--format", "csv", "-q"]) == 0
    assert pacsv.read_csv(forced).num_rows > 0
