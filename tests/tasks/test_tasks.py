"""Synthetic tasks (issue 24 §1, §4): generators checked by independent solvers, train/held-out
separation, the one-unroll accuracy protocol against a per-depth loop, and exact resume of a task run."""

from __future__ import annotations

import hashlib
import json
from typing import get_args

import pytest
import torch

from looplm.config import (Config, ConfigError, DataConfig, ModelConfig, OptimConfig, TaskName, TrainConfig,
                           UniformDepthConfig)
from looplm.model import build_model
from looplm.tasks import TASKS, decode, encode, get_task
from looplm.tasks.data import accuracy_by_depth, heldout, rng_for, rows, task_data, train_instances


# --- independent solvers: parse the prompt, return (answer, number of sequential steps) -----------
def solve_phop(prompt: str) -> tuple[str, int]:
    p, rest = prompt.split(":")
    seq = rest[:-1]
    i, visited = len(seq) - 1, []
    for _ in range(int(p)):
        j = next(j for j in range(i - 1, -1, -1) if seq[j] == seq[i])  # StopIteration: a hop is missing
        assert j + 1 < i, "a hop must move back"
        i = j + 1
        visited.append(i)
    return seq[i], len(set(visited))


def solve_modsum(prompt: str) -> tuple[str, int]:
    ops = prompt[:-1].split("+")
    s = 0
    for d in ops:
        s = (s + int(d)) % 10
    return str(s), len(ops)


def solve_varchain(prompt: str) -> tuple[str, int]:
    body, query = prompt[:-1].split("?")
    env = {}
    for stmt in body.split(";"):
        name, value = stmt.split("=")
        assert value.isdigit() or value in env, "every variable is bound before it is read"
        env[name] = value
    assert len(env) == len(body.split(";")), "each variable is bound once"
    v, steps = query, 0
    while not v.isdigit():
        v, steps = env[v], steps + 1
    values = {x for x in env.values() if x.isdigit()}
    assert len(values) == 2 and len(env) == 2 * steps, "one distractor chain of the same length, another value"
    return v, steps


def solve_addition(prompt: str) -> tuple[str, int]:
    a, b = prompt[:-1].split("+")
    assert len(a) == len(b)
    total = int(a) + int(b)
    return str(total).zfill(len(a) + 1)[::-1], len(a)


def solve_pointer(prompt: str) -> tuple[str, int]:
    parents, query = prompt[:-1].split("?")
    nodes = "abcdefghijklmnopqrstuvwxyz"
    assert len(parents) == len(nodes) and len(query) == 1, "one parent per node, one queried node"
    return _root_of(dict(zip(nodes, parents)), query)


def solve_pointer_edges(prompt: str) -> tuple[str, int]:
    assert prompt.endswith("="), "the query ends with ="
    edges, query = prompt[:-1].split("?")
    pairs = edges.split(";")
    assert pairs.pop() == "" and all(len(p) == 2 for p in pairs), "child-parent pairs, each ended by ;"
    parent = dict(pairs)
    assert len(pairs) == 16 and sorted(parent) == list("abcdefghijklmnop") and len(query) == 1, \
        "one edge per node a … p, one query"
    return _root_of(parent, query)


def solve_pointer_pairs(prompt: str, k_train: int | None = None) -> tuple[str, int]:
    """Also a ``pointer_pairs_mq`` training row: its earlier queries ``?xr`` are answered right, each ≤ k_train
    hops, and none is the final query or one of its ancestors."""
    edges, *extra, query = prompt.split("?")
    nodes = "abcdefghijklmnop"
    parent = {nodes[c]: nodes[p] for c, p in (divmod(ord(t) - 0x100, 16) for t in edges)}  # U+0100 + 16·c + p
    assert len(edges) == 16 and sorted(parent) == list(nodes) and len(query) == 1, \
        "one edge token per node a … p, one query"
    def walk(v: str) -> list[str]:
        path = [v]
        while parent[path[-1]] != path[-1]:
            path.append(parent[path[-1]])
        return path

    for x, r in extra:
        assert x not in walk(query) and walk(x)[-1] == r and 1 <= len(walk(x)) - 1 <= k_train
    assert len({x for x, _ in extra}) == len(extra), "distinct extra queries"
    return _root_of(parent, query)


