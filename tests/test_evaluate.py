"""Evaluation through lm-eval: numbers against direct computations from the model's own loss."""

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import quantgate as qg
from quantgate.data import corpus
from quantgate.data.corpus import Document, OfflineError, document_keys
from quantgate.eval.computed import mlm_perplexity
from quantgate.eval.evaluate import evaluate
from quantgate.stats import aggregate


@pytest.fixture(scope="module")
def tiny():
    return qg.build("tiny-llama", seed=0).eval()


def test_bits_per_byte_equals_the_models_own_loss(tiny):
    tok = qg.tokenizer(tiny)
    doc = next(iter(corpus("test"))).text  # the first held-out document, shorter than the context
    ids = tok(doc, return_tensors="pt").input_ids  # BOS + the document's tokens
    assert ids.shape[1] < 4096
    with torch.no_grad():
        loss = tiny(ids, labels=ids).loss.item()  # mean over the document's tokens, each given BOS + prefix
    loglik = -loss * (ids.shape[1] - 1)
    n_bytes = len(doc.encode("utf-8"))
    res = evaluate(tiny, tok, ["quantgate_ppl"], limit=1).results["quantgate_ppl"]
    assert res["bits_per_byte"] == pytest.approx(-loglik / n_bytes / math.log(2), rel=1e-4)
    assert res["byte_perplexity"] == pytest.approx(math.exp(-loglik / n_bytes), rel=1e-4)
    assert res["word_perplexity"] == pytest.approx(math.exp(-loglik / len(doc.split())), rel=1e-3)


def test_per_document_values_recompute_lm_evals_metrics(tiny):
    """Each task's kept documents aggregate (quantgate.stats, as lm-eval aggregates) to exactly the metrics
    lm-eval reported; a perplexity document's token count is what the model scores (the text, BOS-prefixed)."""
    tok = qg.tokenizer(tiny)
    out = evaluate(tiny, tok, ["quantgate_ppl", "quantgate_cloze", "quantgate_nextsent"], limit=3)
    for task, metrics in out.results.items():
        columns = out.documents[task]
        assert columns.ids == [0, 1, 2]
        for metric, value in metrics.items():
            if metric != "sample_len":
                assert aggregate(columns, metric) == pytest.approx(value, rel=1e-12), (task, metric)
    ppl = out.documents["quantgate_ppl"]
    assert list(ppl.to_json()) == ["ids", "loglikelihood", "words", "bytes", "works", "hashes", "tokens"]  # eval.json
    first_of_each: dict[str, Document] = {}  # the task takes the test split's documents in turn from each work
    for d in corpus("test"):
        first_of_each.setdefault(d.work, d)
    docs = list(first_of_each.values())[:3]
    assert ppl.works == [d.work for d in docs] and len(set(ppl.works)) == 3
    assert ppl.hashes == [hashlib.sha256(d.text.encode("utf-8")).hexdigest()[:16] for d in docs]
    assert ppl.words is not None and document_keys([0, 1, 2], ppl.words) == (ppl.works, ppl.hashes)
    assert document_keys([0, 1, 2], [w + 1 for w in ppl.words]) is None  # another order: nothing guessed
    assert ppl.bytes == [len(d.text.encode("utf-8")) for d in docs]
    assert ppl.tokens == [tok(d.text, return_tensors="pt").input_ids.shape[1] - 1 for d in docs]
    assert out.documents["quantgate_nextsent"].recorded() == ["acc", "acc_norm", "hashes"]
    assert out.documents["quantgate_cloze"].recorded() == ["loglikelihood", "acc", "hashes"]
    assert len(set(out.documents["quantgate_cloze"].hashes or ())) == 3  # three different documents


