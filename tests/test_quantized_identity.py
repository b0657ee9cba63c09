"""A saved quantized model loads as the model that was saved, or not at all (issue 31): the manifest's
``content_sha256`` covers what decides the numbers beside the weights (the scheme string, the quantizer
state in the manifest, config.json), so an edit made consistently in quantization.json and config.json
is refused on load; a manifest naming a tensor the weights file lacks is one line naming both; the
schemes that now run on MLA and on short sequences reload bit-identical logits."""

import json
import shutil
from typing import cast

import pytest
import torch
from transformers import OPTForCausalLM

import quantgate as qg

IDS = torch.randint(5, 200, (2, 16), generator=torch.Generator().manual_seed(1))


def _batches(n=2):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, 200, (2, 16), generator=g)} for _ in range(n)]


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-opt under a scheme saved in quantgate's own layout (bondarenko sites: static ranges in the
    weights file) and one saved as compressed-tensors (static ranges in the manifest)."""
    root = tmp_path_factory.mktemp("identity")
    out = {}
    for fmt, scheme in (("quantgate", "w8a8-int8-bondarenko"), ("compressed-tensors", "w8a8-int8-static")):
        q = qg.quantize(qg.build("tiny-opt", seed=0), scheme, calibration=_batches(), calib=2).eval()
        qg.save(q, root / fmt)
        assert json.loads((root / fmt / "quantization.json").read_text())["format"] == fmt
        out[fmt] = (root / fmt, _logits(q))
    return out


def _copy(saved, fmt, tmp_path):
    shutil.copytree(saved[fmt][0], tmp_path / "q")
    return tmp_path / "q"


def _edit(file, change):
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data, indent=1))


def _set_scheme(path, scheme):
    """The scheme changed alike in the manifest and in config.json's quantization record."""
    _edit(path / "quantization.json", lambda m: m.update(scheme=scheme))
    _edit(path / "config.json", lambda c: c["quantgate"]["quantization"].update(scheme=scheme))


def _rehash(path):
    """Recompute content_sha256 as a tool rewriting the manifest consistently would."""
    from quantgate.quant.manifest import content_sha256

    _edit(path / "quantization.json", lambda m: m.update(content_sha256=content_sha256(m, path)))


EDITED = r"quantization\.json or .*config\.json was edited after saving: they no longer match .*'content_sha256'"


@pytest.mark.parametrize(
    "fmt, scheme",
    [
        ("quantgate", "w8a8-int8-bondarenko:a_bits=6"),
        ("quantgate", "w8a8-int8-bondarenko:a_symmetric=true"),
        ("compressed-tensors", "w8a8-int8-static:a_symmetric=true"),
    ],
)
def test_a_scheme_edited_consistently_in_both_files_is_refused(saved, fmt, scheme, tmp_path):
    path = _copy(saved, fmt, tmp_path)
    _set_scheme(path, scheme)
    with pytest.raises(ValueError, match=EDITED):
        qg.load(path)


def test_edited_activation_ranges_in_the_manifest_are_refused(saved, tmp_path):
    path = _copy(saved, "compressed-tensors", tmp_path)
    manifest = json.loads((path / "quantization.json").read_text())
    ranges = manifest["format_state"]["act_ranges"]  # compressed-tensors' state
    name = next(iter(ranges))
    _edit(
        path / "quantization.json", lambda m: m["format_state"]["act_ranges"][name].__setitem__(1, ranges[name][1] * 2)
    )
    with pytest.raises(ValueError, match=EDITED):
        qg.load(path)


@pytest.mark.parametrize("field, value", [("layer_norm_eps", 0.1), ("activation_function", "gelu")])
def test_an_architecture_edit_in_config_json_is_refused(saved, field, value, tmp_path):
    """Edits that keep every tensor's shape would load and compute other numbers."""
    path = _copy(saved, "quantgate", tmp_path)
    _edit(path / "config.json", lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=EDITED):
        qg.load(path)


def test_an_unedited_save_loads_identically_and_records_its_content_hash(saved, tmp_path):
    for fmt, (path, logits) in saved.items():
        manifest = json.loads((path / "quantization.json").read_text())
        assert len(manifest["content_sha256"]) == 64
        assert torch.equal(_logits(qg.load(path)), logits), fmt


