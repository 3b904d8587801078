"""Markdown tables and plots of the mechanism diagnostics (SCSE Tables 3, 22, Figures 4, 5; readout-blind-spot
Table 3, Appendix D; DeepLoop's κ_R; LMDR Figure 2) from :func:`~looplm.diagnostics.runner.diagnose_model`'s
JSON-ready dicts (``{label: result}`` for several models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from looplm.analysis.plots import plt, save_figure
from looplm.run.finite import md_table


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}" if v != 0 else "0"


def _by_t(records: list[dict[str, Any]], key: str) -> dict[int, float | None]:
    return {int(r["t"]): r[key] for r in records}


def markdown_report(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Three Markdown tables, one row per model: the forcing-bias diagnostic (SCSE Table 3 layout),
    the mechanism diagnostics (Table 22 layout) and the anchor-start rollout / dose response."""
    steps = sorted({int(r["t"]) for res in results.values() for r in res["forcing"]})
    last = steps[-1]
    out = ["**Anchor-response forcing-bias diagnostic** (SCSE Table 3 layout): R_t = N⁻¹‖b_t‖² / "
           "max(N⁻¹‖Δ_{t+1} − Δ_t‖², 1e-12), anchor energy E_Δ,t = N⁻¹‖Δ_t‖², in each model's own "
           "anchor coordinates.", ""]
    rows = [[label, *(_fmt(_by_t(res["forcing"], key).get(t)) for key in ("ratio", "anchor_energy") for t in steps)]
            for label, res in results.items()]
    out += md_table(["Model", *(f"R_{t}" for t in steps), *(f"E_Δ,{t}" for t in steps)], rows)
    out += ["", "**Mechanism diagnostics** (SCSE Table 22 layout): pointwise forcing bias b_t, raw "
            "pre-mask response b̃_t, random-direction gain ‖T_t(Δ+εv) − T_t(Δ)‖_F/ε (ε = 1e-3, mean of "
            "4 directions), anchor energy at the late step.", ""]
    parts = (("forcing", "bias_energy"), ("forcing", "raw_bias_energy"), ("gain", "gain"))
    rows = [[label, *(_fmt(_by_t(res[part], key).get(t)) for part, key in parts for t in steps),
             _fmt(_by_t(res["forcing"], "anchor_energy").get(last))] for label, res in results.items()]
    out += md_table(["Model", *(f"N⁻¹‖b_{t}‖²" for t in steps), *(f"N⁻¹‖b̃_{t}‖²" for t in steps),
                   *(f"gain t={t}" for t in steps), f"E_Δ,{last}"], rows)
    gains = sorted({float(r["gain"]) for res in results.values() for r in res["dose_response"]["records"]})
    shown = [g for g in gains if g != 0.0]
    out += ["", "**Anchor-start rollouts and injection-gain dose response** (SCSE Figure 4): Δ_0 = 0; "
            "cosine of Δ_T with the forcing ray T·b_0(e) (mean [min, max] over examples); push = RMS of "
            "Δ_T; D_g = Δ_T(gain g) − Δ_T(gain 0), as RMS relative to the push and as cosine with D_1.", ""]
    rows = []
    for label, res in results.items():
        fin = res["rollout"]["records"][-1]
        dose = {float(r["gain"]): r for r in res["dose_response"]["records"]}
        span = "–" if fin["cosine"] is None else f"{_fmt(fin['cosine'])} [{_fmt(fin['cosine_min'])}, " \
                                                  f"{_fmt(fin['cosine_max'])}]"
        rows.append([label, span, _fmt(res["dose_response"]["push_rms"]),
                     *(_fmt(dose[g]["relative_to_push"]) if g in dose else "–" for g in shown),
                     *(_fmt(dose[g]["cosine_to_unit_gain"]) if g in dose else "–" for g in shown if g != 1.0)])
    depth = max(res["rollout"]["depth"] for res in results.values())
    out += md_table(["Model", f"cos(Δ_T, T·b_0), T={depth}", "push RMS", *(f"D_{g:g}/push" for g in shown),
                   *(f"cos(D_{g:g}, D_1)" for g in shown if g != 1.0)], rows)
    out += _scale_markdown(results)
    return "\n".join(out)


