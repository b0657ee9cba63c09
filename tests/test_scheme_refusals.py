"""Every scheme or variant string the package accepts either works or says why (issue 31): options a
scheme would not read, keys and components given twice, keep patterns that match nothing and values
that overflow are refused with one line naming the option; schemes that crashed on some families or
inputs run; a quantized model is never quantized again; outputs that cannot be scored are refused."""

import dataclasses
import importlib
import json
import logging
from typing import Any, cast

import pytest
import torch
from conftest import FAMILY_PRESETS
from transformers import BertForMaskedLM, LlamaForCausalLM, OPTForCausalLM

import quantgate as qg
from quantgate.cli import main
from quantgate.quant import get_scheme
from quantgate.quant.quantizers import RangeObserver
from quantgate.quant.schemes import SimulatedScheme, TorchaoScheme
from quantgate.variants import AttentionVariant


def _batches(n=1, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, 200, (2, seq), generator=g)} for _ in range(n)]


def _quantize(model, scheme, seq=16):
    s = get_scheme(scheme)
    if s.needs_calibration:
        return qg.quantize(model, scheme, calibration=_batches(1, seq), calib=1)
    return qg.quantize(model, scheme)


# --- 1. one parser refuses what it cannot honour, naming the option -----------------------------

SCHEME, VARIANT = get_scheme, AttentionVariant.parse


@pytest.mark.parametrize(
    "parse, text, fragment",
    [
        # an option the scheme, as its other options set it up, never reads
        (SCHEME, "w8a8-int8-dynamic:estimator=mse", "estimator=mse does nothing here: it calibrates static"),
        (SCHEME, "w8a8-int8-dynamic:percentile=99.9", "percentile=99.9 does nothing here"),
        (
            SCHEME,
            "torchao-int8-weight-only:smooth=0.5",
            "smooth=0.5 does nothing here: it migrates activation outliers",
        ),
        (
            SCHEME,
            "torchao-fp8-weight-only:smooth=0.5",
            "nothing to smooth (torchao-int8-dynamic and torchao-int8-static",
        ),
        (
            SCHEME,
            "w8a8-int8-static:momentum=0.5,estimator=minmax",
            "running-minmax reads it, and the estimator is minmax",
        ),
        (SCHEME, "w8a8-int8-static:percentile=99", "percentile=99.0 does nothing here: estimator=percentile reads it"),
        (SCHEME, "w8-int8:group_size=64", "group_size=64 does nothing here: it sizes weight groups"),
        (
            SCHEME,
            "w8a8-fp8-e4m3:a_symmetric=false",
            "a_symmetric=false does nothing here: fp8-e4m3 scales are symmetric",
        ),
        (SCHEME, "w4a4-nvfp4:w_granularity=channel", "w_granularity=channel does nothing here: the weights are nvfp4"),
        (SCHEME, "w4a4-mxfp4:estimator=mse", "estimator=mse does nothing here: the activations are mxfp4"),
        (
            SCHEME,
            "kv4-int4:kv_group=16",
            "kv_group=16 does nothing here: it sizes kv_granularity=group or channel ranges",
        ),
        (SCHEME, "kv8-int8:keep=model.layers.0*", "does nothing here: this scheme quantizes the KV cache alone"),
        (SCHEME, "kv8-int8:acts=bondarenko", "acts=bondarenko does nothing here"),
        (SCHEME, "w8-int8:sink=0", "sink=0 does nothing here"),
        # calibration batches for a scheme that calibrates nothing; keep=auto where nothing finds the FFNs
        (SCHEME, "w8a8-int8-dynamic:calib=4", "calib=4 does nothing here: it counts calibration batches"),
        (SCHEME, "kv4-int4:calib=2", "calib=2 does nothing here"),
        (SCHEME, "torchao-int8-weight-only:calib=3", "calib=3 does nothing here"),
        (SCHEME, "torchao-int8-dynamic:keep=auto", "keep=auto finds the FFNs with massive activations"),
        (SCHEME, "llm-int8:keep=auto", "only quantgate's simulated schemes run; name the modules"),
        # ... also when it restates the value the scheme has anyway
        (SCHEME, "w8a8-int8-dynamic:estimator=minmax", "estimator=minmax does nothing here"),
        # a key given twice: which value was meant cannot be known
        (SCHEME, "w8a8-int8-static:a_bits=6,a_bits=4", "a_bits is given twice ('6' and '4'); give it once"),
        (SCHEME, "llm-int8:threshold=4,threshold=4", "threshold is given twice"),
        # variants: components and parameters given twice, values that overflow
        (VARIANT, "clipped:gamma=-0.1+clipped:gamma=-0.3", "names clipped twice; give each component once"),
        (VARIANT, "sink+sink:init=-2", "names sink twice"),
        (VARIANT, "clipped:gamma=-0.1,gamma=-0.3", "clipped: gamma is given twice ('-0.1' and '-0.3')"),
        (VARIANT, "g1-headwise:pi_init=0.3,pi_init=0.4", "pi_init is given twice"),
        (VARIANT, "hyga:d_int=4,low_rank=8", "hyga: d_int is another name for low_rank; give one of them"),
        # beyond 1e4 float16 overflows in the softmax (and 1e40 overflowed float32 after parsing)
        (VARIANT, "sink:init=1e40", "sink: init must be in [-10000, 10000], got 1e+40"),
        (VARIANT, "clipped:gamma=-1e40", "clipped: gamma must be in [-10000, 0]"),
        (VARIANT, "clipped:zeta=1e40", "clipped: zeta must be in [1, 10000]"),
        (VARIANT, "clipped:alpha=1e40", "clipped: alpha must be in [0, 10000]"),
    ],
)
def test_a_string_is_refused_naming_the_option(parse, text, fragment):
    with pytest.raises(ValueError) as err:
        parse(text)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        "w8a8-int8-dynamic:dynamic=false,a_granularity=tensor,estimator=mse",
        "w8a8-int8-static:estimator=percentile,percentile=99.9",
        "w8a8-int8-static:estimator=running-minmax,momentum=0.5",
        "w4-int4-group:group_size=64",
        "kv4-int4:kv_granularity=channel,kv_group=16",
        "kv4-int4:sink=2",
        "torchao-int8-dynamic:smooth=0.5",
        "w8a8-int8-dynamic:smooth=0.8",
        "w8a8-int8-static:a_symmetric=true",
        "w8-int8:keep=lm_head",
        "w8a8-int8-dynamic:smooth=0.5,calib=4",
        "w8a8-int8-dynamic:keep=auto,calib=3",
        "w4a4-nvfp4:calib=2",  # an export's static activation scales
        "torchao-int8-static:calib=2",
    ],
)
def test_options_a_scheme_reads_still_parse_and_print_back(text):
    s = get_scheme(text)
    assert get_scheme(str(s)) == s


