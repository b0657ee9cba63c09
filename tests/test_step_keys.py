"""A study step's key is what its cached file is found by: the step objects of quantgate/study/steps.py compute
the keys the code before them computed, byte for byte, so a cached run does not compute again. The reference is
that code's formulas, copied below as they were (study/steps.py at eadd333, over the model entry as config.yaml
records it); the keys it gave for a study are pinned, and the committed quickstart run's files carry them."""

import dataclasses
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from quantgate.data.batches import cache_dir, source_sha256
from quantgate.files import content_sha256
from quantgate.models.sources import PACKAGED, package_dir, resolve
from quantgate.study import load_study, steps
from quantgate.study.grid import cell_dir, slug
from quantgate.study.schema import DEFAULT_STUDY
from quantgate.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]

# --- the reference: the formulas of the code before Step objects, as they were --------------------------------
EVAL_FORMAT = "per-document values, quantgate_ppl 2.0, backcopy after the first prediction"
STEP_FORMATS = {"model": 1, "observe": 2, "eval-float": 2, "cost": 1, "scheme": 2}  # 2: per-document text hashes
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.gguf", "*.bin", "*.model", "*.txt", "*.tiktoken", "*.jinja")
ROLLING_TASKS = ("quantgate_ppl",)


def step_kind(name: str) -> str:
    return "scheme" if name.startswith("scheme-") else name


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _content_keys(m) -> list[str]:
    memo = cache_dir() / "content-sha256.json"
    keys = []
    load_from = m.source.get("load")
    if load_from is not None:
        folder = package_dir(load_from) if load_from in PACKAGED else resolve(load_from)
        keys.append(content_sha256(folder, patterns=CHECKPOINT_FILES, memo=memo))
    data = source_sha256(str((m.train or {}).get("data", "")))
    return keys + ([data] if data else [])


def _data_keys(*sources: str) -> list[str]:
    return [k for k in map(source_sha256, sources) if k]


def _eval_settings(m):
    if m.train is None or m.eval.max_length is not None or not set(m.eval.tasks) & set(ROLLING_TASKS):
        return m.eval
    return dataclasses.replace(m.eval, max_length=m.train.get("seq_len", TrainConfig.seq_len))


def old_keys(study, cell) -> dict[str, str]:
    """{step file name: key} of ``cell`` as the old ``_CellRun`` and ``_run_cell`` computed them."""
    raw = study.raw["models"][study.models.index(cell.model)]  # the model entry with dicts, as the old spec held it
    m = SimpleNamespace(**{f.name: getattr(cell.model, f.name) for f in dataclasses.fields(cell.model)})
    m.source, m.train, m.schemes = raw["source"], raw["train"], raw["schemes"]
    keys = {}

    def step(name, key):
        version = STEP_FORMATS[step_kind(name)]
        keys[name] = key if version == 1 else _key(key, "format", version)

    dtype = ["dtype", m.dtype] if m.dtype else []
    model_key = _key("model", m.source, cell.variant, m.train, cell.seed, *_content_keys(m), *dtype)
    step("model", model_key)
    ob_cfg = m.observe
    step("observe", _key(model_key, ob_cfg.as_dict(), *_data_keys(ob_cfg.data)))
    ev_cfg = _eval_settings(m)
    step("eval-float", _key(model_key, ev_cfg.as_dict(), EVAL_FORMAT))
    step("cost", model_key)
    data = _data_keys(m.calibration.data, m.observe.data)
    for entry in m.schemes:
        scheme = entry["scheme"]
        cfg = dataclasses.replace(ev_cfg, tasks=entry["tasks"] or ev_cfg.tasks)
        key = _key(model_key, scheme, m.calibration.as_dict(), cfg.as_dict(), m.observe.as_dict(), EVAL_FORMAT, *data)
        step(f"scheme-{slug(scheme)}", key)
    return keys


# --- the keys of the code now ---------------------------------------------------------------------------------


def new_keys(cell, cdir: Path) -> dict[str, str]:
    """{step file name: key} of ``cell`` as the step objects compute them (no step runs)."""
    run = steps._CellRun(cell, cdir)
    return {name: step.key_of(run, entry) for step, name, entry in run.planned()}


