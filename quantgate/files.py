"""The file layer: what quantgate reads and writes, one way.

* Written whole or not at all: a reader (or a run killed mid-write) never sees half a file
  (:func:`write_text_atomic`), a folder of files is replaced as one (:func:`staged_dir`), and an output
  directory is checked before the work that fills it (:func:`writable_dir`, :func:`folder_name`,
  :func:`refuse_same`); a write that fails on a full or read-only disk is one line (:func:`os_error_line`).
* Written only where quantgate may write: :func:`claim_output`, the one rule every command's output folder
  passes (an empty or missing folder, or one quantgate wrote as the same kind of output; a model folder
  replaced only with ``--overwrite``; never through a link leading out of it), marked :data:`MARKER`.
* Read with the file named: :func:`read_json` bounds the size, checks the top-level type and names the file
  in every error; :func:`parse_json`, the one parse of JSON text, refuses whatever json cannot read as an
  InputError.
* Keyed by content: :func:`content_sha256` hashes a file or folder, remembering each file's hash under its
  size, times and inode so an unchanged file is not read twice.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.errors import InputError
from quantgate.json_record import JsonRecord

__all__ = [
    "write_text_atomic",
    "write_bytes_atomic",
    "parse_json",
    "read_json",
    "read_text",
    "read_json_lines",
    "json_kind",
    "file_sha256",
    "JSON_LIMIT",
    "content_sha256",
    "writable_dir",
    "claim_output",
    "mark_output",
    "MARKER",
    "Marker",
    "OUTPUT_KINDS",
    "is_folder_name",
    "folder_name",
    "refuse_same",
    "staged_dir",
    "os_error_line",
    "write_failure",
]

JSON_LIMIT = 1 << 30  # bytes: the most read_json reads by default (a study's metrics.json is a few MB)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8) as :func:`write_bytes_atomic` does."""
    return write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a new temporary file beside it and one rename; parents are created.
    Nothing is written through a link: the temporary file is created afresh (never opened through a link
    planted at its name) and the rename replaces a link at ``path`` itself, not the file it points to. A failed
    write (a full disk) removes its temporary file and leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # an earlier run's leftover of this process id, or a link planted there
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (str(tmp), None):
            e.filename = str(path)  # the file the user asked for, not its temporary name
        raise
    return path


def temporary_folder(path: Path) -> Path:
    """Where a folder bound for ``path`` (a checkpoint, a model) is written before :func:`publish_folder`."""
    return path.with_name(f".{path.name}.tmp")


def publish_folder(tmp: Path, path: Path) -> None:
    """Make the fully written folder ``tmp`` appear as ``path`` with one rename (replacing an older ``path``),
    its files and the rename on disk first: an interrupted write leaves the old ``path`` or none, never half."""
    for f in tmp.iterdir():
        _fsync(f)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading ----------------------------------------------------------------------------------------