def _older_layout(manifest):
    """The manifest as quantgate wrote it before backends owned their state: the backend's and the format's state
    fields at the top level, and every manifest with the torchao-static backend's input_ndims (empty elsewhere)."""
    for key in ("state", "format_state"):
        manifest.update(manifest.pop(key, {}))
    manifest.setdefault("input_ndims", {})


@pytest.mark.parametrize("fmt", ["quantgate", "compressed-tensors"])
def test_a_manifest_in_the_older_layout_still_loads(saved, fmt, tmp_path):
    path = _copy(saved, fmt, tmp_path)
    _edit(path / "quantization.json", _older_layout)
    _rehash(path)
    assert "input_ndims" in json.loads((path / "quantization.json").read_text())
    assert torch.equal(_logits(qg.load(path)), saved[fmt][1])


def test_a_manifest_without_the_content_hash_is_refused(saved, tmp_path):
    path = _copy(saved, "quantgate", tmp_path)
    _edit(path / "quantization.json", lambda m: m.pop("content_sha256"))
    with pytest.raises(ValueError, match=r"quantization\.json: field 'content_sha256' is missing; save the quantized"):
        qg.load(path)


def _tied_save(tmp_path):
    """A quantized tiny OPT, whose embeddings are tied to the head: its manifest holds an alias."""
    q = qg.quantize(qg.build("tiny-opt", seed=0), "kv8-int8")
    qg.save(q, tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert manifest["aliases"], "the test needs a save with an alias"
    return tmp_path / "q", next(iter(manifest["aliases"]))


def test_a_manifest_alias_to_a_missing_tensor_is_one_line_naming_file_and_tensor(tmp_path):
    path, alias = _tied_save(tmp_path)
    _edit(path / "quantization.json", lambda m: m["aliases"].update({alias: "model.nowhere.weight"}))
    with pytest.raises(
        ValueError,
        match=r"quantization\.json: field 'aliases' maps lm_head\.weight to tensor "
        r"model\.nowhere\.weight, which .*quantized\.safetensors does not hold; "
        r"save the quantized model again",
    ) as err:
        qg.load(path)
    assert "\n" not in str(err.value)


def test_a_manifest_alias_to_another_tensor_is_refused(tmp_path):
    """An alias to a tensor the file does hold loads without a shape error, and computes other numbers."""
    path, alias = _tied_save(tmp_path)
    _edit(path / "quantization.json", lambda m: m["aliases"].update({alias: "model.decoder.embed_positions.weight"}))
    with pytest.raises(ValueError, match=EDITED):
        qg.load(path)
    _rehash(path)  # a manifest rewritten consistently passes this check (the file's structure is checked after)
    with pytest.raises(ValueError, match="does not match its config and manifest"):
        qg.load(path)


@pytest.mark.parametrize(
    "preset, scheme",
    [
        ("tiny-mla", "llm-int8"),
        ("tiny-mla", "w4a4-nvfp4"),
        ("tiny-llama", "kv4-int4:kv_granularity=channel"),
        ("tiny-opt", "w8a8-int8-static:estimator=percentile"),
    ],
)
def test_schemes_that_crashed_save_and_reload_bit_identical(preset, scheme, tmp_path):
    model = qg.build(preset, seed=0).eval()
    if preset == "tiny-opt":  # a site that sees only zeros calibrates by percentile
        cast(OPTForCausalLM, model).model.decoder.layers[0].fc1.register_forward_pre_hook(
            lambda m, args: (torch.zeros_like(args[0]),)
        )
    q = (
        qg.quantize(model, scheme, calibration=_batches(), calib=2)
        if ":estimator" in scheme
        else qg.quantize(model, scheme, calibration=_batches())
    )
    qg.save(q, tmp_path / "q")
    again = qg.load(tmp_path / "q")
    if preset == "tiny-opt":
        cast(OPTForCausalLM, again).model.decoder.layers[0].fc1.register_forward_pre_hook(
            lambda m, args: (torch.zeros_like(args[0]),)
        )
    assert torch.equal(_logits(again), _logits(q))
