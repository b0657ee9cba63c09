"""A warm interpreter for the tests' subprocesses. Importing quantgate costs seconds of CPU (torch, transformers,
torchao), and every ``quantgate ...`` command of the docs' pages (tests/test_doc_blocks.py), every page's driver and
every ``python script.py`` / ``python -m quantgate.cli ...`` a test starts (conftest.run_python) paid it again. Here
one server process imports ``quantgate.cli`` once; each command is then a child *forked* from it: a fresh process
with the command's own arguments, working directory, environment, stdin, stdout and stderr, which runs the console
script's ``quantgate.cli.main`` (or the script, module or ``-c`` source, as ``python`` runs them) and exits with its
status. What a command does is the same code on the same inputs; only the import is shared.

Where the two could differ, the command runs cold instead (the real executable, ``os.execv``): an environment that
is not the server's (``FOO=1 quantgate ...``: libraries read some variables at import), ``python`` options other
than ``-c`` and ``-m``, or a server that cannot be reached. A client killed (a timeout) takes its child's process
group with it. The child ends as the interpreter ends a process (threads joined, atexit handlers run, streams
flushed) but skips tearing down the objects it inherited (seconds of copy-on-write), so a file that only that
teardown would flush stays unflushed. The server imports lm-eval too: a child has what its import sets in the
environment (HF_XET_HIGH_PERFORMANCE) even where it would not import it.

Two roles, one file (the client imports no quantgate):

* ``python _warm_quantgate.py serve SOCKET``: the server (:meth:`Warm.start` starts it, with the environment its
  commands must have);
* ``python _warm_quantgate.py python SOCKET ARGS...``: the client for ``python ARGS...`` (:meth:`Warm.python`);
  ``BIN/quantgate ARGS...``, a two-line script :class:`Warm` writes, is the client for the console script.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# what bash sets in each shell, pytest for each test, and readline (LINES, COLUMNS; tests set and unset them): no
# import reads them, and a child has the request's
VOLATILE = {"PWD", "OLDPWD", "SHLVL", "_", "PYTEST_CURRENT_TEST", "LINES", "COLUMNS"}
COLD = b"cold"


def comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE}


# --- the client ------------------------------------------------------------------------------------------------


def client(address: str, mode: str, argv: list[str], cold: list[str]) -> None:
    """Ask the server at ``address`` for a forked child that runs ``argv`` here (mode ``cli``: the console script
    ``argv[0]`` with its arguments; ``python``: the interpreter's arguments), with this process's environment and
    standard streams; exit with its status. Runs ``cold`` (os.execv) where the server cannot take it."""
    request = {"mode": mode, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    reply = COLD
    if mode == "cli" or (argv and (argv[0] in ("-c", "-m") or not argv[0].startswith("-"))):
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(address)
            socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
            reply = sock.recv(64)  # the exit status, once the child ended (kept open until then)
        except OSError:
            reply = COLD
    if reply == COLD:
        os.execv(cold[0], cold)
    if not reply:
        print("tests/_warm_quantgate.py: the server ended during the command", file=sys.stderr)
        sys.exit(1)
    sys.exit(int(reply))


# --- the server ------------------------------------------------------------------------------------------------


def serve(address: str) -> None:
    """Import quantgate.cli, then fork a child per request until the parent (the test session) is gone."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    before = dict(os.environ)
    import quantgate.cli  # the import every child shares

    with contextlib.suppress(ImportError):  # lm-eval (optional), which the evaluations import; it sets an env var
        import quantgate.eval.lm_eval_models  # noqa: F401

    gc.freeze()  # the children's collections leave the inherited objects alone (and their pages shared)
    base = comparable(before)  # what a request's environment must be
    imported = {k: os.environ.get(k) for k in {*before, *os.environ} if os.environ.get(k) != before.get(k)}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address + ".part")
    listener.listen(16)
    os.rename(address + ".part", address)  # connectable once it exists
    parent = os.getppid()
    children: dict[int, socket.socket] = {}  # pid -> the client waiting for it
    while os.getppid() == parent:
        waiting = {conn: pid for pid, conn in children.items()}
        readable, _, _ = select.select([listener, *waiting], [], [], 0.05)
        for conn in readable:
            if conn is listener:
                _accept(listener, base, imported, children)
            elif not _peek(conn):  # the client is gone (killed): so is its child's group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(waiting[conn], signal.SIGKILL)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid not in children:
                continue
            conn = children.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.send(str(code if code >= 0 else 128 - code).encode())
            conn.close()