def _root_of(parent: dict[str, str], query: str) -> tuple[str, int]:
    """The root of ``query`` and its hop count; checks the forest is two trees of equal size, the other one with
    a chain as long as the query's (no count tells the roots apart)."""
    nodes = sorted(parent)

    def root(v: str) -> tuple[str, int]:
        steps = 0
        while parent[v] != v:
            v, steps = parent[v], steps + 1
            assert steps <= len(nodes), "no cycle but the roots' self-loops"
        return v, steps

    walks = {v: root(v) for v in nodes}
    roots = [r for r, _ in walks.values()]
    assert len(set(roots)) == 2 and roots.count(roots[0]) == len(nodes) // 2, "two trees of equal size"
    answer, hops = walks[query]
    assert any(r != answer and d == hops for r, d in walks.values()), "the other tree has a k-hop chain"
    return answer, hops


def solve_pointer_forest(prompt: str) -> tuple[str, int]:
    """Parses the 32 edge tokens (U+4E00 + 32·child + parent) and follows q's parents; checks the forest: every
    node a … 5 the child of exactly one edge, four roots (self-loops) of four trees of 8 nodes, and each other tree
    holding a node as many hops from its root as q (no count tells the roots apart)."""
    edges, query = prompt.split("?")
    nodes = "abcdefghijklmnopqrstuvwxyz012345"
    pairs = [divmod(ord(t) - 0x4E00, 32) for t in edges]
    assert len(edges) == 32 and all(0 <= c < 32 for c, _ in pairs) and len(query) == 1, "32 edge tokens, one query"
    assert sorted(c for c, _ in pairs) == list(range(32)), "every node the child of exactly one edge"
    parent = {nodes[c]: nodes[p] for c, p in pairs}

    def walk(v: str) -> tuple[str, int]:
        hops = 0
        while parent[v] != v:
            v, hops = parent[v], hops + 1
            assert hops <= 32, "no cycle but the roots' self-loops"
        return v, hops

    walks = {v: walk(v) for v in nodes}
    roots = [r for r, _ in walks.values()]
    assert len(set(roots)) == 4 and all(roots.count(r) == 8 for r in set(roots)), "four trees of 8 nodes"
    assert sorted(v for v in nodes if parent[v] == v) == sorted(set(roots)), "the roots are the self-loops"
    answer, hops = walks[query]
    for r in set(roots) - {answer}:
        assert any(rv == r and d == hops for rv, d in walks.values()), "every other tree has a k-hop chain"
    return answer, hops


SOLVERS = {"phop": solve_phop, "modsum": solve_modsum, "modsum_partial": solve_modsum, "varchain": solve_varchain, "addition": solve_addition,
           "pointer": solve_pointer, "pointer_edges": solve_pointer_edges,
           "pointer_pairs": solve_pointer_pairs, "pointer_pairs_mq": solve_pointer_pairs,
           "pointer_forest": solve_pointer_forest}


def _cfg(task: str, k: int = 3, heldout_size: int = 32) -> DataConfig:
    return DataConfig(dataset="task", task=task, task_k=k, task_heldout=heldout_size)


def test_registry_matches_config_literal():
    assert set(TASKS) == set(get_args(TaskName)) == set(SOLVERS)
    known = "addition, modsum, modsum_partial, phop, pointer, pointer_edges, pointer_forest, pointer_pairs, pointer_pairs_mq, varchain"
    with pytest.raises(ValueError, match=f"unknown task 'nope'; known: {known}"):
        get_task("nope")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generators_are_deterministic_per_seed(task):
    fam = get_task(task)
    for k in (1, 3):
        assert fam.make(k, rng_for("t", 1)) == fam.make(k, rng_for("t", 1))
    cfg = _cfg(task)
    a, b = train_instances(cfg, 16, 0, 5, 0), train_instances(cfg, 16, 0, 5, 0)
    assert a == b and a != train_instances(cfg, 16, 0, 6, 0)
    assert heldout(task, 2, "test", 8, 0) != heldout(task, 2, "test", 8, 1)  # the seed matters