def test_a_scheme_built_in_python_with_an_unread_option_is_refused_too():
    """parse(str(s)) == s holds for every scheme that can be built: one that str() would print with an
    option that parse() refuses cannot be built either."""
    s = get_scheme("w8a8-int8-dynamic")
    assert isinstance(s, SimulatedScheme) and s.act is not None
    with pytest.raises(ValueError, match="estimator=mse does nothing here"):
        dataclasses.replace(s, act=dataclasses.replace(s.act, estimator="mse"))
    with pytest.raises(ValueError, match=r"smooth=0\.5 does nothing here"):
        dataclasses.replace(cast(TorchaoScheme, get_scheme("torchao-int8-weight-only")), smooth=0.5)


def test_keyword_options_go_through_the_same_checks():
    with pytest.raises(ValueError, match="estimator=mse does nothing here"):
        qg.quantize(qg.build("tiny-llama"), "w8a8-int8-dynamic", estimator="mse")
    with pytest.raises(ValueError, match="a_bits is given twice"):
        qg.quantize(qg.build("tiny-llama"), "w8a8-int8-static:a_bits=6", calibration=_batches(), a_bits=4)


def test_refusals_are_one_line_cli_errors(capsys):
    assert main(["quantize", "tiny-llama", "--scheme", "w8a8-int8-dynamic:estimator=mse"]) == 2
    assert main(["info", "tiny-llama", "--variant", "sink:init=1e40"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err and "does nothing here" in err and "init must be in" in err


def test_cli_calib_for_a_scheme_that_calibrates_nothing_is_refused_before_loading(capsys):
    assert main(["quantize", "no-such-model", "--scheme", "w8a8-int8-dynamic", "--calib", "4"]) == 2
    assert main(["quantize", "no-such-model", "--scheme", "w4a4-nvfp4", "--calib", "2"]) == 2  # no --out
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("--calib 4 does nothing here: w8a8-int8-dynamic calibrates nothing; leave it out")
    assert err[1].endswith("w4a4-nvfp4 calibrates nothing unless it is saved (--out); leave it out")


# --- 2. a keep pattern that matches nothing ------------------------------------------------------


@pytest.mark.parametrize("scheme", ["w8a8-int8-static", "w8-int8", "torchao-int8-weight-only", "llm-int8"])
def test_a_keep_pattern_matching_no_module_is_refused_with_real_names(scheme):
    model = qg.build("tiny-llama", seed=0)
    with pytest.raises(ValueError) as err:
        qg.quantize(model, f"{scheme}:keep=model.layrs.0*", calibration=_batches())
    text = str(err.value)
    assert "keep pattern 'model.layrs.0*' matches no module of this model" in text and "model.layers.0" in text
    assert qg.quantization_of(model) is None  # nothing changed
    with pytest.raises(ValueError, match="keep pattern 'nothing' matches no module"):
        qg.quantize(model, f"{scheme}:keep=model.layers.0*|nothing", calibration=_batches())


def test_a_keep_pattern_that_matches_is_accepted():
    q = cast(LlamaForCausalLM, qg.quantize(qg.build("tiny-llama", seed=0), "w8-int8:keep=model.layers.1*|lm_head"))
    float_weight = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0)).model.layers[1].mlp.up_proj.weight
    assert torch.equal(q.model.layers[1].mlp.up_proj.weight, float_weight)