def _scale_markdown(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The scale, visit-alignment and token-convergence sections (skipped for results without them)."""
    out: list[str] = []
    for label, res in results.items():
        if "scale" not in res:
            continue
        sc = res["scale"]
        out += ["", f"**Hidden-state scale, {label}** (readout blind spot, SPEC §7): per-token RMS of H_k "
                "(mean, p50, p99, max over tokens) and L2 norm (mean, max; L2 = √d·RMS, d = "
                f"{sc.get('d', '?')}); r_k = share of the immediate readout gradient "
                "‖∂L_k/∂H_k‖² along each token's radial direction; ∂L_k/∂log s for H_k → s·H_k "
                f"(g_K at k = K = {sc['K']}); a_rad,k = ⟨u_k, F(H_k) − H_k⟩/d with ‖u_k‖_rms = 1, "
                "next to the measured RMS change.", ""]
        rows = [[str(r["k"]), _fmt(r["rms_mean"]), _fmt(r["rms_p50"]), _fmt(r["rms_p99"]), _fmt(r["rms_max"]),
                 _fmt(r.get("l2_mean")), _fmt(r.get("l2_max")), _fmt(r["ce"]), _fmt(r["radial_grad_fraction"]),
                 _fmt(r["radial_derivative"]), _fmt(r["radial_increment"]), _fmt(r["rms_increment"])]
                for r in sc["loops"]]
        out += md_table(["k", "RMS mean", "p50", "p99", "max", "L2 mean", "L2 max", "CE_k", "r_k", "∂L_k/∂log s",
                       "a_rad,k", "ΔRMS"], rows)
    aligned = {label: res["visit_alignment"] for label, res in results.items() if "visit_alignment" in res}
    if aligned:
        out += ["", "**Visit alignment** (DeepLoop κ_R, SPEC §7): κ̂_j = ‖Σ_r G_{r,j}‖² / Σ_r ‖G_{r,j}‖² "
                "of the visit-wise weight gradients of each core sublayer (1 = orthogonal equal-norm "
                "visits, R = aligned), mean over batches; κ̂_R = max_j.", ""]
        names = list(dict.fromkeys(p["name"] for va in aligned.values() for p in va["per_sublayer"]))
        rows = []
        for label, va in aligned.items():
            per = {p["name"]: p for p in va["per_sublayer"]}
            visits = sorted({p["visits"] for p in va["per_sublayer"]})
            rows.append([label, str(va["depth"]), "/".join(map(str, visits)), va["loss"],
                         _fmt(va["kappa_hat"]), *(_fmt(per[n]["kappa"]) if n in per else "–" for n in names)])
        out += md_table(["Model", "R", "visits", "loss", "κ̂_R", *(f"κ̂ {n.removeprefix('core.')}" for n in names)],
                      rows)
    conv = {label: res["convergence"] for label, res in results.items() if "convergence" in res}
    if conv:
        out += ["", "**Token convergence** (LMDR, SPEC §6): ρ_{r,t} = ‖h_t^r − h_t^{r−1}‖/(‖h_t^{r−1}‖ + 1e-8); "
                "token t converged from the smallest r with ρ < τ for all r' in [r, R]; tokens never "
                "converged count as depth R + 1.", ""]
        rows = []
        for label, c in conv.items():
            sp = "–" if c["spearman"] is None else f"{_fmt(c['spearman'])} (p = {_fmt(c['spearman_p'])})"
            rows.append([label, _fmt(c["tau"]), str(c["depth"]), str(c["tokens"]), _fmt(c["rho_mean"][0]),
                         _fmt(c["rho_mean"][-1]), _fmt(c["depth_mean"]), _fmt(c["depth_median"]),
                         _fmt(c["never_fraction"]), sp])
        out += md_table(["Model", "τ", "R", "tokens", "mean ρ_1", "mean ρ_R", "depth mean", "depth median",
                       "never", "Spearman(depth, position)"], rows)
    return out


def plot_forcing_ratio(results: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Bar plot of R_t per model (SCSE Figure 5 style): bars at the last step, open markers at earlier ones."""
    labels = list(results)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(labels) + 2.0), 3.8))
    x = np.arange(len(labels))
    last = [res["forcing"][-1] for res in results.values()]
    bars = ax.bar(x, [r["ratio"] for r in last], width=0.6, color="tab:blue", alpha=0.8,
                  label=f"t = {last[0]['t']}" if last else None)
    for rect, r in zip(bars, last):
        ax.annotate(f"{r['ratio']:.2f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    ha="center", va="bottom", fontsize=8)
    markers = "os^Dv"
    seen: set[int] = set()
    for i, res in enumerate(results.values()):
        for j, r in enumerate(res["forcing"][:-1]):
            lab = f"t = {r['t']}" if r["t"] not in seen else None
            seen.add(r["t"])
            ax.plot([i], [r["ratio"]], linestyle="none", marker=markers[j % len(markers)], markersize=8,
                    markerfacecolor="none", markeredgecolor="black", label=lab)
    ax.axhline(1.0, linestyle="--", color="gray", linewidth=1, label="unit reference")
    ax.set_xticks(x, labels, rotation=15, ha="right")
    ax.set(ylabel="R_t (pointwise bias / update energy)", title="Forcing-bias energy ratio R_t", ylim=(0, None))
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, path)


