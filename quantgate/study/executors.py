"""Where a study's cells run.

* ``serial`` (the default): one cell after another, in this process. Needs nothing beyond quantgate.
* ``ray``: each cell a Ray task asking for its model's ``resources`` (``{cpus: n, gpus: n}``, default
  :class:`Resources`' own), on the cluster at ``address`` (``--address``, else ``RAY_ADDRESS``) or on a Ray
  started here on this machine's CPUs and GPUs. The driver shows a progress bar over the cells and writes
  metrics.json and the report when all are done; each cell's worker keeps its log in ``cells/<cell>/cell.log``
  (host, pid, threads, then quantgate's log lines). A worker that dies mid-cell is replaced and its task run
  again (:data:`RETRIES` times): the steps a cell finished are cached under the run directory, so the retry
  resumes where the dead worker stopped and the study ends as a serial run would. ``pip install 'ray>=2.60,<3'``
  (quantgate's ``ray`` extra); every worker needs quantgate installed.

The run directory is the only channel between the driver and the workers: results live on a filesystem every
worker shares (one machine, NFS, a cluster volume). The driver writes a token into it (:data:`RUN_ID`) and each
task checks it sees that token before any work, refusing with :class:`StudyDirectoryNotShared` otherwise.

A cell runs with as many torch threads as the CPUs it asks for, so a Ray cell's numbers equal those of a serial
run made with that thread count (thread counts change the last bits of reductions, as on any machine).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..errors import InputError, MissingDependency, Unavailable
from .grid import Cell, cell_dir
from .records import CellRecord

__all__ = [
    "EXECUTORS",
    "Resources",
    "RESOURCES",
    "RETRIES",
    "RUN_ID",
    "StudyDirectoryNotShared",
    "check_reachable",
    "run_cells",
]

log = logging.getLogger("quantgate")
EXECUTORS = ("serial", "ray")
RETRIES = 3  # times a cell whose worker died is run again
PROBE_SECONDS = 5.0  # how long a Ray address may take to accept a connection
RUN_ID = ".quantgate-run-id"  # the driver's token in the run directory: a worker that cannot read it cannot see it

RunCell = Callable[[Cell, Path], CellRecord]


class StudyDirectoryNotShared(Unavailable):
    """A Ray worker cannot see the study's run directory."""


@dataclass(frozen=True)
class Resources:
    """What one cell asks of a Ray worker: ``cpus`` and ``gpus`` (a fraction of one shares it); a model's
    ``resources:`` sets either."""

    cpus: float = 1.0
    gpus: float = 0.0


RESOURCES = tuple(f.name for f in fields(Resources))  # the keys of a model's resources:


def check_resources(resources: dict) -> bool:
    """A model's ``resources``: keys among :data:`RESOURCES`, each a number >= 0."""
    return all(
        k in RESOURCES and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
        for k, v in resources.items()
    )


def run_cells(
    cells: list[Cell], out: Path, run_cell: RunCell, executor: str = "serial", address: str | None = None
) -> list[CellRecord]:
    """Every cell's record, in the cells' order, each computed by ``run_cell(cell, its directory)``."""
    if executor not in EXECUTORS:
        raise InputError(f"unknown executor {executor!r}; valid: {', '.join(EXECUTORS)}")
    if address is not None and executor != "ray":
        raise InputError(
            f"an address ({address}) names a Ray cluster, and this study runs on the {executor} executor: add "
            "--executor ray (or executor: ray in the study file), or leave the address out"
        )
    if executor == "ray":
        return _on_ray(cells, out, run_cell, address)
    records = []
    for n, cell in enumerate(cells, 1):
        log.info("[%d/%d] %s", n, len(cells), cell.id)
        records.append(run_cell(cell, cell_dir(out, cell.model.name, cell.id)))
    return records


def _require_ray():
    try:
        import ray  # Ray is optional: imported where a study asks for it
    except ImportError as e:
        raise MissingDependency(
            f"the ray executor needs Ray (pip install 'ray>=2.60,<3', quantgate's ray extra): {e}"
        ) from None
    return ray


def check_reachable(address: str | None, timeout: float = PROBE_SECONDS) -> None:
    """Refuse, in one line within ``timeout`` seconds, a Ray address (``host:port`` or ``ray://host:port``) where
    nothing accepts a connection: ray.init would retry "Failed to connect to GCS" for minutes. Addresses Ray
    resolves itself (None, ``auto``, ``local``) are not probed."""
    if not address or address in ("auto", "local"):
        return
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():  # another form Ray reads: Ray says what it makes of it
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise InputError(
            f"cannot reach the Ray cluster at {address}: {why} (tried for {timeout:g} s); start Ray there (ray start "
            f"--head), or give --address (or RAY_ADDRESS) the head node's host:port"
        ) from None


def _on_ray(cells: list[Cell], out: Path, run_cell: RunCell, address: str | None) -> list[CellRecord]:
    ray = _require_ray()
    from tqdm.auto import tqdm

    started_here = not ray.is_initialized()
    if started_here:  # address None: RAY_ADDRESS, or a Ray of this machine's own
        check_reachable(address or os.environ.get("RAY_ADDRESS"))  # ray.init would retry for minutes
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    token = uuid.uuid4().hex
    marker = out / RUN_ID
    marker.write_text(token)
    task = ray.remote(max_retries=RETRIES, retry_exceptions=False)(_cell_task)
    refs = {}
    for i, cell in enumerate(cells):
        need = Resources(**(cell.model.resources or {}))
        cdir = cell_dir(out, cell.model.name, cell.id)
        ref = task.options(num_cpus=need.cpus, num_gpus=need.gpus).remote(run_cell, cell, cdir, out, token, need.cpus)
        refs[ref] = i
    records: list[CellRecord | None] = [None] * len(cells)
    pending = list(refs)
    try:
        with tqdm(total=len(cells), desc="cells (ray)", unit="cell") as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    records[refs[ref]] = _result(ray, ref, cells[refs[ref]])
                    bar.update(1)
                    bar.set_postfix_str(cells[refs[ref]].id)
    finally:
        for ref in pending:  # a failed cell stops the study, as in a serial run; finished steps stay cached
            ray.cancel(ref, force=True)
        marker.unlink(missing_ok=True)
        if started_here:
            ray.shutdown()
    return [r for r in records if r is not None]


def _result(ray, ref, cell: Cell) -> CellRecord:
    """The cell's record, or its task's own error (the worker's exception, not Ray's wrapper)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None
    except ray.exceptions.WorkerCrashedError:
        raise Unavailable(
            f"{cell.id}: its Ray worker died {RETRIES + 1} times; run the study again: the steps it finished "
            f"are kept in the run directory"
        ) from None


def _cell_task(run_cell: RunCell, cell: Cell, cdir: Path, out: Path, token: str, cpus: float) -> CellRecord:
    """A Ray worker's work on one cell: check it sees the run directory, log to the cell's cell.log, run it."""
    marker = out / RUN_ID
    if not (marker.is_file() and marker.read_text() == token):
        raise StudyDirectoryNotShared(
            f"the Ray worker on {socket.gethostname()} cannot see the study's run directory {out} (no {RUN_ID} of "
            f"this run there): a Ray study keeps its results on a filesystem every worker shares (one machine, "
            f"NFS, a cluster volume); give --out a path every node mounts"
        )
    threads = max(1, int(cpus))
    torch.set_num_threads(threads)
    cdir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(cdir / "cell.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("%s: host %s, pid %d, %d torch threads", cell.id, socket.gethostname(), os.getpid(), threads)
        return run_cell(cell, cdir)
    finally:
        log.removeHandler(handler)
        handler.close()