def test_computed_tasks_keep_per_sequence_values():
    from quantgate.eval.computed import backcopy_metrics

    bert = qg.build("tiny-bert", seed=0).eval()
    out = evaluate(bert, None, ["quantgate_mlm_ppl"], limit=1)
    docs = out.documents["quantgate_mlm_ppl"]
    assert docs.tokens is not None and docs.hashes is not None and docs.loglikelihood is not None
    assert len(docs.ids) == 16 and all(n > 0 for n in docs.tokens)  # one batch of 16 sequences
    assert len(docs.hashes) == 16 and docs.recorded() == ["loglikelihood", "hashes", "tokens"]
    assert out.results["quantgate_mlm_ppl"]["perplexity"] == pytest.approx(
        math.exp(-sum(docs.loglikelihood) / sum(docs.tokens)), rel=1e-12
    )
    assert mlm_perplexity(bert, qg.tokenizer(bert), limit=1) == pytest.approx(
        out.results["quantgate_mlm_ppl"]["perplexity"], rel=1e-6
    )
    llama = qg.build("tiny-llama", seed=0).eval()
    out = evaluate(llama, None, ["quantgate_backcopy"], limit=1)
    docs = out.documents["quantgate_backcopy"]
    assert docs.recorded() == [
        "loglikelihood",
        "hashes",
        "tokens",
        "loglikelihood_after_first",
        "tokens_after_first",
        "copied",
        "copies",
    ]
    assert docs.hashes is not None and len(docs.ids) == 16 and len(set(docs.hashes)) == 16  # named by its tokens
    assert docs.copied is not None and docs.copies is not None
    assert out.results["quantgate_backcopy"]["copy_acc"] == sum(docs.copied) / sum(docs.copies)
    # without the first prediction, by hand: each sequence's own loss over targets 2..L-1
    from quantgate.eval.computed import BACKCOPY_HELD_OUT_SEED

    batch = next(iter(qg.data.batches(qg.tokenizer(llama), "backcopy", 128, 16, seed=BACKCOPY_HELD_OUT_SEED)))
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = llama(input_ids=ids).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, 1:-1].transpose(1, 2), ids[:, 2:], reduction="none").sum(1)
    assert docs.loglikelihood_after_first == pytest.approx((-nll).tolist(), rel=1e-5)
    assert docs.tokens_after_first == [126] * 16
    assert out.results["quantgate_backcopy"]["perplexity_after_first"] == pytest.approx(
        math.exp(float(nll.sum()) / (126 * 16)), rel=1e-6
    )
    assert backcopy_metrics(llama, qg.tokenizer(llama), limit=1) == pytest.approx(out.results["quantgate_backcopy"])


