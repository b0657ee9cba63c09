"""Shared helpers of the ecosystem scripts: one venv per other tool, snippets run in it, quantgate's
CLI run in the main python, timing and a record of every command.

The main process stays in quantgate's own python; everything of the other tool (its install, its
imports, its heavy work) runs in a subprocess of its venv. Data crosses the boundary as JSON files.
Nothing here downloads a model: the venv subprocesses get HF_HUB_OFFLINE=1 (and the transformers /
datasets equivalents).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "ecosystem"
SETUP_RECORD = "qg-ecosystem-setup.json"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class EcosystemError(RuntimeError):
    """A step of an ecosystem script failed; the message says which and why."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def script_exit(main: Callable[[], int]) -> None:
    """Run a script's ``main`` and exit with its status: 1 with the message on an :class:`EcosystemError`, 130 on an
    interrupt."""
    try:
        sys.exit(main())
    except EcosystemError as e:
        log(f"ERROR: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)


@dataclass
class Command:
    """One command the script ran: what, where, how long, and how it ended."""

    argv: list[str]
    rc: int
    wall_s: float
    where: str  # "main" (quantgate's python) or the venv path
    note: str = ""
    tail: str = ""
    output: str = field(default="", repr=False)  # the whole output; not kept in the JSON

    @property
    def shell(self) -> str:
        return shlex.join(self.argv)


@dataclass
class Recorder:
    """Every command run, in order, for the report."""

    commands: list[Command] = field(default_factory=list)

    def add(self, command: Command) -> Command:
        self.commands.append(command)
        return command

    def as_json(self) -> list[dict]:
        return [{**{k: v for k, v in asdict(c).items() if k != "output"}, "shell": c.shell} for c in self.commands]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _stream(argv: Sequence[str], env: Mapping[str, str] | None, timeout: float | None, prefix: str) -> tuple[int, str]:
    """Run ``argv``, echoing its output (prefixed) as it comes; killed after ``timeout`` s; returns (rc, output)."""
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env) if env else None
    )
    out: list[str] = []
    fired: list[bool] = []

    def expire() -> None:
        fired.append(True)
        proc.kill()

    timer = threading.Timer(timeout, expire) if timeout else None
    if timer:
        timer.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            out.append(line)
            print(f"{prefix}{line}", end="", flush=True)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.kill()
        raise
    finally:
        if timer:
            timer.cancel()
    if fired:
        out.append(f"\n[killed: it ran past its limit of {timeout:.0f} s]\n")
    return rc, "".join(out)


def system_python_env() -> dict[str, str]:
    """The environment for a venv subprocess: offline, without the main python's path settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OFFLINE)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# --- venvs ----------------------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_versions(venv: Path, distributions: Sequence[str]) -> dict[str, str | None]:
    """The installed version of each distribution in the venv (None where missing)."""
    code = textwrap.dedent(
        """
        import json, sys
        from importlib import metadata
        out = {}
        for name in sys.argv[1:]:
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                out[name] = None
        print(json.dumps(out))
        """
    )
    res = subprocess.run(
        [str(venv_python(venv)), "-c", code, *distributions],
        capture_output=True,
        text=True,
        env=system_python_env(),
        timeout=120,
    )
    if res.returncode != 0:
        raise EcosystemError(f"cannot read the package versions of {venv}: {_tail(res.stderr, 5)}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main_versions(distributions: Sequence[str]) -> dict[str, str | None]:
    """The installed version of each distribution in quantgate's own python."""
    out: dict[str, str | None] = {}
    for name in distributions:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def same_version(have: str | None, want: str) -> bool:
    """``have`` is ``want``, ignoring a local label (torch's ``2.13.0+cpu`` is ``2.13.0``)."""
    return have is not None and have.split("+")[0] == want.split("+")[0]


