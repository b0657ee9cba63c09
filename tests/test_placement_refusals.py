"""Placement and processes validated before any work (issue 41, item 6): a max_memory too small for any module,
a whole model on disk, fewer documents than processes, a training or Ray study in several processes and an
unreachable Ray address are each refused in one line, before anything loads, launches or waits."""

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_python

import quantgate as qg
from quantgate import cli
from quantgate.cli import main
from quantgate.models import build
from quantgate.models.io import Placement, offloaded

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    qg.save(build("tiny-llama", seed=4), path)
    return path


@pytest.fixture
def no_launch(monkeypatch):
    """Fail where the old code would start processes (torchrun) instead of refusing first."""

    def launched(argv, processes):
        raise AssertionError(f"launched {processes} processes for {argv} instead of refusing first")

    monkeypatch.setattr(cli, "relaunch", launched)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _study(tmp_path: Path, name: str, model: str, extra: str = "", limit: int = 2) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nseed: 0\n{extra}models:\n  - name: m\n{model}    variants: [vanilla]\n"
        "schemes: []\ncalibration: {batches: 1, seq_len: 32, batch_size: 2}\n"
        f"observe: {{batches: 1, seq_len: 32, batch_size: 2}}\neval: {{tasks: [quantgate_ppl], limit: {limit}}}\n"
    )
    return path


def test_eval_max_memory_too_small_refused(checkpoint, tmp_path, capsys):
    args = ["eval", str(checkpoint), "--limit", "1", "--device-map", "auto", "--max-memory", "cpu=1KB"]
    assert main([*args, "--offload-folder", str(tmp_path / "off")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--max-memory" in line and "cpu" in line and "at least" in line, line
    assert not (tmp_path / "off").exists()  # refused before anything was written there
    # the size it names loads the model, some of it on the CPU
    smallest = line.split("at least ")[1].split()[0].rstrip(",.;:)")
    placement = Placement("auto", {"cpu": smallest}, str(tmp_path / "off2"))
    model = qg.load(checkpoint, placement=placement)
    assert set(offloaded(model)) != {name for name, _ in model.named_parameters()}  # not every weight on disk


def test_study_placement_max_memory_too_small_refused(checkpoint, tmp_path, capsys):
    offload = tmp_path / "off"
    placement = f"    placement: {{device_map: auto, max_memory: {{cpu: 1KB}}, offload_folder: {offload}}}\n"
    study = _study(tmp_path, "tight", f"    load: {checkpoint}\n{placement}")
    assert main(["study", str(study), "--out", str(tmp_path / "run")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "max_memory" in line and "at least" in line and "corrupt" not in line, line


def test_observe_whole_model_on_disk(checkpoint, tmp_path, capsys):
    """Refused (a model computes on a GPU or the CPU: some module must be there), for observe and in a study."""
    on_disk = json.dumps({"": "disk"})
    args = ["observe", str(checkpoint), "--device-map", on_disk, "--offload-folder", str(tmp_path / "off")]
    assert main([*args, "--out", str(tmp_path / "obs")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "disk" in line and "cpu" in line, line
    placement = f"    placement: {{device_map: {on_disk}, offload_folder: {tmp_path / 'off2'}}}\n"
    study = _study(tmp_path, "disk", f"    load: {checkpoint}\n{placement}")
    assert main(["study", str(study), "--dry-run"]) == 2  # the study file is refused before it runs
    assert "disk" in _one_line(capsys.readouterr().err)


def test_eval_limit_fewer_documents_than_processes_refused_before_launch(no_launch, tmp_path, capsys):
    assert main(["eval", "tiny-llama", "--limit", "1", "--processes", "2"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--limit 1" in line and "--processes 2" in line, line
    study = _study(tmp_path, "few", "    preset: tiny-llama\n", limit=1)
    assert main(["study", str(study), "--out", str(tmp_path / "run"), "--processes", "2"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "limit" in line and "2 processes" in line, line
    assert not (tmp_path / "run").exists()


def test_training_study_with_processes_refused_at_dry_run(no_launch, tmp_path, capsys):
    smoke = str(ROOT / "experiments" / "smoke.yaml")
    for extra in (["--dry-run"], ["--out", str(tmp_path / "run")]):
        assert main(["study", smoke, "--processes", "2", *extra]) == 2, extra
        line = _one_line(capsys.readouterr().err)
        assert "splits evaluation, not training" in line, line
    assert not (tmp_path / "run").exists()


def test_ray_with_processes_refused_at_dry_run(no_launch, tmp_path, capsys):
    study = _study(tmp_path, "loads", "    preset: tiny-llama\n")
    on_ray = _study(tmp_path, "rayed", "    preset: tiny-llama\n", extra="executor: ray\n")
    for args in (
        [str(study), "--executor", "ray", "--processes", "2", "--dry-run"],
        [str(on_ray), "--processes", "2", "--dry-run"],
        [str(study), "--executor", "ray", "--processes", "2", "--out", str(tmp_path / "run")],
    ):
        assert main(["study", *args]) == 2, args
        line = _one_line(capsys.readouterr().err)
        assert "the ray executor" in line and "--processes" in line, line
    assert not (tmp_path / "run").exists()
    assert main(["study", str(study), "--processes", "2", "--dry-run"]) == 0  # serial, no training: it can split
    assert "1 cells" in capsys.readouterr().out


def test_unreachable_ray_address_fails_quickly(tmp_path):
    study = _study(tmp_path, "base", "    preset: tiny-llama\n")
    cmd = ["-m", "quantgate.cli", "study", str(study), "--out", str(tmp_path / "run")]
    start = time.monotonic()
    try:
        done = run_python(
            [*cmd, "--executor", "ray", "--address", "127.0.0.1:1"], capture_output=True, text=True, timeout=45
        )
    except subprocess.TimeoutExpired:
        pytest.fail("an unreachable Ray address still waits after 45 s")
    assert time.monotonic() - start < 20
    assert done.returncode == 2, done.stderr[-2000:]
    line = _one_line(done.stderr)
    assert "127.0.0.1:1" in line and "Ray" in line, line


@pytest.mark.parametrize("device_map", ['{"": 3}', '{"": "gpu"}'])
def test_a_placement_failure_names_the_placement_not_corrupt_weights(checkpoint, device_map, capsys):
    """A device the machine lacks or a device name that is none: the error names the placement; the weights,
    which load whole, are not called corrupt."""
    assert main(["eval", str(checkpoint), "--limit", "1", "--device-map", device_map]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "corrupt" not in line and ("device" in line or "--device-map" in line), line


def test_a_gpu_named_as_text_in_a_study_file_is_that_gpu():
    """YAML keys reach Placement as text; max_memory's "0" is GPU 0, as --max-memory 0=... gives it."""
    from quantgate.models.io import Placement

    assert Placement("auto", {"0": "70GiB", "cpu": "2GiB"}).max_memory == {0: "70GiB", "cpu": "2GiB"}