def test_cloze_and_nextsent_against_direct_scores(tiny):
    tok = qg.tokenizer(tiny)
    from quantgate.eval.tasks import TASK_DIR

    with open(TASK_DIR / "data" / "quantgate_nextsent.jsonl") as f:
        items = [json.loads(line) for line in f][:4]
    res = evaluate(tiny, tok, ["quantgate_nextsent"], limit=4).results["quantgate_nextsent"]
    correct = 0
    for item in items:
        ctx = tok(item["context"], add_special_tokens=False).input_ids
        scores = []
        for choice in item["choices"]:
            full = tok(item["context"] + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = tiny(torch.tensor([full])).logits[0, :-1].log_softmax(-1)
            cont = torch.tensor(full[len(ctx) :])
            scores.append(float(logp[len(ctx) - 1 :].gather(1, cont[:, None]).sum()))
        correct += int(max(range(4), key=scores.__getitem__) == item["label"])
    assert res["acc"] == pytest.approx(correct / 4)


def test_quantized_models_evaluate_through_the_same_call(tiny):
    tok = qg.tokenizer(tiny)
    ref = evaluate(tiny, tok, ["quantgate_cloze"], limit=8).results["quantgate_cloze"]["perplexity"]
    calib = qg.data.batches(tok, "train", 64, 4)
    for scheme in ("w8a8-int8-static", "torchao-int8-weight-only", "llm-int8"):
        options: dict[str, Any] = {"calib": 2} if scheme == "w8a8-int8-static" else {}
        q = qg.quantize(tiny, scheme, calibration=calib, **options)
        out = evaluate(q, tok, ["quantgate_cloze"], limit=8)
        record = qg.quantization_of(q)
        assert record is not None and out.settings.quantization == record.scheme
        assert out.results["quantgate_cloze"]["perplexity"] == pytest.approx(ref, rel=0.2)


def _rank_real_over_shuffled(model, tok, n_docs: int = 40) -> float:
    """Share of held-out 12-word openings whose pseudo-log-likelihood beats a word shuffle of them."""
    from quantgate.eval.lm_eval_models import PseudoLogLikelihoodLM

    lm = PseudoLogLikelihoodLM(model, tok, batch_size=64, max_length=128)
    rng = torch.Generator().manual_seed(1)

    class Req:
        def __init__(self, text):
            self.args = (text,)

    wins = total = 0
    for doc in list(corpus("test"))[:n_docs]:
        words = doc.text.split()[:12]
        shuffled = [words[i] for i in torch.randperm(len(words), generator=rng).tolist()]
        if shuffled == words:
            continue
        real, fake = lm.loglikelihood_rolling([Req(" ".join(words)), Req(" ".join(shuffled))])
        wins += real > fake
        total += 1
    return wins / total


def test_masked_lm_pseudo_log_likelihood_prefers_real_sentences():
    """A tiny BERT trained briefly on the bundled corpus (tests/fixtures/README.md: 5000 steps, ~4 min)
    ranks held-out sentences above their word shuffles; the same model untrained is at chance."""
    fixture = Path(__file__).with_name("fixtures") / "tiny-bert-mlm"
    trained = qg.load(fixture)
    tok = qg.tokenizer(trained)
    assert _rank_real_over_shuffled(trained, tok) >= 0.8  # measured: 0.975
    assert _rank_real_over_shuffled(qg.build("tiny-bert", seed=0).eval(), tok) < 0.75
    assert mlm_perplexity(trained, tok, seq_len=32, limit=4) < 0.05 * 8192  # measured: 263 (uniform: 8192)


def test_mlm_tasks_run_on_bert():
    bert = qg.build("tiny-bert")
    out = evaluate(bert, None, ["quantgate_nextsent", "quantgate_mlm_ppl"], limit=2)
    assert set(out.results) == {"quantgate_nextsent", "quantgate_mlm_ppl"}
    assert out.results["quantgate_mlm_ppl"]["perplexity"] == pytest.approx(8192, rel=0.3)  # untrained: ~uniform


def test_bad_input(tiny, monkeypatch):
    tok = qg.tokenizer(tiny)
    bundled = "bundled \\(offline\\): quantgate_passages, quantgate_ppl"
    with pytest.raises(ValueError, match=f"unknown task\\(s\\) quantgate_magic; {bundled}"):
        evaluate(tiny, tok, ["quantgate_magic"])
    with pytest.raises(ValueError, match="the tokenizer has 8192 tokens but the model embeds only 4096"):
        evaluate(qg.build("tiny-llama", vocab_size=4096), tok, ["quantgate_ppl"])
    with pytest.raises(ValueError, match="quantgate_mlm_ppl scores masked LMs"):
        evaluate(tiny, tok, ["quantgate_mlm_ppl"])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(OfflineError, match="wikitext -> quantgate_ppl"):
        evaluate(tiny, tok, ["wikitext"])


def test_the_passages_task_reads_passages_in_turn_from_every_work(tiny):
    """quantgate_passages: the first n passages of the test split, one from each work in turn, each of at most 256
    words, scored as rolling log-likelihoods whose word perplexity is lm-eval's aggregate of them."""
    from quantgate.data.corpus import passages, text_hash

    r = evaluate(tiny, qg.tokenizer(tiny), ["quantgate_passages"], limit=9, max_length=64)
    d = r.documents["quantgate_passages"]
    first = passages("test")[:9]
    assert d.words is not None and d.works is not None and d.loglikelihood is not None
    assert d.hashes == [text_hash(p.text) for p in first] and len(set(d.works)) == 9
    assert d.words == [len(p.text.split()) for p in first] and max(d.words) <= 256
    ppl = math.exp(-sum(d.loglikelihood) / sum(d.words))
    assert r.results["quantgate_passages"]["word_perplexity"] == pytest.approx(ppl, rel=1e-9)
