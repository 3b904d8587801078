"""What test modules share: the tiny model variants (every registered rule and architecture option),
their config, tokens, and an independent hand-written reference for terminal KV sharing (SPEC §6).
pyproject.toml puts tests/ on sys.path (``pythonpath``): ``from helpers import tiny``."""

from __future__ import annotations

import math

import torch

from looplm.config import RULE_NAMES, ModelConfig
from looplm.model import LoopLM, build_model
from looplm.model.layers import CausalSelfAttention

V, D, L = 97, 32, 12

VARIANTS = {
    **{rule: dict(rule=rule) for rule in RULE_NAMES},
    "scse-embedding": dict(rule="scse", options=dict(anchor="embedding")),
    "scse-frozen_random": dict(rule="scse", options=dict(anchor="frozen_random")),
    "scse-nomask": dict(rule="scse", options=dict(mask=False)),
    "scse-leak": dict(rule="scse", options=dict(leak=0.02, kappa=0.15)),
    "step_film-2rows": dict(rule="step_film", options=dict(steps=2)),  # T > 2 reuses the last row
    "norm_reset-P2": dict(rule="norm_reset", options=dict(period=2)),
    "sc_cond-nomask": dict(rule="sc_cond", options=dict(mask=False)),
    "sc_cond-embedding": dict(rule="sc_cond", options=dict(anchor="embedding")),
    "sc_subtract-nomask": dict(rule="sc_subtract", options=dict(mask=False)),
    "scse_leak-nomask": dict(rule="scse_leak", options=dict(mask=False)),
    "additive_subtract-step": dict(rule="additive_subtract", options=dict(step_tau=0.015)),
    "looped-prelude-coda": dict(rule="looped", n_prelude=1, n_core=2, n_coda=1),
    **{f"{rule}-huginn": dict(rule=rule, n_prelude=1, n_core=2, n_coda=1)
       for rule in ("huginn_linear", "parcae_decay", "parcae", "orthoinj", "deq_qkv")},
    "parcae-zeros": dict(rule="parcae", options=dict(state_init="zeros")),
    "orthoinj-embedding": dict(rule="orthoinj", options=dict(state_init="embedding")),
    "plain-input_norm": dict(rule="plain", input_norm=True),
    "plain-deeploop": dict(rule="plain", residual="deeploop", residual_depth=3, n_core=2),
    "plain-deepnorm": dict(rule="plain", residual="deepnorm", residual_depth=3),
    "plain-post_ln": dict(rule="plain", residual="post_ln", residual_depth=3),
    "plain-p0.4": dict(rule="plain", residual="post_ln", residual_p=0.4, residual_depth=5),
    "looped-deeploop": dict(rule="looped", residual="deeploop", residual_depth=4),
    "plain-inter_loop_norm": dict(rule="plain", scale_control=dict(kind="inter_loop_norm")),
    "plain-spectral_damping": dict(rule="plain", scale_control=dict(kind="spectral_damping")),
    "looped-final_only_norm": dict(rule="looped", readout="final_only_norm", n_prelude=1, n_coda=1),
    # issue 14 §1: the architectures of Huginn-0125 and Ouro (tiny), and the rest of their options
    "huginn-0125": dict(rule="huginn_linear", n_prelude=1, n_core=2, n_coda=1,
                        position=dict(kind="rope", theta=50000.0, layout="interleaved"), qk_bias=True,
                        block_norm="pre_post",
                        embed_scale=D ** 0.5, exit_norm="final",
                        options=dict(adapter_bias=False, step_norm=False, state_init="truncated_normal",
                                     state_init_std=0.6)),
    "ouro": dict(rule="plain", n_core=2, n_kv_heads=2, position=dict(kind="rope", theta=1e6),
                 block_norm="sandwich", scale_control=dict(kind="final_norm"), readout="raw", tie_embeddings=False),
    "looped-rope-mqa": dict(rule="looped", n_prelude=1, n_coda=1, n_kv_heads=1,
                            position=dict(kind="rope", scaling="linear", scaling_factor=2.0), exit_norm="learned"),
    "unshared": dict(architecture="unshared", n_layers=3),
}


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=D, n_heads=4, d_ff=64, seq_len=L, dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def make(name: str, seed: int = 0) -> LoopLM:
    """The variant in evaluation mode (dropout is 0; evaluation mode fixes the Huginn gaussian state)."""
    torch.manual_seed(seed)
    return build_model(tiny(**VARIANTS[name])).eval()


