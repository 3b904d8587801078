r"""looplm: looped (shared-block, depth-recurrent) transformer language models.

Glossary (one word per idea, used everywhere in the code):

- **prelude / core / coda**: unshared blocks before the loop / the K shared blocks applied once per
  loop step / unshared blocks after the loop.
- **loop depth T**: how many times the core is applied; a ``forward`` argument, never model state.
  Each paper has its own letter, kept where its methods are: R ("recurrences": Looped Models Done
  Right, DeepLoop) and K ("loops": readout blind spot) also mean the loop depth. The one other K is
  DeepLoop's number of blocks in the shared core (``model.n_core``; N = K·R).
- **loop step t**: 0-based index of one core application, t = 0 … T−1; state ``h_t`` is the state
  *before* step t, so ``h_T`` is read out at depth T.
- **update G(x) = Core(x) − x**: the residual branch of the core; zero-preserving (G(0) = 0).
- **anchor h\***: the fixed input-conditioned reference computed once per sequence.
- **deviation Δ_t = h_t − h\***: the state SCSE evolves.
- **injection**: the input-conditioned signal added at each loop step by additive rules.
- **forcing bias b_t(e) = T_t(0; e)**: the next deviation produced from the anchor itself.
- **readout**: ``logits = W_out · RMSNorm(h)`` (``rmsnorm``), ``W_out · h`` (``raw``), or raw at
  intermediate loops and normalized at the last (``final_only_norm``).
- **depth sampler / depth prior**: the distribution of training loop depths (fixed, uniform, Poisson
  log-normal ``pln``, or a ``learned`` categorical prior).
- **truncated BPTT (b)**: back-propagation through the last b loop steps only.
- **KV cache per_visit / terminal KV sharing**: K/V kept per (layer, visit), or only each token's
  last-visit K/V per physical layer.
- **residual parameterization**: pre-LN, or the post-LN family ``x ← RMSNorm(α·x + f(x))`` with
  α = (2N)^p and initialization gain β = (8N)^−p (DeepNorm p = 1/4, DeepLoop p = 1/2).
- **visit alignment κ̂_R**: how aligned a shared sublayer's per-visit weight gradients are (1 … R).

Sources: SCSE (Source-Centered State Evolution), Looped Models Done Right, DeepLoop, and the readout
blind-spot paper; ``SPEC.md`` pins every equation this package implements.
"""

from looplm.version import __version__

__all__ = ["__version__"]

# Hugging Face Auto classes: registered here only when transformers is already imported (importing it
# costs seconds, which the core never pays); `import looplm.hf` always registers (looplm.hf docstring).
import sys as _sys

if "transformers" in _sys.modules:
    try:
        from looplm.hf import register as _register_hf

        _register_hf()
    except ImportError:  # a transformers too old or broken for looplm.hf: the core still works
        pass
