"""Studies: one YAML from models to a quantization report.

A study expands models x variants x seeds into cells (:mod:`.grid`) and runs each cell's steps, cached
by key (:mod:`.steps`). ``eval``, ``observe`` and ``calibration`` are study-wide settings that a model's
entry can override, key by key (a model trained on the backcopy task observes and calibrates on it
beside one that reads text). Study files are validated before any work starts, down to what each value
must be; errors name the YAML line and the valid choices (:mod:`.schema`).

The run directory gets ``config.yaml`` (the resolved study), ``metrics.json`` (every number the report
shows, and the per-layer detail behind the plots; read it as a :class:`~.records.StudyRecord`),
``report.md`` and PNG plots, all rebuilt by ``quantgate report DIR`` from metrics.json alone
(:mod:`.report`).
"""

from .grid import Cell, ModelSpec, Study, cell_dir, shrink
from .records import CellRecord, SchemeRecord, StudyRecord, read_metrics
from .schema import DEFAULT_STUDY, StudyError, load_study
from .steps import plan, run_study

__all__ = [
    "run_study",
    "load_study",
    "plan",
    "shrink",
    "Study",
    "StudyError",
    "DEFAULT_STUDY",
    "ModelSpec",
    "Cell",
    "cell_dir",
    "CellRecord",
    "SchemeRecord",
    "StudyRecord",
    "read_metrics",
]
