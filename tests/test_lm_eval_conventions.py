"""lm-eval's conventions in quantgate eval (--num-fewshot, --bootstrap-iters, --output-path, --log-samples)
and quantgate's models on lm-eval's own command line (quantgate lm-eval --model quantgate / quantgate-mlm)."""

import json
import math
import statistics
from pathlib import Path

import pytest

import quantgate as qg
from quantgate.cli import main

LM_EVAL_KEYS = {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama"
    qg.save(qg.build("tiny-llama", seed=0), path)
    return path


def _eval(argv, capsys) -> dict:
    """Run quantgate eval in process; its eval.json (argv must carry --out)."""
    assert main(["eval", *argv]) == 0, capsys.readouterr().err
    out = Path(argv[argv.index("--out") + 1])
    return json.loads((out / "eval.json").read_text())


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.rglob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_num_fewshot_reaches_lm_eval(llama_dir, tmp_path, capsys):
    """--num-fewshot 2: lm-eval records 2 shots and puts two other passages before each cloze context,
    which changes the scores; without it the same file records 0."""
    runs = {}
    for shots in (0, 2):
        lm = tmp_path / f"lm{shots}"
        result = _eval(
            [
                str(llama_dir),
                "--tasks",
                "quantgate_cloze",
                "--limit",
                "2",
                "--num-fewshot",
                str(shots),
                "--output-path",
                str(lm),
                "--log-samples",
                "--out",
                str(tmp_path / f"q{shots}"),
            ],
            capsys,
        )
        raw = json.loads(_one(lm, "results_*.json").read_text())
        samples = [json.loads(line) for line in _one(lm, "samples_quantgate_cloze_*.jsonl").read_text().splitlines()]
        runs[shots] = result, raw, samples
        assert raw["n-shot"] == {"quantgate_cloze": shots}
        assert result["settings"]["num_fewshot"] == shots
    zero, (two_result, _, two) = runs[0][2], runs[2]
    for a, b in zip(zero, two, strict=True):
        ctx0, ctx2 = a["arguments"]["gen_args_0"]["arg_0"], b["arguments"]["gen_args_0"]["arg_0"]
        assert ctx2.endswith(ctx0) and ctx2[: -len(ctx0)].count("\n\n") == 2  # two examples, each + delimiter
    ll0 = runs[0][0]["documents"]["quantgate_cloze"]["loglikelihood"]
    ll2 = two_result["documents"]["quantgate_cloze"]["loglikelihood"]
    assert len(ll0) == len(ll2) == 2 and all(abs(x - y) > 1e-6 for x, y in zip(ll0, ll2, strict=True))


def test_bootstrap_iters_gives_lm_evals_stderr(capsys, tmp_path):
    """--bootstrap-iters 100: acc gets lm-eval's stderr (closed form for a mean: sample stddev / sqrt(n));
    the default (0) leaves the results exactly as before, with no stderr."""
    base = ["tiny-llama", "--tasks", "quantgate_nextsent", "--limit", "8"]
    plain = _eval([*base, "--out", str(tmp_path / "plain")], capsys)["results"]["quantgate_nextsent"]
    out = _eval([*base, "--bootstrap-iters", "100", "--out", str(tmp_path / "boot")], capsys)
    res, docs = out["results"]["quantgate_nextsent"], out["documents"]["quantgate_nextsent"]
    assert not any(k.endswith("_stderr") for k in plain)
    assert {k: v for k, v in res.items() if not k.endswith("_stderr")} == plain
    for metric in ("acc", "acc_norm"):
        expected = statistics.stdev(docs[metric]) / math.sqrt(len(docs[metric]))
        assert math.isfinite(res[f"{metric}_stderr"]) and res[f"{metric}_stderr"] == pytest.approx(expected, rel=1e-12)
    assert res["acc_norm_stderr"] > 0  # measured: acc_norm 3/8, stderr 0.183
    assert "acc_norm 0.375 ± 0.18" in capsys.readouterr().out


def test_output_path_is_lm_evals_file_with_quantgate_numbers(llama_dir, tmp_path, capsys):
    """The --output-path file has lm-eval's keys and the same perplexity as quantgate's eval.json; the
    computed task (backcopy) is in eval.json only; the model is recorded as --model quantgate would take it."""
    lm = tmp_path / "lm"
    result = _eval(
        [
            str(llama_dir),
            "--tasks",
            "quantgate_ppl,quantgate_backcopy",
            "--limit",
            "2",
            "--output-path",
            str(lm),
            "--out",
            str(tmp_path / "q"),
        ],
        capsys,
    )
    path = _one(lm, "results_*.json")
    assert path.parent.name == str(llama_dir).replace("/", "__")  # lm-eval's folder: the sanitized model name
    raw = json.loads(path.read_text())
    assert set(raw) >= LM_EVAL_KEYS and set(raw["results"]) == {"quantgate_ppl"}
    theirs, ours = raw["results"]["quantgate_ppl"], result["results"]["quantgate_ppl"]
    assert theirs["word_perplexity,none"] == ours["word_perplexity"]
    assert theirs["bits_per_byte,none"] == ours["bits_per_byte"]
    assert raw["n-samples"]["quantgate_ppl"]["effective"] == 2 and raw["versions"]["quantgate_ppl"] == 2.0
    assert raw["config"]["model"] == "quantgate" and raw["config"]["model_args"] == {"pretrained": str(llama_dir)}
    assert raw["config"]["quantgate_family"] == "llama" and raw["config"]["bootstrap_iters"] == 0
    assert "quantgate_backcopy" in result["results"] and result["lm_eval_output"]["results"] == str(path)
    assert not list(lm.rglob("samples_*"))  # only with --log-samples


def test_log_samples_writes_lm_evals_samples_files(llama_dir, tmp_path, capsys):
    """--log-samples: one samples_<task>_<date>.jsonl per task, one line per document, whose logged
    (log-likelihood, words) pair is quantgate's per-document value."""
    lm = tmp_path / "lm"
    result = _eval(
        [
            str(llama_dir),
            "--tasks",
            "quantgate_ppl",
            "--limit",
            "3",
            "--output-path",
            str(lm),
            "--log-samples",
            "--out",
            str(tmp_path / "q"),
        ],
        capsys,
    )
    path = _one(lm, "samples_quantgate_ppl_*.jsonl")
    assert f"wrote {path}" in capsys.readouterr().out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    docs = result["documents"]["quantgate_ppl"]
    assert [r["doc_id"] for r in rows] == docs["ids"] == [0, 1, 2]
    assert [r["word_perplexity"][0] for r in rows] == pytest.approx(docs["loglikelihood"], rel=1e-12)
    assert [r["word_perplexity"][1] for r in rows] == docs["words"]
    raw = json.loads(_one(lm, "results_*.json").read_text())
    assert set(raw["task_hashes"]) == {"quantgate_ppl"}  # lm-eval hashes the samples it logged


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["tiny-llama", "--num-fewshot", "-1"], "num_fewshot (--num-fewshot) must be a whole number >= 0, got -1"),
        (["tiny-llama", "--bootstrap-iters", "-5"], "bootstrap_iters (--bootstrap-iters) must be a whole number >= 0"),
        (["tiny-llama", "--log-samples"], "give output_path (--output-path) too"),
        (
            ["tiny-llama", "--tasks", "quantgate_backcopy", "--output-path", "OUT"],
            "an output path (lm-eval's results file) apply to lm-eval tasks, and quantgate_backcopy are computed",
        ),
        (["tiny-llama", "--tasks", "quantgate_backcopy", "--num-fewshot", "1"], "num_fewshot apply to lm-eval tasks"),
        (["tiny-llama", "--output-path", "FILE"], "is a file: give a directory or a file name ending in .json"),
    ],
)
def test_bad_eval_options_are_one_line_errors(argv, fragment, tmp_path, capsys):
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a in ("OUT", "FILE") else a for a in argv]
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and not (tmp_path / "OUT").exists()


