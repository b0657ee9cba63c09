"""Caches keyed by content, not by names, and files read through one layer that names them.

Content keys: a study's steps are keyed by the sha256 of a ``load:`` checkpoint's files and of local data
files (hashed once, remembered by size, times and inode); the token cache by the data files' content;
``compare`` pairs runs by the model's sha256, never by a shared label. Corrupt files: a cached step that
cannot be read back is computed again with a warning, and a corrupt input (metrics.json, eval.json,
lm-eval's results and samples) is a one-line error naming the file.
"""

import importlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import quantgate as qg
import quantgate.files as files
from quantgate.cli import main
from quantgate.data.batches import token_stream
from quantgate.data.tokenizers import bundled_tokenizer
from quantgate.study import run_study

STUDY = """name: keyed
models:
  - name: m
    load: {ckpt}
schemes: [w8-int8]
calibration: {{batches: 1, seq_len: 32, batch_size: 2}}
observe: {{batches: 1, seq_len: 32, batch_size: 2, data: "hf:{data}:train"}}
eval: {{tasks: [quantgate_ppl], limit: 1}}
"""


def _write_data(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"{text} {i}. " * 8} for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path / "cache"


@pytest.fixture
def study(tmp_path, cache):
    """A one-cell study loading a saved checkpoint and observing a local data folder, run once."""
    ckpt, data = tmp_path / "ckpt", tmp_path / "data"
    qg.save(qg.build("tiny-llama", seed=0), ckpt)
    _write_data(data, "The cat sat on the mat")
    f = tmp_path / "keyed.yaml"
    f.write_text(STUDY.format(ckpt=ckpt, data=data))
    run = run_study(f, tmp_path / "run")
    return f, run, ckpt, data


def _steps(run: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in sorted(run.glob("cells/*/*.json"))}


def _ppl(run: Path) -> float:
    return json.loads((run / "metrics.json").read_text())["cells"][0]["float"]["quantgate_ppl"]["word_perplexity"]


# --- content keys ---------------------------------------------------------------------------------


def test_replacing_a_load_checkpoint_reruns_its_steps(study, tmp_path, monkeypatch):
    f, run, ckpt, _ = study
    before, ppl0 = _steps(run), _ppl(run)
    hashed = []
    real = getattr(files, "file_sha256", None)

    def recording(p):
        hashed.append(p)
        assert real is not None
        return real(p)

    monkeypatch.setattr(files, "file_sha256", recording, raising=False)
    run_study(f, run)  # nothing changed: every step reused, no weights read again to key them
    assert _steps(run) == before and hashed == []
    shutil.rmtree(ckpt)
    qg.save(qg.build("tiny-llama", seed=1), ckpt)  # another model behind the same path
    run_study(f, run)
    after = _steps(run)
    assert all(after[name] != before[name] for name in before)  # every step depends on the model
    fresh = run_study(f, tmp_path / "fresh")
    assert _ppl(run) == _ppl(fresh) != ppl0


def test_a_hub_repository_pushed_to_since_reruns_its_steps(study, tmp_path, monkeypatch):
    """A hub id is keyed by its snapshot's content (the snapshot a fetch gives now), not by the id."""
    f, _, ckpt, _ = study
    sources = importlib.import_module("quantgate.models.sources")
    monkeypatch.setattr(sources, "_hub_snapshot", lambda repo_id: ckpt)  # the hub, as a folder
    hub = tmp_path / "hub.yaml"
    hub.write_text(f.read_text().replace(f"load: {ckpt}", "load: someone/tiny"))
    run = run_study(hub, tmp_path / "hub-run")
    before = _steps(run)
    shutil.rmtree(ckpt)
    qg.save(qg.build("tiny-llama", seed=1), ckpt)  # a new commit: other weights under the same id
    run_study(hub, run)
    after = _steps(run)
    assert all(after[name] != before[name] for name in before)


def test_rewriting_a_local_data_file_reruns_what_reads_it(study):
    f, run, _, data = study
    before = _steps(run)
    _write_data(data, "A completely different sentence about dogs")
    run_study(f, run)
    after = _steps(run)
    changed = {name for name in before if after[name] != before[name]}
    assert changed == {"observe.json", "scheme-w8-int8.json"}  # observe and the SQNR read it; eval does not


