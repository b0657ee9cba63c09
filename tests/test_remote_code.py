"""No code from a checkpoint ever runs, and nothing asks whether it may (issue 31, security).

A folder whose config.json or tokenizer_config.json carries an ``auto_map`` (transformers' pointer to a
.py file shipped beside the weights) is refused up front, in one line naming the file and the field, by
every door (``quantgate observe``/``info``, ``qg.load``/``qg.tokenizer``, ``study --dry-run``); and every
loading call in quantgate/ passes ``trust_remote_code=False`` (checked on the source, with ``ast``)."""

import ast
import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import quantgate as qg
from quantgate.cli import main
from quantgate.models.families import config_of

PACKAGE = Path(qg.__file__).parent
EVIL = """\
from pathlib import Path

Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast


class EvilTok(PreTrainedTokenizerFast):
    pass


class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A checkpoint as transformers writes it (no quantgate record), with the bundled BPE tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("plain") / "model"
    config = config_of(qg.build("tiny-llama")).to_dict()
    config.pop("quantgate")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(path)
    qg.tokenizer("bpe-8192").save_pretrained(path)
    return path


def _plant(plain: Path, where: Path, file: str) -> tuple[Path, Path]:
    """A copy of ``plain`` in ``where`` whose ``file`` points at an evil.py that writes a marker file."""
    folder, marker = where / "evil-model", where / "MARKER"
    shutil.copytree(plain, folder)
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    data = json.loads((folder / file).read_text())
    if file == "tokenizer_config.json":
        data.pop("tokenizer_class", None)  # then transformers 5 takes the auto_map and asks
        data["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTok"]}
    else:
        data.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    (folder / file).write_text(json.dumps(data))
    return folder, marker


def _api(folder: Path, tmp_path: Path) -> None:
    qg.tokenizer(qg.load(folder))


def _cli(*argv: str):
    def run(folder: Path, tmp_path: Path) -> None:
        assert main([a.format(dir=folder, tmp=tmp_path) for a in argv]) == 2

    return run


def _study(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "study.yaml").write_text(f"name: x\nmodels:\n  - load: {folder}\n")
    assert main(["study", str(tmp_path / "study.yaml"), "--dry-run"]) == 2


DOORS = {
    "observe": _cli("observe", "{dir}", "--max-batches", "1", "--out", "{tmp}/observed"),
    "info": _cli("info", "{dir}"),
    "eval": _cli("eval", "{dir}", "--limit", "1"),
    "qg.load": _api,
    "study --dry-run": _study,
}


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(
    "file, fragment",
    [
        (
            "tokenizer_config.json",
            """tokenizer_config.json: field 'auto_map' ({"AutoTokenizer": [null, "evil.EvilTok"]})""",
        ),
        ("config.json", """config.json: field 'auto_map' ({"AutoConfig": "evil.EvilConfig"})"""),
    ],
)
def test_a_planted_auto_map_is_refused_in_one_line_without_asking(
    plain, tmp_path, monkeypatch, capsys, door, file, fragment
):
    folder, marker = _plant(plain, tmp_path, file)
    asked: list[str] = []

    def says_yes(prompt=""):  # a user who says yes
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", says_yes)
    monkeypatch.chdir(tmp_path)
    try:
        DOORS[door](folder, tmp_path)
        message = capsys.readouterr().err.strip()
    except ValueError as e:
        message = str(e)
    assert not asked, f"transformers asked: {asked}"
    assert not marker.exists(), "the checkpoint's code ran"
    assert fragment in message and "never runs a checkpoint's code" in message
    assert "\n" not in message and "Traceback" not in message


def test_no_terminal_no_prompt_no_stall(plain, tmp_path):
    """As a user runs it: a subprocess with stdin not a terminal does not print transformers' question."""
    folder, marker = _plant(plain, tmp_path, "tokenizer_config.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "quantgate.cli", "observe", str(folder), "--max-batches", "1"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 2 and not marker.exists()
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"quantgate observe: error: {folder / 'tokenizer_config.json'}: field 'auto_map' "
        '({"AutoTokenizer": [null, "evil.EvilTok"]}) names code shipped with the checkpoint, and quantgate never '
        "runs a checkpoint's code: delete the field if the model is a standard transformers architecture, or "
        "load it with transformers yourself where you trust the code"
    ]


