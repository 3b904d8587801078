"""One decode step as one static region (issue 28 §1): a fixed-capacity ``per_visit`` KV cache whose length
and positions are tensors, so the model's own forward (``model.read(model.loop(tok, cache=static), R)``) has
the same shapes and Python path at every token: one ``torch.compile`` graph, or one captured CUDA graph.
:class:`StaticScope` writes the token's K/V at slot ``length`` (``index_copy_``) and attends over the whole
capacity under a mask. Fixed depth only; the prefill keeps the eager path.
"""

from __future__ import annotations

from typing import Callable, Literal, get_args

import torch
import torch.nn.functional as F

from looplm.model.kvcache import AttentionScope, KVCache, KVVisit

StepHow = Literal["eager", "compile", "cuda_graph", "compile_cuda_graph"]


class StaticKVCache:
    """A ``per_visit`` cache of ``capacity`` positions built from a prefilled :class:`KVCache`; tensors written in
    place: ``buffers`` (B, H_kv, capacity, hd) pairs, ``valid`` (B, capacity), ``length`` (), ``n_valid`` (B,).
    ValueError: a cache that is not ``per_visit`` or is empty, or a capacity below the cached length or above
    ``seq_len``."""

    def __init__(self, cache: KVCache, capacity: int, seq_len: int):
        if cache.mode != "per_visit" or not cache.buffers:
            raise ValueError(f"StaticKVCache: needs a prefilled per_visit KVCache, got mode {cache.mode!r} with "
                             f"{cache.length} cached positions")
        if not cache.length <= capacity <= seq_len:
            raise ValueError(f"capacity: need {cache.length} (cached) <= capacity <= {seq_len} (model.seq_len), "
                             f"got {capacity}")
        L = cache.length
        self.capacity, self.steps_left = capacity, capacity - L
        # the cached positions, then zeros up to the capacity: (B, H_kv, capacity, hd) banks, (B, capacity) valid
        self.buffers = {key: tuple(F.pad(t[:, :, :L], (0, 0, 0, capacity - L)) for t in kv)
                        for key, kv in cache.buffers.items()}
        self.valid = F.pad(cache.valid, (0, capacity - L))
        self.length = torch.tensor(L, device=self.valid.device)
        self.n_valid = cache.n_valid.clone()
        self.stats = {key: s.clone() for key, s in cache.stats.items()}
        for t in (*[t for kv in self.buffers.values() for t in kv], self.valid, self.length, self.n_valid,
                  *self.stats.values()):
            torch._dynamo.mark_static_address(t)  # written in place: CUDA graphs keep their addresses

    def open_scope(self, key_valid: torch.Tensor | None, positions: torch.Tensor) -> "StaticScope":
        if key_valid is not None:
            raise ValueError("attention_mask: a static decode step takes no padding mask (the cache holds it)")
        return StaticScope(self, None, positions)


class _StaticVisit(KVVisit):
    """:class:`~looplm.model.kvcache.KVVisit` traced, not eager (the static step is one graph)."""

    def attend(self, layer_id: int, q, k, v, dropout_p: float = 0.0) -> torch.Tensor:
        return self.scope.attend(layer_id, self.visit, q, k, v, record=self.record)

    def positions(self, L: int, device=None) -> torch.Tensor:
        return self.scope.positions(L, device)


class StaticScope(AttentionScope):
    """The attention scope of one static decode step (one token per row): its positions and statistics as an
    :class:`AttentionScope`'s, the token's K/V written in place."""

    check_positions = False  # positions < capacity <= seq_len by construction (StaticKVCache)

    def at(self, visit: int, record: bool = True) -> _StaticVisit:
        return _StaticVisit(self, visit, record)

    def attend(self, layer_id: int, visit: int, q, k, v, *, record: bool = True) -> torch.Tensor:
        """q (B, H, 1, hd), k and v (B, H_kv, 1, hd) → (B, H, 1, hd): over the cached tokens and this one."""
        c = self.cache
        bk, bv = c.buffers[(layer_id, visit)]
        slot = c.length.view(1)
        if record:  # the token's own K/V at slot `length` (per_visit: its final value)
            bk.index_copy_(2, slot, k)
            bv.index_copy_(2, slot, v)
        else:  # read-only: the token's K/V only in a copy
            bk, bv = bk.index_copy(2, slot, k), bv.index_copy(2, slot, v)
        here = torch.arange(c.capacity, device=q.device) == c.length  # (capacity,)
        mask = (c.valid | here)[:, None, None, :]  # (B, 1, 1, capacity)
        # SDPA's math for one query, written out so the compiler fuses it (no kernel call per visit); the g
        # query heads a key/value head serves (attention()'s grouping) share its scores' row block
        B, H, _, hd = q.shape
        s = q.view(B, bk.shape[1], -1, hd) @ bk.transpose(-1, -2) * hd**-0.5  # (B, H_kv, g, capacity)
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return (p @ bv).view(B, H, 1, hd)

    def commit(self) -> None:
        c = self.cache
        c.valid.index_fill_(1, c.length.view(1), True)
        c.length.add_(1)
        c.n_valid.add_(1)
        for key, total in self.pending_stats.items():
            c.stats[key].copy_(total)


