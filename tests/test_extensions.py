"""Each kind of extension docs/architecture.md lists, written as one module outside the package (issue 45): a
gate, a scheme, a model family, a report section (the backend is tests/test_house.py's). Each module is
imported from a temporary folder, registers through the package's registries and is then used end to end; the
registries are put back afterwards. The page's table names the files each kind touches in the package; the
test of the page checks that it names as many as the toy of that kind has modules (:data:`TOYS`)."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import quantgate as qg

ROOT = Path(__file__).parents[1]

TOY_GATE = '''"""A gate in one module: G1 per head with a temperature option."""
import torch

from quantgate.attention.gates import Gate, projection, split_heads
from quantgate.options import Option
from quantgate.variants import gate_kind


@gate_kind(
    "g1-toy",
    "test: sigmoid(x W / t) per (head, channel), t = 1 (cold) or 4 (warm)",
    pi_init=0.3,
    options={"heat": Option(str, ("cold", "warm"), "cold")},
)
class ToyGate(Gate):
    x_readers = ("proj",)

    def __init__(self, spec, dims, std):
        super().__init__(spec, dims)
        self.t = 4.0 if spec.option("heat") == "warm" else 1.0
        self.proj = projection(dims.d_model, dims.n_heads * dims.head_dim, spec.low_rank, spec.bias_init * self.t, std)

    @classmethod
    def bias_for(cls, pi_init):
        return float(torch.logit(torch.tensor(pi_init)))

    def compute(self, x):
        return torch.sigmoid(split_heads(self.proj(x), self.dims.n_heads) / self.t)
'''

TOY_SCHEME = '''"""A scheme in one module: a row of an existing class."""
from quantgate.quant.schemes import SCHEMES, SimulatedScheme, TensorQuant

SCHEMES.add(
    "w6a8-toy",
    SimulatedScheme(
        "w6a8-toy",
        "test: INT6 weights per channel, INT8 activations per token, dynamic",
        weight=TensorQuant("int6", "channel"),
        act=TensorQuant("int8", "token", dynamic=True),
    ),
)
'''

TOY_FAMILY = '''"""A model family in one module: Mistral's row, and a tiny preset of it."""
from quantgate.models.families import DECODER_LAYOUT, GATED_MLP, FAMILIES, Family
from quantgate.models.presets import PRESETS, Preset, decoder_config

FAMILIES.add(
    "mistral",
    Family("mistral", ("mistral",), "MistralConfig", "MistralForCausalLM", **DECODER_LAYOUT, ffn_linears=GATED_MLP),
)
PRESETS.add("tiny-mistral", Preset("mistral", decoder_config(64, 2, 4, 2, 128), "2 layers, d=64, GQA 4/2"))
'''

TOY_SECTION = '''"""A report section in one module, placed after "What the numbers show"."""
from quantgate.study.report import SECTIONS


def cells_and_schemes(report):
    return f"\\n## Toy section\\n\\n{len(report.cells)} cells, {len(report.schemes)} schemes\\n"


SECTIONS.add("cells_and_schemes", cells_and_schemes, after="numbers")
'''


# each kind of extension: the modules its toy is made of (the page's table names as many files)
TOY_TASK = '''"""An evaluation task in one module: per-sequence log-likelihood of held-out text, scored by quantgate."""
import torch

from quantgate.data import batches
from quantgate.eval.tasks import TASKS, Task
from quantgate.models.sources import tokenizer as get_tokenizer
from quantgate.stats import TaskDocuments, aggregate


