import re

import pytest

import quantgate as qg
from quantgate.cli import main


def test_info_on_preset(capsys):
    assert main(["info", "tiny-llama", "--variant", "g1-headwise"]) == 0
    out = capsys.readouterr().out
    n_gate = 2 * (64 * 4 + 4)  # two blocks of Linear(d_model=64 -> 4 heads)
    assert f"+ {n_gate:,} gate/sink" in out and re.search(r"family\s+llama", out) and "float32" in out


def test_info_on_directory(tmp_path, capsys):
    qg.save(qg.build("tiny-bert", "sink"), tmp_path / "m")
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"variant\s+sink", out) and "+ 8 gate/sink" in out  # 2 blocks x 4 heads


def test_info_list(capsys):
    assert main(["info", "--list"]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen3-next" in out and "hyga" in out and "clipped" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["info", "tiny-gpt"], "no model 'tiny-gpt': give a checkpoint directory"),
        (["info", "tiny-opt", "--variant", "g1-foo"], "unknown attention variant 'g1-foo'"),
        (["info"], "needs a preset"),
    ],
)
def test_info_errors(capsys, argv, fragment):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_variant_overhead_benchmark_smoke():
    """The benchmark script stays runnable (its numbers are printed, not asserted)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "variant_overhead.py"
    spec = importlib.util.spec_from_file_location("variant_overhead", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ms = bench.bench("tiny-llama", ["vanilla", "g1-headwise"], batch=1, seq=8, rounds=1, backend="auto")
    assert set(ms) == {"vanilla", "g1-headwise"} and all(t > 0 for t in ms.values())


def test_eval_and_compare(tmp_path, capsys):
    assert (
        main(["eval", "tiny-opt", "--tasks", "quantgate_nextsent", "--limit", "4", "--out", str(tmp_path / "fp")]) == 0
    )
    assert (
        main(
            [
                "eval",
                "tiny-opt",
                "--tasks",
                "quantgate_nextsent",
                "--limit",
                "4",
                "--scheme",
                "w8-int8",
                "--out",
                str(tmp_path / "w8"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["compare", str(tmp_path), "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| tiny-opt | vanilla | - | float |" in table and "| tiny-opt | vanilla | - | w8-int8 |" in table
    import csv
    import json

    from quantgate.stats import format_delta, paired_delta

    with open(tmp_path / "cmp" / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    fp, w8 = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("fp", "w8"))
    delta = float(rows[1]["quantgate_nextsent/acc delta"])
    assert delta == pytest.approx(
        w8["results"]["quantgate_nextsent"]["acc"] - fp["results"]["quantgate_nextsent"]["acc"]
    )
    # eval.json keeps each item's values: the change carries its paired-bootstrap interval
    paired = paired_delta(fp["documents"]["quantgate_nextsent"], w8["documents"]["quantgate_nextsent"], "acc")
    assert [float(rows[1][f"quantgate_nextsent/acc delta {end}"]) for end in ("low", "high")] == pytest.approx(
        [paired.low, paired.high]
    )
    assert f"| {format_delta(paired)} |" in table and "~ marks a change whose 95% interval includes 0" in table
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    assert main(["compare", str(tmp_path / "nowhere")]) == 2


def test_hardware_errors_are_one_line_and_other_errors_surface(monkeypatch, capsys):
    import torch

    import quantgate.cli
    from quantgate.quant import HardwareUnavailable

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        assert main(["quantize", "tiny-llama", "--scheme", "torchao-fp8-dynamic"]) == 2
        assert "torchao-fp8-dynamic cannot run here" in capsys.readouterr().err

    def fail(error):
        def quantize(*args, **kwargs):
            raise error

        monkeypatch.setattr(quantgate.cli, "quantize", quantize)  # the name the command calls

    fail(HardwareUnavailable("w8a8-x cannot run here: no such GPU"))
    assert main(["quantize", "tiny-llama", "--scheme", "w8-int8"]) == 2
    assert capsys.readouterr().err.strip() == "quantgate quantize: error: w8a8-x cannot run here: no such GPU"
    with pytest.raises(HardwareUnavailable):  # --debug: the traceback of a known error too
        main(["--debug", "quantize", "tiny-llama", "--scheme", "w8-int8"])
    fail(RuntimeError("shape mismatch"))  # a bug, not the user's setup: its traceback, not a misleading line
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["quantize", "tiny-llama", "--scheme", "w8-int8"])


def test_quantize_out_says_which_tools_load_the_save(tmp_path, capsys):
    """A gated model's save only quantgate loads: the command says so, in the words config.json records."""
    qg.save(qg.build("tiny-llama", "g1-elementwise"), tmp_path / "gated")
    qg.save(qg.build("tiny-llama"), tmp_path / "plain")
    for name in ("gated", "plain"):
        assert (
            main(
                [
                    "quantize",
                    str(tmp_path / name),
                    "--scheme",
                    "w8a8-int8-dynamic",
                    "--out",
                    str(tmp_path / f"q-{name}"),
                ]
            )
            == 0
        )
    gated, plain = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert gated.startswith(f"wrote {tmp_path / 'q-gated'} (quantgate format: quantgate (pip install quantgate; ")
    assert "g1-elementwise" in gated
    assert plain.endswith("format: transformers, lm-eval and vLLM load it)")


def test_train_log_with_tensorboard_writes_events_beside_the_log(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny-llama",
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--out",
                str(out),
                "--log-with",
                "tensorboard",
            ]
        )
        == 0
    )
    assert (out / "log.jsonl").is_file() and list((out / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(SystemExit):  # argparse names the valid choices
        main(["train", "--preset", "tiny-llama", "--log-with", "wandb"])