def test_evaluate_refuses_bad_lm_eval_options():
    from quantgate.eval.checks import check_lm_eval_options

    for kwargs, fragment in (
        ({"num_fewshot": 1.5}, "whole number >= 0, got 1.5"),
        ({"bootstrap_iters": True}, "whole number >= 0, got True"),
        ({"log_samples": True}, "give output_path"),
    ):
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            check_lm_eval_options(**kwargs)
    assert check_lm_eval_options(0, 100, "some/dir", True) is None  # type: ignore[func-returns-value]  # accepted


def test_lm_eval_models_are_registered_and_load_like_quantgate_eval():
    """lm-eval's registry finds both models after the import; each builds from lm-eval's arg string,
    loading and quantizing as quantgate eval does, and refuses what does not fit in one line."""
    from lm_eval.api.registry import get_model

    from quantgate.eval.lm_eval_models import PseudoLogLikelihoodLM, QuantgateLM

    assert get_model("quantgate") is QuantgateLM and get_model("quantgate-mlm") is PseudoLogLikelihoodLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models still there
    lm = QuantgateLM.create_from_arg_string("pretrained=tiny-llama,scheme=w8-int8", {"batch_size": "auto"})
    record = qg.quantization_of(lm.model)
    assert record is not None and record.scheme == "w8-int8" and lm.batch_size_per_gpu == 8
    assert lm.max_length == 4096 and lm.add_bos_token is False  # tiny-llama: 8192 positions, capped
    mlm = PseudoLogLikelihoodLM.create_from_arg_string(
        "pretrained=tiny-bert,scheme=w8a8-int8-dynamic,variant=g1-headwise", {"batch_size": 4, "device": "cpu"}
    )
    record = qg.quantization_of(mlm.model)
    assert record is not None and record.scheme == "w8a8-int8-dynamic" and mlm.batch_size == 4
    assert str(qg.variant_of(mlm.model)) == "g1-headwise" and mlm.max_length == 1024  # its positions
    info = mlm.get_model_info()
    assert info["quantgate_source"] == "tiny-bert" and info["quantgate_quantization"] == "w8a8-int8-dynamic"
    for cls, args, fragment in (
        (QuantgateLM, "pretrained=tiny-bert", "tiny-bert is a masked LM: use --model quantgate-mlm"),
        (PseudoLogLikelihoodLM, "pretrained=tiny-llama", "tiny-llama is a causal LM: use --model quantgate"),
        (QuantgateLM, "pretrained=tiny-llama,foo=1", "not foo"),
        (QuantgateLM, "pretrained=tiny-llama,peft=x", "loads through quantgate.load; peft do not apply"),
        (QuantgateLM, "pretrained=tiny-llama,scheme=w9-int9", "w9-int9"),
        (QuantgateLM, "scheme=w8-int8", "needs pretrained=NAME"),
        (PseudoLogLikelihoodLM, "pretrained=tiny-bert,dtype=int8", "float32, bfloat16, float16"),
    ):
        with pytest.raises(ValueError, match=fragment):
            cls.create_from_arg_string(args)
    with pytest.raises(ValueError, match="quantize or convert an in-memory model"):
        QuantgateLM(pretrained=qg.build("tiny-llama"), scheme="w8-int8")