@torch.no_grad()
def documents(model, tokenizer, limit):
    tokenizer = tokenizer or get_tokenizer(model)
    data = batches(tokenizer, "validation", 32, 2, "clm", max_batches=int(limit or 2))
    loglikelihood, tokens = [], []
    for batch in data:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits.float()[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loglikelihood += (-nll.sum(1)).tolist()
        tokens += [ids.shape[1] - 1] * len(ids)
    return TaskDocuments(ids=list(range(len(tokens))), loglikelihood=loglikelihood, tokens=tokens)


TASKS.add("toy_nll", Task(
    "toy_nll", "causal LMs", "clm", perplexity="perplexity", headline=("perplexity",), unit="sequences",
    compute=documents, results=lambda docs: {"perplexity": aggregate(docs, "perplexity")},
))
'''

TOYS = {
    "a gate": (TOY_GATE,),
    "a quantization scheme": (TOY_SCHEME,),
    "a model family": (TOY_FAMILY,),
    "a report section": (TOY_SECTION,),
    "a new evaluation task": (TOY_TASK,),
}


@pytest.fixture
def extension(tmp_path, monkeypatch, registries):
    """``extension(name, text)``: the module ``name`` written to a temporary folder and imported; the package's
    registries it may fill are put back after the test."""
    from quantgate.eval.tasks import TASKS
    from quantgate.models.families import FAMILIES
    from quantgate.models.presets import PRESETS
    from quantgate.quant.schemes import SCHEMES
    from quantgate.study.report import SECTIONS
    from quantgate.variants import GATE_KINDS

    registries(GATE_KINDS, SCHEMES, FAMILIES, PRESETS, SECTIONS, TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(name: str, text: str):
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return importlib.import_module(name)

    return load


def _ids(model, n=10):
    return torch.randint(0, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(1))


def test_a_gate_is_one_module(extension, tmp_path):
    toy = extension("toy_gate", TOY_GATE)
    printed = str(qg.AttentionVariant.parse("g1-toy:heat=warm,low_rank=4"))
    assert printed == "g1-toy:low_rank=4,heat=warm"  # the grammar parses and prints its option
    with pytest.raises(ValueError, match=r"g1-toy: heat must be one of cold, warm, got 'hot'"):
        qg.AttentionVariant.parse("g1-toy:heat=hot")
    model = qg.build("tiny-llama", "g1-toy:heat=warm", seed=0).eval()
    gate = model.get_submodule("model.layers.0.self_attn.gate")
    assert isinstance(gate, toy.ToyGate)
    with torch.no_grad():
        gate.get_parameter("proj.weight").zero_()  # the bias alone: the gate starts at pi_init
        torch.testing.assert_close(gate(torch.randn(1, 3, 64)), torch.full((1, 4, 3, 16), 0.3))
    qg.save(model, tmp_path / "gated")
    again = qg.load(tmp_path / "gated")
    assert str(qg.variant_of(again)) == "g1-toy:heat=warm"
    with torch.no_grad():
        torch.testing.assert_close(again(_ids(model)).logits, model(_ids(model)).logits)


def test_a_scheme_is_one_module(extension, tmp_path):
    extension("toy_scheme", TOY_SCHEME)
    model = qg.build("tiny-llama", seed=0).eval()
    q = qg.quantize(model, "w6a8-toy:w_bits=5")
    record = qg.quantization_of(q)
    assert record is not None and record.scheme == "w6a8-toy:w_bits=5"
    w = q.get_parameter("model.layers.0.mlp.up_proj.weight")
    for row in w:  # INT5 per channel, symmetric: at most 2^5 - 1 levels in a row
        assert row.unique().numel() <= 31
    qg.save(q, tmp_path / "q")
    with torch.no_grad():
        torch.testing.assert_close(qg.load(tmp_path / "q")(_ids(model)).logits, q(_ids(model)).logits)


def test_a_family_is_one_module(extension):
    extension("toy_family", TOY_FAMILY)
    model = qg.build("tiny-mistral", "g1-headwise", seed=0).eval()
    assert type(model).__name__ == "MistralForCausalLM" and str(qg.variant_of(model)) == "g1-headwise"
    assert qg.models.family_of(model).name == "mistral"
    data = [{"input_ids": _ids(model, 16), "attention_mask": torch.ones(2, 16, dtype=torch.long)}]
    report = qg.observe(model, data, progress=False)
    mass = report.summary.sink_mass
    assert mass is not None and 0 < mass <= 1
    q = qg.quantize(model, "w8a8-int8-static", calibration=data, calib=1)
    with torch.no_grad():
        assert torch.isfinite(q(_ids(model)).logits).all()


def test_a_report_section_is_one_module(extension, tmp_path):
    import shutil

    from quantgate.study.report import write_study_report

    extension("toy_section", TOY_SECTION)
    run = tmp_path / "quickstart"
    shutil.copytree(ROOT / "results" / "quickstart", run, ignore=shutil.ignore_patterns("cells", "*.png"))
    write_study_report(run)
    page = (run / "report.md").read_text()
    headings = re.findall(r"^## (.+)$", page, flags=re.M)
    assert "Toy section" in headings
    at = headings.index("Toy section")
    assert headings[at - 1] == "What the numbers show"  # after numbers, as registered


def test_an_evaluation_task_is_one_module(extension, tmp_path, capsys):
    """A task quantgate scores itself, added as a row: a study evaluates it, its report and compare show it."""
    from quantgate.cli import main
    from quantgate.stats import fmt

    extension("toy_task", TOY_TASK)
    study = tmp_path / "s.yaml"
    study.write_text(
        "name: s\nmodels:\n  - name: m\n    preset: tiny-llama\nschemes: [w8-int8]\n"
        "calibration: {batches: 1, seq_len: 32, batch_size: 2}\nobserve: {batches: 1, seq_len: 32, batch_size: 2}\n"
        "eval: {tasks: [toy_nll], limit: 2}\n"
    )
    assert main(["study", str(study), "--out", str(tmp_path / "run")]) == 0
    metrics = qg.study.read_metrics(tmp_path / "run")
    (cell,) = metrics.cells
    ppl = cell.float_results["toy_nll"]["perplexity"]
    assert ppl > 1 and len(cell.float_documents["toy_nll"].ids) == 4  # 2 batches of 2 sequences
    assert fmt(ppl) in (tmp_path / "run" / "report.md").read_text()  # the cell's headline perplexity, in its table
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "run")]) == 0
    table = capsys.readouterr().out
    assert "toy_nll/perplexity" in table.splitlines()[0] and "w8-int8" in table


def test_the_architecture_page_names_as_many_files_as_each_toy_has_modules():
    """The page's "Where a new thing goes" row of each kind tested here names as many package files as the toy of
    that kind, which the tests above use end to end, has modules."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| (a [\w ]+?) \| (.+?) \|", page, re.M))
    for kind, modules in TOYS.items():
        assert kind in rows, f"docs/architecture.md has no row for {kind}"
        named = re.findall(r"`quantgate/[\w/]+\.py`", rows[kind])
        assert len(named) == len(modules), (kind, rows[kind], len(modules))
