"""quantgate's refusals, as types: a caller catches :class:`QuantgateError` apart from bugs, and the command line
prints any of them as one line (``quantgate CMD: error: ...``) where a bug keeps its traceback.

Each class also derives from the built-in exception a caller would have caught before it existed, so ``except
ValueError`` still catches an :class:`InputError`::

    QuantgateError
    ├── InputError (ValueError)                 the user's input: an unknown variant or scheme, a wrong family, a bad
    │   │                                       study file, NaN in activations; the message names the fix
    │   ├── study.schema.StudyError             a study file that cannot run (its line and the valid choices)
    │   ├── audit.AuditError                    an audit that cannot run as asked
    │   └── evaluate.NonFiniteOutputs           a model whose log-likelihoods are NaN or inf
    ├── MissingFile (FileNotFoundError)         a checkpoint, study file or run directory that is not there
    ├── MissingDependency (ModuleNotFoundError) an optional package the request needs (the message: pip install ...)
    └── Unavailable (RuntimeError)              what this machine or run cannot do now:
        ├── quant.HardwareUnavailable           hardware the scheme needs (an FP8-capable GPU)
        ├── train.TrainingDiverged              NaN/inf loss or gradients (the last finite weights are saved)
        ├── runlock.RunDirectoryBusy            another process writing the run directory
        └── study.executors.StudyDirectoryNotShared   a Ray worker that cannot see the run directory

:class:`~quantgate.data.corpus.OfflineError` (no network for a source that needs it) is a QuantgateError and a
ConnectionError.
"""

from __future__ import annotations

__all__ = ["QuantgateError", "InputError", "MissingFile", "MissingDependency", "Unavailable"]


class QuantgateError(Exception):
    """A refusal of quantgate's: the message is one line naming the problem and the fix."""


class InputError(QuantgateError, ValueError):
    """The user's input cannot be used as given (a name, a value, a file's content)."""


class MissingFile(QuantgateError, FileNotFoundError):
    """A file or folder the request names is not there."""


class MissingDependency(QuantgateError, ModuleNotFoundError):
    """An optional package the request needs is not installed; the message says what to install."""


class Unavailable(QuantgateError, RuntimeError):
    """What this machine or run cannot do now (hardware, a diverged run, a busy or unshared directory)."""
