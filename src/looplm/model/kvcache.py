"""KV caches indexed by virtual layer, and the attention scope of one forward pass (SPEC §6).
Source: terminal KV sharing, Looped Models Done Right, arXiv:2610.06833 (§3.2, Lemma 1, Figure 3).

``per_visit``: one bank per (physical layer, visit), K·R banks, exact. ``terminal``: one bank per physical
layer holding each prefix token's last-visit K/V (a chunk's visit r still sees its own visit r); K banks.
A forward passes one :class:`AttentionScope` down (as HF passes ``layer_idx``): prelude and coda attend at
visit 0, core call ``call`` of step t at ``t · calls_per_step + call``. Early exit (our choice): a frozen row
copies its exit visit's K/V forward; a chunk running more visits than cached reads the deepest stored visit
at or below its own, one running fewer copies its deepest forward.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

from looplm.model.layers import attention

CacheMode = Literal["per_visit", "terminal"]
CACHE_MODES: tuple[str, ...] = get_args(CacheMode)


def check_cache_mode(mode: str, field: str) -> None:
    """ValueError naming ``field`` unless ``mode`` is one of :data:`CACHE_MODES`."""
    if mode not in CACHE_MODES:
        raise ValueError(f"{field}: unknown KV cache mode {mode!r}; allowed: {', '.join(CACHE_MODES)}")


def chunk_positions(valid: torch.Tensor | None, cache: KVCache | None, L: int, device) -> torch.Tensor:
    """Position ids (B, L) (or (1, L)) of a chunk: the real tokens of ``cache`` (None: 0) plus those of the chunk
    (``valid`` (B, L) bool, None = all) before each; left padding gets 0."""
    start = cache.n_valid[:, None] if cache is not None and cache.n_valid is not None else 0  # (B, 1) or 0
    if valid is None:
        pos = start + torch.arange(L, device=device)  # (B, L) or (L,)
        return pos if pos.dim() == 2 else pos[None]
    return (start + valid.long().cumsum(1) - 1).clamp(min=0)


def _nearest(keys: list[int], v: int) -> int:
    """The largest key ≤ v, else the smallest key (``keys`` non-empty)."""
    below = [k for k in keys if k <= v]
    return max(below) if below else min(keys)


class KVCache:
    """Cached K/V of B sequences (``mode`` per_visit or terminal; ValueError otherwise). Banks are preallocated
    (B, H_kv, capacity, hd) pairs (issue 15; capacity ``max_len`` or seq_len, doubled on overflow) written in
    place; ``banks`` {(layer_id, visit or visit mod calls_per_step): (K, V)}; ``valid`` (B, L_past) bool,
    ``n_valid`` (B,) real tokens; ``stats`` per-sequence running sums (SCSE mask energy)."""

    def __init__(self, mode: CacheMode = "per_visit", max_len: int | None = None):
        check_cache_mode(mode, "mode")
        self.mode = mode
        self.capacity = max_len
        self.buffers: dict = {}  # key → (K, V) (B, H_kv, capacity, hd)
        self.length = 0  # cached positions L_past, padding included
        self._valid: torch.Tensor | None = None  # (B, capacity) bool
        self.all_valid = True  # no cached position is padding
        self.n_valid: torch.Tensor | None = None
        self.stats: dict = {}
        self.calls_per_step = 1

    @property
    def banks(self) -> dict:
        """{key: (K, V)} (B, H_kv, L_past, hd): views of the used part of the buffers."""
        n = self.length
        return {key: (k[:, :, :n], v[:, :, :n]) for key, (k, v) in self.buffers.items()}

    @property
    def valid(self) -> torch.Tensor | None:
        return None if self._valid is None else self._valid[:, :self.length]

    def nbytes(self) -> int:
        """Bytes of the cached tokens' K/V (L_past positions of every bank, not the capacity)."""
        return sum(2 * k[:, :, :self.length].numel() * k.element_size() for k, _ in self.buffers.values())

    def capacity_nbytes(self) -> int:
        """Bytes allocated for the banks (the whole capacity)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.buffers.values())

    def open_scope(self, key_valid: torch.Tensor | None, positions: torch.Tensor) -> "AttentionScope":
        """The attention scope of a forward over the next chunk (a static cache hands out its own)."""
        return AttentionScope(self, key_valid, positions)

    def n_banks(self) -> int:
        return len(self.buffers)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (LongTensor), in place (finished sequences leave)."""
        self.buffers = {key: (k[index], v[index]) for key, (k, v) in self.buffers.items()}
        if self._valid is not None:
            self._valid = self._valid[index]
            self.n_valid = self.n_valid[index]
            self.all_valid = bool(self.valid.all())
        self.stats = {key: s[index] for key, s in self.stats.items()}

    def _prefix_key(self, layer_id: int, visit: int):
        if self.mode == "terminal":
            key = (layer_id, visit % self.calls_per_step)
            return key if key in self.buffers else None
        visits = [v for (lid, v) in self.buffers if lid == layer_id]
        return (layer_id, _nearest(visits, visit)) if visits else None

    def reserve(self, n: int) -> None:
        """Make room for ``n`` cached positions (grows every buffer to max(n, 2 × capacity) if needed)."""
        if self.capacity is not None and n <= self.capacity:
            return
        self.capacity = cap = max(n, 2 * (self.capacity or 0))
        L = self.length
        grown = {}
        for key, (k, v) in self.buffers.items():
            nk, nv = self._new_bank(k)
            nk[:, :, :L], nv[:, :, :L] = k[:, :, :L], v[:, :, :L]
            grown[key] = (nk, nv)
        self.buffers = grown
        if self._valid is not None:
            self._valid = F.pad(self._valid[:, :L], (0, cap - L))  # (B, cap), False past L

    def _new_bank(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*like.shape[:2], self.capacity, like.shape[3])
        return like.new_empty(shape), like.new_empty(shape)