# --- 3. schemes that crashed on accepted input now run ------------------------------------------


@pytest.mark.parametrize(
    "preset, scheme, seq",
    [
        ("tiny-llama", "kv4-int4:kv_granularity=channel", 16),  # fewer tokens than a block of kv_group=32
        ("tiny-llama", "kv4-int4:kv_granularity=channel", 40),  # one block and a residual
        ("tiny-mla", "llm-int8", 16),  # MLA's kv_b_proj takes (B, 1, N, C) inputs
        ("tiny-mla", "w4a4-nvfp4", 16),
        ("tiny-mla", "w4a4-mxfp4", 16),
    ],
)
def test_schemes_that_crashed_now_run(preset, scheme, seq):
    model = qg.build(preset, seed=0).eval()
    q = _quantize(model, scheme, seq)
    ids = _batches(1, seq, seed=1)[0]["input_ids"]
    with torch.no_grad():
        ref, out = model(ids).logits, q(ids).logits
    assert torch.isfinite(out).all() and out.shape == ref.shape
    err = (out - ref).square().mean() / ref.square().mean()
    assert 0 < err < 0.2  # quantized, and still the model


def test_kv_channel_keys_under_one_block_stay_in_full_precision():
    """KIVI's residual: the incomplete last block of keys is kept in full precision, so under kv_group
    tokens only the values are quantized."""
    model = qg.build("tiny-llama", seed=0).eval()
    ids = _batches(1, 16, seed=1)[0]["input_ids"]
    channel = qg.quantize(model, "kv4-int4:kv_granularity=channel")
    values = qg.quantize(model, "kv4-int4")
    for attn in values.modules():
        fake_quant = getattr(attn, "qg_fake_quant", None)
        if fake_quant is not None:
            fake_quant["k"] = torch.nn.Identity()
    with torch.no_grad():
        assert torch.equal(channel(ids).logits, values(ids).logits)


@pytest.mark.parametrize("estimator", ["percentile", "mse", "minmax", "running-minmax"])
def test_a_quantizer_that_saw_only_zeros_gets_the_range_zero(estimator):
    observer = RangeObserver(estimator)
    observer.update(torch.zeros(4, 8))
    lo, hi = observer.range("int8", False)
    assert float(lo) == 0.0 and float(hi) == 0.0


def test_percentile_calibration_of_a_zero_site_quantizes():
    model = cast(OPTForCausalLM, qg.build("tiny-opt", seed=0).eval())
    fc1 = model.model.decoder.layers[0].fc1
    fc1.register_forward_pre_hook(lambda m, args: (torch.zeros_like(args[0]),))
    q = qg.quantize(model, "w8a8-int8-static:estimator=percentile", calibration=_batches(2), calib=2)
    with torch.no_grad():
        assert torch.isfinite(q(_batches(1, seed=1)[0]["input_ids"]).logits).all()


