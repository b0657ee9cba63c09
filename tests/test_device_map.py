"""Big-model placement (issue 33): a checkpoint loaded with a device_map that puts one block on disk (accelerate's
offload, read back as the forward reaches it) gives the whole model's logits, observe statistics and per-document
evaluation; quantization, which must read and replace every weight, refuses disk-placed weights and runs on a placed
model whose weights are in memory, with the whole model's quantized perplexity."""

import json

import pytest
import torch

import quantgate as qg
from quantgate.cli import main
from quantgate.eval.evaluate import evaluate
from quantgate.models import build
from quantgate.models.io import Placement, offloaded
from quantgate.models.sources import tokenizer

IDS = torch.randint(5, 8000, (2, 24), generator=torch.Generator().manual_seed(3))
SPLIT: dict[str, str | int] = {  # module: device (Placement's device_map)
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    qg.save(build("tiny-llama", seed=4), path)
    return path


def test_a_block_on_disk_gives_the_whole_models_numbers(checkpoint, tmp_path):
    whole = qg.load(checkpoint)
    placed = qg.load(checkpoint, placement=Placement(SPLIT, offload_folder=str(tmp_path / "offload")))
    assert offloaded(placed) and all(n.startswith("model.layers.1.") for n in offloaded(placed))
    assert not offloaded(whole)
    with torch.no_grad():
        assert torch.equal(placed(IDS).logits, whole(IDS).logits)
    stats = [qg.observe(m, [{"input_ids": IDS}], progress=False) for m in (whole, placed)]
    assert stats[1].summary == stats[0].summary and stats[1].layers == stats[0].layers
    tok = tokenizer(whole)
    one, two = (evaluate(m, tok, ["quantgate_ppl"], limit=3, batch_size=1) for m in (whole, placed))
    assert two.documents == one.documents
    assert two.settings.model_sha256 == one.settings.model_sha256  # the disk-placed weights hashed too
    with pytest.raises(ValueError, match=r"placed on disk by its device_map: .* must be in memory"):
        qg.quantize(placed, "w8a8-int8-dynamic")


def test_a_placed_model_quantizes_in_place_as_the_whole_one_does(checkpoint, tmp_path):
    """Every module placed explicitly (this machine has one device): quantized in place, the same perplexity."""
    in_memory: dict[str, str | int] = dict.fromkeys(SPLIT, "cpu")
    results = []
    for placement in (None, Placement(in_memory)):
        model = qg.load(checkpoint, placement=placement)
        calib = [{"input_ids": IDS}]
        q = qg.quantize(model, "w8a8-int8-static", calibration=calib, inplace=True, calib=1)
        assert q is model
        results.append(evaluate(q, tokenizer(q), ["quantgate_ppl"], limit=3, batch_size=1))
    assert results[1].documents == results[0].documents
    assert results[1].results == results[0].results


def test_the_command_line_places_and_refuses_what_cannot_be_placed(checkpoint, tmp_path, capsys):
    split = json.dumps(SPLIT)
    assert main(["eval", str(checkpoint), "--limit", "2", "--batch-size", "1", "--out", str(tmp_path / "whole")]) == 0
    assert (
        main(
            [
                "eval",
                str(checkpoint),
                "--limit",
                "2",
                "--batch-size",
                "1",
                "--out",
                str(tmp_path / "placed"),
                "--device-map",
                split,
                "--offload-folder",
                str(tmp_path / "off"),
            ]
        )
        == 0
    )
    whole, placed = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("whole", "placed"))
    assert placed["documents"] == whole["documents"]
    capsys.readouterr()
    quantized = tmp_path / "q8"
    assert (
        main(["quantize", str(checkpoint), "--scheme", "w8a8-int8-dynamic", "--inplace", "--out", str(quantized)]) == 0
    )
    assert "quantized in place" in capsys.readouterr().out
    for args, fragment in (
        (["eval", str(checkpoint), "--max-memory", "cpu=1GiB"], "give --device-map auto"),
        (["eval", str(checkpoint), "--device-map", "{nope"], "is not valid JSON"),
        (["eval", str(checkpoint), "--device-map", "everywhere"], "one of auto, balanced"),
        (["eval", str(checkpoint), "--max-memory", "cpu", "--device-map", "auto"], "give DEVICE=SIZE pairs"),
        (["eval", str(quantized), "--device-map", "auto"], "is a quantized checkpoint, which loads whole"),
        (["eval", "tiny-llama", "--device-map", "auto"], "is a preset, built whole"),
        (
            [
                "observe",
                str(checkpoint),
                "--variant",
                "g1-headwise",
                "--device-map",
                split,
                "--offload-folder",
                str(tmp_path / "off2"),
            ],
            "weights were placed on disk, and the g1-headwise variant's gates",
        ),
        (
            [
                "quantize",
                str(checkpoint),
                "--scheme",
                "w8a8-int8-dynamic",
                "--device-map",
                split,
                "--offload-folder",
                str(tmp_path / "off3"),
            ],
            "placed on disk by its device_map",
        ),
    ):
        assert main(args) == 2, args
        assert fragment in capsys.readouterr().err, args


@pytest.mark.slow  # a minute or more: study runs in subprocesses or twice
def test_a_study_places_its_checkpoint_and_quantizes_fresh_loads_in_place(checkpoint, tmp_path):
    """A study model with ``placement:`` loads through the device_map; each scheme quantizes a fresh load in place
    (the float model is loaded again for the next), and every number equals the same study without placement:
    observe, float and quantized per-document values, quantization error. With a block on disk and no schemes
    the float numbers equal too; placement is refused where it cannot apply."""
    from quantgate.study import StudyError, read_metrics, run_study

    def study(name, placement="", schemes="[w8a8-int8-static, w8a8-int8-dynamic]"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f"name: {name}\nseed: 0\nmodels:\n  - name: m\n    load: {checkpoint}\n    variants: [vanilla]\n"
            f"{placement}schemes: {schemes}\ncalibration: {{batches: 2, seq_len: 32, batch_size: 4}}\n"
            "observe: {batches: 1, seq_len: 32, batch_size: 4}\neval: {tasks: [quantgate_ppl], limit: 2}\n"
        )
        return path

    def cell(name, **kw):
        return read_metrics(run_study(study(name, **kw), tmp_path / name)).cells[0]

    in_memory = json.dumps(dict.fromkeys(SPLIT, "cpu"))
    whole, placed = cell("whole"), cell("placed", placement=f"    placement: {{device_map: {in_memory}}}\n")
    assert placed.observe == whole.observe and placed.float_documents == whole.float_documents
    for scheme, record in whole.schemes.items():
        assert placed.schemes[scheme].documents == record.documents, scheme
        assert placed.schemes[scheme].logits_sqnr_db == record.logits_sqnr_db, scheme
    on_disk = json.dumps(SPLIT)
    offload = f"    placement: {{device_map: {on_disk}, offload_folder: {tmp_path / 'offload'}}}\n"
    disk = cell("disk", placement=offload, schemes="[]")
    assert disk.observe == whole.observe and disk.float_documents == whole.float_documents
    for placement, fragment in (
        ("    placement: {max_memory: {cpu: 1GiB}}\n", "placement needs device_map"),
        ("    placement: {device_map: everywhere}\n", "device_map 'everywhere': one of auto"),
        ("    placement: {device_map: auto, spread: 2}\n", "unknown key 'spread'"),
        ("    placement: {device_map: auto}\n    train: {steps: 1}\n", "give the model 'load:' and no 'train:'"),
    ):
        with pytest.raises(StudyError, match=fragment):
            run_study(study("bad", placement=placement), tmp_path / "bad")