@pytest.mark.parametrize("same_mtime", [False, True], ids=["rewritten", "rewritten-keeping-its-time"])
def test_token_cache_follows_a_rewritten_hf_data_file(tmp_path, cache, same_mtime):
    """datasets' own cache is keyed by path and modification time: a file rewritten with its old time was read
    as the old text, and those tokens cached under the new content's key."""
    tok = bundled_tokenizer("bpe-8192")
    data = tmp_path / "data"
    _write_data(data, "hello world")
    stamp = (data / "train.jsonl").stat().st_mtime_ns
    first = token_stream(tok, f"hf:{data}:train", 0).copy()
    _write_data(data, "completely different words")
    if same_mtime:
        os.utime(data / "train.jsonl", ns=(stamp, stamp))
    second = token_stream(tok, f"hf:{data}:train", 0)
    texts = [json.loads(line)["text"].strip() for line in (data / "train.jsonl").read_text().splitlines()]
    expected = [t for ids in tok(texts, add_special_tokens=False)["input_ids"] for t in (*ids, 0)]
    assert not np.array_equal(first, second) and second.tolist() == expected


def test_corrupt_token_cache_is_tokenized_again(tmp_path, cache, caplog, monkeypatch):
    tok = bundled_tokenizer("bpe-8192")
    data = tmp_path / "data"
    _write_data(data, "hello world")
    good = token_stream(tok, f"hf:{data}:train", 0).copy()
    [npy] = (cache / "tokens").glob("*.npy")
    npy.write_bytes(npy.read_bytes()[:100])  # truncated
    fresh = importlib.import_module("quantgate.data.batches")
    monkeypatch.setattr(fresh, "_STREAMS", {})  # as in a new process: read from the disk cache
    with caplog.at_level(logging.WARNING, logger="quantgate"):
        again = token_stream(tok, f"hf:{data}:train", 0)
    assert np.array_equal(good, again) and f"token cache {npy} is corrupt" in caplog.text


def test_content_sha256_reads_a_file_again_only_when_it_changes(tmp_path, monkeypatch):
    folder, memo = tmp_path / "m", tmp_path / "memo.json"
    folder.mkdir()
    (folder / "a.safetensors").write_bytes(b"x" * 100)
    (folder / ".lock").write_text("ignored")
    hashed = []
    real = files.file_sha256

    def recording(p):
        hashed.append(p.name)
        return real(p)

    monkeypatch.setattr(files, "file_sha256", recording)
    first = files.content_sha256(folder, memo=memo)
    assert files.content_sha256(folder, memo=memo) == first and hashed == ["a.safetensors"]
    (folder / "a.safetensors").write_bytes(b"y" * 100)  # same size, rewritten in place
    assert files.content_sha256(folder, memo=memo) != first and hashed == ["a.safetensors"] * 2
    memo.write_text("{truncated")  # a corrupt memo: hashed again, not an error
    assert files.content_sha256(folder, memo=memo) != first


def test_compare_never_pairs_two_models_that_share_a_label(tmp_path, monkeypatch):
    # `quantgate eval model` run in two folders: both runs are labelled "model", the models differ
    for name, seed in (("a", 0), ("b", 1)):
        qg.save(qg.build("tiny-llama", seed=seed), tmp_path / name / "model")
    monkeypatch.chdir(tmp_path / "a")
    assert main(["eval", "model", "--limit", "2", "--out", str(tmp_path / "ev_a")]) == 0
    monkeypatch.chdir(tmp_path / "b")
    assert main(["eval", "model", "--scheme", "w8-int8", "--limit", "2", "--out", str(tmp_path / "ev_b")]) == 0
    a, b = (json.loads((tmp_path / d / "eval.json").read_text())["settings"] for d in ("ev_a", "ev_b"))
    assert a["model"] == b["model"] == "model"
    table = qg.study.compare.compare([tmp_path / "ev_a", tmp_path / "ev_b"])
    [row] = [line for line in table.splitlines() if "| w8-int8 |" in line]
    assert "none: no float run has sha256" in row and row.endswith("| - |")  # no change reported
    # the same quantization of a's own model pairs with it, by hash
    monkeypatch.chdir(tmp_path / "a")
    assert main(["eval", "model", "--scheme", "w8-int8", "--limit", "2", "--out", str(tmp_path / "ev_a_q")]) == 0
    table = qg.study.compare.compare([tmp_path / "ev_a", tmp_path / "ev_a_q"])
    [row] = [line for line in table.splitlines() if "| w8-int8 |" in line]
    assert f"(source sha256 {a['model_sha256'][:12]})" in row