FAMILIES = [*FAMILY_PRESETS, "tiny-qwen3-next"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", FAMILIES)
def test_every_named_scheme_runs_on_every_family_or_says_why(preset):
    """The scheme x family table: each named scheme quantizes and gives finite logits, or is refused with
    a one-line reason (here only torchao-fp8-dynamic, which needs an FP8 GPU)."""
    model = qg.build(preset, seed=0).eval()
    ids = _batches(1, seed=1)[0]["input_ids"]
    refused = {}
    for name in qg.quant.SCHEMES:
        try:
            q = _quantize(model, name)
        except qg.quant.HardwareUnavailable as e:
            refused[name] = str(e)
            continue
        with torch.no_grad():
            assert torch.isfinite(q(ids).logits).all(), name
    assert set(refused) <= {"torchao-fp8-dynamic"} and all("\n" not in r for r in refused.values())


# --- 4. a quantized model is not quantized again -------------------------------------------------


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("requant") / "q"
    qg.save(qg.quantize(qg.build("tiny-llama", seed=0), "w8-int8"), path)
    return path


@pytest.mark.parametrize("how", ["twice", "inplace", "dequantize", "loaded"])
def test_quantize_refuses_a_model_quantgate_quantized(how, quantized_dir):
    model = qg.load(quantized_dir) if how == "loaded" else qg.quantize(qg.build("tiny-llama", seed=0), "w8-int8")
    kwargs: dict[str, Any] = (
        {"inplace": True} if how == "inplace" else {"dequantize": True} if how == "dequantize" else {}
    )
    with pytest.raises(ValueError) as err:
        qg.quantize(model, "w8a8-int8-dynamic", **kwargs)
    assert "already quantized (w8-int8)" in str(err.value) and "(tiny-llama)" in str(err.value)
    if how == "dequantize":
        assert "cannot be dequantized" in str(err.value)
    record = qg.quantization_of(model)
    assert record is not None and record.scheme == "w8-int8"


@pytest.mark.parametrize("command", ["quantize", "eval"])
def test_the_cli_refuses_to_requantize_a_quantized_directory(command, quantized_dir, tmp_path, capsys):
    argv = [command, str(quantized_dir), "--scheme", "w8a8-int8-dynamic"]
    argv += ["--out", str(tmp_path / "out")] + (["--limit", "1"] if command == "eval" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already quantized (w8-int8)" in err
    assert not (tmp_path / "out").exists()


def test_eval_names_the_scheme_option_it_refuses(quantized_dir):
    from quantgate.eval.load import load_for_eval

    with pytest.raises(
        ValueError,
        match=r"is already quantized \(w8-int8\); scheme \(--scheme\) quantizes a float "
        r"model: evaluate .* as it is, without a scheme, or give its float source "
        r"\(tiny-llama\)",
    ):
        load_for_eval(str(quantized_dir), scheme="w8a8-int8-dynamic")


# --- 5. outputs that cannot be scored ------------------------------------------------------------


def _nan_model():
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0).eval())
    model.model.norm.register_forward_hook(lambda m, args, out: out * float("nan"))
    return model


@pytest.mark.parametrize("task", ["quantgate_ppl", "quantgate_nextsent", "quantgate_cloze", "quantgate_backcopy"])
def test_evaluate_refuses_non_finite_outputs_naming_task_and_document(task):
    """quantgate_nextsent scored NaN log-likelihoods as accuracy 0 and quantgate_ppl printed nothing."""
    from quantgate.eval.checks import NonFiniteOutputs

    with pytest.raises(NonFiniteOutputs) as err:
        qg.evaluate(_nan_model(), tasks=[task], limit=2, batch_size=2)
    assert str(err.value).startswith(f"{task}: document 0 scores a log-likelihood of nan")
    assert task not in err.value.partial["results"]


def _nan_after_the_first_task(monkeypatch, evaluate):
    """tiny-llama, finite for the lm-eval task, NaN from quantgate_backcopy (a computed task run after it)."""
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0).eval())
    poisoned: list[int] = []
    model.model.norm.register_forward_hook(lambda m, args, out: out * float("nan") if poisoned else out)
    scorers = importlib.import_module("quantgate.eval.computed")  # the backcopy task's row calls it there
    backcopy = scorers.backcopy_documents

    def poisoning_backcopy(*a, **k):
        poisoned.append(1)
        return backcopy(*a, **k)

    monkeypatch.setattr(scorers, "backcopy_documents", poisoning_backcopy)
    return model


