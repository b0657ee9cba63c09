"""tests/_warm_quantgate.py: a command forked from the warm interpreter (conftest.run_python, the docs' pages) runs
as the same command in a fresh ``python`` does: its output, arguments, sys.path, working directory and exit status;
an environment other than the server's runs cold; a killed client takes its child with it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_python, warm_python

SCRIPT = """\
import os, sys
print(__name__, sys.argv[1:], os.getcwd(), sys.path[0] in ("", os.getcwd()))  # prog.py is in the working directory
code = sys.argv[1] if len(sys.argv) > 1 else ""
if code == "fail":
    raise RuntimeError("it broke")
sys.exit(int(code) if code.isdigit() else code or None)
"""


@pytest.fixture
def server():
    """The server run_python forks from now (conftest.warm_python: one per environment the session meets)."""
    found = warm_python()
    assert found is not None  # the tests' subprocesses run warm on this machine
    return found


def test_a_module_the_server_imported_runs_as_main_without_a_warning(server, tmp_path):
    """``python -m quantgate.cli``: the server imported quantgate.cli; the child runs it afresh, as python does."""
    warm = run_python(["-m", "quantgate.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert (warm.returncode, warm.stderr) == (0, "") and warm.stdout.startswith("quantgate ")
    assert (server.folder / "server.log").read_text().splitlines()[-1].startswith("warm ")


@pytest.mark.parametrize("how", ["script", "module", "source"])
@pytest.mark.parametrize("ending", ["", "3", "fail", "a message"])
def test_a_warm_run_is_the_cold_run(server, tmp_path, how, ending):
    (tmp_path / "prog.py").write_text(SCRIPT)
    args = {"script": [str(tmp_path / "prog.py")], "module": ["-m", "prog"], "source": ["-c", SCRIPT]}[how]
    args += [ending] if ending else []
    warm = run_python(args, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    cold = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout)
    assert warm.stderr.strip().splitlines()[-1:] == cold.stderr.strip().splitlines()[-1:]
    assert warm.stdout.startswith("__main__ ") and warm.stdout.rstrip().endswith(" True")
    assert (server.folder / "server.log").read_text().splitlines()[-1].startswith("warm ")


def test_another_environment_runs_cold(server, tmp_path):
    done = run_python(["-c", "import os; print(os.environ['QUANTGATE_TEST_X'])"], capture_output=True, text=True,
                      env={**os.environ, "QUANTGATE_TEST_X": "x"}, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "x\n"
    last = (server.folder / "server.log").read_text().splitlines()[-1]
    assert last.startswith("cold -c ") and last.endswith("(environment differs: QUANTGATE_TEST_X )")


def test_a_killed_client_takes_its_child_with_it(server, tmp_path):
    """A timeout kills the client (subprocess.run's, the pages' driver): the server then kills the child's group."""
    source = "import pathlib, time; pathlib.Path('started').touch(); time.sleep(600)"
    client = subprocess.Popen(server.python(["-c", source]), cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(re.findall(r"^warm (\d+) -c ", (server.folder / "server.log").read_text(), re.M)[-1])
    assert Path(f"/proc/{pid}").exists()
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
