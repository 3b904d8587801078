"""KV caches indexed by virtual layer, and the attention scope of one forward pass (SPEC §6).
Source: terminal KV sharing, Looped Models Done Right, arXiv:2610.06833 (§3.2, Lemma 1, Figure 3).

A looped model visits each physical attention layer once per recurrence, so a KV cache is indexed by
*virtual* layer. Two layouts:

- ``per_visit``: one bank per (physical layer, visit) — K·R banks for K core layers at R recurrences.
  Incremental decoding with it reproduces the full forward exactly.
- ``terminal`` (terminal KV sharing, "Looped Models Done Right"): one bank per physical layer holding,
  for every prefix token, the K/V of its *last* visit. Every visit of a later token attends to those
  terminal K/V (and, within the chunk being processed, to the chunk's own K/V of the same visit, as in
  training). Memory: K banks instead of K·R.

A forward pass creates one :class:`AttentionScope` (the cache, the chunk's key-padding mask and the
chunk's pending writes) and passes it down explicitly, as HF passes ``layer_idx``: each attention call
receives a :class:`KVVisit` ``scope.at(visit)`` naming the virtual-layer visit. Prelude and coda layers
have visit 0; core application ``call`` of loop step t has visit ``t · calls_per_step + call``
(``calls_per_step`` = 2 for ``sc_subtract`` and ``additive_subtract``), the index Ouro writes as
``step·L + layer``. Nothing is found through global state, so scopes are re-entrant and thread-safe
(one scope per forward). The scope also carries a key-padding mask for left-padded batches.

**Early-exit policy** (per-token adaptive depth, our choice): a row frozen by
:meth:`AttentionScope.freeze` after exiting at visit r keeps writing its visit-r K/V into every later
visit slot of the chunk ("copy-forward"; in the terminal layout its terminal K/V is its exit visit's).
Likewise, when a later chunk runs more visits than the cache holds for its prefix, the prefix is read
from the deepest stored visit at or below the requested one (``latest available``), and when it runs
fewer, the chunk's deepest visit is copied forward into the missing slots, so every bank always
covers every cached token.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

CacheMode = Literal["per_visit", "terminal"]
CACHE_MODES: tuple[str, ...] = ("per_visit", "terminal")

def _nearest(keys: list[int], v: int) -> int:
    """The largest key ≤ v, else the smallest key (``keys`` non-empty)."""
    below = [k for k in keys if k <= v]
    return max(below) if below else min(keys)


class KVCache:
    """Cached K/V of the tokens processed so far, for one batch of B sequences.

    Args:
        mode: ``per_visit`` or ``terminal`` (see the module docstring).

    Attributes:
        banks: {key: (K, V)}, each (B, H, L_past, head_dim); key = (layer_id, visit) for ``per_visit``,
            (layer_id, visit mod calls_per_step) for ``terminal``.
        calls_per_step: core calls per loop step of the model's rule (2 for ``sc_subtract`` and
            ``additive_subtract``; set by the model): terminal sharing keeps the last recurrence's K/V of
            each call, so such rules hold 2 banks per core layer.
        valid: (B, L_past) bool — which cached positions are real tokens (False = left padding).
        n_valid: (B,) int64 — real tokens cached per row (the next token's position id).
        stats: per-sequence running sums used by rules whose step depends on the whole prefix
            (the SCSE mask energy ``‖Δ_t‖²_F``), {key: (B,)}.

    Raises:
        ValueError: unknown mode.
    """

    def __init__(self, mode: CacheMode = "per_visit"):
        if mode not in CACHE_MODES:
            raise ValueError(f"kv_sharing: unknown KV cache mode {mode!r}; allowed: {', '.join(CACHE_MODES)}")
        self.mode = mode
        self.banks: dict = {}
        self.valid: torch.Tensor | None = None
        self.n_valid: torch.Tensor | None = None
        self.stats: dict = {}
        self.calls_per_step = 1

    @property
    def length(self) -> int:
        """Cached positions L_past (including padding)."""
        return 0 if self.valid is None else int(self.valid.shape[1])

    def nbytes(self) -> int:
        """Bytes held by the K/V banks (the quantity terminal sharing reduces)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.banks.values())

    def n_banks(self) -> int:
        return len(self.banks)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (LongTensor), in place (finished sequences leave)."""
        self.banks = {key: (k[index], v[index]) for key, (k, v) in self.banks.items()}
        if self.valid is not None:
            self.valid = self.valid[index]
            self.n_valid = self.n_valid[index]
        self.stats = {key: s[index] for key, s in self.stats.items()}

    def _prefix(self, layer_id: int, visit: int):
        if not self.banks:
            return None
        if self.mode == "terminal":
            return self.banks.get((layer_id, visit % self.calls_per_step))
        visits = [v for (lid, v) in self.banks if lid == layer_id]
        if not visits:
            return None
        return self.banks[(layer_id, _nearest(visits, visit))]


class KVVisit(NamedTuple):
    """What an attention layer receives for one visit: the forward's scope and the visit index.

    ``record=False`` reads the cache but writes nothing (extra readouts, such as intermediate-depth
    codas or the readouts of logit-based exit criteria, leave no trace in the cache).
    """

    scope: "AttentionScope"
    visit: int
    record: bool = True

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float = 0.0) -> torch.Tensor:
        """See :meth:`AttentionScope.attend`. (B, H, L, hd) each → (B, H, L, hd)."""
        return self.scope.attend(layer_id, self.visit, q, k, v, dropout_p, record=self.record)


class AttentionScope:
    """The attention context of one forward pass over a chunk of B × L_chunk tokens.

    Args:
        cache: the :class:`KVCache` to read the prefix from and append this chunk to (None: no cache).
        key_valid: (B, L_chunk) bool — False marks left padding (None: every token is real).

    The model passes ``scope.at(visit)`` to every attention call of the forward and calls
    :meth:`commit` once the chunk is done, which appends its K/V to the cache.
    """

    def __init__(self, cache: KVCache | None = None, key_valid: torch.Tensor | None = None):
        self.cache = cache
        self.key_valid = key_valid.bool() if key_valid is not None else None
        self.pending: dict = {}
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending_stats: dict = {}
        self.frozen: torch.Tensor | None = None

    def at(self, visit: int, record: bool = True) -> KVVisit:
        """The handle attention layers receive for virtual-layer visit ``visit`` (module docstring)."""
        return KVVisit(self, visit, record)

    def freeze(self, rows: torch.Tensor | None) -> None:
        """Mark batch rows (B,) bool as exited: their later visits write their last visit's K/V."""
        self.frozen = rows

    # ------------------------------------------------------------------ attention
    def _mask(self, B: int, Lq: int, Lp: int, device) -> torch.Tensor | None:
        """Boolean (B, 1, Lq, Lp + Lq) mask (True = attend), or None for plain causal attention."""
        has_pad = self.key_valid is not None and not bool(self.key_valid.all())
        past_pad = self.cache is not None and self.cache.valid is not None and not bool(self.cache.valid.all())
        if Lp == 0 and not has_pad:
            return None
        if Lq == 1 and not has_pad and not past_pad:
            return torch.ones(1, 1, 1, Lp + 1, dtype=torch.bool, device=device)  # one query sees everything
        causal = torch.ones(Lq, Lq, dtype=torch.bool, device=device).tril()  # (Lq, Lq)
        cur = causal.expand(B, Lq, Lq)
        if has_pad:
            eye = torch.eye(Lq, dtype=torch.bool, device=device)
            # padded keys are masked; every query keeps its own key so no row is empty (no NaN)
            cur = (cur & self.key_valid[:, None, :]) | eye
        if Lp:
            past = (self.cache.valid[:, None, :].expand(B, Lq, Lp) if past_pad
                    else torch.ones(B, Lq, Lp, dtype=torch.bool, device=device))
            cur = torch.cat([past, cur], dim=-1)
        return cur[:, None]  # (B, 1, Lq, Lp + Lq)

    def attend(self, layer_id: int, visit: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float = 0.0, *, record: bool = True) -> torch.Tensor:
        """Attention of this chunk's queries over the cached prefix and the chunk itself.

        Args:
            layer_id: the physical attention layer. visit: the virtual-layer visit (module docstring).
            q, k, v: (B, H, L_chunk, head_dim) of the current visit.
            record: False reads the cache and writes nothing.
        Returns:
            (B, H, L_chunk, head_dim).
        """
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
        prefix = cache._prefix(layer_id, visit) if cache is not None else None
        return self._sdpa(q, k, v, prefix, dropout_p)

    def _sdpa(self, q, k, v, prefix, dropout_p):
        if prefix is not None:
            k_all, v_all = torch.cat([prefix[0], k], dim=2), torch.cat([prefix[1], v], dim=2)
        else:
            k_all, v_all = k, v
        B, _, Lq, _ = q.shape
        mask = self._mask(B, Lq, k_all.shape[2] - Lq, q.device)
        if mask is not None and mask.shape[0] == 1 and bool(mask.all()):
            return F.scaled_dot_product_attention(q, k_all, v_all, dropout_p=dropout_p)
        if mask is None:
            return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True, dropout_p=dropout_p)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p)

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
        """Append this chunk's K/V (and statistics, validity) to the cache."""
        cache = self.cache
        B, Lc = next(iter(self.pending.values()))[0].shape[0], next(iter(self.pending.values()))[0].shape[2]
        if cache.mode == "terminal":
            for lid, (k, v) in self.pending.items():  # lid: (layer_id, call slot)
                old = cache.banks.get(lid)
                cache.banks[lid] = (k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
        else:
            layers = {lid for lid, _ in cache.banks} | {lid for lid, _ in self.pending}
            new = {}
            for lid in layers:
                stored = [v for (l_, v) in cache.banks if l_ == lid]
                chunk = [v for (l_, v) in self.pending if l_ == lid]
                for visit in sorted(set(stored) | set(chunk)):
                    ck, cv = self.pending[(lid, _nearest(chunk, visit))]
                    if stored:
                        pk, pv = cache.banks[(lid, _nearest(stored, visit))]
                        new[(lid, visit)] = (torch.cat([pk, ck], 2), torch.cat([pv, cv], 2))
                    else:
                        new[(lid, visit)] = (ck, cv)
            cache.banks = new
        valid = (self.key_valid if self.key_valid is not None
                 else torch.ones(B, Lc, dtype=torch.bool, device=next(iter(self.pending.values()))[0].device))
        cache.valid = valid if cache.valid is None else torch.cat([cache.valid, valid], 1)
        n = valid.sum(1)
        cache.n_valid = n if cache.n_valid is None else cache.n_valid + n
        cache.stats.update(self.pending_stats)