class _Read(torch.nn.Module):
    """The model's own cached forward of one token per row as a module (so ``functional_call`` can swap
    the readout weight's layout): tok (B,) → logits (B, V)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tok: torch.Tensor, cache: StaticKVCache, depth: int) -> torch.Tensor:
        return self.model.read(self.model.loop(tok[:, None], cache=cache), depth).logits[:, -1]


class DecodeStep:
    """``step(tokens (B,)) → logits (B, V)``: one fixed-depth decode step on a :class:`StaticKVCache`.

    ``how``: ``eager``, ``compile`` (``fullgraph=True``), ``cuda_graph`` (the eager step captured once) or
    ``compile_cuda_graph`` (the compiled step captured once: fused kernels and no launch overhead); a captured
    step's logits are a view of the graph's output buffer, overwritten by the next step. On CPU every
    ``nn.Linear`` runs on a copy of its weight laid out (in, out) in memory, taken at construction: a batch-1
    GEMV then reads contiguous rows (1.54× over the model's own layout at the Huginn shape, the readout's
    copy alone 1.12×: ``benchmarks/results/decode-leads-3-cpu-2core.md``).
    ValueError: unknown ``how``; a captured step off CUDA; a step past the cache's capacity."""

    HOW: tuple[str, ...] = get_args(StepHow)

    def __init__(self, model, cache: StaticKVCache, depth: int, how: StepHow = "compile", backend: str = "inductor"):
        if how not in self.HOW:
            raise ValueError(f"how: unknown {how!r}; allowed: {', '.join(self.HOW)}")
        if how.endswith("cuda_graph") and cache.length.device.type != "cuda":
            raise ValueError(f"how: {how} needs the model and cache on a CUDA device")
        self.model, self.cache, self.depth, self.how = model, cache, depth, how
        self._layout = {f"model.{name}.weight": mod.weight.detach().t().contiguous().t()  # (out, in), strides (1, out)
                        for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
                        } if cache.length.device.type == "cpu" else {}
        self._read = _Read(model)
        self._fn: Callable = self._step if how in ("eager", "cuda_graph") else torch.compile(
            self._step, backend=backend, dynamic=False, fullgraph=True)
        self._graph = None

    @torch.no_grad()
    def _step(self, tok: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self._read, self._layout, (tok, self.cache, self.depth))  # (B, V)

    @torch.no_grad()
    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        if self.cache.steps_left < 1:
            raise ValueError(f"decode step: the static cache is full ({self.cache.capacity} positions)")
        self.cache.steps_left -= 1
        if not self.how.endswith("cuda_graph"):
            return self._fn(tok)
        if self._graph is None:  # warm up on a side stream (allocator, lazy tables, compilation), then capture
            self._tok = tok.clone()
            snapshot = self.state()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._fn(self._tok)
            torch.cuda.current_stream().wait_stream(side)
            self.rewind(snapshot)  # the warm-up step wrote the cache: undo it
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._out = self._fn(self._tok)  # recorded, not run
        self._tok.copy_(tok)
        self._graph.replay()
        return self._out

    def state(self) -> list:
        """The cache's position state (for :meth:`rewind`: decode the same tokens again)."""
        c = self.cache
        return [c.steps_left, c.valid.clone(), c.length.clone(), c.n_valid.clone(),
                *[s.clone() for s in c.stats.values()]]

    def rewind(self, snap: list) -> None:
        c = self.cache  # K/V slots past `length` are masked until written again, so only these matter
        c.steps_left = snap[0]
        for dst, src in zip([c.valid, c.length, c.n_valid, *c.stats.values()], snap[1:]):
            dst.copy_(src)
