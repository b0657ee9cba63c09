"""Studies on Ray (issue 33): a local Ray (2 CPUs) runs a study's cells as tasks and its metrics equal a serial
run's at the same thread count; a worker killed mid-cell is replaced and the study ends the same; a study whose
driver is killed and run again ends the same; a worker that cannot see the run directory is refused."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from quantgate.study import Cell, CellRecord, run_study
from quantgate.study.executors import RUN_ID, StudyDirectoryNotShared, _cell_task
from quantgate.study.schema import load_study

STUDY = """\
name: rayed
seed: 0
executor: ray
models:
  - name: tiny
    preset: tiny-llama
    variants: [vanilla, g1-headwise]
    resources: {cpus: 1}
    train: {steps: 300, batch_size: 2, seq_len: 32, lr: 0.003, checkpoint_every: 50, eval_every: 0, observe_every: 0}
schemes: [w8a8-int8-dynamic]
calibration: {batches: 1, seq_len: 32, batch_size: 2}
observe: {batches: 1, seq_len: 32, batch_size: 2}
eval: {tasks: [quantgate_ppl], limit: 1, max_length: 32}
"""
TIMINGS = {"seconds", "wall_seconds", "quantize_s", "machine"}  # what timing and the machine decide


def _numbers(run: Path) -> dict:
    """metrics.json without what timing and the machine decide."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in TIMINGS}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return strip(json.loads((run / "metrics.json").read_text()))


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("study") / "rayed.yaml"
    f.write_text(STUDY)
    return f


@pytest.fixture(scope="module")
def serial(study, tmp_path_factory) -> dict:
    """The serial run, with one torch thread: what each Ray cell (1 CPU) computes with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = run_study(study, tmp_path_factory.mktemp("serial") / "run", executor="serial")
    finally:
        torch.set_num_threads(threads)
    return _numbers(run)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


def test_the_study_file_names_its_executor_and_resources(study, tmp_path):
    s = load_study(study)
    assert s.executor == "ray" and s.models[0].resources == {"cpus": 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(STUDY.replace("resources: {cpus: 1}", "resources: {tpus: 1}"))
    with pytest.raises(ValueError, match=r"bad.yaml:8: .*resources.*keys among cpus, gpus"):
        load_study(bad)
    bad.write_text(STUDY.replace("executor: ray", "executor: slurm"))
    with pytest.raises(ValueError, match=r"bad.yaml:3: .*executor.*one of serial, ray"):
        load_study(bad)
    with pytest.raises(ValueError, match="names a Ray cluster, and this study runs on the serial executor"):
        run_study(study, tmp_path / "x", executor="serial", address="ray://nowhere:10001")


@pytest.mark.slow  # 38 s: a local Ray started and a study run twice
def test_a_ray_run_equals_the_serial_run(study, serial, local_ray, tmp_path):
    run = run_study(study, tmp_path / "run")  # executor: ray, from the study file
    assert _numbers(run) == serial
    for log in (run / "cells").glob("*/cell.log"):
        assert "1 torch threads" in log.read_text()
    assert len(list((run / "cells").glob("*/cell.log"))) == 2 and not (run / RUN_ID).exists()


@pytest.mark.slow  # twelve seconds: a Ray worker started, killed and replaced
def test_a_worker_killed_mid_cell_is_replaced_and_the_study_ends_the_same(study, serial, local_ray, tmp_path):
    out = tmp_path / "run"
    errors: list[BaseException] = []

    def go():
        try:
            run_study(study, out)
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    driver = threading.Thread(target=go)
    driver.start()
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and driver.is_alive():
        for cdir in (out / "cells").glob("*"):
            ckpt, log = cdir / "train" / "checkpoints", cdir / "cell.log"
            if ckpt.is_dir() and any(ckpt.iterdir()) and not (cdir / "model.json").exists() and log.is_file():
                victim = int(log.read_text().split(", pid ")[-1].split(",")[0])
                os.kill(victim, signal.SIGKILL)  # mid-training, after its first checkpoint
                victim_log = log
                break
        time.sleep(0.01)
    driver.join(timeout=300)
    assert victim is not None, "no cell was caught mid-training"
    assert not errors, errors
    assert _numbers(out) == serial
    pids = [int(x.split(",")[0]) for x in victim_log.read_text().split(", pid ")[1:]]
    assert pids[0] == victim and len(pids) == 2 and pids[1] != victim  # run again, by another worker


@pytest.mark.slow  # two Ray start-ups in subprocesses: about a minute
def test_a_killed_ray_study_run_again_ends_as_the_serial_run(study, serial, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "quantgate.cli", "study", str(study), "--out", str(out)]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((out / "cells").glob("*/model.json")):
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver, its local Ray and its workers, mid-study
    driver.wait()
    assert not (out / "metrics.json").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _numbers(out) == serial


def test_a_worker_that_cannot_see_the_run_directory_is_refused(study, tmp_path):
    cell = load_study(study).cells()[0]
    (tmp_path / RUN_ID).write_text("another run's token")

    def never_run(cell: Cell, cdir: Path) -> CellRecord:
        raise AssertionError("refused before the cell runs")

    with pytest.raises(StudyDirectoryNotShared, match=r"cannot see the study's run directory .* every worker shares"):
        _cell_task(never_run, cell, tmp_path / "cells" / "x", tmp_path, "this run's token", 1)
    with pytest.raises(StudyDirectoryNotShared, match="give --out a path every node mounts"):
        _cell_task(never_run, cell, tmp_path / "cells" / "x", tmp_path / "elsewhere", "token", 1)
