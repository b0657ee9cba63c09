"""Issue 57, items 1, 2, 4 and 6: no write through a link, no user's file taken for quantgate's by its shape, a
refused command leaves nothing behind, a quantized checkpoint's source checked by path and hash, and a gated
checkpoint that plain transformers loads exactly or refuses. Each test is one case of the hostile sweep."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import TINY_STUDY, one_line_error, snapshot_files

import quantgate as qg
from quantgate.cli import main
from quantgate.files import MARKER
from quantgate.models.record import record_of

TRAIN = ["train", "--preset", "tiny-llama", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
AUDIT = ["--docs", "1", "--schemes", "w8a8-int8-static", "--budget", "1h"]


def _copy_run(study_run, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(study_run[1], run, symlinks=True)
    return run


# --- security: writes that follow links ----------------------------------------------------------------------


def test_report_does_not_truncate_a_file_through_a_linked_lock(study_run, tmp_path, capsys):
    run = _copy_run(study_run, tmp_path)
    outside = tmp_path / "precious.txt"
    outside.write_text("the user's data\n")
    (run / ".quantgate.lock").unlink(missing_ok=True)
    (run / ".quantgate.lock").symlink_to(outside)
    assert main(["report", str(run)]) == 2
    err = one_line_error(capsys, "report")
    assert "link" in err and str(outside) in err
    assert outside.read_text() == "the user's data\n"


def test_report_does_not_write_a_plot_through_a_link(study_run, tmp_path, capsys):
    run = _copy_run(study_run, tmp_path)
    outside = tmp_path / "photo.png"
    outside.write_bytes(b"the user's photo")
    (run / "study_quant.png").unlink(missing_ok=True)
    (run / "study_quant.png").symlink_to(outside)
    assert main(["report", str(run)]) == 2
    assert "symlink" in one_line_error(capsys, "report")
    assert outside.read_bytes() == b"the user's photo"


@pytest.mark.parametrize("out", ["res", "sub/res"])
def test_study_out_through_a_link_in_its_folder_refused(out, tmp_path, capsys):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    if out == "res":
        (project / "res").symlink_to(elsewhere)
    else:
        (project / "sub").symlink_to(elsewhere)
    study = project / "s.yaml"
    study.write_text(f"out: {out}\n" + TINY_STUDY.format(name="s"))
    for extra in (["--dry-run"], []):
        assert main(["study", str(study), *extra]) == 2
        err = one_line_error(capsys, "study")
        assert "link" in err and "outside" in err
    assert list(elsewhere.rglob("*")) == []


# --- data loss: ownership only by marker, or an older run whose every file is quantgate's ----------------------


def test_study_does_not_take_a_users_config_yaml_beside_cells(tmp_path, capsys):
    study = tmp_path / "base.yaml"
    study.write_text(TINY_STUDY.format(name="base"))
    proj = tmp_path / "proj"
    (proj / "cells").mkdir(parents=True)
    (proj / "cells" / "figure1.svg").write_text("<svg/>")
    (proj / "config.yaml").write_text("lr: 0.1  # my experiment\n")
    before = snapshot_files(proj)
    assert main(["study", str(study), "--out", str(proj)]) == 2
    assert "quantgate did not write" in one_line_error(capsys, "study")
    assert snapshot_files(proj) == before


def test_eval_does_not_take_a_users_eval_json(tmp_path, capsys):
    p2 = tmp_path / "p2"
    p2.mkdir()
    (p2 / "eval.json").write_text(json.dumps({"settings": {"lr": 1}, "results": {"acc": 0.9}}))
    before = snapshot_files(p2)
    assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(p2)]) == 2
    assert "quantgate did not write" in one_line_error(capsys, "eval")
    assert snapshot_files(p2) == before


def test_train_overwrite_does_not_delete_a_users_log(tmp_path, capsys):
    p3 = tmp_path / "p3"
    p3.mkdir()
    (p3 / "log.jsonl").write_text('{"event": "lab meeting", "notes": "..."}\n')
    (p3 / "NOTES.md").write_text("my notes\n")
    before = snapshot_files(p3)
    assert main([*TRAIN, "--out", str(p3), "--overwrite"]) == 2
    assert "quantgate did not write" in one_line_error(capsys, "train")
    assert snapshot_files(p3) == before


def test_quantize_overwrite_does_not_take_a_users_config_json(float_model, tmp_path, capsys):
    p4 = tmp_path / "p4"
    p4.mkdir()
    (p4 / "config.json").write_text(json.dumps({"quantgate": {"budget": 3}, "note": "my settings"}))
    before = snapshot_files(p4)
    argv = ["quantize", str(float_model), "--scheme", "w8-int8", "--out", str(p4), "--overwrite"]
    assert main(argv) == 2
    assert "quantgate did not write" in one_line_error(capsys, "quantize")
    assert snapshot_files(p4) == before


def test_build_tokenizers_does_not_replace_a_users_files(tmp_path, monkeypatch, capsys):
    tk = tmp_path / "tk"
    tk.mkdir()
    for name in ("bpe-8192.json", "wordpiece-8192.json"):
        (tk / name).write_text('{"my": "tokenizer"}')
    before = snapshot_files(tk)
    monkeypatch.setattr("quantgate.cli.build_bundled", lambda out: pytest.fail("trained before the check"))
    assert main(["build-tokenizers", "--out", str(tk)]) == 2
    assert "quantgate did not write" in one_line_error(capsys, "build-tokenizers")
    assert snapshot_files(tk) == before


def test_audit_refuses_a_study_run(study_run, float_model, tmp_path, capsys):
    run = _copy_run(study_run, tmp_path)
    before = snapshot_files(run)
    assert main(["audit", str(float_model), "--out", str(run), *AUDIT]) == 2
    err = one_line_error(capsys, "audit")
    assert "study run" in err and "not an audit" in err
    assert snapshot_files(run) == before


def test_a_refused_report_leaves_no_lock(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    assert main(["report", str(mine)]) == 2
    err = one_line_error(capsys, "report")
    assert "--out" not in err  # report has no --out
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_a_refused_audit_leaves_nothing(float_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "audit"

    def refuse(*args, **kwargs):
        raise qg.InputError("refused mid-way")

    monkeypatch.setattr(sys.modules["quantgate.audit.run"], "_search", refuse)
    assert main(["audit", str(float_model), "--out", str(out), *AUDIT]) == 2
    one_line_error(capsys, "audit")
    assert not out.exists()


def test_an_audit_without_export_removes_the_earlier_export(float_model, tmp_path):
    out = tmp_path / "a"
    assert main(["audit", str(float_model), "--out", str(out), *AUDIT]) == 0
    had = (out / "export").is_dir()
    assert main(["audit", str(float_model), "--out", str(out), *AUDIT, "--no-export"]) == 0
    assert not (out / "export").exists()
    assert "--no-export" in (out / "audit.md").read_text() or not had
    assert json.loads((out / MARKER).read_text())["kind"] == "audit"


# --- a quantized checkpoint's source: an absolute path and a hash that every reader checks ---------------------


def test_audit_of_a_quantized_checkpoint_does_not_take_another_folder_of_the_same_name(
    float_model, tmp_path, monkeypatch, capsys
):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    shutil.copytree(float_model, here / "fl")
    monkeypatch.chdir(here)
    assert main(["quantize", "fl", "--scheme", "w8a8-int8-dynamic", "--out", str(tmp_path / "q-dyn")]) == 0
    record = record_of(qg.load(tmp_path / "q-dyn")).quantization
    assert record is not None and record.source_model == str((here / "fl").resolve())
    assert record.source_files_sha256
    qg.save(qg.build("tiny-llama", seed=7), there / "fl")  # another model of the same name, elsewhere
    monkeypatch.chdir(there)
    shutil.rmtree(here / "fl")
    assert main(["audit", str(tmp_path / "q-dyn"), "--out", str(tmp_path / "a"), *AUDIT]) == 2
    assert "not here" in one_line_error(capsys, "audit")
    shutil.copytree(there / "fl", here / "fl")  # another model where the source was: its files differ
    assert main(["audit", str(tmp_path / "q-dyn"), "--out", str(tmp_path / "a"), *AUDIT]) == 2
    assert "differ" in one_line_error(capsys, "audit")
    assert not (tmp_path / "a").exists()


def test_plain_transformers_refuses_a_gated_checkpoint_under_any_variant_and_model_type(tmp_path):
    import transformers

    g = tmp_path / "g"
    qg.save(qg.build("tiny-llama", "g1-elementwise", seed=0), g)
    config = json.loads((g / "config.json").read_text())
    config["model_type"] = config["quantgate"]["model_type"]  # edited back to the base model's
    (g / "config.json").write_text(json.dumps(config))
    for variant in (None, "quantgate"):
        with pytest.raises((ValueError, OSError)):
            transformers.AutoModelForCausalLM.from_pretrained(g, variant=variant)
    with pytest.raises(qg.InputError, match="model_type was changed"):
        qg.load(g)


def test_the_packaged_gated_twin_is_refused_by_plain_transformers(tmp_path):
    import transformers

    from quantgate.models.sources import package_dir

    g = tmp_path / "twin-g1"
    shutil.copytree(package_dir("twin-g1"), g)
    config = json.loads((g / "config.json").read_text())
    config["model_type"] = "llama"
    (g / "config.json").write_text(json.dumps(config))
    with pytest.raises((ValueError, OSError)):
        transformers.AutoModelForCausalLM.from_pretrained(g, variant="quantgate")


def test_audit_variant_on_an_ungated_checkpoint_is_refused(float_model, tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["audit", str(float_model), "--variant", "g1-elementwise", "--out", str(out), *AUDIT]) == 2
    err = one_line_error(capsys, "audit")
    assert "ungated" in err and "random weights" in err
    assert not out.exists()


# --- Ctrl-C and the messages --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["study", "train", "audit"])
def test_ctrl_c_prints_one_line_naming_what_to_rerun(command, float_model, tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    study = tmp_path / "base.yaml"
    study.write_text(TINY_STUDY.format(name="base"))
    argv = {
        "study": ["study", str(study), "--out", str(tmp_path / "run")],
        "train": [*TRAIN, "--out", str(tmp_path / "t")],
        "audit": ["audit", str(float_model), "--out", str(tmp_path / "a"), *AUDIT],
    }[command]
    module, name = {
        "study": ("quantgate.study.steps", "run_cells"),
        "train": ("quantgate.train.loop", "_train"),
        "audit": ("quantgate.audit.run", "_search"),
    }[command]
    monkeypatch.setattr(sys.modules[module], name, interrupt)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"quantgate {command}: interrupted; ") and f"quantgate {command} " in line
    assert ("--resume" in line) == (command == "train")


def test_a_model_without_a_tokenizer_names_its_folder_and_the_fix(tmp_path, capsys):
    m = tmp_path / "m"
    qg.build("tiny-llama", seed=0).save_pretrained(m)  # type: ignore[operator]
    config = json.loads((m / "config.json").read_text())
    del config["quantgate"]  # another tool's checkpoint: no bundled tokenizer named, no tokenizer files
    (m / "config.json").write_text(json.dumps(config))
    assert main(["observe", str(m), "--max-batches", "1", "--seq-len", "32", "--out", str(tmp_path / "o")]) == 2
    err = one_line_error(capsys, "observe")
    assert str(m) in err and "tokenizer.json" in err


def test_a_full_disk_names_the_file(tmp_path, monkeypatch, capsys):
    import errno

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    monkeypatch.setattr("quantgate.files.write_bytes_atomic", lambda *a, **k: full(None), raising=False)
    out = tmp_path / "ev"
    assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(out)]) == 2
    err = one_line_error(capsys, "eval")
    assert "a file:" not in err and str(out) in err and "No space left" in err


def test_an_out_option_with_a_null_byte_is_one_line(tmp_path, capsys):
    assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(tmp_path / "a\0b")]) == 2
    assert "null byte" in one_line_error(capsys, "eval")


def test_an_audit_writes_into_the_folder_holding_the_model_it_reads(float_model, tmp_path):
    """The model audited may lie in --out (an input, not content): the check before the work lets it, and the
    audit's end (which marks the folder) does not refuse it after the work."""
    out = tmp_path / "a"
    out.mkdir()
    shutil.copytree(float_model, out / "fl")
    assert main(["audit", str(out / "fl"), "--out", str(out), *AUDIT]) == 0
    assert (out / "audit.json").is_file() and json.loads((out / MARKER).read_text())["kind"] == "audit"
