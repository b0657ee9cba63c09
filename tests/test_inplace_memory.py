"""In-place quantization in blocks (issue 44): the chunked weight quantizer against the whole-tensor arithmetic
it replaced, bit for bit, alone and in a quantized model; the torchao handler one Linear at a time against
torchao on the whole model; the memory helpers."""

from typing import cast

import pytest
import torch
from transformers import LlamaForCausalLM

import quantgate as qg
from quantgate.quant import fingerprint, heap, quantizers, simulate
from quantgate.quant.quantizers import _grouped, fake_quant, qparams, quantize_weight_qparams


@torch.no_grad()
def reference_qparams(w, fmt, granularity="tensor", symmetric=True, group_size=128, estimator="minmax", **unused):
    """quantize_weight_qparams as it was before blocks: the whole tensor in float32 at once, a new tensor."""
    g = _grouped(w.float(), granularity, group_size)
    lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    if estimator == "mse":
        best_err = torch.full_like(lo, float("inf"))
        best = (lo, hi)
        for r in torch.linspace(0.5, 1.0, 20):
            q, _ = fake_quant(g, lo * r, hi * r, fmt, symmetric)
            err = (q - g).square().sum(dim=1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, lo * r, best[0]), torch.where(better, hi * r, best[1]))
        lo, hi = best
    q, _ = fake_quant(g, lo, hi, fmt, symmetric)
    scale, zero = qparams(lo, hi, fmt, symmetric)
    shape = (1,) if granularity == "tensor" else (w.shape[0], -1)
    return q.reshape(w.shape).to(w.dtype), scale.reshape(shape), zero.reshape(shape)


def reference_weight(w, fmt, granularity="tensor", symmetric=True, group_size=128, estimator="minmax", **unused):
    return reference_qparams(w, fmt, granularity, symmetric, group_size, estimator)[0]


def _weight(shape, dtype):
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 0.1  # rows of different scales, a few outliers
    w.view(-1)[torch.randperm(w.numel())[:5]] *= 20
    return w.to(dtype)


FORMATS = [("int8", True), ("int4", False), ("fp8-e4m3", True)]
GRANULARITIES = [("tensor", 128), ("channel", 128), ("group", 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("estimator", ["minmax", "mse"])
@pytest.mark.parametrize("granularity, group_size", GRANULARITIES)
@pytest.mark.parametrize("fmt, symmetric", FORMATS)
@pytest.mark.parametrize("chunk", [100, 1000, None])  # row pairs (channel), ragged blocks, the default: one block
def test_blocks_are_bit_identical_to_the_whole_tensor(fmt, symmetric, granularity, group_size, estimator, dtype, chunk):
    w = _weight((37, 64), dtype)  # 37 rows: block bounds that would leave a single row at the end
    want = reference_qparams(w, fmt, granularity, symmetric, group_size, estimator)
    for inplace in (False, True):
        x = w.clone()
        got = quantize_weight_qparams(
            x, fmt, granularity, symmetric, group_size, estimator, inplace=inplace, chunk=chunk
        )
        assert (got[0].data_ptr() == x.data_ptr()) == inplace  # in place: the values written into x itself
        assert torch.equal(x, got[0] if inplace else w)  # a copy leaves x as it was
        for a, b in zip(got, want, strict=True):
            assert a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, symmetric", FORMATS)
def test_per_tensor_mse_on_a_tensor_that_threads_split(monkeypatch, fmt, symmetric, dtype):
    """Past 32768 values float32's sum over one row is split between threads: the blocks' float64 sums choose
    the clipping ratio where it is clear, the tensor-sized float32 sums where it is not (forced here)."""
    w = _weight((64, 1024), dtype)
    want = reference_qparams(w, fmt, "tensor", symmetric, 128, "mse")
    for margin in (quantizers.MSE_MARGIN, float("inf")):
        monkeypatch.setattr(quantizers, "MSE_MARGIN", margin)
        got = quantize_weight_qparams(w.clone(), fmt, "tensor", symmetric, 128, "mse", inplace=True, chunk=16384)
        for a, b in zip(got, want, strict=True):
            assert a is not None and torch.equal(a, b)


def test_a_tensor_that_cannot_be_written_comes_back_new():
    w = _weight((64, 32), torch.float32).t()  # not contiguous
    before = w.clone()
    q = quantize_weight_qparams(w, "int8", "channel", inplace=True, chunk=64)[0]
    assert q.data_ptr() != w.data_ptr() and torch.equal(w, before)
    assert torch.equal(q, reference_qparams(w, "int8", "channel")[0])
    with torch.inference_mode():
        frozen = _weight((8, 16), torch.float32)
    assert quantize_weight_qparams(frozen, "int8", inplace=True)[0].data_ptr() != frozen.data_ptr()


def _calibration():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 8192, (2, 24), generator=g)} for _ in range(2)]