def ensure_venv(
    venv: Path,
    pins: Mapping[str, str],
    install_steps: Sequence[Sequence[str]],
    *,
    uninstall: Sequence[str] = (),
    recreate: bool = False,
    recorder: Recorder | None = None,
    timeout: float = 3600,
) -> dict:
    """Create the venv ``venv`` (or reuse it when every ``pins`` distribution is installed at its version
    and none of ``uninstall`` is), running ``pip install <step>`` for each of ``install_steps`` in order,
    then ``pip uninstall -y <uninstall>``. Returns ``{"reused", "wall_s", "setup"}``: ``setup`` is the record
    of the run that installed it (its commands and seconds, kept in the venv as SETUP_RECORD)."""
    py = venv_python(venv)
    record_file = venv / SETUP_RECORD
    if py.exists() and not recreate:
        try:
            have = installed_versions(venv, [*pins, *uninstall])
        except EcosystemError as e:
            log(f"{venv} exists but cannot be queried ({e}); recreating it")
            have = {}
        if (
            have
            and all(same_version(have.get(k), v) for k, v in pins.items())
            and not any(have.get(u) for u in uninstall)
        ):
            log(f"reusing venv {venv} ({', '.join(f'{k}=={v}' for k, v in pins.items())})")
            setup = json.loads(record_file.read_text()) if record_file.is_file() else None
            return {"reused": True, "wall_s": 0.0, "setup": setup}
        log(f"venv {venv} does not hold {dict(pins)} (it has {have}); (re)installing into it")
    start = time.monotonic()
    own = Recorder()
    if recreate and venv.exists():
        log(f"removing {venv} (--recreate-venv)")
        shutil.rmtree(venv)
    if not py.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        argv = [_base_python(), "-m", "venv", str(venv)]
        log(f"creating venv: {shlex.join(argv)}")
        t0 = time.monotonic()
        res = subprocess.run(argv, capture_output=True, text=True)
        for r in (recorder, own):
            if r:
                r.add(Command(argv, res.returncode, time.monotonic() - t0, "main", "create the venv"))
        if res.returncode != 0 or not py.exists():
            raise EcosystemError(
                f"venv creation failed ({shlex.join(argv)}, exit {res.returncode}): "
                f"{_tail(res.stderr or res.stdout, 10)}. Is the python venv module installed (Debian: python3-venv)?"
            )
    for step in [*install_steps, *([["--uninstall", *uninstall]] if uninstall else [])]:
        if step and step[0] == "--uninstall":
            argv = [str(py), "-m", "pip", "uninstall", "-y", *step[1:]]
        else:
            argv = [str(py), "-m", "pip", "install", *step]
        log(f"in the venv: {shlex.join(argv)} (this can take minutes)")
        t0 = time.monotonic()
        rc, out = _stream(argv, system_python_env(), timeout, prefix="  pip| ")
        for r in (recorder, own):
            if r:
                r.add(Command(argv, rc, time.monotonic() - t0, str(venv), "venv setup", _tail(out, 5)))
        if rc != 0:
            what = "uninstall" if "uninstall" in argv else "install"
            raise EcosystemError(
                f"pip {what} failed in {venv} (exit {rc}): {shlex.join(argv)}\n{_tail(out, 15)}\n"
                f"The package may not be installable on this machine (python {sys.version.split()[0]}, "
                f"{os.uname().machine}); rerun with --recreate-venv after fixing the cause."
            )
    have = installed_versions(venv, list(pins))
    wrong = {k: have.get(k) for k, v in pins.items() if not same_version(have.get(k), v)}
    if wrong:
        raise EcosystemError(f"after installing, {venv} holds {wrong} instead of {dict(pins)}")
    took = time.monotonic() - start
    log(f"venv {venv} ready in {took:.0f} s")
    setup = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "wall_s": took,
        "commands": [{**c, "display": display(c["argv"])} for c in own.as_json()],
    }
    record_file.write_text(json.dumps(setup, indent=2))
    return {"reused": False, "wall_s": took, "setup": setup}


