"""quantgate.json_record: typed records written and read as JSON (keys, omitted Nones, nesting, refusals)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from quantgate.json_record import JsonRecord, RecordError, json_field
from quantgate.observe_records import (
    CellObserve,
    LayerSummary,
    MassiveEntry,
    NonFinite,
    ObserveSummary,
    TensorSummary,
    UnitSummary,
)


@dataclass(frozen=True)
class Leaf(JsonRecord):
    value: float
    below: float = json_field(key="below_0.1", default=0.0)
    note: str | None = json_field(omit_none=True)


@dataclass(frozen=True)
class Tree(JsonRecord):
    leaf: Leaf | None
    leaves: list[Leaf] = field(default_factory=list)
    named: dict[str, Leaf] = field(default_factory=dict)
    pairs: list[list] = field(default_factory=list)


def test_keys_omitted_nones_and_nesting_round_trip():
    tree = Tree(Leaf(1.5, 0.25), [Leaf(2.0, note="x")], {"a": Leaf(3.0)}, [[0, 4]])
    data = tree.to_json()
    assert data == {
        "leaf": {"value": 1.5, "below_0.1": 0.25},  # the JSON key, and no "note": None
        "leaves": [{"value": 2.0, "below_0.1": 0.0, "note": "x"}],
        "named": {"a": {"value": 3.0, "below_0.1": 0.0}},
        "pairs": [[0, 4]],
    }
    again = Tree.from_json(json.loads(json.dumps(data)))
    assert again == tree and isinstance(again.named["a"], Leaf) and again.leaves[0].note == "x"
    assert Tree.from_json({"leaf": None}) == Tree(None)  # an optional record stays None


def test_unknown_and_missing_keys_are_refused():
    with pytest.raises(ValueError, match=r"Leaf: unknown field\(s\) \['below'\]"):  # the field name, not its key
        Leaf.from_json({"value": 1.0, "below": 0.5})
    with pytest.raises(RecordError, match=r"^value is missing$"):
        Leaf.from_json({"below_0.1": 0.5})
    with pytest.raises(RecordError, match=r"^leaf\.value is missing$"):  # the path from the record read
        Tree.from_json({"leaf": {"below_0.1": 0.5}})
    with pytest.raises(ValueError, match="Leaf: expected a JSON object, got list"):
        Leaf.from_json([1.0])  # type: ignore[arg-type]  # what a file may hold
    with pytest.raises(RecordError, match=r"^leaf is a JSON array, not an object$"):  # nested: its path
        Tree.from_json({"leaf": [1.0]})


@pytest.mark.parametrize(
    ("data", "wanted"),
    [
        ({"leaf": None, "leaves": None}, "leaves is null, not an array"),
        ({"leaf": None, "named": {"a": None}}, "named.a is null, not a JSON object"),
        ({"leaf": {"value": None}}, "leaf.value is null, not a number"),
        ({"leaf": None, "leaves": [1.0]}, r"leaves\[0\] is a JSON number, not an object"),
    ],
)
def test_null_where_the_annotation_takes_no_none_is_refused_with_its_path(data, wanted):
    """null is read as None only where the field's annotation takes None (``Leaf | None``, ``str | None``): elsewhere
    a RecordError naming the field, as for any other value of the wrong kind (not a None the code after trips on)."""
    with pytest.raises(RecordError, match=f"^{wanted}$"):
        Tree.from_json(data)
    assert Leaf.from_json({"value": 1.0, "note": None}).note is None


def _tensor(max_abs: float, ratio: float | None) -> TensorSummary:
    return TensorSummary(1.0, max_abs, 3.0, 0.5, ratio, 2, 0.5, [[0, 1]])


def test_cell_observe_keeps_the_headline_and_the_three_largest_massive_activations():
    def layer(i: int, peak: float) -> LayerSummary:
        massive = [MassiveEntry(c, 1, peak - c, [[0, 1]], [[5, 1]]) for c in range(2)]
        return LayerSummary(2.0, 3.0, peak, 0.3, None, 2, {"block_out": _tensor(peak, 10.0 * i)}, None, None, massive)

    layers = [layer(0, 100.0), layer(1, 300.0)]
    nonfinite = [NonFinite(1, "ffn_out", 2)]
    summary = ObserveSummary(2.0, 3.0, 300.0, 10.0, 0.3, None, tokens=64, max_at_token0=0.5, nonfinite=nonfinite)
    cell = CellObserve.of(summary, layers)
    data = cell.to_json()
    assert data["summary"]["nonfinite"] == 1 and data["summary"]["max_activation"] == 300.0
    assert data["summary"]["max_at_token0"] == 0.5 and data["summary"]["tokens"] == 64
    assert [(m["layer"], m["channel"], m["max_abs"]) for m in data["summary"]["top_massive"]] == [
        (1, 0, 300.0),
        (1, 1, 299.0),
        (0, 0, 100.0),
    ]
    assert [L["max_median_ratio"] for L in data["layers"]] == [0.0, 10.0]
    assert set(data["layers"][0]) == {
        "max_inf_norm",
        "kurtosis",
        "max_activation",
        "sink_mass",
        "gate_mean",
        "massive_activations",
        "max_median_ratio",
    }
    assert CellObserve.from_json(json.loads(json.dumps(data))) == cell


def test_unit_summary_reads_the_reports_key():
    assert UnitSummary.from_json({"mean": 0.5, "below_0.1": 0.125, "per_head": [0.5], "hist": []}).below_0_1 == 0.125


@dataclass(frozen=True)
class Holder(JsonRecord):
    leaf: Leaf | None = json_field(none_as={})
    renamed: dict[str, float] = json_field(key="float", default_factory=dict)
    where: str | None = json_field(stored=False)


def test_stand_ins_for_none_renamed_defaults_and_unstored_fields():
    empty = Holder()
    assert empty.to_json() == {"leaf": {}, "float": {}}  # None written as its stand-in; `where` not in the JSON
    assert Holder.from_json({"leaf": {}, "float": {"a": 1.0}}) == Holder(renamed={"a": 1.0})  # {} read as None
    assert Holder(where="run").to_json() == empty.to_json() and Holder().renamed is not Holder().renamed
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['where'\]"):
        Holder.from_json({"where": "run"})