def test_a_model_type_transformers_does_not_ship_is_refused_without_auto_map(plain, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(plain, folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "model_type": "evil"}))
    with pytest.raises(
        ValueError,
        match=r"config\.json: field 'model_type' is \"evil\", which transformers .* does "
        r"not ship, and quantgate never runs a checkpoint's own code",
    ):
        qg.load(folder)


# --- every loading call in quantgate/ switches remote code off ----------------------------------------

# call name -> the keyword that must be passed as False. from_pretrained / load_dataset: transformers' and
# datasets' loaders (trust_remote_code); lm-eval's simple_evaluate runs a task's own code unless told not to.
GUARDED = {
    "from_pretrained": "trust_remote_code",
    "load_dataset": "trust_remote_code",
    "load_dataset_builder": "trust_remote_code",
    "pipeline": "trust_remote_code",
    "simple_evaluate": "confirm_run_unsafe_code",
}
FORBIDDEN = {"get_class_from_dynamic_module", "get_cached_module_file"}  # loaders of a checkpoint's .py files
HFLM_SUBCLASS_INIT = "trust_remote_code"  # lm-eval's HFLM takes it too: super().__init__ of a subclass
# calls that cannot take the keyword, each with the reason; empty: every loader quantgate calls takes it
ALLOWED: dict[tuple[str, int], str] = {}


def _calls():
    """(file, line, call name, keywords) of every call of interest under quantgate/."""
    for file in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(file.read_text(), str(file))
        hflm_inits: set[int] = set()
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if any(isinstance(b, ast.Name) and b.id == "HFLM" for b in cls.bases):
                hflm_inits.update(
                    id(c)
                    for c in ast.walk(cls)
                    if isinstance(c, ast.Call)
                    and isinstance(c.func, ast.Attribute)
                    and c.func.attr == "__init__"
                    and isinstance(c.func.value, ast.Call)
                    and getattr(c.func.value.func, "id", None) == "super"
                )
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if id(node) in hflm_inits:
                name = "HFLM.__init__"
            if name in GUARDED or name in FORBIDDEN or name == "HFLM.__init__":
                yield file.relative_to(PACKAGE.parent), node.lineno, name, {k.arg: k.value for k in node.keywords}


def test_every_loading_call_passes_trust_remote_code_false():
    calls = list(_calls())
    wrong = []
    for file, line, name, keywords in calls:
        if (str(file), line) in ALLOWED:
            continue
        if name in FORBIDDEN:
            wrong.append(f"{file}:{line}: {name} loads a checkpoint's code")
            continue
        keyword = HFLM_SUBCLASS_INIT if name == "HFLM.__init__" else GUARDED[name]
        value = keywords.get(keyword)
        if not (isinstance(value, ast.Constant) and value.value is False):
            wrong.append(f"{file}:{line}: {name}(...) without {keyword}=False")
    assert not wrong, "\n".join(wrong)
    names = [name for _, _, name, _ in calls]
    # the check is not vacuous: the loaders quantgate has are found
    assert names.count("from_pretrained") >= 4 and "load_dataset" in names and "simple_evaluate" in names
    assert "HFLM.__init__" in names


def test_a_data_folder_with_a_dataset_script_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """datasets refuses a folder holding a loading script with a RuntimeError traceback; the script never runs."""
    data = tmp_path / "scr"
    data.mkdir()
    marker = tmp_path / "ran"
    (data / "scr.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (data / "train.jsonl").write_text('{"text": "some words"}\n')
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    argv = ["observe", "tiny-llama", "--data", f"hf:{data}:train", "--max-batches", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{data} holds a dataset script (scr.py), code that quantgate never runs" in err
    assert "Traceback" not in err and not marker.exists()