def _base_python() -> str:
    """A python to make venvs with: the interpreter this script runs in (not a venv's)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base


def run_in_venv(
    venv: Path,
    code: str,
    payload: Mapping,
    *,
    name: str,
    recorder: Recorder | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 3600,
    keep_dir: Path | None = None,
    check: bool = True,
) -> tuple[dict | None, Command]:
    """Run the python ``code`` in the venv as a file (``__main__``: a spawned worker can re-import it), as
    ``python <file> <in.json> <out.json>``; ``payload`` goes in, the JSON the code writes to out.json
    comes back. Fails with the tail of its output when it exits non-zero or writes nothing; with
    ``check=False`` it returns whatever out.json holds (None if nothing) and the command instead."""
    work = Path(tempfile.mkdtemp(prefix=f"qg-{name}-")) if keep_dir is None else keep_dir
    work.mkdir(parents=True, exist_ok=True)
    script, inp, outp = work / f"{name}.py", work / f"{name}.in.json", work / f"{name}.out.json"
    script.write_text(code)
    inp.write_text(json.dumps(payload))
    if outp.exists():
        outp.unlink()
    argv = [str(venv_python(venv)), str(script), str(inp), str(outp)]
    full_env = system_python_env()
    full_env.update(env or {})
    log(f"running {name} in {venv}: {shlex.join(argv)}")
    t0 = time.monotonic()
    rc, out = _stream(argv, full_env, timeout, prefix=f"  {name}| ")
    wall = time.monotonic() - t0
    command = Command(argv, rc, wall, str(venv), name, _tail(out), out)
    if recorder:
        recorder.add(command)
    if not check:
        log(f"{name} exit {rc} in {wall:.1f} s")
        return (json.loads(outp.read_text()) if outp.exists() else None), command
    if rc != 0 or not outp.exists():
        raise EcosystemError(
            f"{name} failed in {venv} (exit {rc}, {wall:.0f} s; its files are in {work}):\n{_tail(out, 30)}"
        )
    log(f"{name} done in {wall:.1f} s")
    return json.loads(outp.read_text()), command


# --- quantgate in the main python ------------------------------------------------------------------


def run_main(
    args: Sequence[str], *, recorder: Recorder | None = None, note: str = "", check: bool = True, timeout: float = 7200
) -> Command:
    """Run ``python -m quantgate.cli <args>`` in quantgate's python (this interpreter)."""
    argv = [sys.executable, "-m", "quantgate.cli", *args]
    log(f"running: quantgate {shlex.join(list(args))}")
    t0 = time.monotonic()
    rc, out = _stream(argv, None, timeout, prefix="  qg| ")
    command = Command(argv, rc, time.monotonic() - t0, "main", note, _tail(out, 40), out)
    if recorder:
        recorder.add(command)
    if rc != 0 and check:
        raise EcosystemError(f"quantgate {shlex.join(list(args))} failed (exit {rc}):\n{_tail(out, 20)}")
    log(f"quantgate {args[0]} exit {rc} in {command.wall_s:.1f} s")
    return command


def display(argv: Sequence[str]) -> str:
    """A command as a person would type it: ``quantgate ...`` for the main python's CLI."""
    argv = list(argv)
    if len(argv) > 2 and argv[1:3] == ["-m", "quantgate.cli"]:
        return shlex.join(["quantgate", *argv[3:]])
    return shlex.join(argv)


# --- checkpoints ---------------------------------------------------------------------------------


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def human_size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def quant_method(path: Path) -> str | None:
    """``quantization_config.quant_method`` of a checkpoint's config.json (None if it has none)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    except ValueError:
        return None
    return qc.get("quant_method") if isinstance(qc, dict) else None


def save_float_smollm2(path: Path, *, recorder: Recorder | None = None, force: bool = False) -> Path:
    """SmolLM2-135M float, saved by ``quantgate.save`` (in a subprocess of quantgate's python)."""
    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")) and not force:
        log(f"reusing the float SmolLM2 checkpoint {path}")
        return path
    code = "import sys, quantgate as qg; qg.save(qg.load('smollm2-135m'), sys.argv[1]); print('saved', sys.argv[1])"
    argv = [sys.executable, "-c", code, str(path)]
    log(f"saving SmolLM2-135M float with quantgate.save to {path} (first use converts the GGUF, ~40 s)")
    t0 = time.monotonic()
    rc, out = _stream(argv, None, 1800, prefix="  qg| ")
    if recorder:
        recorder.add(Command(argv, rc, time.monotonic() - t0, "main", "qg.save(qg.load('smollm2-135m'), DIR)"))
    if rc != 0:
        raise EcosystemError(f"saving SmolLM2 with quantgate failed (exit {rc}):\n{_tail(out, 20)}")
    return path


def corpus_texts(split: str, n: int, *, spread: bool = True) -> list[dict]:
    """``n`` documents of quantgate's bundled corpus ``split``: evenly spread over the split (so several
    works are in it), or the first ``n``."""
    from quantgate.data import corpus

    docs = list(corpus(split))
    if n > len(docs):
        raise EcosystemError(f"the {split} split has {len(docs)} documents, fewer than {n}")
    picks = [docs[i * len(docs) // n] for i in range(n)] if spread else docs[:n]
    return [{"id": d.id, "text": d.text} for d in picks]


def write_json(path: Path, data: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    log(f"wrote {path}")
