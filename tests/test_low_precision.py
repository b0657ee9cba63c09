"""Models in bfloat16 / float16 (issue 32, item 7): the quantizers' arithmetic stays float32 whatever the model's
dtype, a study's ``dtype:`` runs its model in that dtype under keys of their own, and a bf16 model's quantized
perplexity matches its float32 twin's within bf16's own error."""

import json
from typing import Any

import pytest
import torch

import quantgate as qg
from quantgate.quant.quantizers import fake_quant, quantize_weight
from quantgate.study import StudyError, load_study, run_study

FORMATS = [("int8", False), ("int8", True), ("int6", False), ("int4", True), ("fp8-e4m3", True), ("fp8-e5m2", True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("fmt", "symmetric"), FORMATS)
@pytest.mark.parametrize("per_row", [False, True])
def test_fake_quant_of_a_low_precision_tensor_is_the_float32_round_trip_rounded(dtype, fmt, symmetric, per_row):
    """Definition: fake_quant(x) for a bf16/fp16 x equals the float32 round trip of the same values, rounded to
    x's dtype once at the end, and counts the same saturated values."""
    g = torch.Generator().manual_seed(hash((fmt, symmetric, per_row)) % 2**31)
    x = (torch.randn(32, 96, generator=g) * 20).to(dtype)
    xf = x.float()
    if per_row:
        lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    else:  # a range narrower than the data: some values saturate
        lo, hi = xf.min() * 0.6, xf.max() * 0.7
    y, over = fake_quant(x, lo, hi, fmt, symmetric)
    ref, ref_over = fake_quant(xf, lo, hi, fmt, symmetric)
    assert y.dtype == dtype
    assert torch.equal(y, ref.to(dtype)) and over == ref_over
    if not per_row and fmt.startswith("fp8"):
        assert over > 0  # the test's range does saturate FP8


@pytest.mark.parametrize("estimator", ["minmax", "mse"])
def test_a_bf16_weight_is_quantized_in_float32(estimator):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = quantize_weight(w, "int8", "channel", True, estimator=estimator)
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, quantize_weight(w.float(), "int8", "channel", True, estimator=estimator).bfloat16())


@pytest.mark.parametrize("scheme", ["w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-int8-bondarenko"])
def test_a_bf16_model_quantizes_like_its_float32_twin(scheme):
    """The same weights in bf16 and fp32, quantized by one scheme on the same calibration batches: their mean
    token NLL differs by no more than bf16's own float difference plus 2% (of the quantized NLL)."""
    f32 = qg.build("tiny-llama", seed=0)
    tok = qg.tokenizer(f32)
    calib = lambda: qg.data.batches(tok, "train", 32, 4, max_batches=2)
    ids = next(iter(qg.data.batches(tok, "validation", 64, 4, max_batches=1)))["input_ids"]

    def nll(model):
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]))

    bf16 = qg.build("tiny-llama", seed=0, dtype=torch.bfloat16)
    options: dict[str, Any] = (
        {"calibration": calib(), "calib": 2} if qg.quant.get_scheme(scheme).needs_calibration else {}
    )
    q32 = qg.quantize(f32, scheme, **options)
    options = {"calibration": calib(), "calib": 2} if options else {}
    q16 = qg.quantize(bf16, scheme, **options)
    assert next(q16.parameters()).dtype == torch.bfloat16
    float_gap = abs(nll(bf16) - nll(f32))
    assert abs(nll(q16) - nll(q32)) <= float_gap + 0.02 * nll(q32)


def test_a_study_dtype_is_checked_recorded_and_keyed(tmp_path):
    body = (
        "name: dt\nseed: 0\nmodels:\n  - name: m\n    preset: tiny-llama\n{dtype}"
        "schemes: [w8a8-int8-dynamic]\nobserve: {{batches: 1, seq_len: 16, batch_size: 2}}\n"
        "eval: {{tasks: [quantgate_ppl], limit: 1, max_length: 32}}\n"
    )
    f = tmp_path / "dt.yaml"
    f.write_text(body.format(dtype="    dtype: bf16\n"))
    with pytest.raises(StudyError, match=r"dt.yaml:6: .*dtype.*one of float32, bfloat16, float16"):
        load_study(f)
    f.write_text(body.format(dtype="    dtype: float32\n"))
    assert load_study(f).models[0].dtype is None  # float32 is the default: the same keys as no dtype at all
    f.write_text(body.format(dtype="    dtype: bfloat16\n"))
    assert load_study(f).models[0].dtype == "bfloat16"
    run = run_study(f, tmp_path / "bf16")
    f.write_text(body.format(dtype=""))
    plain = run_study(f, tmp_path / "fp32")
    cell = lambda r, step: json.loads(next((r / "cells").glob("m--*")).joinpath(f"{step}.json").read_text())
    assert cell(run, "eval-float")["key"] != cell(plain, "eval-float")["key"]
    assert json.loads((run / "metrics.json").read_text())["study"]["models"][0]["dtype"] == "bfloat16"
    assert "dtype" not in json.loads((plain / "metrics.json").read_text())["study"]["models"][0]


def test_the_command_line_loads_observes_quantizes_and_evaluates_in_a_dtype(tmp_path, capsys):
    """--dtype on eval, observe and quantize: the evaluation records it and scores as float32 does, within bf16's
    own error; a bad name is refused by argparse with the choices."""
    from quantgate.cli import main

    for dtype in ("float32", "bfloat16"):
        assert (
            main(
                [
                    "eval",
                    "tiny-llama",
                    "--tasks",
                    "quantgate_backcopy",
                    "--limit",
                    "1",
                    "--dtype",
                    dtype,
                    "--scheme",
                    "w8a8-int8-dynamic",
                    "--out",
                    str(tmp_path / dtype),
                ]
            )
            == 0
        )
    runs = {d: json.loads((tmp_path / d / "eval.json").read_text()) for d in ("float32", "bfloat16")}
    assert runs["bfloat16"]["settings"]["dtype"] == "bfloat16" and runs["float32"]["settings"]["dtype"] == "float32"
    ppl = {d: r["results"]["quantgate_backcopy"]["perplexity"] for d, r in runs.items()}
    assert ppl["bfloat16"] == pytest.approx(ppl["float32"], rel=0.02)
    assert (
        main(
            [
                "observe",
                "tiny-llama",
                "--dtype",
                "bfloat16",
                "--max-batches",
                "1",
                "--seq-len",
                "32",
                "--batch-size",
                "2",
                "--out",
                str(tmp_path / "obs"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "quantize",
                "tiny-llama",
                "--dtype",
                "bfloat16",
                "--scheme",
                "w8a8-int8-static",
                "--calib",
                "1",
                "--seq-len",
                "32",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    assert "logits SQNR" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", "tiny-llama", "--dtype", "bf16"])
    assert "invalid choice: 'bf16' (choose from 'float32', 'bfloat16', 'float16')" in capsys.readouterr().err