def json_kind(value: object) -> str:
    """JSON's name for the type of ``value``: object, array, string, number, boolean or null."""
    kinds = ((dict, "object"), (list, "array"), (str, "string"), (bool, "boolean"), ((int, float), "number"))
    return next((name for typ, name in kinds if isinstance(value, typ)), "null")


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a value read from a file can be of any size)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_json(text: str) -> Any:
    """The JSON value ``text`` holds; where it holds none, an InputError saying why: json's message of where it
    breaks (``Expecting ',' delimiter: line 1 column 5 (char 4)``), an integer of more digits than Python reads
    (4300), or nesting too deep."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError("its JSON is nested too deeply") from None
    except ValueError as e:  # json's JSONDecodeError, or int()'s refusal of an integer past its digit limit
        raise InputError(str(e)) from None


def read_text(path: str | Path, limit: int) -> str:
    """The UTF-8 text of file ``path``, of at most ``limit`` bytes (read no further); an InputError saying why where
    it is larger or not UTF-8 (the caller names the file), an OSError where it cannot be opened or read."""
    with open(path, "rb") as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise InputError(f"it holds more than {limit:,} bytes, the most read here")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"it is not UTF-8 text (byte {e.start})") from None


def read_json(path: str | Path, kind: type | tuple[type, ...] = dict, *, limit: int = JSON_LIMIT, fix: str = "") -> Any:
    """The JSON value in file ``path`` (UTF-8, at most ``limit`` bytes), which must be of type ``kind``
    (``dict``: an object; ``list``: an array; ``object``: any value). Anything else, a missing, unreadable,
    truncated or oversized file included, is a one-line InputError ``cannot read <path>: <why>``, followed
    by ``fix`` (what to do about it) where given."""
    path = Path(path)

    def fail(why: str) -> InputError:
        return InputError(f"cannot read {path}: {why}" + (f"; {fix}" if fix else ""))

    try:
        data = parse_json(read_text(path, limit))
    except OSError as e:
        raise fail(e.strerror or str(e)) from None
    except InputError as e:
        raise fail(str(e)) from None
    if not isinstance(data, kind):
        wanted = " or ".join(json_kind(t()) for t in (kind if isinstance(kind, tuple) else (kind,)))
        raise fail(f"it holds a JSON {json_kind(data)}, not {'an' if wanted[0] in 'aeiou' else 'a'} {wanted}")
    return data


def read_json_lines(path: str | Path) -> list[tuple[int, Any]]:
    """(line number, JSON value) of each non-blank line of JSON Lines file ``path``; a one-line InputError naming the
    file and the first line that is not JSON (cut off mid-write)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append((number, parse_json(line)))
            except InputError as e:
                raise InputError(f"cannot read {path}: line {number} is not valid JSON (truncated?): {e}") from None
    return rows


# --- content keys -----------------------------------------------------------------------------------

_CHUNK = 8 << 20


def content_sha256(path: str | Path, *, patterns: Iterable[str] = ("*",), memo: str | Path | None = None) -> str:
    """sha256 of the content of file ``path`` (its bytes' sha256), or of folder ``path``: of the relative
    names and contents of the files in it and below whose names match one of ``patterns`` (hidden files and
    folders aside). With ``memo`` (a JSON file), each file's hash is remembered there under its path, size,
    modification and change times and inode, so a file left as it is is not read again, while a file
    rewritten, replaced or copied over (which changes at least its change time) always is."""
    path = Path(path)
    patterns = tuple(patterns)
    if path.is_file():
        files = [path]
    else:
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
            and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
        )
    known = _read_memo(memo)
    changed = False
    digests = []
    for f in files:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = known.get(str(f.resolve()))
        if isinstance(entry, list) and entry[:4] == stamp and len(entry) == 5:
            digest = entry[4]
        else:
            digest = file_sha256(f)
            known[str(f.resolve())], changed = [*stamp, digest], True
        digests.append((f.relative_to(path).as_posix() if f != path else "", digest))
    if memo is not None and changed:
        with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
            kept = {k: v for k, v in known.items() if Path(k).is_file()}
            write_text_atomic(memo, json.dumps(kept, indent=0, sort_keys=True))
    if path.is_file():
        return digests[0][1]
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()


def _read_memo(memo: str | Path | None) -> dict[str, Any]:
    if memo is None or not Path(memo).is_file():
        return {}
    try:
        return read_json(memo)
    except InputError:  # a corrupt memo: every file is hashed again
        return {}


