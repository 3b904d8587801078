"""Mechanism diagnostics (SPEC §6–7).

- :mod:`~looplm.diagnostics.forcing`: forcing bias b_t, raw pre-mask response b̃_t, energy ratio R_t
  and anchor energy E_Δ,t (SCSE eq. 7–9, Table 3);
- :mod:`~looplm.diagnostics.gain`: random-direction gain of the one-step deviation map (Table 22);
- :mod:`~looplm.diagnostics.rollout`: anchor-start rollouts, forcing-ray cosines and the
  injection-gain dose response (Figure 4);
- :mod:`~looplm.diagnostics.scale`: per-loop hidden-state RMS, radial-gradient fraction r_k, final
  radial derivative g_K and radial increment a_rad,k (readout blind spot; SPEC §7 "Scale");
- :mod:`~looplm.diagnostics.alignment`: visit alignment κ̂_R of the core's visit-wise weight
  gradients (DeepLoop eq. 12; SPEC §7 "Visit alignment");
- :mod:`~looplm.diagnostics.convergence`: token convergence ρ_{r,t}, convergence depths and their
  Spearman correlation with position (LMDR; SPEC §6 "Token convergence");
- :mod:`~looplm.diagnostics.report`: Markdown tables and plots (Tables 3 and 22, Figures 4 and 5,
  per-loop scale and convergence);
- :mod:`~looplm.diagnostics.runner`: :func:`diagnose_model` / :func:`diagnose_checkpoint`, behind
  ``looplm diagnose`` (:mod:`looplm.cli`).
"""