class KVVisit(NamedTuple):
    """What an attention layer receives for one visit; ``record=False`` reads the cache and writes nothing."""

    scope: "AttentionScope"
    visit: int
    record: bool = True

    # a compiled block (torch.compile) runs the cache bookkeeping eagerly: the graph breaks here, so
    # the block compiles into the part before and after attention, whatever the visit or cache length
    @torch.compiler.disable
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float = 0.0) -> torch.Tensor:
        """See :meth:`AttentionScope.attend`. q (B, H, L, hd), k and v (B, H_kv, L, hd) → (B, H, L, hd)."""
        return self.scope.attend(layer_id, self.visit, q, k, v, dropout_p, record=self.record)

    @torch.compiler.disable
    def positions(self, L: int, device=None) -> torch.Tensor:
        """See :meth:`AttentionScope.positions` (eager in a compiled block, like :meth:`attend`)."""
        return self.scope.positions(L, device)


class AttentionScope:
    """The attention context of one forward over a chunk: ``cache`` (or None), ``key_valid`` (B, L_chunk) bool
    (False = left padding); :meth:`commit` appends the chunk's K/V to the cache."""

    check_positions = True  # the model checks its positions against seq_len (a static cache bounds them)

    def __init__(self, cache: KVCache | None = None, key_valid: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None):
        self.cache = cache
        self.key_valid = key_valid.bool() if key_valid is not None else None
        self._positions = positions
        self.has_pad = self.key_valid is not None and not bool(self.key_valid.all())
        self.pending: dict = {}
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending_stats: dict = {}
        self.frozen: torch.Tensor | None = None

    def positions(self, L: int, device=None) -> torch.Tensor:
        """Position ids (B, L) (or (1, L)) of this chunk's L tokens: those given at construction, else the
        cache's real-token counts plus the real tokens before each in the chunk (:func:`chunk_positions`).
        Rotary embeddings read them."""
        if self._positions is None:
            self._positions = chunk_positions(self.key_valid, self.cache, L, device)
        return self._positions

    def at(self, visit: int, record: bool = True) -> KVVisit:
        """The handle attention layers receive for virtual-layer visit ``visit`` (module docstring)."""
        return KVVisit(self, visit, record)

    def freeze(self, rows: torch.Tensor | None) -> None:
        """Mark batch rows (B,) bool as exited: their later visits write their last visit's K/V."""
        self.frozen = rows

    # ------------------------------------------------------------------ attention
    def _mask(self, B: int, Lq: int, Lp: int, device) -> torch.Tensor | None:
        """Boolean (B, 1, Lq, Lp + Lq) mask (True = attend), or None for plain causal attention."""
        if Lp == 0 and not self.has_pad:
            return None  # (one query over an all-valid prefix never gets here: _sdpa attends without a mask)
        cur = torch.ones(Lq, Lq, dtype=torch.bool, device=device).tril().expand(B, Lq, Lq)  # causal
        if self.has_pad:
            # padded keys are masked; every query keeps its own key so no row is empty (no NaN)
            cur = (cur & self.key_valid[:, None, :]) | torch.eye(Lq, dtype=torch.bool, device=device)
        if Lp:  # a cached prefix
            past = (self.cache.valid[:, None, :].expand(B, Lq, Lp) if not self.cache.all_valid
                    else torch.ones(B, Lq, Lp, dtype=torch.bool, device=device))
            cur = torch.cat([past, cur], dim=-1)
        return cur[:, None]  # (B, 1, Lq, Lp + Lq)

    def attend(self, layer_id: int, visit: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float = 0.0, *, record: bool = True) -> torch.Tensor:
        """Attention of the chunk's q (B, H, L, hd) over the cached prefix and the chunk's k, v (B, H_kv, L, hd)
        at ``visit`` of physical layer ``layer_id`` → (B, H, L, hd); ``record=False`` writes nothing."""
        cache = self.cache
        if record:
            if self.frozen is not None and layer_id in self.last:
                fz = self.frozen[:, None, None, None]
                lk, lv = self.last[layer_id]
                k_w, v_w = torch.where(fz, lk, k), torch.where(fz, lv, v)
            else:
                k_w, v_w = k, v
            self.last[layer_id] = (k_w, v_w)
            if cache is not None:
                key = (layer_id, visit if cache.mode == "per_visit" else visit % cache.calls_per_step)
                self.pending[key] = (k_w, v_w)
        key = cache._prefix_key(layer_id, visit) if cache is not None else None
        if key is None:
            return self._sdpa(q, k, v, dropout_p)
        L, Lc = cache.length, k.shape[2]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # autograd: no in-place writes
            pk, pv = cache.buffers[key]
            return self._sdpa(q, torch.cat([pk[:, :, :L], k], 2), torch.cat([pv[:, :, :L], v], 2), dropout_p)
        cache.reserve(L + Lc)
        bk, bv = cache.buffers[key]
        # the chunk's own K/V right after the prefix (scratch: commit writes the final values there)
        bk[:, :, L:L + Lc], bv[:, :, L:L + Lc] = k, v
        return self._sdpa(q, bk[:, :, :L + Lc], bv[:, :, :L + Lc], dropout_p)

    def _sdpa(self, q, k_all, v_all, dropout_p):
        B, _, Lq, _ = q.shape
        if Lq == 1 and not self.has_pad and (self.cache is None or self.cache.all_valid):
            return attention(q, k_all, v_all, dropout_p=dropout_p)  # one query sees all
        mask = self._mask(B, Lq, k_all.shape[2] - Lq, q.device)
        if mask is not None and mask.shape[0] == 1 and bool(mask.all()):
            return attention(q, k_all, v_all, dropout_p=dropout_p)
        if mask is None:
            return attention(q, k_all, v_all, is_causal=True, dropout_p=dropout_p)
        return attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p)

    # ------------------------------------------------------------------ per-sequence statistics
    def accumulate(self, key, value: torch.Tensor) -> torch.Tensor:
        """Running per-sequence sum over the cached prefix and this chunk: returns prefix + value (B,)."""
        total = value
        if self.cache is not None and key in self.cache.stats:
            total = self.cache.stats[key] + value
        self.pending_stats[key] = total
        return total

    # ------------------------------------------------------------------ commit
    def commit(self) -> None:
        """Write this chunk's K/V (and statistics, validity) into the cache, in place."""
        cache = self.cache
        first = next(iter(self.pending.values()))[0]
        B, Lc, dev = first.shape[0], first.shape[2], first.device
        L, end = cache.length, cache.length + Lc
        cache.reserve(end)
        if cache.mode == "terminal":
            for key, (k, v) in self.pending.items():  # key: (layer_id, call slot)
                if key not in cache.buffers:
                    cache.buffers[key] = cache._new_bank(k)
                bk, bv = cache.buffers[key]
                bk[:, :, L:end], bv[:, :, L:end] = k, v
        else:
            layers = {lid for lid, _ in cache.buffers} | {lid for lid, _ in self.pending}
            for lid in sorted(layers):
                stored = [v for (l_, v) in cache.buffers if l_ == lid]
                chunk = [v for (l_, v) in self.pending if l_ == lid]
                for visit in sorted(set(stored) | set(chunk)):
                    ck, cv = self.pending[(lid, _nearest(chunk, visit))]
                    if (lid, visit) not in cache.buffers:  # a visit the prefix lacks: its deepest visit below
                        bk, bv = cache._new_bank(ck)
                        if stored and L:
                            pk, pv = cache.buffers[(lid, _nearest(stored, visit))]
                            bk[:, :, :L], bv[:, :, :L] = pk[:, :, :L], pv[:, :, :L]
                        cache.buffers[(lid, visit)] = (bk, bv)
                    bk, bv = cache.buffers[(lid, visit)]
                    bk[:, :, L:end], bv[:, :, L:end] = ck, cv
        valid = (self.key_valid if self.key_valid is not None
                 else torch.ones(B, Lc, dtype=torch.bool, device=dev))
        if cache._valid is None:
            cache._valid = torch.zeros(B, cache.capacity, dtype=torch.bool, device=dev)
        cache._valid[:, L:end] = valid
        cache.length = end
        cache.all_valid = cache.all_valid and not self.has_pad
        n = valid.sum(1)
        cache.n_valid = n if cache.n_valid is None else cache.n_valid + n
        cache.stats.update(self.pending_stats)