# --- corrupt cache entries ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    ['{"key": "abc", "results": {', "[1]", "null", "{}", '{"key": "KEY"}', ""],
    ids=["truncated", "array", "null", "empty", "fields-missing", "zero-bytes"],
)
def test_corrupt_cached_step_is_computed_again_with_a_warning(study, content, caplog):
    f, run, _, _ = study
    step = next(run.glob("cells/*/eval-float.json"))
    good = json.loads(step.read_text())
    step.write_text(content.replace("KEY", good["key"]))
    with caplog.at_level(logging.WARNING, logger="quantgate"):
        run_study(f, run)
    assert f"{step}" in caplog.text and "computing that step again" in caplog.text
    again = json.loads(step.read_text())
    assert again["key"] == good["key"] and again["results"] == good["results"]


# --- corrupt inputs: one line naming the file -----------------------------------------------------

LM_EVAL = {"results": {"t": {"acc,none": 1.0}}, "configs": {}}
CORRUPT = {
    # (command, files to write under the run folder {name: content}, the file the error names)
    "report-truncated": ("report", {"metrics.json": '{"study": {"name": "x"}, "cel'}, "metrics.json"),
    "report-empty-object": ("report", {"metrics.json": "{}"}, "metrics.json"),
    "report-null": ("report", {"metrics.json": "null"}, "metrics.json"),
    "report-cells-not-objects": (
        "report",
        {
            "metrics.json": json.dumps(
                {"study": {"name": "x"}, "cells": [1], "schemes": [], "machine": {}, "wall_seconds": {}}
            )
        },
        "metrics.json",
    ),
    "report-unknown-cell-field": (
        "report",
        {
            "metrics.json": json.dumps(
                {
                    "study": {"name": "x"},
                    "cells": [{"id": "a/b", "model": "a", "variant": "b", "colour": 1}],
                    "schemes": [],
                    "machine": {},
                    "wall_seconds": {},
                }
            )
        },
        "metrics.json",
    ),
    "compare-study-truncated": ("compare", {"metrics.json": '{"study": {'}, "metrics.json"),
    "compare-study-empty": ("compare", {"metrics.json": "{}"}, "metrics.json"),
    "compare-eval-truncated": ("compare", {"eval.json": '{"settings": {"model": "x"}, "res'}, "eval.json"),
    "compare-eval-array": ("compare", {"eval.json": "[1]"}, "eval.json"),
    "compare-eval-settings-string": (
        "compare",
        {"eval.json": json.dumps({"settings": "x", "results": {}})},
        "eval.json",
    ),
    "compare-eval-results-array": ("compare", {"eval.json": json.dumps({"settings": {}, "results": [1]})}, "eval.json"),
    "compare-eval-task-array": (
        "compare",
        {"eval.json": json.dumps({"settings": {}, "results": {"t": [1]}})},
        "eval.json",
    ),
    "compare-eval-documents-array": (
        "compare",
        {"eval.json": json.dumps({"settings": {}, "results": {"t": {"acc": 1}}, "documents": [1]})},
        "eval.json",
    ),
    "compare-lm-eval-truncated": ("compare", {"results_2024.json": json.dumps(LM_EVAL)[:-9]}, "results_2024.json"),
    "compare-lm-eval-task-array": (
        "compare",
        {"results_2024.json": json.dumps({"results": {"t": [1]}, "configs": {}})},
        "results_2024.json",
    ),
    "compare-lm-eval-config-string": (
        "compare",
        {"results_2024.json": json.dumps({**LM_EVAL, "config": "x"})},
        "results_2024.json",
    ),
    "compare-lm-eval-samples-truncated": (
        "compare",
        {"results_2024.json": json.dumps(LM_EVAL), "samples_t_2024.jsonl": '{"doc_id": 0, "fil'},
        "samples_t_2024.jsonl",
    ),
}


