"""quantgate.registry.Registry: the one table kind behind every name quantgate looks up (issue 45)."""

import subprocess
import sys

import pytest

import quantgate as qg
from quantgate.errors import InputError
from quantgate.registry import Registry


def test_lookup_refuses_an_unknown_name_listing_the_known_ones():
    table = Registry("colour", {"red": 1, "green": 2}, listing="known")
    assert table.lookup("green") == 2 and table["red"] == 1 and list(table) == ["red", "green"] and len(table) == 2
    with pytest.raises(InputError, match=r"^unknown colour 'blue'; known: red, green$"):
        table.lookup("blue")
    with pytest.raises(KeyError):  # a Mapping: [] and get() keep their meaning
        table["blue"]
    assert table.get("blue") is None and "blue" not in table


def test_a_name_given_twice_is_refused_and_the_first_entry_kept():
    table = Registry("colour", {"red": 1})
    with pytest.raises(InputError, match=r"colour 'red' is registered twice"):
        table.add("red", 2)
    assert table["red"] == 1


def test_entries_go_at_the_end_or_beside_a_named_one():
    table = Registry("section", {"a": 1, "c": 3})
    table.add("d", 4)
    table.add("b", 2, after="a")
    table.add("start", 0, before="a")
    assert list(table.items()) == [("start", 0), ("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    with pytest.raises(InputError, match=r"unknown section 'z'"):
        table.add("e", 5, before="z")
    with pytest.raises(InputError, match=r"section 'e': give before= or after=, not both"):
        table.add("e", 5, before="a", after="b")


def test_a_registry_of_named_entries_keys_each_by_its_name():
    from types import SimpleNamespace

    rows = [SimpleNamespace(name="b"), SimpleNamespace(name="a")]
    table = Registry.named("row", rows, listing="rows")
    assert list(table) == ["b", "a"] and table["a"] is rows[1]
    with pytest.raises(InputError, match=r"row 'b' is registered twice"):
        Registry.named("row", [*rows, SimpleNamespace(name="b")])
    with pytest.raises(InputError, match=r"^unknown row 'c'; rows: b, a$"):
        table.lookup("c")


def test_keys_that_are_classes_are_named_in_errors():
    class Odd:
        pass

    table: Registry[type, int] = Registry("handler", {int: 1})
    with pytest.raises(InputError, match=r"^unknown handler 'Odd'; valid: int$"):
        table.lookup(Odd)


def test_a_snapshot_puts_the_table_back():
    table = Registry("colour", {"red": 1})
    with table.snapshot():
        table.add("blue", 2)
        assert list(table) == ["red", "blue"]
    assert list(table) == ["red"]
    with pytest.raises(RuntimeError), table.snapshot():  # also when the block fails
        table.add("blue", 2)
        raise RuntimeError
    assert list(table) == ["red"]


FILLED_WITHOUT_THE_PACKAGE = """
import sys
from quantgate.variants import GATE_KINDS, AttentionVariant
from quantgate.quant.schemes import HANDLERS, SCHEMES, handler_for
assert "quantgate.audit" not in sys.modules and "quantgate.study" not in sys.modules  # not through qg.*
assert str(AttentionVariant.parse("g1-headwise+sink")) == "g1-headwise+sink" and "hyga" in GATE_KINDS
for name in ("w8a8-int8-static", "torchao-int8-dynamic", "llm-int8"):
    handler_for(SCHEMES[name])
print("ok", len(HANDLERS))
"""


def test_a_table_a_higher_layer_fills_is_full_when_its_reader_is_imported_alone():
    """No table waits for the package's ``__init__`` to import its filling modules: the gate kinds live beside the
    gate classes (which the variant grammar imports) and the quant package imports the handler modules."""
    run = subprocess.run(
        [sys.executable, "-c", FILLED_WITHOUT_THE_PACKAGE], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok ")


@pytest.mark.parametrize(
    ("table", "lookup", "words"),
    [
        (qg.quant.SCHEMES, qg.quant.get_scheme, "unknown quantization scheme 'nope'; valid: w8a8-int8-static, "),
        (qg.models.FAMILIES, qg.models.get_family, "unknown model family 'nope'; supported: bert, opt, "),
        (qg.models.PRESETS, qg.models.presets.get_preset, "unknown preset 'nope'; valid: tiny-bert, "),
    ],
)
def test_every_named_table_is_a_registry_and_refuses_in_its_words(table, lookup, words):
    assert isinstance(table, Registry)
    with pytest.raises(InputError) as e:
        lookup("nope")
    assert str(e.value).startswith(words)


def test_the_package_tables_are_registries():
    from quantgate.models.sources import PACKAGED
    from quantgate.quant.schemes import HANDLERS, OPTIONS
    from quantgate.study.report import SECTIONS
    from quantgate.variants import GATE_KINDS

    for table in (GATE_KINDS, HANDLERS, OPTIONS, PACKAGED, SECTIONS):
        assert isinstance(table, Registry) and len(table) > 0, table
    assert list(SECTIONS)[:2] == ["header", "criterion"]  # by the functions' names, in the page's order


def test_an_interval_range_is_data_and_an_option_says_what_it_wants():
    import pickle

    from quantgate.options import AT_LEAST_1, Option, Range

    momentum = Range.between(0.0, 1.0, hi_open=True)
    assert momentum == Range.between(0.0, 1.0, hi_open=True) and Range.between(1) == AT_LEAST_1
    assert pickle.loads(pickle.dumps(momentum)) == momentum and str(momentum) == "in [0, 1)"
    assert [x in momentum for x in (0.0, 0.5, 1.0, -0.1, float("nan"), "0.5")] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    heat = Option(str, ("cold", "warm"), "cold")
    assert heat.wants == "one of cold, warm" and heat.accepts("warm") and not heat.accepts("hot")
    with pytest.raises(InputError, match=r"^gate: heat must be one of cold, warm, got 'hot'$"):
        heat.check("gate", "heat", "hot")
    with pytest.raises(InputError, match=r"^s: momentum must be a finite number, got nan$"):
        Option(float, momentum).check("s", "momentum", float("nan"))
