"""Byte quantities mean what they print (``gradalg.units``).

One convention both ways, dask's: "GB" is 10⁹ bytes, "GiB" 2³⁰, a bare number bytes.
Before, ``ga.options(memory_budget="7.84GB")`` was read in binary units (8.42·10⁹ bytes)
while plans and refusals printed decimal GB: a number copied from a plan gave 7 % more
than shown. Here: the parse table, typed errors naming the fix, every byte option, and the
round trips from a plan's displayed budget, from a refusal's suggested budget and from a
command-line config.
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.plan.budget import suggest_budget
from gradalg.plan.planner import plan
from gradalg.units import format_bytes, parse_bytes, si

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

PARSED = [
    ("4GB", 4 * 10**9), ("4 GB", 4 * 10**9), ("4gb", 4 * 10**9), (" 4 G ", 4 * 10**9),
    ("7.84GB", 7_840_000_000), ("4.1GB", 4_100_000_000),      # exact: dask's parser gives 4,099,999,999
    ("11.2 GB", 11_200_000_000), ("87 MB", 87_000_000), ("3.4 kB", 3_400), ("64KB", 64_000),
    ("2 TB", 2 * 10**12), ("1 PB", 10**15),
    ("1.5GiB", 1_610_612_736), ("512 MiB", 512 * 2**20), ("8KiB", 8192), ("1 TiB", 2**40), ("2Gi", 2 * 2**30),
    ("512", 512), ("512 B", 512), ("1e9", 10**9), ("1e6 kB", 10**9), ("0.5", 0), ("1.5", 2),
    (4096, 4096), (2.5e9, 2_500_000_000), (np.int64(3_000), 3_000),
]


@pytest.mark.parametrize("text, expected", PARSED)
def test_parse_table(text, expected):
    assert parse_bytes(text) == expected
    if expected > 0:
        with ga.options(memory_budget=text):
            assert ga.get_options().memory_budget == expected


@pytest.mark.parametrize("bad, says", [
    ("lots", "unknown unit 'lots'"), ("4 XB", "unknown unit 'XB'"), ("4GB extra", "unknown unit"),
    ("GB", "no number"), ("", "no number"), ("-1GB", ">= 0"), ("nan", "unknown unit"),
    (float("nan"), ">= 0"), (float("inf"), ">= 0"), (True, "must be"), ([4], "must be"), (-5, ">= 0"),
])
def test_bad_byte_strings_name_the_option_and_the_fix(bad, says):
    before = ga.get_options()
    with pytest.raises(ga.OptionError, match=re.escape(says)) as err:
        ga.options(memory_budget=bad)
    message = str(err.value)
    assert "memory_budget" in message and "'8GB' (decimal" in message and "'8GiB' (binary" in message
    assert isinstance(err.value, ValueError) and ga.get_options() == before
    with pytest.raises(ga.OptionError, match="memory_budget must be positive"):
        ga.options(memory_budget="0GB")


def test_every_byte_option_takes_the_same_strings():
    with ga.options(dense_projection_bytes="1GiB", sjlt_table_bytes="256MB", reuse_buffer_bytes="1 MiB") as o:
        assert (o.dense_projection_bytes, o.sjlt_table_bytes, o.reuse_buffer_bytes) == (2**30, 256 * 10**6, 2**20)
    with pytest.raises(ga.OptionError, match="sjlt_table_bytes='4 XB': unknown unit"):
        ga.options(sjlt_table_bytes="4 XB")


def test_printed_bytes_read_back_as_printed():
    """format_bytes writes three significant digits in decimal units; parse_bytes reads
    exactly that number back, whatever the size (a prefix is chosen after rounding)."""
    rng = np.random.default_rng(0)
    sizes = [1, 999, 1000, 999_499, 999_700_000, 999_999_999_999, 7_843_210_000, 2 * 2**30, 2**40, 3.3e15]
    sizes += list(10 ** rng.uniform(0, 16, 300))
    for n in sizes:
        shown = format_bytes(n)
        assert re.fullmatch(r"\d+(\.\d+)? [kMGTP]?B", shown), shown
        assert parse_bytes(shown) == round(float(f"{n:.3g}")), (n, shown)
        assert abs(parse_bytes(shown) - n) <= 0.005 * n + 0.5
    assert (format_bytes(999_700_000), si(999_700_000)) == ("1 GB", "1 G")     # not "1e+03 MB"
    assert format_bytes(2 * 2**30) == "2.15 GB" and format_bytes(512) == "512 B"


def mlp_scores():
    model = models.mlp()
    task = ga.tasks.classification(model)
    train, query = models.classification_data(20, seed=1), models.classification_data(4, seed=2)
    return ga.grads(task, TensorDataset(*query)) @ ga.grads(task, TensorDataset(*train)).T


def test_a_budget_copied_from_a_plan_is_the_budget_shown():
    S = mlp_scores()
    with ga.options(memory_budget=7_843_210_000):
        text = str(S.explain())
    shown = re.search(r"memory budget ([0-9.]+ [kMGT]?B) \(ga.options\(memory_budget=\.\.\.\)\)", text).group(1)
    assert shown == "7.84 GB"
    with ga.options(memory_budget=shown):      # copied as printed: 7.84·10⁹ bytes, not 7.84·2³⁰
        p = plan(S.expr)
        assert p.options.memory_budget == p.budget.bytes == 7_840_000_000
        assert f"memory budget {shown} (ga.options(memory_budget=...))" in str(S.explain())
    budget = S.explain(memory_budget="3MB").plan.budget
    assert (budget.bytes, budget.setting, budget.describe()) == (3_000_000, "explain",
                                                                  "3 MB (explain(memory_budget=...))")


def test_a_refusals_suggested_budget_is_what_it_says_and_plans():
    S = mlp_scores()
    with ga.options(memory_budget=2_000):
        with pytest.raises(ga.MemoryBudgetError) as err:
            plan(S.expr)
    message, need = str(err.value), err.value.fits_under      # every pass of the plan, at a batch of one
    suggested = re.search(r"would fit under ga.options\(memory_budget='([^']+)'\)", message).group(1)
    shown_need = re.search(r"([0-9.]+ [kMGT]?B) would fit under", message).group(1)
    assert suggested == suggest_budget(need) and parse_bytes(shown_need) == round(float(f"{need:.3g}"))
    assert 1.25 * need <= parse_bytes(suggested) <= 1.25 * need * 1.01     # rounded up to 3 digits, decimal
    assert f"({shown_need}: the plan's largest pass at a batch of one, not only this one; 1.25 × that rounded up: " \
           "a 25% headroom, budget_headroom)" in message                                  # the headroom is said, and how much
    # the suggestion is written in the unit of the need it is made from (not '6296.1GB' beside '5.04 TB')
    assert re.sub(r"[0-9.]", "", suggested) == shown_need.split()[1], (suggested, shown_need)
    with ga.options(memory_budget=suggested):                            # applied as written: it plans
        assert plan(S.expr).options.memory_budget == parse_bytes(suggested)
    with pytest.raises(ga.MemoryBudgetError, match=r"would fit under explain\(memory_budget='[0-9.]+kB'\)"):
        S.explain(memory_budget="2kB")        # a budget given to explain() is changed there (Budget.setting)
    for need, want in ((3.3e5, "413kB"), (7.4e8, "925MB"), (7.99e8, "999MB"), (8.01e8, "1002MB"),
                       (7.45e9, "9.32GB"), (1.7e11, "213GB"), (5.04e12, "6.3TB"), (10, "13B")):
        got = suggest_budget(need)
        assert got == want and 1.25 * need <= parse_bytes(got) <= 1.25 * need * 1.01 + 1, (need, got)


def test_a_config_budget_is_read_in_the_same_units(tmp_path):
    pytest.importorskip("pydantic")
    from gradalg.cli.common import options_for
    from gradalg.cli.config import load_config
    from gradalg.cli.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('[options]\nmemory_budget = "1.5GB"\n')
    cfg = load_config(path)

    class Args:
        quiet = True
    with options_for(cfg, Args()) as o:
        assert o.memory_budget == 1_500_000_000
    assert load_config(path, ["options.memory_budget=512MiB"]).options["memory_budget"] == "512MiB"
    path.write_text('[options]\nmemory_budget = "1.5 XB"\n')
    with pytest.raises(ConfigError, match=r"options.*memory_budget='1.5 XB': unknown unit 'XB'.*'8GB' \(decimal"):
        load_config(path)