@pytest.mark.parametrize("case", CORRUPT, ids=list(CORRUPT))
def test_corrupt_input_is_one_line_naming_the_file(case, tmp_path, capsys):
    command, written, named = CORRUPT[case]
    run = tmp_path / "run"
    run.mkdir()
    for name, content in written.items():
        (run / name).write_text(content)
    assert main([command, str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"quantgate {command}: error: ") and "\n" not in err
    assert str(run / named) in err


def test_read_json_bounds_size_and_checks_the_top_level_type(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"a": ' + "1" * 100 + "}")
    with pytest.raises(ValueError, match=rf"cannot read {f}: it holds more than 50 bytes"):
        files.read_json(f, limit=50)
    f.write_text("[1, 2]")
    assert files.read_json(f, list) == [1, 2]
    with pytest.raises(ValueError, match=rf"cannot read {f}: it holds a JSON array, not an object; fix it"):
        files.read_json(f, fix="fix it")
    f.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="it is not UTF-8 text"):
        files.read_json(f)
    f.write_text("[" * 100_000)
    with pytest.raises(ValueError, match=r"not valid JSON|nested too deeply"):
        files.read_json(f)
    with pytest.raises(ValueError, match=rf"cannot read {tmp_path / 'missing.json'}: No such file"):
        files.read_json(tmp_path / "missing.json")


def test_a_json_number_past_pythons_digit_limit_is_refused_naming_the_file(tmp_path):
    """json raises a plain ValueError (int()'s limit of 4300 digits), not a JSONDecodeError, for such a number: it is
    the file's fault all the same, refused in one line that names it."""
    f = tmp_path / "x.json"
    f.write_text('{"a": ' + "1" * 5000 + "}")
    with pytest.raises(qg.InputError, match=rf"cannot read {f}: Exceeds the limit \(4300 digits\)"):
        files.read_json(f)
    f.write_text('{"a": 1}\n[' + "1" * 5000 + "]\n")
    with pytest.raises(qg.InputError, match=rf"cannot read {f}: line 2 is not valid JSON"):
        files.read_json_lines(f)


def test_a_bug_parsing_a_text_source_is_raised_not_taken_for_no_source(monkeypatch):
    """A text source that is none has no content key (corpus() refuses it, saying why); a plain ValueError from the
    code parsing it is a bug and propagates."""
    batches = importlib.import_module("quantgate.data.batches")
    assert batches.source_sha256("hf:no-split") is None

    def bug(source):
        raise ValueError("a bug in the parser")

    monkeypatch.setattr(batches, "hf_spec", bug)
    with pytest.raises(ValueError, match="a bug in the parser"):
        batches.source_sha256("hf:some/data:train")


def test_a_bug_reading_a_marker_or_memo_is_raised_not_taken_for_a_corrupt_file(tmp_path, monkeypatch):
    """An unreadable marker or hash memo is passed over (no owner; hashed again); a plain ValueError from the code
    reading them is a bug and propagates."""
    folder = tmp_path / "run"
    files.mark_output(folder, "eval", "quantgate eval")
    assert files.owner(folder) == ("eval", "quantgate eval")
    (folder / files.MARKER).write_text("{not json")
    assert files.owner(folder) is None
    memo, data = tmp_path / "memo.json", tmp_path / "a.txt"
    data.write_text("a")
    memo.write_text("[1]")
    assert files.content_sha256(data, memo=memo) == files.file_sha256(data)

    def broken(*args, **kwargs):
        raise ValueError("a bug in the reader")

    monkeypatch.setattr(files, "read_json", broken)
    with pytest.raises(ValueError, match="a bug in the reader"):
        files.owner(folder)
    with pytest.raises(ValueError, match="a bug in the reader"):
        files.content_sha256(data, memo=memo)
