"""What leaves looplm works without it (issue 27 §2-3): an export loads where looplm cannot be imported, under
the installed transformers and under 4.57.6 (the oldest of the ``hf`` extra, when ``make install`` put it in
``.venv/transformers-4.57``); one default depth and KV layout for transformers and looplm; ``export`` never
writes into a non-empty folder by accident; ``lm-eval`` runs offline over the data folder, names the hub error,
and its ``--db`` results show in ``looplm report``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(__file__).resolve().parents[2] / ".cache" / "test" / "hf-datasets"))
transformers = pytest.importorskip("transformers")

from looplm.cli import main  # noqa: E402
from looplm.config import Config, TrainConfig, UniformDepthConfig  # noqa: E402
from looplm.eval.generate import generate  # noqa: E402
from looplm.model import build_model  # noqa: E402
from helpers import VARIANTS, tiny  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
OLD_TRANSFORMERS = Path(sys.prefix) / "transformers-4.57"  # written by `make install` (Makefile)
# float32 logits of one model, same weights and code, in two processes: only the reduction order of the
# kernels (thread count) may differ, ~1e-6 relative on logits of size ~10; 1e-5 leaves room, 1e-3 would not
# hide a wrong layer (differences of order 1)
TOL = dict(rtol=1e-5, atol=1e-5)

# A fresh interpreter where `import looplm` fails: the export must load with torch + transformers alone.
WITHOUT_LOOPLM = """
import json, sys
sys.modules["looplm"] = None  # import looplm raises ImportError
sys.path = [p for p in sys.path if p != {src!r}]
import torch, transformers
from safetensors.torch import load_file, save_file
folder, io = sys.argv[1], sys.argv[2]
ids = load_file(io + "/in.safetensors")["ids"]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
with torch.no_grad():
    logits = model(ids, use_cache=False).logits
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
save_file({{"logits": logits.contiguous(), "gen": gen.contiguous()}}, io + "/out.safetensors")
info = {{"version": transformers.__version__, "class": type(model).__module__, "num_steps": model.config.num_steps,
        "looplm": sorted(m for m, v in sys.modules.items() if m.startswith("looplm") and v is not None)}}
import os
if os.path.exists(folder + "/tokenizer.json"):
    # 4.57 reads tokenizer_config.json alone; 5 reads config.json first, whose auto_map asks about remote code
    kw = {{}} if transformers.__version__.startswith("4.") else {{"trust_remote_code": True}}
    tok = transformers.AutoTokenizer.from_pretrained(folder, **kw)  # stdin closed: a question would fail
    info["tokenizer"] = [type(tok).__name__, tok("The jury said")["input_ids"], tok.eos_token]