MODEL_SCHEMES = [
    "w8a8-int8-static",  # per tensor, min-max, INT8
    "w8a8-int8-static:w_estimator=mse",
    "w8a8-int8-dynamic",  # per channel
    "w8-int8:w_estimator=mse",
    "w4-int4-group",  # groups, asymmetric INT4
    "w4-int4-group:w_estimator=mse",
    "w8a8-fp8-e4m3",  # per tensor, FP8
    "w8a8-fp8-e4m3:w_estimator=mse",
    "w8a8-int8-bondarenko",  # embedding (tied to the head: a new table) and norm weights too
    "w8a8-int8-bondarenko:w_estimator=mse",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", MODEL_SCHEMES)
def test_a_model_quantized_in_place_in_blocks_is_bit_identical(monkeypatch, scheme, dtype):
    """tiny-llama quantized in place in blocks of 1000 values (its embedding table in 525, each Linear in 5 or
    more) against the same model quantized by the whole-tensor arithmetic, every tensor compared."""
    calibration = _calibration()
    with monkeypatch.context() as m:
        m.setattr(simulate, "quantize_weight_qparams", reference_qparams)
        m.setattr(simulate, "quantize_weight", reference_weight)
        want = qg.quantize(qg.build("tiny-llama", dtype=dtype), scheme, calibration=calibration, inplace=True)
    monkeypatch.setattr(quantizers, "CHUNK", 1000)
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", dtype=dtype))
    linear = model.model.layers[0].mlp.down_proj
    where = linear.weight.data_ptr()
    got = cast(LlamaForCausalLM, qg.quantize(model, scheme, calibration=calibration, inplace=True))
    assert got is model and linear.weight.data_ptr() == where  # written in place
    mine, theirs = got.state_dict(), want.state_dict()
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    for (name, a), (_, b) in zip(got.named_modules(), want.named_modules(), strict=True):
        pa, pb = getattr(a, simulate.WEIGHT_QPARAMS, None), getattr(b, simulate.WEIGHT_QPARAMS, None)
        assert (pa is None) == (pb is None), name
        if pa is not None and pb is not None:
            assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True)), name
    if "bondarenko" in scheme:  # the head keeps the float table, the embedding has its quantized copy
        assert got.lm_head.weight is not got.model.embed_tokens.weight
        assert torch.equal(
            got.lm_head.weight, cast(LlamaForCausalLM, qg.build("tiny-llama", dtype=dtype)).lm_head.weight
        )


def test_torchao_one_linear_at_a_time_is_torchao_on_the_whole_model():
    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    from quantgate.quant import get_scheme
    from quantgate.quant.schemes import TorchaoScheme
    from quantgate.quant.simulate import quantizable_linears

    scheme = cast(TorchaoScheme, get_scheme("torchao-int8-dynamic"))
    want = qg.build("tiny-llama")
    targets = {id(m) for _, m in quantizable_linears(want, scheme)}
    quantize_(want, scheme.torchao_config(), filter_fn=lambda m, fqn: id(m) in targets)  # the handler before
    got = qg.quantize(qg.build("tiny-llama"), "torchao-int8-dynamic", inplace=True)
    assert fingerprint(got) == fingerprint(want)


def test_nonfinite_count_and_trim():
    from quantgate.quant import _nonfinite

    x = torch.randn(1000, 7)
    assert _nonfinite(x) == 0 and _nonfinite(torch.empty(0)) == 0
    x[3, 2], x[500, 0], x[999, 6] = float("nan"), float("inf"), -float("inf")
    assert _nonfinite(x) == 3 and _nonfinite(x.bfloat16()) == 3
    heap.trim()  # glibc: gives free pages back; elsewhere nothing
    model = cast(LlamaForCausalLM, qg.build("tiny-llama"))
    with heap.trimming(model):
        hooked = sum(len(b._forward_hooks) for b in model.model.layers)
        assert hooked == (len(model.model.layers) if heap._MALLOC_TRIM is not None else 0)
    assert sum(len(b._forward_hooks) for b in model.model.layers) == 0


@pytest.mark.skipif(heap._MALLOC_TRIM is None, reason="no malloc_trim here: trimming asks for no blocks")
def test_trimming_a_model_of_no_family_hooks_nothing_and_a_bug_is_raised(monkeypatch):
    """A model of no family quantgate knows (family_of refuses it) is run without trimming; a plain ValueError
    from finding the blocks is a bug and propagates."""
    model = qg.build("tiny-llama")

    def unknown(model):
        raise qg.InputError("model type 'x' is not supported")

    def bug(model):
        raise ValueError("a bug finding the blocks")

    monkeypatch.setattr(heap, "family_of", unknown)
    with heap.trimming(model):
        assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    monkeypatch.setattr(heap, "family_of", bug)
    with pytest.raises(ValueError, match="a bug finding the blocks"), heap.trimming(model):
        pass


@pytest.mark.parametrize(
    "scheme", ["w8a8-int8-static", "w8a8-int8-bondarenko", "w8a8-int8-dynamic:smooth=0.5,keep=auto"]
)
def test_calibrating_without_the_logits_and_the_cache_changes_nothing(monkeypatch, scheme):
    """Calibration asks for the last position's logits only and no KV cache (logits_to_keep=1, use_cache=False):
    nothing reads the head's output or the cache."""
    import inspect
    import types

    import quantgate.quant as quant

    calibration = _calibration()
    got = fingerprint(qg.quantize(qg.build("tiny-llama"), scheme, calibration=calibration, inplace=True))
    no_option = types.SimpleNamespace(signature=lambda f: inspect.Signature())  # as for a model without the option
    monkeypatch.setattr(quant, "inspect", no_option)
    assert fingerprint(qg.quantize(qg.build("tiny-llama"), scheme, calibration=calibration, inplace=True)) == got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smoothing_reads_the_column_maxima_it_read_from_a_float_copy(dtype):
    from quantgate.quant.mitigate import _column_absmax, smoothing_groups

    for _, _, readers in smoothing_groups(qg.build("tiny-llama", dtype=dtype)):
        stacked = torch.cat([r.weight.float() for r in readers])  # what the observer was given before
        assert torch.equal(torch.max(torch.abs(_column_absmax(readers)), dim=0)[0], torch.max(stacked.abs(), dim=0)[0])
