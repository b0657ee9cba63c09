"""Bad input on the command line and the Python API: each gets one clear line, before any work is lost."""

import multiprocessing
import sys
import threading
import time

import pytest
import torch

import quantgate as qg
from quantgate.cli import main
from quantgate.data import batches, corpus
from quantgate.data.corpus import OfflineError, hub_reachable
from quantgate.eval.checks import check_limit
from quantgate.models.families import config_of
from quantgate.models.presets import preset_config
from quantgate.runlock import RunDirectoryBusy, run_lock


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"quantgate {qg.__version__}"


@pytest.mark.parametrize("limit", ["0", "-1", "2.5", "nan"])
def test_eval_limit_is_checked_before_the_model_loads(capsys, limit):
    assert main(["eval", "no-such-model", "--limit", limit]) == 2
    assert "limit" in capsys.readouterr().err


@pytest.mark.parametrize("limit, expected", [(None, None), (0.5, 0.5), (3.0, 3), (7, 7)])
def test_valid_limits_pass(limit, expected):
    assert check_limit(limit) == expected and type(check_limit(limit)) is type(expected)


@pytest.mark.parametrize("sink_tokens", [-1, 0, 1.5, True])
def test_observe_refuses_sink_token_counts_below_one(sink_tokens):
    model = qg.build("tiny-opt")
    data = batches(qg.tokenizer(model), "validation", 32, 2, max_batches=1)
    with pytest.raises(ValueError, match="sink_tokens"):
        qg.observe(model, data, sink_tokens=sink_tokens, progress=False)


def test_observe_refuses_a_sink_as_long_as_the_sequence():
    model = qg.build("tiny-llama")
    data = batches(qg.tokenizer(model), "validation", 16, 2, max_batches=1)
    with pytest.raises(ValueError, match="leaves no other key in 16-token"):
        qg.observe(model, data, sink_tokens=16, progress=False)
    assert qg.observe(model, data, sink_tokens=15, progress=False).meta.sink_tokens == 15


@pytest.mark.parametrize("preset, limit", [("tiny-opt", 2048), ("tiny-bert", 1024)])
def test_sequences_longer_than_learned_positions_are_refused(preset, limit):
    model = qg.build(preset)
    ids = torch.ones(1, limit + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"seq_len {limit + 1} is longer than this .* {limit} positions"):
        qg.observe(model, [{"input_ids": ids}], progress=False)
    qg.observe(model, [{"input_ids": ids[:, :limit]}], progress=False)  # the longest that fits runs


def test_cli_refuses_seq_len_past_positions(capsys):
    assert main(["observe", "tiny-opt", "--seq-len", "4000"]) == 2
    assert "seq_len 4000 is longer than this opt model's 2048 positions" in capsys.readouterr().err
    assert main(["quantize", "tiny-bert", "--scheme", "w8-int8", "--seq-len", "2000"]) == 2
    assert "1024 positions" in capsys.readouterr().err


def test_rope_models_run_past_their_nominal_positions():
    model = qg.build("tiny-llama", max_position_embeddings=16)
    report = qg.observe(model, [{"input_ids": torch.ones(1, 32, dtype=torch.long)}], progress=False)
    assert report.meta.seq_len == 32


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"lr": 1e6}, "'lr' is not a OPTConfig field"),
        ({"num_hidden_layer": 4}, "'num_hidden_layer' is not a OPTConfig field"),
        ({"num_hidden_layers": "four"}, "num_hidden_layers expects int (default 2), got 'four'"),
        ({"do_layer_norm_before": 1}, "do_layer_norm_before expects bool"),
        ({"hidden_size": 64.0}, "hidden_size expects int"),
    ],
)
def test_preset_overrides_must_be_config_fields_of_their_type(overrides, fragment):
    with pytest.raises(ValueError, match=r"valid: |expects") as e:
        preset_config("tiny-opt", overrides)
    assert fragment in str(e.value)
    with pytest.raises(ValueError, match=r"is not a|expects"):
        qg.build("tiny-opt", **overrides)


def test_valid_preset_overrides_apply():
    config = preset_config("tiny-opt", {"num_hidden_layers": 3, "dropout": 0})  # an int where a float goes
    assert config.num_hidden_layers == 3 and config.dropout == 0
    assert config_of(qg.build("tiny-bert", hidden_dropout_prob=0.0)).hidden_dropout_prob == 0.0


def test_train_config_typo_is_an_error_listing_the_fields(capsys, tmp_path):
    assert (
        main(["train", "--preset", "tiny-opt", "--config", "lr=1e6", "--steps", "1", "--out", str(tmp_path / "run")])
        == 2
    )
    err = capsys.readouterr().err
    assert "'lr' is not a OPTConfig field" in err and "num_hidden_layers" in err and "--lr" in err
    assert not (tmp_path / "run").exists()


def test_offline_text_source_fails_fast_with_the_fix(monkeypatch):
    monkeypatch.setattr(sys.modules["quantgate.data.corpus"], "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("datasets must not be asked"))
    with pytest.raises(OfflineError, match=r"not reachable\. Offline, use the bundled corpus"):
        next(corpus("wikitext-2:test"))


def test_hub_reachable_gives_up_within_its_timeout(monkeypatch):
    """A name lookup that hangs (no network, slow resolver) does not hold the caller past the timeout."""
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(30)
        raise OSError("no network")

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("socket.create_connection", hang)
    start = time.monotonic()
    try:
        assert hub_reachable(timeout=0.2) is False
        assert time.monotonic() - start < 5
    finally:
        release.set()


def _hold(path, ready, release):
    with run_lock(path):
        ready.set()
        release.wait(30)


def test_run_lock_admits_one_writer_and_frees_on_exit(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the child only takes a file lock
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(RunDirectoryBusy, match=f"in use by pid {holder.pid}"), run_lock(tmp_path):
            pass
    finally:
        release.set()
        holder.join(30)
    with run_lock(tmp_path):  # released when the holder exits
        pass


def test_run_lock_is_released_when_its_holder_is_killed(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the child only takes a file lock
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path, ready, release))
    holder.start()
    assert ready.wait(60)
    holder.kill()
    holder.join(30)
    with run_lock(tmp_path):
        pass


def test_eval_mode_restores_each_models_mode_also_on_error():
    import torch.nn as nn

    from quantgate.models.modes import eval_mode

    a, b = nn.Linear(2, 2).train(), nn.Linear(2, 2).eval()
    with eval_mode(a, b):
        assert not a.training and not b.training
    assert a.training and not b.training
    with pytest.raises(RuntimeError, match="inside"), eval_mode(a):
        raise RuntimeError("inside")
    assert a.training