def test_what_was_scored_before_the_non_finite_task_is_kept(monkeypatch):
    evaluate = importlib.import_module("quantgate.eval.evaluate")

    model = _nan_after_the_first_task(monkeypatch, evaluate)
    with pytest.raises(evaluate.NonFiniteOutputs) as err:
        qg.evaluate(model, tasks=["quantgate_nextsent", "quantgate_backcopy"], limit=2, batch_size=2)
    assert str(err.value).startswith("quantgate_backcopy: document 0")
    assert set(err.value.partial["results"]) == {"quantgate_nextsent"}
    assert err.value.partial["results"]["quantgate_nextsent"]["acc"] >= 0


def test_cli_eval_of_a_nan_model_exits_nonzero_with_one_line(monkeypatch, capsys):
    import quantgate.cli as cli

    monkeypatch.setattr(cli, "load_for_eval", lambda *a, **k: _nan_model())
    assert main(["eval", "tiny-llama", "--tasks", "quantgate_ppl", "--limit", "2"]) == 2
    captured = capsys.readouterr()
    assert "quantgate_ppl: document 0 scores a log-likelihood of nan" in captured.err
    error = captured.err.splitlines()[-1]  # after lm-eval's progress bars
    assert error.startswith("quantgate eval: error: quantgate_ppl: document 0") and "Traceback" not in captured.err
    assert "quantgate_ppl:" not in captured.out


def test_cli_eval_keeps_the_tasks_finished_before_a_non_finite_one(monkeypatch, capsys, tmp_path):
    """quantgate eval --out: the tasks scored before the NaN one are written to eval.partial.json and named."""
    import quantgate.cli as cli

    model = _nan_after_the_first_task(monkeypatch, importlib.import_module("quantgate.eval.evaluate"))
    monkeypatch.setattr(cli, "load_for_eval", lambda *a, **k: model)
    argv = ["eval", "tiny-llama", "--tasks", "quantgate_nextsent,quantgate_backcopy", "--limit", "2"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("quantgate eval: error: quantgate_backcopy: document 0") and "eval.partial.json" in error
    partial = json.loads((tmp_path / "run" / "eval.partial.json").read_text())
    assert set(partial["results"]) == {"quantgate_nextsent"} and not (tmp_path / "run" / "eval.json").exists()


@pytest.mark.parametrize("task", ["quantgate_ppl", "quantgate_nextsent"])
def test_lm_evals_own_cli_refuses_a_nan_model_and_writes_nothing(task, monkeypatch, capsys, tmp_path):
    """`quantgate lm-eval` (lm-eval's command line): lm-eval itself writes NaN metrics and exits 0."""
    lm_eval_models = importlib.import_module("quantgate.eval.lm_eval_models")

    monkeypatch.setattr(lm_eval_models, "_load", lambda *a, **k: _nan_model())
    # lm-eval's log handlers can outlive an earlier test's captured stream: not this command's output
    monkeypatch.setattr(logging, "raiseExceptions", False)
    argv = [
        "lm-eval",
        "run",
        "--model",
        "quantgate",
        "--model_args",
        "pretrained=tiny-llama",
        "--tasks",
        task,
        "--limit",
        "2",
        "--output_path",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    kind = "loglikelihood_rolling" if task == "quantgate_ppl" else "loglikelihood"
    assert f"quantgate lm-eval: error: {kind} request 1 of " in err and "scored nan" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_pll_model_refuses_a_nan_score_too():
    from quantgate.eval.checks import NonFiniteOutputs
    from quantgate.eval.lm_eval_models import PseudoLogLikelihoodLM

    model = cast(BertForMaskedLM, qg.build("tiny-bert", seed=0).eval())
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: out * float("nan"))
    lm = PseudoLogLikelihoodLM(model, qg.tokenizer(model))
    request = type("Request", (), {"args": ("The cat sat on the mat.",), "doc_id": 7})()
    with pytest.raises(NonFiniteOutputs, match=r"loglikelihood_rolling request 1 of 1 \(document 7: 'The cat"):
        lm.loglikelihood_rolling([request])
