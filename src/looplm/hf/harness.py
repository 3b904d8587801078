"""An lm-evaluation-harness backend for looplm checkpoints (model name ``looplm``), and a multi-depth runner.

:class:`LoopLMEvalHarness` (a ``TemplateLM``) takes ``--model_args`` ``checkpoint=DIR`` (a checkpoint, run
directory or export; required), ``depth=T`` (default: the largest of ``depths``, else ``train.eval_depth``),
``depths=1;8;48`` (each batch one unroll read out at all of them, memoized), ``batch_size``, ``device``,
``kv_cache``, ``stride``. :func:`evaluate_harness` (``looplm lm-eval``) runs ``simple_evaluate`` once per depth
from that memo. Importing this module registers ``looplm`` (``python -m looplm.hf.harness`` is the harness's
command line with it). Methods, and how its numbers differ from ``looplm eval``'s: ``docs/interop.md``.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

import lm_eval.models  # noqa: F401  lm-eval loads its own models only into an empty registry: fill it before ours
from looplm.model.cursor import NLL, Readout
from looplm.run.finite import md_table

MODEL_NAME = "looplm"
CHECKPOINT_SWEEP = "checkpoints"  # the runs-table sweep of checkpoints evaluated outside a sweep (``--db``)
# offline tasks (write_local_tasks) over files of the data folder: ``looplm lm-eval --tasks`` writes them on demand
LOCAL_TASKS = {"looplm_lambada": "lambada/lambada_test.jsonl", "looplm_wikitext": "wikitext-2-raw/wiki.test.raw"}


def parse_depths(value: Any) -> list[int]:
    """``8`` / ``"1;8;48"`` / ``"1 8"`` / ``[1, 8]`` → sorted unique depths (ValueError on anything else)."""
    if value is None:
        return []
    if isinstance(value, (int, np.integer)):
        items = [int(value)]
    elif isinstance(value, str):
        items = [int(s) for s in value.replace(";", " ").replace(":", " ").split() if s]
    else:
        items = [int(v) for v in value]
    if not items or min(items) < 0:
        raise ValueError(f"depths: need loop depths >= 0 like 1;8;48, got {value!r}")
    return sorted(set(items))


@register_model(MODEL_NAME)
class LoopLMEvalHarness(TemplateLM):
    """The ``looplm`` harness backend (module docstring)."""

    def __init__(self, checkpoint: str | None = None, depth: int | str | None = None, depths: Any = None,
                 batch_size: int | str | None = 16, device: str | None = "cpu", kv_cache: str | None = None,
                 stride: int | None = None, max_batch_size: int | None = None, **kwargs: Any):
        super().__init__()
        from looplm.data.tokenizer import eot_id
        from looplm.eval.runner import load_tokenizer_for
        from looplm.run.checkpoint import load_checkpoint
        from looplm.run.hf_folder import export_kv_cache

        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # the harness's command line defaults to cuda; a user who asked for it gets the warning
            logging.getLogger(__name__).warning("looplm: device=%s but no CUDA device is available; using cpu", device)
            device = "cpu"
        if checkpoint is None:
            raise ValueError("looplm: give checkpoint=DIR in --model_args")
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"looplm: unknown model_args {unknown}; allowed: checkpoint, depth, depths, "
                             "batch_size, device, kv_cache, stride")
        self.model, self.config, _, ckpt = load_checkpoint(checkpoint, device=device or "cpu")
        self.tok = load_tokenizer_for(ckpt)
        self.checkpoint = str(ckpt)
        self.device_ = torch.device(device or "cpu")
        self.seq_len = int(self.model.cfg.seq_len)
        listed = parse_depths(depths)
        self.depth = int(depth) if depth is not None else (listed[-1] if listed else int(self.config.train.eval_depth))
        self.depths = sorted(set(listed) | {self.depth})
        self.batch_size_ = 16 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        self.kv_cache = kv_cache or export_kv_cache(checkpoint) or "per_visit"
        self.stride = None if stride in (None, "", "none") else int(stride)
        try:
            self.eot = eot_id(self.tok)
        except ValueError as exc:
            raise ValueError(f"looplm: {exc}") from None
        self._memo: dict[tuple, dict[int, Any]] = {}
        self.unrolls = 0  # forwards run (one per batch, whatever the number of depths)

    # ------------------------------------------------------------------ TemplateLM plumbing
    @property
    def eot_token_id(self) -> int:
        return self.eot

    @property
    def max_length(self) -> int:
        return self.seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens=False)

    def get_model_info(self) -> dict[str, Any]:
        return {"model": MODEL_NAME, "checkpoint": self.checkpoint, "depth": self.depth, "depths": self.depths,
                "rule": self.config.model.rule, "params": self.model.num_params()}

    def set_depth(self, depth: int) -> None:
        """Make ``depth`` the depth whose answers are returned (it must be one of ``depths``)."""
        if int(depth) not in self.depths:
            raise ValueError(f"depth {depth} is not among the scored depths {self.depths}")
        self.depth = int(depth)

    # ------------------------------------------------------------------ loglikelihood
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from looplm.eval.lambada import right_pad

        keys = [(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        todo = sorted({k for k in keys if k not in self._memo or any(T not in self._memo[k] for T in self.depths)},
                      key=lambda k: -(len(k[0]) + len(k[1])))
        self.model.eval()
        for i in tqdm(range(0, len(todo), self.batch_size_), disable=disable_tqdm or not todo, desc="looplm ll"):
            chunk = todo[i:i + self.batch_size_]
            seqs = [(list(c) + list(t))[-(self.seq_len + 1):] for c, t in chunk]
            n_cont = [min(len(t), len(s) - 1) for (_, t), s in zip(chunk, seqs)]
            x, rows_t, cols_t, tgt_t = right_pad(seqs, n_cont, self.device_)  # every continuation token
            out = self.model(x, self.depths, readout=Readout(tokens=(rows_t, cols_t)))
            self.unrolls += 1
            for T in self.depths:
                logp = out.logits_by_depth[T].float().log_softmax(-1)  # (N, V)
                ll = logp.gather(-1, tgt_t[:, None]).squeeze(-1).double()
                hit = (logp.argmax(-1) == tgt_t).float()
                sums = torch.zeros(len(chunk), dtype=torch.float64, device=self.device_).index_add_(0, rows_t, ll)
                miss = torch.zeros(len(chunk), device=self.device_).index_add_(0, rows_t, 1.0 - hit)
                for k, ll_k, greedy in zip(chunk, sums.tolist(), (miss == 0).tolist()):
                    self._memo.setdefault(k, {})[T] = (float(ll_k), bool(greedy))
        results = [self._memo[k][self.depth] for k in keys]
        for (req, _, _), ans in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req, ans)
        return results

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from looplm.data.tokens import eval_windows

        self.model.eval()
        out_vals = []
        for req in tqdm(requests, disable=disable_tqdm, desc="looplm rolling"):
            (text,) = req.args
            key = ("rolling", self.stride, tuple(self.tok_encode(text)))
            if key not in self._memo or any(T not in self._memo[key] for T in self.depths):
                stream = np.asarray([self.prefix_token_id, *key[2]], dtype=np.int64)
                total = {T: 0.0 for T in self.depths}
                for x, y, mask in eval_windows(stream, self.seq_len, self.batch_size_, stride=self.stride):
                    x, y, mask = x.to(self.device_), y.to(self.device_), mask.to(self.device_)
                    o = self.model(x, self.depths, y.masked_fill(~mask, -100), readout=NLL)
                    self.unrolls += 1
                    for T in self.depths:
                        total[T] -= float(o.nll_by_depth[T][mask].double().sum())
                self._memo[key] = total
            ll = self._memo[key][self.depth]
            out_vals.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
        return out_vals

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from looplm.eval.generate import generate

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for key, idxs in groups.items():
            kw = dict(json.loads(key))
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eot_text = self.tok_decode([self.eot])
            if eot_text not in until:
                until.append(eot_text)
            max_new = max(1, min(int(kw.pop("max_gen_toks", 256)), self.seq_len))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0) or 0.0) if do_sample else 0.0
            top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
            seed = int(kw.pop("seed", 0) or 0)
            keep = self.seq_len - max_new + 1
            for i in tqdm(range(0, len(idxs), self.batch_size_), disable=disable_tqdm, desc="looplm generate"):
                part = idxs[i:i + self.batch_size_]
                prompts = [(self.tok_encode(requests[j].args[0]) or [self.eot])[-keep:] for j in part]
                gen = generate(self.model, prompts, max_new, self.depth, temperature=temperature,
                               top_k=None if top_k is None else int(top_k),
                               top_p=None if top_p is None else float(top_p), seed=seed,
                               cache_mode=self.kv_cache, eos_id=self.eot)
                for j, toks in zip(part, gen.tokens):
                    text = self.tok_decode(toks)
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    results[j] = text
                    self.cache_hook.add_partial("generate_until", requests[j].args, text)
        return results  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- runner


def _metrics(task_result: dict[str, Any]) -> dict[str, float]:
    """Numeric harness metrics of one task, ``,none`` filter suffix dropped (other filters kept)."""
    out = {}
    for name, value in task_result.items():
        if name == "alias" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, _, filt = name.partition(",")
        out[metric if filt in ("", "none") else f"{metric},{filt}"] = float(value)
    return out


def evaluate_harness(checkpoint: str | Path, *, tasks: Sequence[str], depths: Sequence[int] | None = None,
                     include_path: str | Path | None = None, include_defaults: bool = True,
                     num_fewshot: int | None = None, limit: float | None = None, batch_size: int = 16,
                     device: str = "cpu", kv_cache: str | None = None, seed: int = 0,
                     bootstrap_iters: int = 1000, db: str | Path | None = None, tag: str = "") -> dict[str, Any]:
    """Harness tasks at several loop depths from one unroll per batch (module docstring).

    ``tasks`` are found in ``include_path`` (and the harness's own with ``include_defaults``); the offline
    :data:`LOCAL_TASKS` are written from the data folder unless ``include_path`` defines them. ``depths`` default
    to train.eval_depth; ``db`` stores every numeric metric per task and depth. Returns the JSON-ready results
    (``depths`` → ``"T"`` → the harness's ``results``, ``unrolls``, ``stored``, ``markdown``).
    FileNotFoundError: without ``include_path``, a local task's file is missing from the data folder (named)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from looplm.data.paths import resolve_data_root

    lm = LoopLMEvalHarness(checkpoint=str(checkpoint), depths=list(depths) if depths else None,
                           batch_size=batch_size, device=device, kv_cache=kv_cache)
    files = {name: resolve_data_root("") / LOCAL_TASKS[name] for name in tasks if name in LOCAL_TASKS}
    for name, path in files.items():
        if include_path is None and not path.is_file():
            raise FileNotFoundError(f"--tasks {name}: needs {path} (the data folder is $LOOPLM_DATA or ../shared/data)")
    files = {name: path for name, path in files.items() if path.is_file()}
    per_depth: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="looplm-tasks-") as local:
        # the data-folder tasks first: a later include path (the user's) that defines the same task wins
        write_local_tasks(local, lambada_jsonl=files.get("looplm_lambada"), wikitext_raw=files.get("looplm_wikitext"))
        paths = [str(p) for p in (local if files else None, include_path) if p]
        manager = TaskManager(include_path=paths or None, include_defaults=include_defaults)
        for T in lm.depths:
            lm.set_depth(T)
            res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=False,
                                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed)
            per_depth[str(T)] = {"results": {task: _metrics(r) for task, r in res["results"].items()},
                                 "n_samples": res.get("n-samples", {})}
    version = getattr(lm_eval, "__version__", "unknown")
    settings = {"lm_eval_version": version, "num_fewshot": num_fewshot, "limit": limit, "stride": lm.stride,
                "kv_cache": lm.kv_cache}
    out: dict[str, Any] = {"checkpoint": lm.checkpoint, "tasks": list(tasks), "depths": per_depth,
                           "unrolls": lm.unrolls, "lm_eval_version": version, "stored": 0, "settings": settings}
    if db is not None:
        from looplm.analysis.store import EvalIdentity, ResultStore, RunRecord

        items = [(EvalIdentity.make(lm.config, "lm_eval", dataset=task, split="", depth=int(T), settings=settings,
                                    tag=tag), metrics)
                 for T, r in per_depth.items() for task, metrics in r["results"].items() if metrics]
        run = RunRecord(sweep=CHECKPOINT_SWEEP, run_id=str(lm.checkpoint), variant="", seed=lm.config.train.seed,
                        config=lm.config.to_dict(), run_dir=str(lm.checkpoint), params=lm.model.num_params())
        run.variant = f"{lm.config.name or 'checkpoint'} [{run.config_hash[:8]}]"
        with ResultStore(db) as store:
            out["stored"] = store.put_many(items, config=lm.config, settings=settings)
            if run.config_hash not in {r.config_hash for r in store.runs()}:  # a model of no sweep: `looplm report` lists it
                store.put_run(run)
    out["markdown"] = markdown_table(per_depth)
    return out


