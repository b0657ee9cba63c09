"""The typed records at the edges: the quantization record, the evaluation result, the study's metrics.json; each
writes the JSON the code wrote before it was typed, byte for byte, and reads the files older versions wrote."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

import quantgate as qg
from quantgate.eval.evaluate import Evaluation, LmEvalOutput
from quantgate.models.record import (
    CalibrationRecord,
    MitigationRecord,
    ModelRecord,
    QuantizationRecord,
    RotationRecord,
    record_of,
)
from quantgate.study.records import CellRecord, SchemeRecord, StudyRecord, WorstLayer, read_metrics

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted(
    p.parent for p in (ROOT / "results").rglob("metrics.json") if "cells" in json.loads(p.read_text())
)  # the committed study runs (other experiments write metrics.json files of their own shape)


def _written(record: StudyRecord) -> str:
    """metrics.json as a study run writes it (study/records.py's write_metrics)."""
    return json.dumps(record.to_json(), indent=1, sort_keys=True)


def test_quickstart_metrics_rebuild_byte_for_byte():
    run = ROOT / "results" / "quickstart"
    assert _written(read_metrics(run)) == (run / "metrics.json").read_text()


# (sha256 of the committed metrics.json, of what the hand-written records of eadd333 wrote after reading it), first
# 16 hex digits: an older run's file lacks fields added since, which reading fills in with their defaults
BEFORE_TYPED = {
    "bondarenko_table2": ("4bb75453b7048b44", "a6cbd1216acb76b6"),
    "cpu_recipe": ("9827138136c39cf1", "44922acec05a82c6"),
    "hyga_ablation": ("9ac3e58281695b92", "d7f232aeab4e5fdb"),
    "mitigations": ("ab0a73c4046d00e7", "25d61691c0c0460b"),
    "qiu_table4": ("5b2370696a5383e9", "276b68c76e803449"),
    "quickstart": ("8183d72cd787fbae", "8183d72cd787fbae"),
    "retrofit": ("fb5080add60258d6", "bf38062d8823cf63"),
    "twins_search/bert-d256-mlm/seed0": ("fb5d687e0ed6294e", "b45a424d9795fd93"),
    "twins_search/d128-2L-chain/seed0": ("136dc18000b2fc35", "e884f34bf46d80ab"),
    "twins_search/d128-2L/seed0": ("c93d7d7da5c2e059", "1514f8d11cf98106"),
    "twins_search/d256-4L/seed0": ("12a71b9f8aab7f99", "0a35a89a3e30593e"),
    "twins_search/d64-2L-8M/seed0": ("a6b8705b5ed49966", "d186cfec1568c2b1"),
    "twins_search/d64-2L-8M/seed1": ("41f8628ffe1aae6a", "cfc0266137b0a11f"),
    "twins_search/d64-2L-8M/seed2": ("20ab7319f13d9740", "cfeb22ec1bff7211"),
    "twins_search/d64-2L/seed0": ("6471010a91d72566", "85d462dba1737fe8"),
    "twins_search/d64-2L/seed1": ("1f0e05e2a16a9cb5", "5dfcb63a23070e27"),
    "twins_search/d64-2L/seed2": ("b190b2a247903045", "d280ba1ac7d9433d"),
}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("run", RUNS, ids=[str(r.relative_to(ROOT / "results")) for r in RUNS])
def test_committed_metrics_write_what_the_untyped_records_wrote(run):
    """Each committed run's metrics.json, read and written again, gives the bytes the hand-written records gave
    before they were typed; a run regenerated since (its file no longer the pinned one) gives its own file back."""
    name, text = str(run.relative_to(ROOT / "results")), (run / "metrics.json").read_text()
    was_file, was_written = BEFORE_TYPED.get(name, ("", ""))
    written = _written(read_metrics(run))
    if _sha(text) == was_file:
        assert _sha(written) == was_written
    else:  # written by the current code: it reads back as itself
        assert written == text


@pytest.mark.parametrize("run", RUNS, ids=[str(r.relative_to(ROOT / "results")) for r in RUNS])
def test_committed_metrics_read_typed_and_write_what_they_read(run):
    record = read_metrics(run)
    again = StudyRecord.from_json(json.loads(_written(record)), run)
    assert _written(again) == _written(record)
    for cell in record.cells:
        assert cell.run_dir == run and cell.cluster == record.report.cluster
        for scheme in cell.schemes.values():
            assert all(isinstance(w, WorstLayer) for w in scheme.worst_layers)
            assert scheme.calibration is None or isinstance(scheme.calibration, CalibrationRecord)
            assert scheme.mitigation is None or isinstance(scheme.mitigation, MitigationRecord)


def test_study_records_keep_their_json_names_and_stand_ins():
    cell = CellRecord(id="m/vanilla", model="m", variant="vanilla", float_results={"t": {"acc": 0.5}})
    data = cell.to_json()
    assert data["float"] == {"t": {"acc": 0.5}} and "float_results" not in data  # its name in metrics.json
    assert data["observe"] == {} and data["cost"] is None  # no observe record: {}, as runs wrote it
    assert "run_dir" not in data and "cluster" not in data  # where it was read from: not part of the JSON
    assert CellRecord.from_json(data) == cell
    with pytest.raises(ValueError, match="unknown field"):
        CellRecord.from_json({**data, "run_dir": "x"})
    failed = SchemeRecord.from_json({"key": "abc", "error": "needs a GPU", "seconds": 0.5})  # a step file's key
    assert failed.to_json() == {"error": "needs a GPU", "seconds": 0.5}
    step = SchemeRecord.from_json({"key": "abc", "worst_layers": [{"layer": 2, "sqnr_db": 31.5}], "seconds": 1.0})
    assert step.worst_layers == [WorstLayer(2, 31.5)] and "error" not in step.to_json()


def test_the_quantization_record_writes_its_keys_in_order_and_reads_older_records():
    rotation = {"kind": "hadamard", "online": True, "seed": 0, "d_model": 64, "d_ff": 128, "extra_params": 0,
                "extra_ops_per_token": 1792}  # fmt: skip
    mitigation = {"rotation": rotation, "keep": [], "kept_params": 0}
    data = {
        "scheme": "w8a8-int8-static:rotate=online",
        "calibration": {"batches": 2, "requested": 4, "tokens": 512, "source": "train", "seq_len": 128},
        "source_model": "tiny-llama",
        "source_sha256": "0" * 64,
        "mitigation": mitigation,
    }
    record = QuantizationRecord.from_json(data)
    assert isinstance(record.mitigation, MitigationRecord) and isinstance(record.mitigation.rotation, RotationRecord)
    assert record.mitigation.extra_ops_per_token == 1792 and record.mitigation.extra_params == 0
    assert json.dumps(record.to_json()) == json.dumps(data)  # the same keys in the same order: no dequantized_from
    older = {"scheme": "w8-int8", "calibration": {"batches": 2, "tokens": 512, "source": None, "seq_len": None}}
    assert QuantizationRecord.from_json(older).to_json() == {**older, "source_model": None, "source_sha256": None}
    with pytest.raises(ValueError, match="QuantizationRecord: unknown field"):
        QuantizationRecord.from_json({**data, "schema": "x"})


def test_quantize_stores_the_typed_record_and_quantization_of_reads_it():
    model = qg.build("tiny-llama", seed=0)
    tok = qg.tokenizer(model)
    q = qg.quantize(model, "w8a8-int8-static", calibration=qg.data.batches(tok, "train", 32, 2), calib=2)
    own = record_of(q).quantization
    assert isinstance(own, QuantizationRecord) and own.calibration == CalibrationRecord(2, 2, 128, "train", 32)
    assert qg.quantization_of(q) == own and own.with_origin() == {"origin": "quantgate", **own.to_json()}
    config: Any = q.config
    assert config.quantgate["quantization"] == own.to_json()  # config.json's object: plain JSON
    assert ModelRecord.from_json(config.quantgate) == record_of(q)


def test_the_evaluation_writes_eval_json_as_before():
    settings = {"tasks": ["quantgate_ppl"], "limit": 2, "num_fewshot": None, "n_shot": {"quantgate_ppl": 0},
                "task_versions": {"quantgate_ppl": 2.0}, "fewshot_seed": 1234, "bootstrap_iters": 0,
                "batch_size": 8, "max_length": 128, "model": "tiny-llama", "model_sha256": "0" * 64,
                "family": "llama", "variant": "vanilla", "quantization": None, "quantization_origin": None,
                "source_sha256": None, "quantization_record": None, "dtype": "float32"}  # fmt: skip
    data = {
        "results": {"quantgate_ppl": {"word_perplexity": 12.5}},
        "documents": {"quantgate_ppl": {"ids": [0, 1], "loglikelihood": [-3.0, -4.0], "words": [1, 2]}},
        "lm_eval_output": {"results": "out/results_1.json"},
        "settings": settings,
        "versions": {"quantgate": "0.1.0", "lm_eval": None},
    }
    record = Evaluation.from_json(data)
    assert record.lm_eval_output == LmEvalOutput(results="out/results_1.json") and record.settings.fewshot_seed == 1234
    assert json.dumps(record.to_json(), indent=1) == json.dumps(data, indent=1)
    computed = {k: v for k, v in settings.items() if k not in ("n_shot", "task_versions", "fewshot_seed")}
    alone = {k: v for k, v in {**data, "settings": computed}.items() if k != "lm_eval_output"}  # no lm-eval task ran
    assert json.dumps(Evaluation.from_json(alone).to_json()) == json.dumps(alone)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_report_leaves_metrics_json_as_it_is_and_migrate_writes_what_an_older_run_lacks(tmp_path, capsys):
    """``quantgate report RUN`` rebuilds the report without touching metrics.json, even one of a run made before
    its documents' works and text hashes were kept (read with them recovered: the same report); ``--migrate``
    writes them into the file, here giving back the committed bytes, and a second ``--migrate`` changes nothing."""
    import shutil

    from quantgate.cli import main

    committed = ROOT / "results" / "retrofit"
    run = tmp_path / "retrofit"
    shutil.copytree(committed, run)
    assert main(["report", str(run)]) == 0
    assert _sha256(run / "metrics.json") == _sha256(committed / "metrics.json")
    assert (run / "report.md").read_bytes() == (committed / "report.md").read_bytes()

    data = json.loads((committed / "metrics.json").read_text())
    for cell in data["cells"]:  # as an older run wrote them: no works, no text hashes
        for documents in [cell["float_documents"], *(r["documents"] for r in cell["schemes"].values())]:
            for column in ("works", "hashes"):
                documents["quantgate_ppl"].pop(column)
    older = json.dumps(data, indent=1, sort_keys=True)
    (run / "metrics.json").write_text(older)
    assert main(["report", str(run)]) == 0
    assert (run / "metrics.json").read_text() == older
    assert (run / "report.md").read_bytes() == (committed / "report.md").read_bytes()

    assert main(["report", str(run), "--migrate"]) == 0
    assert _sha256(run / "metrics.json") == _sha256(committed / "metrics.json")
    assert (run / "report.md").read_bytes() == (committed / "report.md").read_bytes()
    assert main(["report", str(run), "--migrate"]) == 0
    assert _sha256(run / "metrics.json") == _sha256(committed / "metrics.json")
    capsys.readouterr()