def _peek(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _said(argv: list[str]) -> list[str]:
    """A command's first words, for the server's log (one line each)."""
    return [(a.splitlines() or [""])[0][:60] for a in argv[:3]]


def _same_environment(env: dict[str, str], base: dict[str, str], imported: dict[str, str | None]) -> bool:
    """Whether a process started in ``env`` imports into the environment the server's children get: ``env`` is the
    server's own, or has what the import sets already set to that (a test process that imported quantgate)."""
    env, base = comparable(env), dict(base)
    for key, value in imported.items():
        if env.get(key) == value:
            env.pop(key, None)
            base.pop(key, None)
    return env == base


def _accept(
    listener: socket.socket, base: dict[str, str], imported: dict[str, str | None], children: dict[int, socket.socket]
) -> None:
    """Take one request: fork its child, or answer COLD. ``imported``: what the import changed in the environment
    (torchao sets TORCHINDUCTOR_CACHE_DIR), which the child's environment gets as a fresh process's would."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        request = json.loads(message)
    except (OSError, ValueError):
        request = None
    if request is None or len(fds) != 3 or not _same_environment(request["env"], base, imported):
        env = comparable(request["env"]) if request else {}
        differ = sorted(k for k in {*env, *base} if env.get(k) != base.get(k) and k not in imported)
        print("cold", *_said((request or {}).get("argv", [])), "(environment differs:", *differ, ")", flush=True)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(COLD)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        _child(request, fds, imported)  # never returns
    print("warm", pid, *_said(request["argv"]), flush=True)
    for fd in fds:
        os.close(fd)
    children[pid] = conn


def _child(request: dict[str, Any], fds: list[int], imported: dict[str, str | None]) -> None:
    """Become the command: its own session (the server kills it as a group), its streams, directory and
    environment; then run it as the console script or ``python`` would, and exit with its status."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in imported.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    argv = list(request["argv"])
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    code = 0
    try:
        if request["mode"] == "cli":  # the console script: its folder first on sys.path
            sys.argv = argv
            sys.path.insert(0, str(Path(argv[0]).parent))
            main.__dict__["__file__"] = argv[0]
            from quantgate.cli import main as cli

            sys.exit(cli())
        elif argv[0] == "-c":  # python -c SOURCE ARGS: the working directory first on sys.path
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":  # python -m MODULE ARGS (run afresh as __main__, as if the server had not imported it;
            # a package stays imported, as python imports it before running its __main__)
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            package = hasattr(sys.modules.get(argv[1]), "__path__")
            for name in [f"{argv[1]}.__main__"] + ([] if package else [argv[1]]):
                sys.modules.pop(name, None)
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        else:  # python SCRIPT ARGS: the script's folder first on sys.path
            sys.argv = argv
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:  # as the interpreter reads it: None is 0, a number its status, anything else 1
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _finish(code: int) -> None:
    """End as the interpreter ends a process (non-daemon threads joined, atexit handlers run, the standard streams
    flushed), but without tearing down every object inherited from the server: that teardown costs seconds, as it
    writes to every page the fork shares."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code & 0xFF)


# --- the test side -----------------------------------------------------------------------------------------


class Warm:
    """A server in ``folder`` whose commands run in environment ``env`` (None: this process's, as a subprocess
    inherits it, which can hold what os.environ does not show: readline's LINES and COLUMNS under pytest); with
    ``shim``, PATH starts with a folder holding the ``quantgate`` client, and :attr:`env` is that environment."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None, shim: bool = False):
        self.folder = folder
        self.address = str(folder / "server.sock")
        self.real = str(Path(sys.executable).with_name("quantgate"))
        self.env = None if env is None else dict(env)
        self.proc: subprocess.Popen | None = None
        self.started_in: dict[str, str] = {}  # the comparable environment the server was started in
        if shim:
            assert env is not None, "the shim's PATH needs the environment named"
            bin_dir = folder / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            script = bin_dir / "quantgate"
            script.write_text(
                f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(HERE)!r})\nfrom _warm_quantgate import "
                f"client\nclient({self.address!r}, 'cli', [{self.real!r}, *sys.argv[1:]], [{self.real!r}, "
                f"*sys.argv[1:]])\n"
            )
            script.chmod(0o755)
            self.env = {**env, "PATH": os.pathsep.join([str(bin_dir), env.get("PATH", "")])}

    def start(self, wait: float = 300) -> bool:
        """Start the server; whether it is serving (False: every command runs cold)."""
        log = (self.folder / "server.log").open("w")
        self.started_in = comparable(dict(os.environ if self.env is None else self.env))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", self.address],
            cwd=self.folder,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.proc.poll() is None:
            if Path(self.address).exists():
                return True
            time.sleep(0.05)
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def python(self, args: list[str]) -> list[str]:
        """The command line that runs ``python *args`` as a child of the server (cold where it cannot)."""
        return [sys.executable, __file__, "python", self.address, *args]


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "python":  # python _warm_quantgate.py python SOCKET ARGS...
        client(sys.argv[2], "python", sys.argv[3:], [sys.executable, *sys.argv[3:]])
