"""The backcopy task's options: ``backcopy:start=chain`` draws the token after BOS from the chain, a
trained model records its task, and the ``quantgate_backcopy`` evaluation scores it on that task."""

import re

import pytest
import torch

import quantgate as qg
from quantgate.data.synthetic import BackcopyBatches, task_options
from quantgate.eval.computed import BACKCOPY_HELD_OUT_SEED
from quantgate.eval.evaluate import evaluate
from quantgate.models.families import config_of
from quantgate.train import TrainConfig, train

TOK = qg.tokenizer("tiny-llama")


def _first(source: str, seed: int = 3, n: int = 64) -> torch.Tensor:
    return next(iter(qg.data.batches(TOK, source, 24, n, seed=seed)))["input_ids"]


def test_chain_start_draws_the_token_after_bos_from_its_successors():
    plain, chain = _first("backcopy"), _first("backcopy:start=chain")
    task = BackcopyBatches(24, 64)
    allowed = set(task.successors[TOK.bos_token_id].tolist())
    assert (chain[:, 0] == TOK.bos_token_id).all() and (plain[:, 0] == TOK.bos_token_id).all()
    assert set(chain[:, 1].tolist()) <= allowed and len(set(chain[:, 1].tolist())) == len(allowed)
    assert len(set(plain[:, 1].tolist())) > 3 * len(allowed)  # uniform over 512 tokens: 64 draws, ~60 distinct
    # after position 1 both follow the same rule: a copy after a trigger, else a trigger or a chain successor
    for ids in (plain, chain):
        for i in range(2, ids.shape[1]):
            prev = ids[:, i - 1]
            copied = torch.isin(prev, task.triggers)
            chained = (task.successors[prev] == ids[:, i : i + 1]).any(1)
            ok = torch.where(copied, ids[:, i] == ids[:, i - 2], chained | torch.isin(ids[:, i], task.triggers))
            assert ok.all(), i


def test_the_default_task_is_unchanged_by_the_options():
    assert torch.equal(_first("backcopy"), _first("backcopy:start=random"))
    assert torch.equal(_first("backcopy"), BackcopyBatches(24, 64, seed=3, bos=TOK.bos_token_id).make(0)["input_ids"])


@pytest.mark.parametrize(
    "source, message",
    [
        ("backcopy:start=sideways", "backcopy: start must be one of random, chain, got 'sideways'"),
        ("backcopy:starts=chain", "backcopy: unknown option 'starts=chain'; valid: start (str, one of random, chain)"),
        ("backcopy:trigger_prob=1.5", "backcopy: trigger_prob must be in [0, 1], got 1.5"),
        ("backcopy:trigger_prob=nan", "backcopy: trigger_prob must be a finite number, got nan"),
        ("backcopy:trigger_prob=often", "backcopy: trigger_prob expects float, got 'often'"),
        ("backcopy:triggers=0", "backcopy: triggers must be >= 1, got 0"),
    ],
)
def test_bad_task_options_name_the_option(source, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        task_options(source)


def test_trigger_options_reach_the_task():
    assert task_options("backcopy:trigger_prob=0.2,triggers=5") == {"trigger_prob": 0.2, "triggers": 5}
    task = qg.data.batches(TOK, "backcopy:triggers=5,trigger_prob=0.2", 24, 64)
    assert isinstance(task, BackcopyBatches) and len(task.triggers) == 5 and task.trigger_prob == 0.2


def test_a_trained_model_is_scored_on_its_own_task(tmp_path):
    model = qg.build("tiny-llama", seed=0)
    model = train(
        model,
        TOK,
        config=TrainConfig(steps=30, data="backcopy:start=chain", batch_size=8, seq_len=64, lr=1e-2, eval_batches=1),
    )
    assert config_of(model).quantgate["task"] == "backcopy:start=chain"
    again = qg.load(qg.save(model, tmp_path / "m"))
    assert config_of(again).quantgate["task"] == "backcopy:start=chain"
    docs = evaluate(again, None, ["quantgate_backcopy"], limit=1).documents["quantgate_backcopy"]
    # by hand: the held-out stream of the chain-start task, next-token log-likelihood per sequence
    ids = next(iter(qg.data.batches(TOK, "backcopy:start=chain", 128, 16, seed=BACKCOPY_HELD_OUT_SEED)))["input_ids"]
    with torch.no_grad():
        logp = again(input_ids=ids).logits[:, :-1].log_softmax(-1)
    by_hand = logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(1)
    assert docs.loglikelihood == pytest.approx(by_hand.tolist(), rel=1e-5)
    del config_of(again).quantgate["task"]  # a model with no recorded task is scored on the default one
    plain = evaluate(again, None, ["quantgate_backcopy"], limit=1).documents["quantgate_backcopy"]
    ids = next(iter(qg.data.batches(TOK, "backcopy", 128, 16, seed=BACKCOPY_HELD_OUT_SEED)))["input_ids"]
    with torch.no_grad():
        logp = again(input_ids=ids).logits[:, :-1].log_softmax(-1)
    assert plain.loglikelihood == pytest.approx(logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(1).tolist(), rel=1e-5)
    # it has learnt BOS's successors, so its own task scores better (by more than the tolerance above)
    assert sum(docs.loglikelihood or ()) > sum(plain.loglikelihood or ()) * (1 - 1e-3)