STUDY = """name: keys
seed: 3
models:
  - name: built
    preset: tiny-llama
    config: {num_hidden_layers: 1}
    variants: [vanilla, g1-headwise]
    seeds: [0, 1]
    dtype: bfloat16
    train: {steps: 3, batch_size: 2, seq_len: 16, lr: 0.001, betas: [0.9, 0.95]}
    eval: {tasks: [quantgate_ppl, quantgate_cloze], limit: {quantgate_ppl: 2}}
    schemes:
      - {scheme: w8a8-int8-static, tasks: [quantgate_ppl]}
      - w8-int8
  - name: loaded
    load: twin-vanilla
    observe: {seq_len: 32, sink_tokens: 2}
    calibration: {data: backcopy, batches: 2}
variants: [vanilla]
schemes: [{scheme: w8a8-int8-bondarenko, a_bits: [8, 6]}, w8a8-int8-dynamic]
calibration: {batches: 1, seq_len: 16, batch_size: 2}
eval: {tasks: [quantgate_ppl], limit: 1, batch_size: 4}
"""
# the keys the code before Step objects gave STUDY's cells (run at eadd333)
PINNED = {
    "built/vanilla-seed0": {
        "model": "f8078f3f27699890",
        "observe": "52e0f4a2f121490d",
        "eval-float": "705eca08ee8a0547",
        "cost": "f8078f3f27699890",
        "scheme-w8a8-int8-static": "fa875f4130534402",
        "scheme-w8-int8": "dac40ac17483fee8",
    },
    "built/vanilla-seed1": {
        "model": "3c4d0f5bcf4bbb3e",
        "observe": "d3dea88b96482f0d",
        "eval-float": "62f79687ef7e1183",
        "cost": "3c4d0f5bcf4bbb3e",
        "scheme-w8a8-int8-static": "6efb168f5f72a631",
        "scheme-w8-int8": "8cb1a48a6995a169",
    },
    "built/g1-headwise-seed0": {
        "model": "47e763438e9da36f",
        "observe": "c836da19bafd24ad",
        "eval-float": "26fdc82cc34a9be1",
        "cost": "47e763438e9da36f",
        "scheme-w8a8-int8-static": "80f04a3f0c3bea7e",
        "scheme-w8-int8": "c5f93d5707eddf8d",
    },
    "built/g1-headwise-seed1": {
        "model": "a395356889da2c58",
        "observe": "ee169968aa4a0ad1",
        "eval-float": "802f6238bed0c71b",
        "cost": "a395356889da2c58",
        "scheme-w8a8-int8-static": "4cfa5976c06a9119",
        "scheme-w8-int8": "e6e9c614d926bf42",
    },
    "loaded/vanilla": {
        "model": "15dcdb4be365936c",
        "observe": "deb0d96a5530bb2b",
        "eval-float": "492c7ded402a8f1e",
        "cost": "15dcdb4be365936c",
        "scheme-w8a8-int8-bondarenko": "23fa9266b8e2d8af",
        "scheme-w8a8-int8-bondarenko_a_bits_6": "f5d9973fb5c29688",
        "scheme-w8a8-int8-dynamic": "0fbf921cf71f2741",
    },
}


def test_step_keys_are_the_old_codes(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(STUDY)
    study = load_study(f)
    for cell in study.cells():
        assert new_keys(cell, tmp_path) == old_keys(study, cell) == PINNED[cell.id], cell.id


def test_keys_with_local_data_and_a_loaded_checkpoint_are_the_old_codes(tmp_path):
    """Local data files (their sha256 follows the legacy text in a scheme's key) and a training data source."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"The cat sat on the mat {i}. " * 8}) + "\n" for i in range(8))
    )
    source = f'"hf:{data}:train"'
    f = tmp_path / "keys.yaml"
    f.write_text(
        f"models:\n  - name: t\n    preset: tiny-llama\n    train: {{steps: 2, data: {source}}}\n"
        f"  - name: l\n    load: twin-g1\n    variants: [g1-elementwise]\n"
        f"schemes: [w8a8-int8-static]\nobserve: {{data: {source}, seq_len: 32}}\ncalibration: {{data: {source}}}\n"
    )
    study = load_study(f)
    for cell in study.cells():
        keys = new_keys(cell, tmp_path)
        assert keys == old_keys(study, cell), cell.id
        assert len(set(keys.values())) == len(keys) - 1  # the model's and the cost's are one


def test_the_committed_quickstart_runs_cached_steps_are_found():
    """Every step file of the committed quickstart run carries the key the code computes for it."""
    run = ROOT / "results" / "quickstart"
    study = load_study(DEFAULT_STUDY)
    for cell in study.cells():
        cdir = cell_dir(run, cell.model.name, cell.id)
        keys = new_keys(cell, cdir)
        assert keys == {p.stem: json.loads(p.read_text())["key"] for p in cdir.glob("*.json")}, cell.id
