"""How ODCConfig reads the values a user writes: every integer knob through one parser (Python values and ``ODC_*``
strings alike), a misspelt ``ODC_*`` variable named with the one it resembles, and a misspelt ``odc_*`` key of an
FSDP config answered with the closest valid option (not with the typo)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from odc_hf import config as config_module
from odc_hf.config import ODCConfig

ROOT = Path(__file__).resolve().parents[2]
INTEGER_FIELDS = [f.name for f in dataclasses.fields(ODCConfig) if str(f.type).startswith("int")]


def test_the_integer_knobs_are_the_ones_the_parser_covers():
    assert INTEGER_FIELDS == [
        "max_tokens_per_microbatch",
        "attention_shape_bucket",
        "global_batch_size",
        "plan_ahead",
    ]


@pytest.mark.parametrize("name", INTEGER_FIELDS)
def test_every_integer_knob_takes_the_same_counts_from_python_and_the_environment(name):
    for value, expected in ((32768, 32768), ("32k", 32768), ("2048", 2048), (2048.0, 2048), ("1_024", 1024)):
        stored = getattr(ODCConfig(**{name: value}), name)
        assert stored == expected and type(stored) is int, (value, stored)
    assert getattr(ODCConfig.from_env({f"ODC_{name.upper()}": "32k"}), name) == 32768


@pytest.mark.parametrize("name", INTEGER_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "abc", True, False, 2048.5, [2048], "2048.0"])
def test_integer_knobs_refuse_what_is_not_a_count_naming_the_field_and_an_example(name, value):
    # before: int(nan) / int(inf) raised ValueError / OverflowError without the field, "abc" "invalid literal for
    # int()", "32k" was refused although ODC_*=32k was not, "2048" said "got 2048", True and 2048.0 passed
    with pytest.raises(ValueError, match=rf"^{name} must be .*, e\.g\. [0-9].*; got ") as caught:
        ODCConfig(**{name: value})
    assert repr(value) in str(caught.value)


def test_range_errors_keep_their_messages():
    with pytest.raises(
        ValueError, match=r"^max_tokens_per_microbatch must be a positive integer, got 0 \(e\.g\. "
    ):
        ODCConfig(max_tokens_per_microbatch=0)
    with pytest.raises(ValueError, match=r"^attention_shape_bucket must be an integer >= 0, got -1"):
        ODCConfig(attention_shape_bucket=-1)
    with pytest.raises(ValueError, match=r"^ODC_PLAN_AHEAD='2x': expected an integer such as 32768 or 32k"):
        ODCConfig.from_env({"ODC_PLAN_AHEAD": "2x"})
    assert ODCConfig(timeout_s="60").timeout_s == 60.0
    with pytest.raises(ValueError, match=r"^timeout_s must be a number, e\.g\. 600 or 1\.5; got True"):
        ODCConfig(timeout_s=True)
    with pytest.raises(
        ValueError, match=r"^timeout_s must be a finite number of seconds > 0 \(ODC_TIMEOUT_S"
    ):
        ODCConfig(timeout_s="nan")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(config_module, "_WARNED_VARIABLES", set(), raising=False)


def test_a_misspelt_odc_variable_warns_once_naming_the_closest_one(fresh_warnings, caplog):
    environ = {"ODC_BALANSE": "lb_micro", "ODC_MAX_TOKENS": "4k", "ODC_CONFIG_PATH": "/etc/datacube.conf"}
    with caplog.at_level(logging.WARNING, logger="odc_hf"):
        config = ODCConfig.from_env(environ)
        ODCConfig.from_env(environ)  # a second trainer in the process: no second warning
    assert config.balance == "lb_mini"  # the misspelt variable is still not read
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "ODC_BALANSE is not one odc_hf reads, so it has no effect: did you mean ODC_BALANCE?" in lines[0]
    assert (
        "ODC_MAX_TOKENS is not one odc_hf reads" in lines[1] and "ODC_MAX_TOKENS_PER_MICROBATCH?" in lines[1]
    )
    # ODC_CONFIG_PATH resembles no odc_hf variable: another tool's (Open Data Cube's), left alone


def test_valid_odc_variables_and_other_ranks_give_no_warning(fresh_warnings, caplog):
    with caplog.at_level(logging.WARNING, logger="odc_hf"):
        ODCConfig.from_env({"ODC_BALANCE": "lb_micro", "ODC_NO_RELAUNCH": "1", "ODC_EXPANDABLE_SEGMENTS": "0",
                            "ODC_ACCUMULATE_MAX_CTAS": "32"})  # fmt: skip
        ODCConfig.from_env({"ODC_BALANSE": "lb_micro", "LOCAL_RANK": "1"})  # the node's first rank says it
    assert not caplog.records


def test_every_odc_variable_the_library_reads_is_in_the_one_list():
    from odc_hf.config import env_variables

    read = set()
    for path in (ROOT / "odc_hf").rglob("*.py"):
        read |= set(re.findall(r"""["'](ODC_[A-Z0-9_]+)["']""", path.read_text()))
    assert read, "the scan found no variable"
    assert read <= set(env_variables()), f"add {sorted(read - set(env_variables()))} to OTHER_ENV_VARIABLES"


def test_a_misspelt_odc_key_in_an_fsdp_config_suggests_the_closest_valid_option():
    from odc_hf.integrations.accelerate.refusals import check_fsdp_config

    with pytest.raises(ValueError) as caught:
        check_fsdp_config({"odc_balanse": "lb_micro"}, "fsdp_config in the accelerate config 'odc.yaml'")
    message = str(caught.value)
    assert "'odc_balanse' is not an ODC option; the closest is 'odc_balance'" in message, message
    assert "e.g. --odc_balance with ODCSFTConfig" in message and "(ODC_BALANCE=...)" in message, message
    assert "--odc_balanse" not in message and "ODC_BALANSE" not in message, message
    with pytest.raises(ValueError) as caught:  # a valid option in the wrong place: named as it is
        check_fsdp_config({"fsdp_odc_global_batch_size": 64}, "x")
    assert "e.g. --odc_global_batch_size" in str(caught.value) and "not an ODC option" not in str(
        caught.value
    )
    with pytest.raises(ValueError, match=r"'odc_zzz' is not an ODC option\).*--odc_<option>.*ODC_<OPTION>="):
        check_fsdp_config({"odc_zzz": 1}, "x")