def test_lm_eval_arguments_pass_through_with_quantgates_task_folder(capsys):
    from quantgate.eval.lm_eval_models import with_task_folder
    from quantgate.eval.tasks import TASK_DIR

    run = ["--model", "quantgate", "--tasks", "quantgate_ppl"]
    assert with_task_folder(run) == [*run, "--include_path", str(TASK_DIR)]
    assert with_task_folder(["ls", "tasks"]) == ["ls", "tasks", "--include_path", str(TASK_DIR)]
    for unchanged in ([*run, "--include_path", "mine"], [*run, "--include_path=mine"], ["run", "--help"], ["run"], []):
        assert with_task_folder(unchanged) == unchanged
    assert main(["lm-eval", "--help"]) == 0  # lm-eval's own help, not quantgate's
    assert "Language Model Evaluation Harness" in capsys.readouterr().out
    assert main(["lm-eval", "run", "--no-such-flag"]) == 2


def _lm_eval_cli(args: list[str], out: Path, capsys) -> dict:
    """``quantgate lm-eval ARGS --output_path OUT`` (lm-eval's own command line, run in this process as
    test_lm_eval_arguments_pass_through_with_quantgates_task_folder runs it); lm-eval's results file."""
    assert main(["lm-eval", *args, "--output_path", str(out)]) == 0, capsys.readouterr().err[-3000:]
    return json.loads(_one(out, "results_*.json").read_text())


def test_lm_eval_cli_with_model_quantgate_matches_quantgate_eval(llama_dir, tmp_path, capsys):
    """lm-eval's own command line, --model quantgate with a scheme, gives quantgate eval --scheme's
    perplexity (measured: equal to the last digit)."""
    raw = _lm_eval_cli(
        [
            "--model",
            "quantgate",
            "--model_args",
            f"pretrained={llama_dir},scheme=w8a8-int8-dynamic",
            "--tasks",
            "quantgate_ppl",
            "--limit",
            "2",
        ],
        tmp_path / "lm",
        capsys,
    )
    ours = _eval(
        [str(llama_dir), "--scheme", "w8a8-int8-dynamic", "--limit", "2", "--out", str(tmp_path / "q")], capsys
    )
    assert raw["config"]["model"] == "quantgate" and raw["config"]["quantgate_quantization"] == "w8a8-int8-dynamic"
    assert raw["results"]["quantgate_ppl"]["word_perplexity,none"] == pytest.approx(
        ours["results"]["quantgate_ppl"]["word_perplexity"], rel=1e-3
    )
    assert raw["results"]["quantgate_ppl"]["byte_perplexity,none"] == pytest.approx(
        ours["results"]["quantgate_ppl"]["byte_perplexity"], rel=1e-3
    )


@pytest.mark.slow  # 9 s; the causal model's CLI test stays in the default run
def test_lm_eval_cli_with_model_quantgate_mlm_matches_quantgate_eval(tmp_path, capsys):
    """The same for a masked LM: --model quantgate-mlm (pseudo-log-likelihood) against quantgate eval."""
    bert = tmp_path / "bert"
    qg.save(qg.build("tiny-bert", seed=0), bert)
    raw = _lm_eval_cli(
        [
            "--model",
            "quantgate-mlm",
            "--model_args",
            f"pretrained={bert},scheme=w8a8-int8-dynamic",
            "--tasks",
            "quantgate_ppl",
            "--limit",
            "1",
            "--batch_size",
            "32",
        ],
        tmp_path / "lm",
        capsys,
    )
    ours = _eval(
        [
            str(bert),
            "--scheme",
            "w8a8-int8-dynamic",
            "--limit",
            "1",
            "--batch-size",
            "32",
            "--out",
            str(tmp_path / "q"),
        ],
        capsys,
    )
    assert raw["config"]["model"] == "quantgate-mlm" and raw["config"]["quantgate_family"] == "bert"
    assert raw["results"]["quantgate_ppl"]["word_perplexity,none"] == pytest.approx(
        ours["results"]["quantgate_ppl"]["word_perplexity"], rel=1e-3
    )