@pytest.mark.parametrize("task", sorted(TASKS))
def test_independent_solver_agrees_on_answer_and_difficulty(task):
    fam, solve = get_task(task), SOLVERS[task]
    ks = sorted({1, 2, 3, 5, fam.max_k // 2, fam.max_k})
    insts = [fam.make(k, rng_for("solver", task, k, i)) for k in ks for i in range(20)]
    insts += list(train_instances(_cfg(task), 40, 0, 0, 0))
    for inst in insts:
        answer, steps = solve(inst.prompt, 3) if task == "pointer_pairs_mq" else solve(inst.prompt)  # k_train 3
        assert (answer, steps) == (inst.answer, inst.k), inst


def test_multi_query_rows_score_every_answer_and_hold_out_every_view():
    cfg = _cfg("pointer_pairs_mq", k=3, heldout_size=64)
    insts = [i for step in range(30) for i in train_instances(cfg, 16, 0, step, 0)]
    assert {i.prompt.count("?") for i in insts} == {1, 2, 3, 4}  # 0 … 3 extra queries
    x, y = rows("pointer_pairs_mq", insts, 28)
    for r, inst in enumerate(insts):
        ids = get_task("pointer_pairs_mq").vocab.encode(inst.prompt + inst.answer)
        scored = (y[r] != -100).nonzero().flatten().tolist()
        # each query's answer (the token after the queried node, 2 after its "?"), nothing else
        asks = [j + 1 for j, c in enumerate(inst.prompt + inst.answer) if c == "?"]
        assert scored == asks and [y[r, j].item() for j in scored] == [ids[j + 1] for j in asks]
    held = {i.prompt for k in (1, 2, 3) for s in ("valid", "test") for i in heldout("pointer_pairs_mq", k, s, 64, 0)}
    views = {p for i in insts for _, p in get_task("pointer_pairs_mq").views(i)}
    assert len(views) > len(insts) and not views & held
    assert all(len(i.prompt) == 18 for k in (1, 5, 7) for i in heldout("pointer_pairs_mq", k, "test", 8, 0))


def test_modsum_partial_rows_supervise_every_running_sum():
    cfg = _cfg("modsum_partial", k=6, heldout_size=64)
    insts = [i for step in range(4) for i in train_instances(cfg, 16, 0, step, 0)]
    x, y = rows("modsum_partial", insts, 24)
    for r, inst in enumerate(insts):
        ops = inst.prompt[:-1].split("+")
        want = {2 * i: solve_modsum("+".join(ops[: i + 1]) + "=")[0] for i in range(len(ops))}  # after operand i
        want[len(inst.prompt) - 1] = inst.answer  # the "=" position reads out the answer
        scored = (y[r] != -100).nonzero().flatten().tolist()
        assert scored == sorted(want) and [decode([y[r, j].item()]) for j in scored] == [want[j] for j in scored]
    plain = heldout("modsum_partial", 3, "test", 8, 0)
    assert all(i.targets == () for i in plain)
    assert (rows("modsum_partial", list(plain), 24)[1] != -100).sum() == len(plain)  # held out: the answer only


def test_pointer_forest_has_four_equal_trees_and_a_fixed_length_prompt():
    """Beyond the solver (run on every task above): q's hops counted on a parent array rebuilt from the tokens,
    every root a possible answer (each of the four is the answer about a quarter of the time: the roots'
    self-loops alone earn 25%), 34 prompt tokens at every k, and the instance fits the preset's seq_len."""
    from looplm.presets import PRESETS

    fam = get_task("pointer_forest")
    assert fam.max_k == 7 and len(fam.vocab.vocab) == 1 + 41 + 1024
    assert not {chr(c) for c in range(0x100, 0x200)} & set(fam.vocab.chars)  # apart from pointer_pairs' tokens
    nodes = "abcdefghijklmnopqrstuvwxyz012345"
    rank = {}
    for k in range(1, 8):
        for inst in heldout("pointer_forest", k, "valid", 64, 0):
            edges, q = inst.prompt.split("?")
            parent = [0] * 32
            for t in edges:
                parent[(ord(t) - 0x4E00) // 32] = (ord(t) - 0x4E00) % 32
            v, hops = nodes.index(q), 0
            while parent[v] != v:
                v, hops = parent[v], hops + 1
            assert (nodes[v], hops) == (inst.answer, k) and len(inst.prompt) == 34
            roots = sorted(nodes[r] for r in range(32) if parent[r] == r)
            rank[roots.index(inst.answer)] = rank.get(roots.index(inst.answer), 0) + 1
    assert sorted(rank) == [0, 1, 2, 3] and max(rank.values()) < 0.4 * sum(rank.values())
    x, _ = rows("pointer_forest", list(heldout("pointer_forest", 7, "valid", 8, 0)),
                PRESETS["task-pointer_forest"].model.seq_len)
    assert x.shape[1] == PRESETS["task-pointer_forest"].model.seq_len == 34


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_heldout_instances_never_overlap(task):
    """Held-out sets are drawn from their own seed streams and training redraws any instance whose prompt
    hash is held out; modsum at k <= 2 (10 and 100 instances) would collide within a few draws otherwise."""
    cfg = _cfg(task, k=3, heldout_size=64)

    def digest(inst):
        return hashlib.sha256(f"{inst.k}|{inst.prompt}".encode()).hexdigest()

    held = {s: {digest(i) for k in range(1, 4) for i in heldout(task, k, s, 64, 0)} for s in ("valid", "test")}
    assert held["valid"] and not held["valid"] & held["test"]
    train = {digest(i) for step in range(60) for i in train_instances(cfg, 16, 0, step, 0)}
    assert not train & (held["valid"] | held["test"])
    if task == "modsum":  # the tiny spaces: a quarter held out in each split, the rest still trained on
        assert len(heldout(task, 1, "test", 64, 0)) == 2 and len(heldout(task, 2, "test", 64, 0)) == 25
        assert {i.prompt for i in train_instances(cfg, 400, 1, 0, 0) if i.k == 1} == \
            {f"{d}=" for d in range(10)} - {i.prompt for s in ("valid", "test") for i in heldout(task, 1, s, 64, 0)}


def test_rows_put_the_answer_targets_at_the_right_places():
    insts = [get_task("addition").make(k, rng_for("rows", k)) for k in (1, 3)]
    x, y = rows("addition", insts, 16)
    assert x.shape == (2, len(insts[1].prompt) + len(insts[1].answer) - 1)  # trimmed to the longest row
    for r, inst in enumerate(insts):
        scored = (y[r] != -100).nonzero().flatten()
        assert y[r, scored].tolist() == encode(inst.answer)
        assert x[r, scored[0]].item() == encode("=")[0]  # the answer is read after the prompt's last token
    # k = 3: an 8-token prompt "abc+def=" and a 4-digit answer, 11 inputs
    with pytest.raises(ValueError, match="model.seq_len: 8 is too short for a k=3 instance; need >= 11"):
        rows("addition", insts, 8)


def test_task_fields_leave_other_configs_as_they_were():
    """Configs of other datasets keep the results-store hash they had before the task fields existed; a
    config file written before them is refused naming the fields (config files are complete; the committed
    ones were rewritten once)."""
    from looplm.analysis.store import config_hash
    from looplm.presets import PRESETS

    d = PRESETS["debug"].to_dict()
    for name in ("task", "task_k", "task_heldout", "task_seed"):
        del d["data"][name]
    assert config_hash(d) == config_hash(PRESETS["debug"])
    with pytest.raises(ConfigError, match="data.task: missing"):
        Config.from_dict(d)
    t = PRESETS["task-phop"]
    assert config_hash(t) != config_hash(t.replace(data=t.data.replace(task_k=5)))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="data.task_k.*only read with data.dataset=task"):
        DataConfig(dataset="brown", task_k=3)
    with pytest.raises(ConfigError, match="data.task_k.*must be >= 1"):
        DataConfig(dataset="task", task_k=0)
    with pytest.raises(ConfigError, match="data.task"):
        DataConfig(dataset="task", task="sudoku")
    with pytest.raises(ValueError, match="data.task_k: task varchain needs 1 <= k <= 13, got 14"):
        task_data(DataConfig(dataset="task", task="varchain", task_k=14))


def test_accuracy_protocol_equals_a_per_depth_loop():
    torch.manual_seed(0)
    model = build_model(ModelConfig(rule="looped", vocab_size=64, d_model=32, n_heads=2, d_ff=64, seq_len=24,
                                    dropout=0.0, position=dict(kind="rope"))).eval()
    insts = [i for k in (1, 2, 4) for i in heldout("modsum", k, "test", 12, 0)]
    x, y = rows("modsum", insts, 24)
    scored = y != -100
    with torch.no_grad():  # half the rows answered as the model does at T = 2, so the counts are not all 0
        y = torch.where(scored & (torch.arange(len(y)) % 2 == 0)[:, None], model(x, depth=2).logits.argmax(-1), y)
    depths = [1, 2, 3, 5]
    got = accuracy_by_depth(model, x, y, depths, batch_size=7)
    assert got[2]["correct"] >= len(insts) // 2
    with torch.no_grad():
        for T in depths:  # the reference: a separate forward at each depth, full logits
            logits = model(x, depth=T).logits
            top2 = logits.topk(2, -1).values
            # argmax flips only between logits closer than float rounding (~1e-6): none here
            assert (top2[..., 0] - top2[..., 1])[scored].min() > 1e-4
            correct = ((logits.argmax(-1) == y) | ~scored).all(-1)
            nll = torch.nn.functional.cross_entropy(logits[scored], y[scored])
            assert got[T]["correct"] == int(correct.sum()) and got[T]["n"] == len(insts)
            # one unroll vs T separate unrolls: the same ops, summed in another order (float64 vs mean)
            torch.testing.assert_close(torch.tensor(got[T]["nll"], dtype=torch.float64), nll.double(),
                                       rtol=1e-5, atol=1e-6)


def _task_run_cfg() -> Config:
    return Config(name="task-tiny",
                  model=ModelConfig(rule="looped", d_model=32, n_heads=2, d_ff=64, seq_len=12, dropout=0.1,
                                    position=dict(kind="rope")),
                  data=DataConfig(dataset="task", task="modsum", task_k=3, task_heldout=16),
                  depth=UniformDepthConfig(lo=1, hi=3), optim=OptimConfig(lr=3e-3, warmup_steps=2),
                  train=TrainConfig(steps=6, batch_size=8, eval_every=3, eval_batches=1, eval_depth=3, ckpt_every=2,
                                    device="cpu"))


def test_task_run_resumes_exactly_and_eval_tasks_reads_it(tmp_path, capsys):
    from looplm.cli import main
    from looplm.eval.tasks import task_accuracy
    from looplm.run.checkpoint import load_checkpoint
    from looplm.train.trainer import train

    cfg = _task_run_cfg()
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, full, progress=False)
    train(cfg, part, progress=False, stop_after=3)
    train(cfg, part, progress=False, resume=True)
    a, b = ([json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (full, part))
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        assert (ra["depths"], ra["loss"]) == (rb["depths"], rb["loss"])  # bit-identical on CPU
        assert (ra.get("val_loss"), ra.get("val_acc")) == (rb.get("val_loss"), rb.get("val_acc"))
    assert "val_acc" in a[2] and "val_acc" in a[5]
    ma, mb = load_checkpoint(full)[0], load_checkpoint(part)[0]
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)

    out = tmp_path / "acc.json"
    assert main(["eval", "tasks", "--checkpoint", str(full), "--ks", "1,2,5", "--depths", "1,3,6",
                 "--max-examples", "10", "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| T \\ k | 1 | 2 | 5* |" in out.with_suffix(".md").read_text()
    ref = task_accuracy(ma, cfg.data, [1, 2, 5], [1, 3, 6], max_examples=10)
    assert {k: {T: r["correct"] for T, r in v.items()} for k, v in res["accuracy"].items()} == \
        {str(k): {str(T): r["correct"] for T, r in v.items()} for k, v in ref.items()}
    assert (res["k_train"], res["train_depth"], res["accuracy"]["1"]["1"]["n"]) == (3, 3, 2)  # k=1: 10 // 4 per split
    from looplm.run.provenance import weights_sha256
    assert res["provenance"]["weights_sha256"] == weights_sha256(res["checkpoint"])
    assert (res["provenance"]["task"], res["provenance"]["task_seed"]) == (res["task"], 0)
    # depth 0 (no loop) is not a loop depth: refused with the flag named
    assert main(["eval", "tasks", "--checkpoint", str(full), "--depths", "0,1", "--quiet"]) == 2
    assert "--depths: loop depths must be >= 1, got 0" in capsys.readouterr().err
    # a task checkpoint has no text to score: a one-line error naming `eval tasks`
    assert main(["eval", "ppl", "--checkpoint", str(full), "--depths", "1", "--quiet"]) == 2
    assert "looplm eval tasks" in capsys.readouterr().err
    # a character outside the task vocabulary is refused, not read as <|endoftext|>
    assert main(["generate", "--checkpoint", str(full), "--prompt", "12+€", "--max-new-tokens", "1"]) == 2
    assert "outside the tokenizer's vocabulary" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(full), "--prompt", "12+34=", "--max-new-tokens", "1"]) == 0


def _hand_halting(model, x, y, criterion: str, tau: float, C: int):
    """The reference: one forward reading out every depth 0 … C (states and logits), the criterion's
    statistic per instance and loop written out (SPEC §6), the first loop k < C that fires, and the exact
    match read from that depth's predictions. Returns (depth, correct, fixed acc per T, statistic)."""
    from looplm.model.cursor import Readout

    scored = y != -100
    with torch.no_grad():
        out = model(x, depth=list(range(C + 1)), readout=Readout(states=True))
    stat = torch.zeros(len(x), C, dtype=torch.float64)
    for k in range(1, C + 1):
        if criterion == "hidden_update":  # max over answer tokens of ‖h_k − h_{k−1}‖ / (‖h_{k−1}‖ + 1e-8)
            h, prev = out.states[k].double(), out.states[k - 1].double()
            u = (h - prev).norm(dim=-1) / (prev.norm(dim=-1) + 1e-8)
            stat[:, k - 1] = u.masked_fill(~scored, 0).amax(1)
        else:  # margin: mean over answer tokens of top-1 − top-2 logit
            top2 = out.logits_by_depth[k].double().topk(2, -1).values
            stat[:, k - 1] = ((top2[..., 0] - top2[..., 1]) * scored).sum(1) / scored.sum(1)
    fires = stat[:, : C - 1] < tau if criterion == "hidden_update" else stat[:, : C - 1] >= tau
    depth = torch.tensor([int(f.nonzero()[0]) + 1 if f.any() else C for f in fires])
    hits = {T: ((out.logits_by_depth[T].argmax(-1) == y) | ~scored).all(-1) for T in range(1, C + 1)}
    correct = torch.stack([hits[int(d)][b] for b, d in enumerate(depth)])
    return depth, correct, {T: hits[T].double().mean().item() for T in hits}, stat


def _mid_tau(stat: torch.Tensor) -> float:
    """A τ halfway between two well-separated observed statistics near their median, so float rounding
    (ours: ~1e-6 relative between the runner's smaller batches and one forward) cannot flip a halt."""
    v = stat.flatten().unique().sort().values
    mid = len(v) // 2
    gaps = v[mid - len(v) // 4 + 1: mid + len(v) // 4 + 1] - v[mid - len(v) // 4: mid + len(v) // 4]
    i = int(gaps.argmax()) + mid - len(v) // 4
    assert v[i + 1] - v[i] > 1e-4 * v[i].abs().clamp(min=1.0)
    return float((v[i] + v[i + 1]) / 2)


@pytest.mark.parametrize("criterion", ["hidden_update", "margin"])
def test_halting_per_difficulty_equals_a_hand_written_per_depth_computation(criterion):
    from looplm.eval.exits import build_exit_criterion
    from looplm.eval.tasks import halt_instances, task_halting

    torch.manual_seed(0)
    C = 6
    model = build_model(ModelConfig(rule="looped", vocab_size=64, d_model=32, n_heads=2, d_ff=64, seq_len=24,
                                    dropout=0.0, position=dict(kind="rope"))).eval()
    insts = [i for k in (2, 3) for i in heldout("modsum", k, "test", 16, 0)]
    x, y = rows("modsum", insts, 24)
    scored = y != -100
    with torch.no_grad():  # row r's target is the model's answer at T = r % C + 1: correctness depends on depth
        preds = {T: model(x, depth=T).logits.argmax(-1) for T in range(1, C + 1)}
    y = torch.stack([torch.where(scored[r], preds[r % C + 1][r], y[r]) for r in range(len(y))])
    _, _, _, stat = _hand_halting(model, x, y, criterion, 0.0, C)
    # the margin falls with depth here: its loop-1 values split the instances; the update's fall everywhere
    tau = _mid_tau(stat[:, :1] if criterion == "margin" else stat[:, : C - 1])
    depth, correct, _, _ = _hand_halting(model, x, y, criterion, tau, C)
    assert 1 < len(set(depth.tolist())) and 0 < int(correct.sum()) < len(y)  # the check can fail
    got_depth, got_correct = halt_instances(model, x, y, build_exit_criterion(criterion, tau), C, batch_size=5)
    assert got_depth.tolist() == depth.tolist() and got_correct.tolist() == correct.tolist()

    # the per-k report on the held-out instances themselves (their true answers)
    data = DataConfig(dataset="task", task="modsum", task_k=3, task_heldout=16)
    got = task_halting(model, data, [2, 3], {"criterion": criterion, "ceiling": C, "tau": tau}, batch_size=7)
    assert got["tau"] == tau
    for k in (2, 3):
        xk, yk = rows("modsum", list(heldout("modsum", k, "test", 16, 0)), 24)
        d, c, fixed, _ = _hand_halting(model, xk, yk, criterion, tau, C)
        m = d.double().mean().item()
        lo, hi = int(m), min(int(m) + 1, C)  # the compute-matched mix of the two fixed depths around m
        r = got["by_k"][k]
        assert (r["n"], r["acc"]) == (len(xk), c.double().mean().item())
        assert r["mean_depth"] == pytest.approx(m, abs=1e-12)  # a mean of the same integers
        assert r["acc_matched"] == pytest.approx(fixed[lo] + (m - lo) * (fixed[hi] - fixed[lo]), abs=1e-12)


def test_halting_settings_errors_name_the_key():
    from looplm.eval.tasks import check_halting

    assert check_halting({"criterion": "margin", "tolerance": 0.01}, 16)["ceiling"] == 16
    for bad, msg in [({"criterion": "nope", "tau": 1}, r"halting\.criterion: got 'nope'; allowed: .*hidden_update"),
                     ({"criterion": "margin"}, "exactly one of tau, target_depth, tolerance, got none"),
                     ({"criterion": "margin", "tau": 1, "tolerance": 0.1}, "exactly one of"),
                     ({"criterion": "margin", "target_depth": 17}, r"halting\.target_depth: got 17; allowed: 1 … 16"),
                     ({"criterion": "margin", "tau": 1, "ceiling": 0}, r"halting\.ceiling"),
                     ({"criterion": "margin", "tau": 1, "depth": 3}, r"halting\.depth: unknown key")]:
        with pytest.raises(ValueError, match=msg):
            check_halting(bad, 16)


def test_heldout_windows_balance_k_and_mask_the_real_tokens():
    """What `looplm diagnose` reads for a task run: the first instances of each k ≤ task_k, in k order."""
    from looplm.tasks.base import decode
    from looplm.tasks.data import heldout_windows

    cfg = DataConfig(dataset="task", task="addition", task_k=3, task_heldout=16)
    wins = heldout_windows(cfg, "valid", 32, batch_size=4, batches=3)
    assert [len(x) for x, _, _ in wins] == [4, 4, 4]
    prompts = [decode([int(t) for t in row[m]]).split("=")[0] + "=" for x, _, m in wins for row, m in zip(x, m)]
    assert prompts == [i.prompt for k in (1, 2, 3) for i in heldout("addition", k, "valid", 16, 0)[:4]]
    for x, y, m in wins:
        assert torch.equal(m, x != 0) and bool(m[y != -100].all())  # every answer target is a real token
