"""The output-directory guard: every command checks its output directory before the work (writable, not
the input's folder, a study name that stays inside results/), a write that fails on a full or read-only
disk is one line and keeps what was written before, and a checkpoint save replaces the folder's checkpoint
as a whole (no stale manifest or weights of another format left behind)."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY_STUDY, one_line_error

import quantgate as qg
import quantgate.files as files
from quantgate.cli import main

# command -> (argv with OUT for the output directory, the function doing the work, which must not run)
COMMANDS = {
    "quantize": (["quantize", "tiny-llama", "--scheme", "w8-int8", "--out", "OUT"], "quantgate.cli._load_or_build"),
    "eval": (["eval", "tiny-llama", "--limit", "1", "--out", "OUT"], "quantgate.cli.load_for_eval"),
    "eval-output-path": (["eval", "tiny-llama", "--output-path", "OUT"], "quantgate.cli.load_for_eval"),
    "train": (["train", "--preset", "tiny-llama", "--steps", "1", "--out", "OUT"], "quantgate.cli.build"),
    "study": (["study", "STUDY", "--out", "OUT"], "quantgate.study.steps._run_cell"),
    "observe": (["observe", "tiny-llama", "--out", "OUT"], "quantgate.cli._load_or_build"),
    "compare": (["compare", "RUNS", "--out", "OUT"], "quantgate.study.compare.collect_evals"),
}


def _blocked(kind: str, tmp_path: Path, monkeypatch) -> Path:
    """An output directory that cannot be written, of ``kind``."""
    if kind == "file-in-the-way":
        (tmp_path / "blocker").write_text("a file, not a folder")
        return tmp_path / "blocker" / "out"
    if kind == "read-only-filesystem":  # as on a read-only mount (the tests may run as root, whom chmod does not stop)

        def refuse(directory):
            raise OSError(errno.EROFS, "Read-only file system", str(directory))

        monkeypatch.setattr(files, "_probe", refuse, raising=False)
        return tmp_path / "ro"
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    return tmp_path / "ro" / "out"


@pytest.mark.parametrize("kind", ["file-in-the-way", "read-only-filesystem", "chmod-read-only"])
@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_unwritable_output_is_refused_before_the_work(command, kind, tmp_path, monkeypatch, capsys):
    argv, work = COMMANDS[command]
    out = _blocked(kind, tmp_path, monkeypatch)
    study = tmp_path / "s.yaml"
    study.write_text(TINY_STUDY.format(name="s"))
    (tmp_path / "runs").mkdir()

    def must_not_run(*args, **kwargs):
        raise AssertionError(f"{work} ran before the output directory was checked")

    monkeypatch.setattr(work, must_not_run)
    subs = {"OUT": str(out), "STUDY": str(study), "RUNS": str(tmp_path / "runs")}
    assert main([subs.get(a, a) for a in argv]) == 2
    assert str(out) in one_line_error(capsys, argv[0])


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_full_disk_during_quantize_keeps_the_checkpoint_there(error, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "tiny-llama", "--scheme", "w8-int8", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("quantgate.quant.manifest.save_file", full)
    capsys.readouterr()
    argv = ["quantize", "tiny-llama", "--scheme", "w8a8-int8-dynamic", "--out", str(out), "--overwrite"]
    assert main(argv) == 2  # --overwrite: the model quantgate saved there is replaced (issue 41)
    err = one_line_error(capsys, "quantize")
    assert "No space left on device" in err and str(out) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous checkpoint, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # nothing half-written beside it
    qg.load(out)


def test_full_disk_writing_eval_json_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    out = files.claim_output(tmp_path / "ev", "eval", mark=True)  # an earlier eval's folder (issue 41)
    (out / "eval.json").write_text('{"previous": true}')
    real = os.fdopen

    class HalfThenFull:  # a file that takes half of what is written, then reports a full disk (naming no file)
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fdopen", lambda fd, *a, **k: HalfThenFull(real(fd, *a, **k)))
    assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(out)]) == 2
    err = one_line_error(capsys, "eval")
    assert f"{out / 'eval.json'}: No space left on device" in err
    assert sorted(p.name for p in out.iterdir()) == [files.MARKER, "eval.json"]
    assert (out / "eval.json").read_text() == '{"previous": true}'


def test_full_disk_mid_study_keeps_the_finished_steps(tmp_path, monkeypatch, capsys):
    study, run = tmp_path / "s.yaml", tmp_path / "run"
    study.write_text(TINY_STUDY.format(name="s"))
    from quantgate.study import steps

    real, calls = steps._write_json, []

    def full_on_third(path, obj):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, obj)

    monkeypatch.setattr(steps, "_write_json", full_on_third)
    assert main(["study", str(study), "--out", str(run)]) == 2
    assert f"{calls[2]}: No space left on device" in one_line_error(capsys, "study")
    kept = {p: p.stat().st_mtime_ns for p in calls[:2]}
    assert all(json.loads(p.read_text())["key"] for p in kept) and not calls[2].exists()
    monkeypatch.setattr(steps, "_write_json", real)
    assert main(["study", str(study), "--out", str(run)]) == 0
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # reused, not recomputed


def test_quantize_refuses_to_write_over_its_input(tmp_path, capsys):
    src = tmp_path / "src"
    model = qg.build("tiny-llama", seed=0)
    qg.save(model, src)
    (tmp_path / "link").symlink_to(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (src, tmp_path / "other" / ".." / "src", tmp_path / "link"):
        assert main(["quantize", str(src), "--scheme", "w8-int8", "--out", str(out)]) == 2
        assert "would overwrite it" in one_line_error(capsys, "quantize")
    assert main(["quantize", str(tmp_path / "link"), "--scheme", "w8-int8", "--out", str(src)]) == 2
    with pytest.raises(ValueError, match="the float checkpoint this model was quantized from"):
        qg.save(qg.quantize(qg.load(src), "w8-int8"), src)  # the Python API too
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert qg.quantization_of(qg.load(src)) is None


def test_a_save_replaces_the_checkpoint_of_another_kind(tmp_path):
    float_model = qg.build("tiny-llama", "g1-headwise", seed=0)
    quantized = qg.quantize(float_model, "w8-int8")
    alone = {}
    for name, m in (("float", float_model), ("quantized", quantized)):
        qg.save(m, tmp_path / name)
        alone[name] = sorted(p.name for p in (tmp_path / name).iterdir())
    both = tmp_path / "both"
    both.mkdir()
    (both / "notes.txt").write_text("the user's own file")
    ids = torch.tensor([[1, 5, 9, 2]])
    for name, m in (("quantized", quantized), ("float", float_model), ("quantized", quantized)):
        qg.save(m, both)
        assert sorted(p.name for p in both.iterdir()) == sorted([*alone[name], "notes.txt"])
        with torch.no_grad():
            assert torch.equal(qg.load(both)(ids).logits, m(ids).logits)
    assert (both / "notes.txt").read_text() == "the user's own file"


@pytest.mark.parametrize("name", ["..", "."])
def test_a_study_name_must_stay_inside_results(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    for mine in ("config.yaml", "report.md"):
        (tmp_path / mine).write_text("the user's own file")
    study = tmp_path / "s.yaml"
    study.write_text(TINY_STUDY.format(name=f'"{name}"'))
    assert main(["study", str(study)]) == 2
    err = one_line_error(capsys, "study")
    assert "s.yaml" in err and f"'{name}'" in err
    assert all((tmp_path / mine).read_text() == "the user's own file" for mine in ("config.yaml", "report.md"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "report.md", "results", "s.yaml"]


def test_full_disk_while_a_training_checkpoint_is_written_keeps_the_earlier_ones(tmp_path, monkeypatch, capsys):
    """A full disk at a checkpoint (not the final model save) was a SafetensorError traceback."""
    import importlib

    from safetensors import SafetensorError

    checkpoint = importlib.import_module("quantgate.train.checkpoint")  # qg.train is the function
    # a checkpoint's safetensors: the RNG states (written first), the weights and the optimizer state
    writers = (importlib.import_module("quantgate.train.rng"), checkpoint)
    real, written = checkpoint.save_file, []

    def fills_up(tensors, filename, *args, **kwargs):
        if "step-2" in filename:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        written.append(filename)
        return real(tensors, filename, *args, **kwargs)

    for module in writers:
        monkeypatch.setattr(module, "save_file", fills_up)
    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny-llama",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    err = one_line_error(capsys, "train")
    assert f"cannot write the checkpoint {out / 'checkpoints' / 'step-2'}: Error while serializing" in err
    assert "the earlier ones are kept (step-1)" in err and "continue with --resume" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]  # no half-written step-2
    for module in writers:
        monkeypatch.setattr(module, "save_file", real)
    assert main([*argv, "--resume"]) == 0 and (out / "model" / "config.json").is_file()