def file_sha256(path: Path) -> str:
    """sha256 of the bytes of the file at ``path`` (hex), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --- writing ----------------------------------------------------------------------------------------


def writable_dir(directory: str | Path, what: str = "--out", create: bool = True) -> Path:
    """``directory``, checked writable (a file is made and removed there) before the work that fills it, and
    created where missing (``create=False``: left missing, its nearest existing parent checked instead, so a
    command refused later leaves nothing behind); a one-line ValueError naming it (``what``: the option that
    gave it) otherwise."""
    if "\0" in str(directory):
        raise InputError(f"{what} {str(directory)!r} holds a null byte, which no path can; choose another directory")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{what} {directory} is a file, not a directory; choose a directory")
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        existing = next(d for d in (directory, *directory.absolute().parents) if d.exists())
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        _probe(existing)
    except OSError as e:
        raise InputError(
            f"{what} {directory}: cannot write there ({e.strerror or e}); choose a writable directory"
        ) from None
    return directory


def _probe(directory: Path) -> None:
    """Make and remove a file in ``directory`` (OSError where that cannot be done)."""
    probe = directory / f".quantgate-write-test.{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.unlink(probe)


# --- ownership of output folders ----------------------------------------------------------------------

MARKER = ".quantgate"  # who wrote a folder: a Marker

# the kinds of folder quantgate writes -> their name in a message
OUTPUT_KINDS = {
    "model": "model",
    "study": "study run",
    "audit": "audit",
    "train": "training run",
    "eval": "evaluation",
    "observe": "observe run",
    "compare": "comparison",
    "tokenizers": "tokenizer set",
}


@dataclass(frozen=True)
class Marker(JsonRecord):
    """A folder's :data:`MARKER`: who wrote it (``written_by``: ``quantgate <command>``, ``qg.save``) and the
    ``kind`` of output it holds (a key of :data:`OUTPUT_KINDS`)."""

    written_by: str
    kind: str

    @property
    def output(self) -> str:
        """The kind of output it names (an audit's marked ``study`` before audits had their own kind)."""
        return "audit" if self.kind == "study" and self.written_by == "quantgate audit" else self.kind


_REPLACED_WHOLE = {"model"}  # a new one replaces the old one's files: only with overwrite
_OWN_FILES = (MARKER, ".quantgate.lock", ".quantgate-write-test.*")  # quantgate's bookkeeping: not content
_MODEL_FILES = ("config.json", "generation_config.json", "quantization.json", "*.safetensors",
                "*.safetensors.index*.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                "merges.txt", "chat_template.jinja", "README.md", "*.png")  # fmt: skip
# the names each kind writes at the top of its folder: an input there of such a name would be written over, and a
# folder an older quantgate wrote (without the marker) holds nothing else
_WRITES = {
    "model": _MODEL_FILES,
    "study": ("config.yaml", "metrics.json", "report.md", "*.png", "cells"),
    "audit": ("audit.json", "audit.md", "export"),
    "train": ("log.jsonl", "checkpoints", "model", "last-good-model", "tensorboard", ".*.tmp"),
    "eval": ("eval.json", "eval.partial.json", "lm_eval"),
    "observe": ("observe.json", "observe.md", "*.png"),
    "compare": ("compare.md", "compare.csv", "compare.png"),
    "tokenizers": ("*.json",),
}


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in file ``path``; {} where it is missing, a link, or not one."""
    if not path.is_file() or path.is_symlink():
        return {}
    try:
        return read_json(path)
    except InputError:
        return {}


def _first_line(path: Path) -> str:
    if not path.is_file() or path.is_symlink():
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.readline(1 << 20)
    except OSError:
        return ""


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _older_model(d: Path) -> bool:
    config = _json_object(d / "config.json")
    weights = any(fnmatch.fnmatch(e, "*.safetensors") for e in os.listdir(d))
    return isinstance(config.get("quantgate"), dict) and "model_type" in config and weights


def _older_study(d: Path) -> bool:
    """metrics.json with the study and its cells; or (stopped before it) cells/ of quantgate's cell folders,
    each holding its model step (``{"format": ..., "key": ...}``)."""
    if {"study", "cells", "versions"} <= _json_object(d / "metrics.json").keys():
        return True
    cells = d / "cells"
    if not _real_dir(cells) or not (d / "config.yaml").is_file() or not (found := os.listdir(cells)):
        return False
    return all("--" in c and {"format", "key"} <= _json_object(cells / c / "model.json").keys() for c in found)


def _older_train(d: Path) -> bool:
    """log.jsonl opening with quantgate's config event, or checkpoints/ of step-N checkpoints only."""
    try:
        first = parse_json(_first_line(d / "log.jsonl") or "null")
    except InputError:
        first = None
    if isinstance(first, dict) and first.get("event") == "config" and {"config", "world_size"} <= first.keys():
        return True
    if not _real_dir(d / "checkpoints") or not (entries := os.listdir(d / "checkpoints")):
        return False
    return all(fnmatch.fnmatch(e, "step-*") or fnmatch.fnmatch(e, ".step-*.tmp") for e in entries)


def _older_eval(d: Path) -> bool:
    """eval.json (or eval.partial.json) holding an evaluation's record: its fields and no others."""
    fields = {"results", "documents", "lm_eval_output", "settings", "versions"}
    data = _json_object(d / "eval.json") or _json_object(d / "eval.partial.json")
    return {"results", "settings", "versions"} <= data.keys() <= fields and "tasks" in (data.get("settings") or {})


# how each kind is recognised in a folder an older quantgate wrote, before the marker existed: every entry is a name
# that kind writes (_WRITES), and a file only quantgate writes is there in quantgate's own shape (a tokenizer set has
# none: a tokenizer file of the user's has the same shape)
_LEGACY = {
    "model": _older_model,
    "study": _older_study,
    "audit": lambda d: {"model", "tolerance", "candidates", "recipe"} <= _json_object(d / "audit.json").keys(),
    "train": _older_train,
    "eval": _older_eval,
    "observe": lambda d: {"summary", "layers", "meta"} <= _json_object(d / "observe.json").keys(),
    "compare": lambda d: _first_line(d / "compare.csv").startswith("model,variant,seed,scheme,reference"),
}


def _older_kind(directory: Path, content: list[str]) -> str | None:
    """The kind of output an older quantgate wrote in ``directory`` (its entries ``content``), None for a folder
    that is not one: a single file of the user's in quantgate's shape does not make a folder quantgate's."""
    for kind, shaped in _LEGACY.items():
        if all(any(fnmatch.fnmatch(e, p) for p in _WRITES[kind]) for e in content) and shaped(directory):
            return kind
    return None


def owner(directory: str | Path) -> tuple[str, str | None] | None:
    """``(kind, written_by)`` of the quantgate output in folder ``directory`` (its :data:`MARKER`; an older
    quantgate's by :func:`_older_kind`, ``written_by`` None), None where quantgate did not write it."""
    directory = Path(directory)
    if not _real_dir(directory):
        return None
    marker = _marker(directory)
    if marker is not None:
        return marker.output, marker.written_by
    content = sorted(e for e in os.listdir(directory) if not any(fnmatch.fnmatch(e, p) for p in _OWN_FILES))
    kind = _older_kind(directory, content) if content else None
    return (kind, None) if kind else None


def _marker(directory: Path) -> Marker | None:
    """The folder's marker where it holds a valid one, else None."""
    path = directory / MARKER
    if not path.is_file() or path.is_symlink():
        return None
    try:
        marker = Marker.from_json(read_json(path, limit=1 << 16))
    except InputError:  # not JSON, or not a marker
        return None
    return marker if marker.kind in OUTPUT_KINDS else None


def _escaping_links(directory: Path, deep: bool) -> Iterator[tuple[Path, Path]]:
    """Each link in ``directory`` (``deep``: and below, links not entered) that leads out of it, with its target."""
    root = directory.resolve()
    for dirpath, dirnames, filenames in os.walk(directory):  # a linked folder is listed, not entered
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            if path.is_symlink() and not (target := path.resolve()).is_relative_to(root):
                yield path, target
        if not deep:
            return


def claim_output(
    directory: str | Path,
    kind: str,
    what: str = "--out",
    *,
    overwrite: bool = False,
    mark: bool = False,
    by: str | None = None,
    inputs: Iterable[str | Path] = (),
    fix: str = "choose an empty folder (or a new one)",
) -> Path:
    """The one rule for where quantgate writes: ``directory`` (``what``: the option that gave it), checked
    before the work that fills it (:func:`writable_dir`), for output of ``kind`` (a key of
    :data:`OUTPUT_KINDS`). quantgate writes only into a folder that is

    * missing or empty (quantgate's own lock and :data:`MARKER` aside), or
    * one it wrote before as the same kind of output: a study run is continued by a study, a training run by
      train (whose --resume/--overwrite rule then applies), an eval, observe or compare folder is written
      again; a model folder is replaced only with ``overwrite`` (``--overwrite``), its other files kept.

    Who wrote a folder is read from its :data:`MARKER` (a :class:`Marker`: written by, kind). A folder an
    older quantgate wrote has none; it counts as quantgate's only where every entry in it is a name that kind
    writes (:data:`_WRITES`) and a file only quantgate writes is there in quantgate's own shape (:data:`_LEGACY`):
    a user's eval.json, log.jsonl or config.json beside their own notes, or in a shape of their own, is theirs.
    Anything else (another tool's model, the user's files, a project folder) is refused, ``overwrite`` or not.
    Nothing is created or changed before the whole check has passed.

    ``inputs``: files the command reads that may lie in the folder (a study file inside its run), not counted
    as content unless the output writes a file of that name. A link in the folder or below that leads out
    of it is refused: quantgate never writes through one.
    Each refusal is a one-line ValueError naming the folder, why, and what to do (``fix``). ``mark``: the folder is
    then created where missing and marked as written by ``by`` (default ``quantgate <kind>``); the writer
    calls it once it is about to write, after the check before the work. Returns ``directory``."""
    if kind not in OUTPUT_KINDS:
        raise InputError(f"unknown output kind {kind!r}; one of {', '.join(OUTPUT_KINDS)}")
    directory = writable_dir(directory, what, create=False)
    name = OUTPUT_KINDS[kind]
    if directory.is_dir():
        _refuse_links(directory, what, fix, deep=False)  # first: nothing is read through them
        root = directory.resolve()
        own = {
            Path(f).name
            for f in inputs
            if Path(f).resolve().parent == root
            and not any(fnmatch.fnmatch(Path(f).name, p) for p in _WRITES.get(kind, ()))
        }
        content = sorted(
            e for e in os.listdir(directory) if e not in own and not any(fnmatch.fnmatch(e, p) for p in _OWN_FILES)
        )
        if content:
            marker = _marker(directory)
            found_kind = marker.output if marker else _older_kind(directory, content)
            if found_kind is None:
                shown = ", ".join(content[:4]) + (f", ... ({len(content)} in all)" if len(content) > 4 else "")
                raise InputError(f"{what} {directory} holds files quantgate did not write ({shown}); {fix}")
            written_by = f" (written by {marker.written_by})" if marker and marker.written_by else ""
            if found_kind != kind:
                raise InputError(
                    f"{what} {directory} holds a quantgate {OUTPUT_KINDS[found_kind]}{written_by}, not "
                    f"{'an' if name[0] in 'aeiou' else 'a'} {name}; {fix}"
                )
            if kind in _REPLACED_WHOLE and not overwrite:
                flag = "--overwrite" if what.startswith("--") else "overwrite=True"
                raise InputError(
                    f"{what} {directory} holds a {name} quantgate saved{written_by}: writing there replaces it; "
                    f"add {flag} to replace it, or {fix}"
                )
            _refuse_links(directory, what, fix, deep=True)
    if mark:
        directory.mkdir(parents=True, exist_ok=True)
        mark_output(directory, kind, by)
    return directory


def mark_output(directory: Path, kind: str, by: str | None = None) -> None:
    """Mark the existing folder ``directory`` as output of ``kind`` written by ``by`` (default ``quantgate
    <kind>``): its :data:`MARKER`, which :func:`claim_output` reads."""
    marker = Marker(by or f"quantgate {kind}", kind)
    if _marker(directory) != marker:
        write_text_atomic(directory / MARKER, json.dumps(marker.to_json()) + "\n")


def _refuse_links(directory: Path, what: str, fix: str, deep: bool) -> None:
    """A one-line ValueError at the first link in ``directory`` (``deep``: or below) that leads out of it."""
    for link, target in _escaping_links(directory, deep):
        raise InputError(
            f"{what} {directory}: {link} is a symlink leading to {target}, outside it; quantgate does not write "
            f"through links: remove the link, or {fix}"
        )


def is_folder_name(name: str) -> bool:
    """Whether ``name`` names a folder inside its parent: not empty, ``.`` or ``..``, no path separator."""
    return name not in ("", ".", "..") and not {"/", "\\", "\0"} & set(name)


def folder_name(name: str, what: str) -> str:
    """``name`` where :func:`is_folder_name`; else a one-line ValueError (``what``: where the name comes from)."""
    if not is_folder_name(name):
        raise InputError(
            f"{what} {name!r} must name a folder inside its parent: not empty, '.' or '..', without / or \\"
        )
    return name


def refuse_same(out: str | Path, source: str | Path, what: str) -> None:
    """A one-line ValueError where the output folder ``out`` is the folder ``source`` (``what``: what that
    folder holds), links and ``..`` resolved: writing there would overwrite it."""
    if Path(out).resolve() == Path(source).resolve():
        spelt = f" ({source})" if str(source) != str(out) else ""
        raise InputError(f"{out} is {what}{spelt}: writing there would overwrite it; write to another directory")


@contextlib.contextmanager
def staged_dir(path: str | Path, replaces: Iterable[str]) -> Iterator[Path]:
    """A fresh folder beside ``path`` to write a set of files into (a checkpoint). When the body returns,
    the files of ``path`` whose names match ``replaces`` (glob patterns: what such a set consists of) and
    that the new set lacks are removed and the new files moved in, so ``path`` holds one set, never a new
    one mixed with the remains of an old one; other files there are kept. When the body raises (a full
    disk), the fresh folder is removed and ``path`` is left as it was."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} is a file, not a directory; choose a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.staged")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        path.mkdir(parents=True, exist_ok=True)
        new = {p.name for p in tmp.iterdir()}
        patterns = tuple(replaces)
        for old in path.iterdir():
            stale = old.name not in new and any(fnmatch.fnmatch(old.name, pat) for pat in patterns)
            if stale and (old.is_file() or old.is_symlink()):
                old.unlink()
        for item in tmp.iterdir():
            target = path / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_ALLOWED = {errno.EROFS, errno.EACCES, errno.EPERM}


def write_failure(e: Exception) -> str:
    """Why a write failed, in one line: an OSError's own reason (``No space left on device``), or the
    message of another writer's error (safetensors' SafetensorError) with its whitespace folded."""
    return e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())


def os_error_line(e: OSError, folder: str | Path | None = None) -> str | None:
    """One line for an OSError the machine's state causes (a full disk or quota, a read-only or forbidden
    path), naming the file (where the error does not, a file written in ``folder``, the command's output);
    None for any other (a bug, shown with its traceback)."""
    if e.errno in _NO_SPACE:
        fix = "free some space (the files written before this one are kept) or choose another --out"
    elif e.errno in _NOT_ALLOWED:
        fix = "check its permissions or choose another --out"
    else:
        return None
    file = e.filename or (f"writing in {folder}" if folder is not None else "writing a file")
    return f"{file}: {e.strerror or e}; {fix}"