def tokens(b: int = 3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, L), generator=g)



def hooked_visits(model: LoopLM, x: torch.Tensor, R: int) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every attention call's K/V (B, H, n, hd) of an uncached forward at depth R, per physical layer,
    in call order (core layers: R · calls_per_step calls)."""
    calls: dict[int, list] = {}
    originals = {}

    def recording(self, x, qkv_inject=None, kv=None, _orig=None):
        qkv = self.qkv(x) if qkv_inject is None else self.qkv(x) + qkv_inject  # K/V as attention sees them
        calls.setdefault(self.layer_id, []).append(qkv)
        return originals[self](x, qkv_inject, kv)

    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            originals[m] = m.forward
            m.forward = recording.__get__(m)
    try:
        model(x, depth=R)
    finally:
        for m, f in originals.items():
            m.forward = f
    H = model.cfg.n_heads
    out = {}
    for lid, qkvs in calls.items():
        out[lid] = []
        for qkv in qkvs:
            B, n, three_d = qkv.shape
            d = three_d // 3
            _, k, v = (t.view(B, n, H, d // H).transpose(1, 2) for t in qkv.split(d, dim=-1))
            out[lid].append((k, v))
    return out


def terminal_reference(model: LoopLM, visits, chunk: torch.Tensor, start: int, R: int) -> torch.Tensor:
    """Logits of ``chunk`` (B, c) at positions start … with every attention an explicit softmax over
    [the prefix's terminal K/V of the same call slot ; the chunk's own K/V] (terminal sharing written
    out by hand: no KVCache, no scope)."""
    cps, counters, originals = model.calls_per_step, {}, {}

    def explicit(self, x, qkv_inject=None, kv=None):
        i = counters.get(self.layer_id, 0)
        counters[self.layer_id] = i + 1
        mine = visits[self.layer_id]
        slot = i % cps if len(mine) > 1 else 0
        pk, pv = [kv_ for j, kv_ in enumerate(mine) if j % cps == slot][-1]  # the slot's last visit
        B, c, d = x.shape
        H = self.n_heads
        qkv = self.qkv(x) if qkv_inject is None else self.qkv(x) + qkv_inject
        q, k, v = (t.view(B, c, H, d // H).transpose(1, 2) for t in qkv.split(d, dim=-1))
        k_all, v_all = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        n = pk.shape[2]
        scores = q @ k_all.transpose(-1, -2) / math.sqrt(d // H)
        allowed = torch.ones(c, n + c, dtype=torch.bool).tril(diagonal=n)
        y = scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v_all
        return self.proj(y.transpose(1, 2).reshape(B, c, d))

    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            originals[m] = m.forward
            m.forward = explicit.__get__(m)
    try:
        positions = torch.arange(start, start + chunk.shape[1]).expand(chunk.shape)
        state, ctx = model.start(model.embed(chunk, positions), positions)
        for t in range(R):
            state = model.step(state, t, ctx)
        return model.readout(model.hidden(state, ctx), final=True)
    finally:
        for m, f in originals.items():
            m.forward = f


def damaged_results_db(path):
    """A results DB at ``path`` (one run, two evaluations) whose pages other than the schema page and the
    ``meta`` table's are garbage: it opens (readonly or not) and SQLite finds the damage only when a query reads
    those pages, as with a file damaged in its middle."""
    import contextlib
    import sqlite3
    from pathlib import Path

    from looplm.analysis.store import EvalIdentity, ResultStore, RunRecord
    from looplm.config import Config

    path = Path(path)
    with ResultStore(path) as store:
        idents = [EvalIdentity.make(Config(), "ppl", dataset="brown", split="test", depth=T) for T in (1, 2)]
        store.put_many([(i, {"ppl": 10.0}) for i in idents], config=Config(), settings={}, provenance={"a": 1})
        store.put_run(RunRecord(sweep="s", run_id="r-s0", variant="r", seed=0, config=Config().to_dict(),
                                run_dir="/x"))
    with contextlib.closing(sqlite3.connect(path)) as conn:  # meta: its table and its primary-key index
        keep = {1, *(r[0] for r in conn.execute("SELECT rootpage FROM sqlite_master WHERE tbl_name = 'meta'"))}
        page = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    for k in range(len(data) // page):
        if k + 1 not in keep:
            data[k * page:(k + 1) * page] = b"\xab" * page
    path.write_bytes(bytes(data))
    return path