def _pca_axes(ax, title: str, share: list[float]) -> None:
    ax.set(title=title, xlabel=f"PC1 ({100 * share[0]:.0f}%)", ylabel=f"PC2 ({100 * share[1]:.0f}%)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, alpha=0.3)


def plot_anchor_rollouts(result: Mapping[str, Any], path: str | Path, *, label: str = "",
                         train_depth: int | None = None) -> Path:
    """SCSE Figure 4 style: (a) trajectories Δ_t with their forcing rays (dashed) and the mean anchor distance
    at ``train_depth`` (dotted); (b) displacements Δ_t(g) − Δ_t(0) per gain, in their own projection."""
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(11.0, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    view = result["rollout"]["pca"]
    paths = np.asarray(view["paths"], dtype=float).reshape(len(view["paths"]), -1, 2)  # (k, T+1, 2)
    ray = np.asarray(view["ray"], dtype=float).reshape(-1, 2)  # (k, 2)
    for i in range(paths.shape[0]):
        c = colors[i % len(colors)]
        ax_a.plot(paths[i, :, 0], paths[i, :, 1], "-o", markersize=2, linewidth=1, color=c,
                  label="trajectory Δ_t (one per example)" if i == 0 else None)
        reach = float(np.linalg.norm(paths[i], axis=1).max())
        norm = float(np.linalg.norm(ray[i]))
        if norm > 0 and reach > 0:
            end = ray[i] / norm * reach
            ax_a.plot([0, end[0]], [0, end[1]], "--", linewidth=1, color=c, alpha=0.7,
                      label="forcing ray t·b_0(e)" if i == 0 else None)
    if train_depth is not None and 0 < train_depth < paths.shape[1]:
        radius = float(np.linalg.norm(paths[:, train_depth], axis=1).mean())
        if radius > 0:
            ax_a.add_patch(plt.Circle((0, 0), radius, fill=False, linestyle=":", color="gray",
                                      label=f"mean anchor distance at t={train_depth}"))
    ax_a.plot([0], [0], marker="*", markersize=12, color="black", linestyle="none", label="anchor h*")
    if result["rollout"]["bias0_rms"] == 0:
        ax_a.text(0.05, 0.92, "b_t(e) = 0: an anchor start stays at the anchor", transform=ax_a.transAxes,
                  color="tab:green", fontsize=11)
    _pca_axes(ax_a, f"(a) anchor-start trajectories, T={result['rollout']['depth']}", view["basis_share"])

    view = result["dose_response"]["pca"]
    any_motion = False
    for j, (g, gpaths) in enumerate(sorted(view["paths"].items(), key=lambda kv: float(kv[0]))):
        arr = np.asarray(gpaths, dtype=float).reshape(len(gpaths), -1, 2)
        any_motion |= bool(np.any(arr))
        c = colors[j % len(colors)]
        for i in range(arr.shape[0]):
            ax_b.plot(arr[i, :, 0], arr[i, :, 1], "-", linewidth=1, color=c,
                      label=f"gain {float(g):g}" if i == 0 else None)
            if float(g) != 1.0:
                ax_b.plot(arr[i, -1, 0], arr[i, -1, 1], marker="^" if float(g) > 1 else "v", color=c,
                          linestyle="none")
    if not any_motion:
        ax_b.text(0.05, 0.92, "no injection response: D ≡ 0", transform=ax_b.transAxes, color="tab:green",
                  fontsize=11)
    ax_b.plot([0], [0], marker="*", markersize=12, color="black", linestyle="none")
    _pca_axes(ax_b, "(b) displacement from the injection-removed rollout", view["basis_share"])
    if label:
        fig.suptitle(label)
    return save_figure(fig, path)


def plot_scale(result: Mapping[str, Any], path: str | Path, *, label: str = "") -> Path:
    """(a) per-loop token RMS of H_k (blind spot Appendix D); (b) mean ρ_r with τ (LMDR Figure 2a)."""
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    loops = result["scale"]["loops"]
    k = [r["k"] for r in loops]
    for key, style, name in (("rms_mean", "-o", "mean"), ("rms_p50", "--", "p50"), ("rms_p99", "-.", "p99"),
                             ("rms_max", ":", "max")):
        ax_a.plot(k, [r[key] for r in loops], style, markersize=3, label=name)
    ax_a.set(yscale="log", xlabel="loop k", ylabel="token RMS of H_k",
             title=f"(a) hidden-state scale, K={result['scale']['K']}")
    conv = result["convergence"]
    r = np.arange(1, len(conv["rho_mean"]) + 1)
    rho = np.asarray(conv["rho_mean"], dtype=float)
    ax_b.plot(r, np.where(rho > 0, rho, np.nan), "-o", markersize=2, label="mean ρ_r")
    ax_b.axhline(conv["tau"], linestyle="--", color="gray", linewidth=1, label=f"τ = {conv['tau']:g}")
    if np.any(rho > 0):
        ax_b.set_yscale("log")
    ax_b.set(xlabel="recurrence r", ylabel="‖h^r − h^{r−1}‖ / ‖h^{r−1}‖",
             title=f"(b) token convergence (never converged: {100 * (conv['never_fraction'] or 0):.0f}%)")
    for ax in (ax_a, ax_b):
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    if label:
        fig.suptitle(label)
    return save_figure(fig, path)