print(json.dumps(info))
"""


def without_looplm(folder: Path, ids: torch.Tensor, io: Path, transformers_path: Path | None = None):
    """Run :data:`WITHOUT_LOOPLM` on ``folder``; returns (its JSON line, logits, generated ids)."""
    from safetensors.torch import load_file, save_file

    io.mkdir(parents=True, exist_ok=True)
    save_file({"ids": ids}, str(io / "in.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(io / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if transformers_path is not None:
        env["PYTHONPATH"] = str(transformers_path)
    res = subprocess.run([sys.executable, "-c", WITHOUT_LOOPLM.format(src=SRC), str(folder), str(io)], env=env,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    out = load_file(str(io / "out.safetensors"))
    return json.loads(res.stdout.strip().splitlines()[-1]), out["logits"], out["gen"]


def versions():
    old = pytest.param(OLD_TRANSFORMERS, id="transformers-4.57.6", marks=pytest.mark.skipif(
        not OLD_TRANSFORMERS.is_dir(), reason=f"no {OLD_TRANSFORMERS} (make install writes it)"))
    return [pytest.param(None, id="installed"), old]


def huginn_export(folder: Path):
    """A Huginn-style (prelude / core / coda, adapter injection) tiny model saved with save_pretrained."""
    from looplm.hf import LoopLMForCausalLM

    torch.manual_seed(0)
    cfg = Config(model=tiny(**VARIANTS["huginn-0125"], seq_len=24, init_std=0.1),
                 depth=UniformDepthConfig(lo=1, hi=4), train=TrainConfig(eval_depth=3))
    model = build_model(cfg.model).eval()
    model.final_depth = cfg.depth.nominal_depth()
    LoopLMForCausalLM.from_looplm(model, cfg).save_pretrained(folder)
    return model


# ---------------------------------------------------------------------------------------------- §2 remote code


@pytest.mark.slow
@pytest.mark.parametrize("tf_path", versions())
@pytest.mark.parametrize("kind", ["scse-export", "huginn-save_pretrained"])
def test_export_loads_where_looplm_cannot_be_imported(kind, tf_path, exported, tiny_ckpt, tmp_path):
    """Logits and greedy tokens of the remote code (no looplm) equal looplm's own model's."""
    from looplm.run.checkpoint import load_checkpoint

    if kind == "scse-export":
        folder = exported
        model, cfg, _, _ = load_checkpoint(tiny_ckpt)
        eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    else:
        folder = tmp_path / "huginn"
        model, eos = huginn_export(folder), None
    depth = json.loads((folder / "config.json").read_text())["num_steps"]
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    info, logits, gen = without_looplm(folder, ids, tmp_path / "io", tf_path)
    assert info["looplm"] == [] and info["class"].startswith("transformers_modules.") and info["num_steps"] == depth
    if tf_path is not None:
        assert info["version"] == "4.57.6"
    with torch.no_grad():
        want = model(ids, depth=depth).logits
    torch.testing.assert_close(logits, want, **TOL)
    ref = generate(model, ids.tolist(), 5, depth, eos_id=eos)
    for row, w in zip(gen[:, ids.shape[1]:].tolist(), ref.tokens):
        assert row[:len(w)] == w
    if kind == "scse-export":
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert info["tokenizer"] == ["PreTrainedTokenizerFast" if tf_path is not None else info["tokenizer"][0],
                                     raw.encode("The jury said").ids, "<|endoftext|>"]


def test_remote_code_is_generated_from_the_package(exported):
    """The folder's code is looplm's modules with only the looplm imports rewritten (no looplm import left)."""
    import ast

    from looplm.hf.remote import REMOTE_FILES, remote_code

    files = remote_code()
    assert set(files) == {f"{name}.py" for name in REMOTE_FILES}
    for name, text in files.items():
        assert (exported / name).read_text() == text
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert node.module.split(".")[0] != "looplm", (name, node.module)
    assert "def from_checkpoint" not in files["modeling_looplm.py"]  # needs looplm's checkpoint loader: package only
    assert "class ModelConfig" in files["configuration_looplm.py"]


def test_tokenizer_config_names_a_class_every_transformers_reads(exported):
    d = json.loads((exported / "tokenizer_config.json").read_text())
    assert d["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in d


def test_derived_config_fields_refuse_overrides(exported):
    import looplm.hf  # noqa: F401  (registers the Auto classes)
    from looplm.hf import LoopLMConfig

    m = transformers.AutoModelForCausalLM.from_pretrained(exported, num_steps=5, hidden_size=32)  # equal: fine
    assert m.config.num_steps == 5 and m.config.hidden_size == 32
    for kwargs in ({"hidden_size": 7}, {"vocab_size": 10}, {"tie_word_embeddings": False}):
        (key,) = kwargs
        with pytest.raises(ValueError, match=f"^{key}: derived from the looplm config"):
            transformers.AutoModelForCausalLM.from_pretrained(exported, **kwargs)
    with pytest.raises(ValueError, match="^num_hidden_layers: derived"):
        LoopLMConfig(num_hidden_layers=2)
    with pytest.raises(TypeError, match="foo"):
        transformers.AutoModelForCausalLM.from_pretrained(exported, foo=1)


# ---------------------------------------------------------------------------------------------- §2 defaults


def test_one_default_depth_and_kv_layout(tiny_ckpt, tmp_path, capsys):
    """`export --num-steps 5 --kv-cache terminal`: transformers, `looplm generate` and the lm-eval backend all
    run depth 5 with terminal sharing, and give the text of the checkpoint run with those flags."""
    import looplm.hf  # noqa: F401
    from looplm.hf.harness import LoopLMEvalHarness
    from looplm.run.checkpoint import load_config

    folder = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tiny_ckpt), "--out", str(folder), "--num-steps", "5",
                 "--kv-cache", "terminal"]) == 0
    assert load_config(folder).train.eval_depth == 5
    lm = LoopLMEvalHarness(checkpoint=str(folder))
    assert (lm.depth, lm.kv_cache) == (5, "terminal")
    runs = {}
    for name, args in (("export", [str(folder)]), ("flags", [str(tiny_ckpt), "--depth", "5", "--kv-cache", "terminal"])):
        out = tmp_path / f"{name}.json"
        assert main(["generate", "--checkpoint", *args, "--prompt", "The jury said", "--max-new-tokens", "6",
                     "--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["export"]["settings"]["depth"] == 5 and runs["export"]["settings"]["kv_cache"] == "terminal"
    assert runs["export"]["results"][0]["tokens"] == runs["flags"]["results"][0]["tokens"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert (model.config.num_steps, model.config.kv_cache) == (5, "terminal")
    enc = tok(["The jury said"], return_tensors="pt")
    with torch.no_grad():
        hf = model.generate(**enc, max_new_tokens=6, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    want = runs["export"]["results"][0]["tokens"]
    assert hf[:len(want)] == want


# ---------------------------------------------------------------------------------------------- §2 folders


def test_export_refuses_a_non_empty_folder_unless_overwrite(tiny_ckpt, exported, tmp_path, capsys):
    from safetensors.torch import save_file

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    for out in (exported, other):
        before = sorted(p.name for p in out.iterdir())
        assert main(["export", "--checkpoint", str(tiny_ckpt), "--out", str(out)]) == 2
        assert f"--out {out}: the folder is not empty" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == before
    stale = other / "model-00002-of-00002.safetensors"  # a weight shard of an earlier, larger export
    save_file({"x": torch.zeros(1)}, str(stale))
    assert main(["export", "--checkpoint", str(tiny_ckpt), "--out", str(other), "--overwrite"]) == 0
    assert not stale.exists() and (other / "notes.txt").read_text() == "keep"
    assert (other / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_get_the_mode_of_a_plain_open(tiny_ckpt, tmp_path, umask):
    """model.safetensors (safetensors writes it 0o600) is as readable as config.json: a shared export."""
    import stat

    old = os.umask(umask)
    try:
        assert main(["export", "--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir() if p.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert "model.safetensors" in modes


def test_distill_default_output_is_outside_an_export(tiny_ckpt, exported):
    from looplm.distill.student import default_student_dir

    assert default_student_dir(exported) == exported.parent / "hf-student"
    assert default_student_dir(tiny_ckpt) == tiny_ckpt / "student"


# ---------------------------------------------------------------------------------------------- §3 lm-eval


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A data folder with the first 8 LAMBADA passages and the first 2 WikiText-2 test articles."""
    pytest.importorskip("lm_eval")
    from looplm.data.paths import resolve_data_root
    from looplm.hf.harness import wikitext_documents

    root, data = resolve_data_root(""), tmp_path_factory.mktemp("data")
    (data / "lambada").mkdir()
    lines = (root / "lambada" / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (data / "lambada" / "lambada_test.jsonl").write_text("".join(lines[:8]), encoding="utf-8")
    (data / "wikitext-2-raw").mkdir()
    docs = wikitext_documents((root / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8"))
    (data / "wikitext-2-raw" / "wiki.test.raw").write_text("".join(d[:1500] + "\n" for d in docs[:2]), encoding="utf-8")
    return data


@pytest.mark.slow
def test_lm_eval_offline_over_the_data_folder_and_in_the_report(exported, small_data, tmp_path, monkeypatch, capsys):
    """`looplm lm-eval --tasks looplm_lambada,looplm_wikitext` needs no network: its numbers equal the harness
    run on tasks written by hand with write_local_tasks, and --db makes the export a row of `looplm report`."""
    from looplm.hf.harness import evaluate_harness, write_local_tasks

    monkeypatch.setenv("LOOPLM_DATA", str(small_data))
    out, db = tmp_path / "lm.json", tmp_path / "results.db"
    assert main(["lm-eval", "--checkpoint", str(exported), "--tasks", "looplm_lambada,looplm_wikitext", "--depths",
                 "1,3", "--only-include-path", "--bootstrap-iters", "0", "--out", str(out), "--db", str(db)]) == 0
    got = json.loads(out.read_text())["depths"]
    tasks = write_local_tasks(tmp_path / "tasks", lambada_jsonl=small_data / "lambada" / "lambada_test.jsonl",
                              wikitext_raw=small_data / "wikitext-2-raw" / "wiki.test.raw")
    ref = evaluate_harness(exported, tasks=list(tasks), depths=[1, 3], include_path=tmp_path / "tasks",
                           include_defaults=False, bootstrap_iters=0)["depths"]
    assert got == json.loads(json.dumps(ref))  # the same harness run on the same files: the same numbers
    assert got["3"]["results"]["looplm_lambada"]["sample_len"] == 8
    capsys.readouterr()
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "tiny-hf [" in text and "looplm_lambada" in text
    (small_data / "moved").mkdir()
    (small_data / "lambada" / "lambada_test.jsonl").rename(small_data / "moved" / "x.jsonl")
    try:
        assert main(["lm-eval", "--checkpoint", str(exported), "--tasks", "looplm_lambada"]) == 2
    finally:
        (small_data / "moved" / "x.jsonl").rename(small_data / "lambada" / "lambada_test.jsonl")
    err = capsys.readouterr().err
    assert f"--tasks looplm_lambada: needs {small_data / 'lambada' / 'lambada_test.jsonl'}" in err


@pytest.mark.slow
def test_lm_eval_hub_task_offline_is_a_one_line_hint(exported, capsys):
    pytest.importorskip("lm_eval")
    assert main(["lm-eval", "--checkpoint", str(exported), "--tasks", "lambada_openai", "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ConnectionError" in err and "--tasks looplm_lambada,looplm_wikitext" in err


def test_lm_eval_hf_model_on_the_export_gives_the_same_numbers(exported, small_data, tmp_path):
    """`lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True` = `looplm lm-eval` at the
    export's depth (float32 on CPU through different batch shapes: sums of ~10 log-probabilities agree to 1e-4)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (the lmeval extra installs it)")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from looplm.hf.harness import evaluate_harness, write_local_tasks

    write_local_tasks(tmp_path / "tasks", lambada_jsonl=small_data / "lambada" / "lambada_test.jsonl")
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={exported},trust_remote_code=True",
                                 tasks=["looplm_lambada"], task_manager=manager, bootstrap_iters=0, device="cpu",
                                 batch_size=4)["results"]["looplm_lambada"]
    ours = evaluate_harness(exported, tasks=["looplm_lambada"], include_path=tmp_path / "tasks",
                            include_defaults=False, bootstrap_iters=0)["depths"]["3"]["results"]["looplm_lambada"]
    assert hf["acc,none"] == ours["acc"]
    assert hf["perplexity,none"] == pytest.approx(ours["perplexity"], rel=1e-4)