def markdown_table(per_depth: dict[str, Any]) -> str:
    """One row per (task, metric), one column per depth."""
    depths = sorted(per_depth, key=int)
    rows = []
    for task in sorted({t for r in per_depth.values() for t in r["results"]}):
        for m in sorted({m for r in per_depth.values() for m in r["results"].get(task, {})}):
            vals = [per_depth[T]["results"].get(task, {}).get(m) for T in depths]
            rows.append([task, m, *("–" if v is None else f"{v:.4g}" for v in vals)])
    return "\n".join(md_table(["task", "metric", *(f"T={T}" for T in depths)], rows, align="ll" + "r" * len(depths)))


# ---------------------------------------------------------------------------------------------- local tasks

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: {output_type}
test_split: test
{body}metadata:
  version: 1.0
"""
LAMBADA_BODY = """doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
WIKITEXT_BODY = """doc_to_text: ""
doc_to_target: "{{page}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_local_tasks(folder: str | Path, *, lambada_jsonl: str | Path | None = None,
                      wikitext_raw: str | Path | None = None, max_chars: int | None = None,
                      docs: int | None = None) -> dict[str, Path]:
    """Write offline harness tasks into ``folder`` (an ``include_path``); returns {task: YAML path}:
    ``looplm_lambada`` (``lambada_openai`` over a local jsonl) and ``looplm_wikitext`` (``loglikelihood_rolling``
    over the raw WikiText articles, the first ``docs``, each cut at a line end after ``max_chars``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    if lambada_jsonl is not None:
        path = folder / "looplm_lambada.yaml"
        path.write_text(TASK_YAML.format(name="looplm_lambada", path=json.dumps(str(Path(lambada_jsonl).resolve())),
                                         output_type="loglikelihood", body=LAMBADA_BODY))
        out["looplm_lambada"] = path
    if wikitext_raw is not None:
        pages = wikitext_documents(Path(wikitext_raw).read_text(encoding="utf-8"))[:docs]
        if max_chars is not None:
            pages = [p if len(p) <= max_chars else p[:p.rfind("\n", 0, max_chars) + 1] for p in pages]
        data = folder / "looplm_wikitext.jsonl"
        data.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages), encoding="utf-8")
        path = folder / "looplm_wikitext.yaml"
        path.write_text(TASK_YAML.format(name="looplm_wikitext", path=json.dumps(str(data.resolve())),
                                         output_type="loglikelihood_rolling", body=WIKITEXT_BODY))
        out["looplm_wikitext"] = path
    return out


def wikitext_documents(text: str) -> list[str]:
    """Split a raw WikiText file into articles: a new one starts at each top-level heading line
    (`` = Title = ``, not `` = = Section = = ``)."""
    docs: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        s = line.strip()
        top = s.startswith("= ") and s.endswith(" =") and not s.startswith("= =")
        if top or not docs:
            docs.append([])
        docs[-1].append(line)
    return ["".join(d) for d in docs if "".join(d).strip()]


def cli_main(argv: Sequence[str] | None = None) -> int:
    """The harness's own command line with ``looplm`` registered (``python -m looplm.hf.harness``)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    result = cli_evaluate()
    return int(result or 0) if isinstance(result, int) else 0


if __name__ == "__main__":
    raise SystemExit(cli_main())
