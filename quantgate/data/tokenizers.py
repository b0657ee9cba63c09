"""Tokenizers trained on the bundled train split and shipped with the package.

* ``bpe-8192``: byte-level BPE for causal LMs (OPT/Llama/Qwen presets). Lossless:
  ``decode(encode(text)) == text`` for any string. Special tokens <pad>=0, <s>=1 (BOS, prepended
  by the tokenizer), </s>=2 (EOS), <unk>=3, <mask>=4.
* ``wordpiece-8192``: cased WordPiece for BERT presets. [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3,
  [MASK]=4; the tokenizer wraps text as [CLS] ... [SEP].

Rebuild both with ``quantgate build-tokenizers`` (about 20 s on 2 cores). The BPE rebuild is
byte-identical; the WordPiece trainer breaks frequency ties in hash-map order, which is random per
process, so a rebuild differs from the shipped file in a handful of tokens (the shipped one is the
reference: models trained here use its ids).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ..errors import InputError, MissingFile
from .corpus import corpus

__all__ = ["BUNDLED_TOKENIZERS", "bundled_tokenizer", "train_tokenizer", "TOKENIZER_DIR"]

TOKENIZER_DIR = Path(__file__).with_name("tokenizers")

_SPECIAL = {
    "bpe": {
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    },
    "wordpiece": {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
    },
}
BUNDLED_TOKENIZERS = {"bpe-8192": ("bpe", 8192), "wordpiece-8192": ("wordpiece", 8192)}


def _special_list(kind: str) -> list[str]:
    order = (
        ("pad_token", "bos_token", "eos_token", "unk_token", "mask_token")
        if kind == "bpe"
        else ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    )
    return [_SPECIAL[kind][k] for k in order]


def train_tokenizer(kind: str, vocab_size: int = 8192, split: str = "train") -> Tokenizer:
    """Train a ``bpe`` or ``wordpiece`` tokenizer on a text source (default: the bundled train split)."""
    specials = _special_list(kind)
    texts = (doc.text for doc in corpus(split))
    trainer: trainers.Trainer
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A </s> $B", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
        tok.train_from_iterator(texts, trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    else:
        raise InputError(f"unknown tokenizer kind {kind!r}; valid: bpe, wordpiece")
    assert [tok.token_to_id(s) for s in specials] == list(range(len(specials)))
    return tok


def wrap(tok: Tokenizer, kind: str) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around a ``tokenizers`` one, with its special tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, model_max_length=1 << 20, **_SPECIAL[kind]
    )


def bundled_tokenizer(name: str) -> PreTrainedTokenizerFast:
    if name not in BUNDLED_TOKENIZERS:
        raise InputError(f"unknown bundled tokenizer {name!r}; valid: {', '.join(BUNDLED_TOKENIZERS)}")
    path = TOKENIZER_DIR / f"{name}.json"
    if not path.is_file():
        raise MissingFile(f"{path} is missing: reinstall quantgate or run `quantgate build-tokenizers`")
    try:
        parsed = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises bare Exceptions for a file it cannot parse
        raise InputError(
            f"cannot read {path} ({' '.join(str(e).split())}): reinstall quantgate or run `quantgate build-tokenizers`"
        ) from None
    tok = wrap(parsed, BUNDLED_TOKENIZERS[name][0])
    tok.name_or_path = name
    return tok


def build_bundled(out: Path = TOKENIZER_DIR) -> list[Path]:
    """Train every bundled tokenizer on the train split and write ``<name>.json`` files."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (kind, size) in BUNDLED_TOKENIZERS.items():
        path = out / f"{name}.json"
        train_tokenizer(kind, size).save(str(path))
        paths.append(path)
    return paths
