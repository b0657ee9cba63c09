"""Bit sweeps: a study entry with listed option values expands to one scheme per value; the report finds
each cell's bit budget (fewest activation bits under a 1% perplexity increase) and plots the sweep."""

import pytest

from quantgate.provenance import machine
from quantgate.quant.schemes import act_bits
from quantgate.stats import Delta
from quantgate.study import CellRecord, StudyError, StudyRecord, load_study
from quantgate.study.measures import bit_sweeps, budget
from quantgate.study.records import WallSeconds
from quantgate.study.report import Report, bit_budget
from quantgate.study.report_plots import plot_bit_sweeps

STUDY = """name: sweep
models:
  - name: t
    preset: tiny-llama
    train: {{steps: 2, batch_size: 2, seq_len: 32}}
schemes:
  - {entry}
  - w8a8-int8-dynamic
eval: {{tasks: [quantgate_ppl], limit: 2}}
"""


def _study(tmp_path, entry):
    f = tmp_path / "s.yaml"
    f.write_text(STUDY.format(entry=entry))
    return load_study(f)


def test_listed_option_values_expand_to_one_scheme_each(tmp_path):
    study = _study(tmp_path, "{scheme: w8a8-int8-bondarenko, a_bits: [8, 6, 4], estimator: percentile}")
    assert [s.scheme for s in study.models[0].schemes] == [
        "w8a8-int8-bondarenko:estimator=percentile",
        "w8a8-int8-bondarenko:estimator=percentile,a_bits=6",
        "w8a8-int8-bondarenko:estimator=percentile,a_bits=4",
        "w8a8-int8-dynamic",
    ]


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ("{scheme: w8a8-int8-bondarenko, a_bits: [8, 1]}", "a_bits must be in [2, 8], got 1"),
        ("{scheme: w8a8-fp8-e4m3, a_bits: [6]}", "a_bits"),
        ("{scheme: w8a8-int8-bondarenko, bits: [6]}", "unknown key 'bits'"),
    ],
)
def test_bad_sweeps_name_the_line_and_option(tmp_path, entry, fragment):
    with pytest.raises(StudyError, match=r"s\.yaml:7: .*") as e:
        _study(tmp_path, entry)
    assert fragment in str(e.value)


def test_sweeps_group_schemes_that_differ_only_in_activation_bits():
    schemes = [
        "w8a8-int8-bondarenko",
        "w8a8-int8-bondarenko:a_bits=5",
        "w8a8-int8-static:a_bits=4",
        "w8a8-int8-static",
        "w8a8-fp8-e4m3",
        "w8a8-int8-dynamic",
    ]
    assert act_bits("w8a8-int8-bondarenko:a_bits=5") == ("w8a8-int8-bondarenko", 5)
    assert bit_sweeps(schemes) == {
        "w8a8-int8-bondarenko": [(8, "w8a8-int8-bondarenko"), (5, "w8a8-int8-bondarenko:a_bits=5")],
        "w8a8-int8-static": [(8, "w8a8-int8-static"), (4, "w8a8-int8-static:a_bits=4")],
    }


def _d(value, low=None, high=None):
    return Delta(value, low, high, "perplexity", 10, "test")


def test_budget_is_the_fewest_bits_under_one_percent_at_every_wider_width():
    assert budget([(8, _d(0.003)), (6, _d(0.009)), (5, _d(0.04)), (4, _d(0.002))]) == (6, _d(0.009))
    assert budget([(8, _d(0.02)), (6, _d(0.001))]) is None
    assert budget([(8, _d(0.0)), (6, None)]) == (8, _d(0.0))


def test_report_section_and_plot(tmp_path):
    cells = [CellRecord(id="t/vanilla", model="t", variant="vanilla"), CellRecord(id="t/g1", model="t", variant="g1")]
    schemes = ["w8a8-int8-bondarenko", "w8a8-int8-bondarenko:a_bits=6"]
    changes = {
        ("t/vanilla", schemes[0]): _d(0.003, 0.001, 0.005),
        ("t/vanilla", schemes[1]): _d(0.09, 0.07, 0.11),
        ("t/g1", schemes[0]): _d(0.002, -0.001, 0.004),
        ("t/g1", schemes[1]): _d(0.008, 0.004, 0.013),
    }
    text = bit_budget(Report(StudyRecord({}, cells, schemes, machine(), WallSeconds(0, 0)), changes))
    assert "| t | vanilla | 0 | A8: +0.30% [+0.10, +0.50] | +0.30% [+0.10, +0.50] | +9.0% [+7.0, +11.0] |" in text
    assert "| t | g1 | 0 | A6: +0.8% [+0.4, +1.3] | +0.20% [-0.10, +0.40] ~ | +0.8% [+0.4, +1.3] |" in text
    sweeps = {
        "w8a8-int8-bondarenko": [
            (8, {c: changes[c, schemes[0]] for c in ("t/vanilla", "t/g1")}),
            (6, {c: changes[c, schemes[1]] for c in ("t/vanilla", "t/g1")}),
        ]
    }
    path = plot_bit_sweeps(sweeps, ["t/vanilla", "t/g1"], 0.01, tmp_path / "bits.png")
    assert path.stat().st_size > 10_000
