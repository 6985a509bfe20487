"""The report's figures, drawn from a results document alone (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mac_moesd.analysis import theory  # noqa: E402
from mac_moesd.analysis.spec_runs import valid_runs  # noqa: E402
from mac_moesd.analysis.digest import Digest  # noqa: E402

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

DPI = 110
STYLE: dict[RcKeyType, Any] = {"figure.figsize": (7.0, 4.2), "axes.grid": True, "grid.alpha": 0.3,
                               "font.size": 10}


def _save(fig, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def roofline(d: Digest, folder: Path) -> Path | None:
    """Attainable FLOP/s against arithmetic intensity, ridge marked, models' operating points."""
    roof = d.roofline
    if not roof:
        return None
    bw = roof["bandwidth_ceiling_gbs"] * 1e9
    peak = roof["flops_tflops"][roof["ridge_dtype"]] * 1e12
    ridge = roof["ridge_flop_per_byte"]
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        ai = np.logspace(-1, max(3, np.log10(ridge) + 1.5), 200)
        ax.loglog(ai, np.minimum(peak, bw * ai), color="black", lw=2, label="roofline (measured)")
        ax.axvline(ridge, color="grey", ls="--")
        ax.annotate(f"ridge {ridge:.1f} FLOP/B", (ridge, peak), textcoords="offset points",
                    xytext=(5, -15), fontsize=9)
        for i, m in enumerate(d.models):
            for tokens, marker in ((1, "o"), (m.verify_window, "s")):
                point = m.operating_point(tokens)
                if point:
                    label = f"{m.name} t={tokens}"
                    ax.loglog(*point, marker=marker, ls="", color=f"C{i}", ms=8, label=label)
        ax.set_xlabel("arithmetic intensity (FLOP per byte of weights read)")
        ax.set_ylabel("FLOP/s")
        ax.set_title("Roofline and batch-1 decode / verify-window operating points")
        ax.legend(fontsize=7, loc="lower right")
        return _save(fig, folder, "roofline")


def ratio(d: Digest, folder: Path) -> Path | None:
    """T_T(B,t)/T_T(B,1) against t for each B: MoE and dense side by side."""
    models = [m for m in d.models if m.points]
    if not models:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.8), sharey=True,
                                 squeeze=False)
        for ax, m in zip(axes[0], models):
            for j, b in enumerate(m.batches):
                ts, rs = m.ratio_curve(b)
                ax.plot(ts, rs, marker="o", color=f"C{j}", label=f"B={b}")
            ax.plot([1, max(m.tokens)], [1, max(m.tokens)], color="grey", ls=":", lw=1)
            kind = f"MoE E={m.experts} K={m.top_k}" if m.experts else "dense"
            ax.set_title(f"{m.name}\n({kind})", fontsize=9)
            ax.set_xlabel("new tokens t")
        axes[0][0].set_ylabel("T_T(B,t) / T_T(B,1)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle("Cost of a t-token forward relative to one token (dotted: linear)", fontsize=10)
        return _save(fig, folder, "ratio")


def efficiency(d: Digest, folder: Path) -> Path | None:
    """Measured target efficiency T_T(B,1)/T_T(B,gamma+1) against B (gamma drafts plus one token)."""
    models = [m for m in d.models if m.points]
    if not models:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        for i, m in enumerate(models):
            for gamma, ls in ((1, "-"), (3, "--")):
                bs, es = m.efficiency_curve(gamma + 1)
                if bs:
                    ax.plot(bs, es, ls=ls, marker="o", color=f"C{i}",
                            label=f"{m.name} gamma={gamma} ({gamma + 1}-token verify)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B")
        ax.set_ylabel("T_T(B,1) / T_T(B,gamma+1)")
        ax.set_title("Target efficiency (measured; 1 = a verify window is free)")
        ax.legend(fontsize=7)
        return _save(fig, folder, "efficiency")


def routing(d: Digest, folder: Path) -> Path | None:
    """Measured unique experts against uniform N(t): one sequence, and independent sequences."""
    docs = d.routing
    if not docs:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
        for i, r in enumerate(docs):
            single = sorted((w["tokens"], w["measured_unique"]) for w in r["windows"] if w["batch"] == 1)
            across = sorted((w["batch"], w["measured_unique"]) for w in r["windows"] if w["tokens"] == 1)
            for ax, rows in ((axes[0], single), (axes[1], across)):
                if not rows:
                    continue
                x = np.array([a for a, _ in rows], dtype=float)
                ax.plot(x, [b for _, b in rows], marker="o", color=f"C{i}", label=f"{r['model']} measured")
                grid = np.linspace(1, x.max(), 100)
                ax.plot(grid, theory.activated_experts(grid, r["experts"], r["top_k"]), color=f"C{i}",
                        ls=":", label=f"uniform N (E={r['experts']}, K={r['top_k']})")
                ax.axhline(r["tau"] * r["experts"], color=f"C{i}", lw=0.8, ls="--")
        axes[0].set_title("one sequence, t consecutive tokens", fontsize=9)
        axes[0].set_xlabel("t")
        axes[1].set_title("B independent sequences, one token each", fontsize=9)
        axes[1].set_xlabel("B")
        axes[0].set_ylabel("unique experts per layer")
        axes[0].legend(fontsize=7)
        fig.suptitle("Activated experts (dashed: tau*E saturation)", fontsize=10)
        return _save(fig, folder, "routing")


def fit_scatter(d: Digest, folder: Path) -> Path | None:
    fits = d.fits
    if not fits:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(4.8, 4.4))
        lo, hi = np.inf, 0.0
        for i, f in enumerate(fits):
            for rows, marker, label in ((f["train_points"], "o", "all points"), (f["heldout_points"], "x", "held out")):
                m = np.array([r["measured_s"] for r in rows]) * 1e3
                p = np.array([r["predicted_s"] for r in rows]) * 1e3
                ax.plot(m, p, marker=marker, ls="", color=f"C{i}", label=f"{f['model']} {label}")
                lo, hi = min(lo, m.min(), p.min()), max(hi, m.max(), p.max())
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # minor labels of a narrow log range overlap
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("measured T_T (ms)")
        ax.set_ylabel("fitted model (ms)")
        ax.set_title("MoESD time model: predicted against measured", fontsize=10)
        ax.legend(fontsize=7)
        return _save(fig, folder, "fit")


def speedup(d: Digest, folder: Path, alpha: float = theory.DEFAULT_ALPHA) -> Path | None:
    """Predicted S(B, gamma) against B per gamma: batch 1, saturation and peak window marked."""
    fits = [f for f in d.fits if f["drafted"]]
    if not fits:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(fits), figsize=(5.6 * len(fits), 4.0), squeeze=False)
        for ax, f in zip(axes[0], fits):
            threshold = theory.saturation_threshold(f["top_k"] / f["experts"])
            for j, gamma in enumerate((1, 2, 4, 8)):
                rows = [p for p in f["predictions"] if p["gamma"] == gamma and p["alpha"] == alpha]
                ax.plot([p["batch"] for p in rows], [p["speedup"] for p in rows], color=f"C{j}",
                        label=f"gamma={gamma}")
                ax.plot(1, rows[0]["speedup"], marker="o", color=f"C{j}")
                ax.axvline(threshold / (gamma + 1), color=f"C{j}", lw=0.8, ls=":")
            peak = next(p for p in f["peaks"] if p["gamma"] == 4 and p["alpha"] == alpha)
            ax.axvspan(*peak["window"], color="C2", alpha=0.08, label="gamma=4 within peak/sqrt2")
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch B (dotted: B*(gamma+1) = T_thres)")
            ax.set_ylabel(f"predicted speedup (alpha={alpha})")
            ax.set_title(f"{f['model']} (`{f['chosen']}` expert loads)", fontsize=9)
            ax.legend(fontsize=7)
        fig.suptitle("Predicted SD speedup; dots mark batch-1 decode", fontsize=10)
        return _save(fig, folder, "speedup")


def what_if(d: Digest, folder: Path) -> Path | None:
    """T_T(B,t) against t under each measured routing and gather, for models swept more than one
    way: one panel per model at its smallest and largest batch."""
    groups = [[m, *d.what_ifs(m)] for m in d.models if d.what_ifs(m)]
    if not groups:
        return None
    panels = [(views, b) for views in groups for b in sorted({min(views[0].batches), max(views[0].batches)})]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, 4.2 * len(panels)), 3.8), squeeze=False)
        for ax, (views, b) in zip(axes[0], panels):
            colours: dict[str, str] = {}
            for v in views:
                colour = colours.setdefault(v.routing, f"C{len(colours)}")
                timed = [(t, s) for t in v.tokens if (s := v.median(b, t)) is not None]
                if timed:
                    ax.plot([t for t, _ in timed], [s * 1e3 for _, s in timed], marker="o", color=colour,
                            ls="--" if v.gather == "sorted" else "-", label=f"{v.routing}, {v.gather}")
            ax.set_title(f"{views[0].name}, B={b}", fontsize=9)
            ax.set_xlabel("new tokens t")
            ax.legend(fontsize=7, handlelength=3.5)
        axes[0][0].set_ylabel("T_T(B,t) (ms)")
        fig.suptitle("Forward time by routing (colour) and gather (dashed: sorted)", fontsize=10)
        return _save(fig, folder, "what_if")


def acceptance(d: Digest, folder: Path) -> Path | None:
    """Acceptance at each draft position for each pair, prompt set, temperature and rule (the
    largest gamma measured)."""
    curves = []
    for p in d.pairs:
        for prompt_set, doc in d.pair_spec(p).items():
            entries = doc.get("acceptance") or []
            widest = max((a["gamma"] for a in entries), default=None)
            for a in (a for a in entries if a["gamma"] == widest):
                for rule, stats in (a.get("rules") or {a["rule_run"]: a["measured"]}).items():
                    curves.append((f"{prompt_set}, T={a['temperature']:g}, {rule}",
                                   [np.nan if v is None else v for v in stats["acceptance_by_position"]]))
    if not curves:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        for i, (label, rates) in enumerate(curves):
            ax.plot(range(1, len(rates) + 1), rates, marker="o", color=f"C{i}", label=label)
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("draft position i")
        ax.set_ylabel("share of rounds accepting draft token i")
        ax.set_title("Acceptance by draft position on your prompts")
        ax.legend(fontsize=7)
        return _save(fig, folder, "acceptance")


def measured_vs_predicted(d: Digest, folder: Path) -> Path | None:
    """Each timed SD run of a pair: measured speedup against the fit's prediction."""
    from mac_moesd.analysis.fit import model_prediction, speedup_predictor

    points = []
    for p in d.pairs:
        fitted = d.fit_of(p["target"], p["draft"])
        if fitted is None or speedup_predictor(fitted) is None:
            continue
        for prompt_set, doc in d.pair_spec(p).items():
            for r in valid_runs(doc["runs"]):
                predicted = model_prediction(fitted, r, doc).shown
                if predicted is not None:
                    points.append((f"{prompt_set}, {p['draft']}", r["batch"], r["measured_speedup"], predicted))
    if not points:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(4.8, 4.4))
        sets = sorted({s for s, *_ in points})
        for i, prompt_set in enumerate(sets):
            for one, marker in ((True, "o"), (False, "s")):
                rows = [(m, q) for s, b, m, q in points if s == prompt_set and (b == 1) == one]
                if rows:
                    ax.plot(*zip(*rows), marker=marker, ls="", color=f"C{i}",
                            label=f"{prompt_set}, {'B=1' if one else 'B>1'}")
        values = [v for *_, m, q in points for v in (m, q)]
        lo, hi = min(values + [1.0]) * 0.9, max(values + [1.0]) * 1.1
        ax.plot([lo, hi], [lo, hi], color="grey", ls="--", lw=1)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.axvline(1.0, color="black", lw=0.6)
        ax.set_xlabel("measured speedup")
        ax.set_ylabel("predicted speedup")
        ax.set_title("SD on your pair: measured against predicted", fontsize=10)
        ax.legend(fontsize=7)
        return _save(fig, folder, "measured_vs_predicted")


ALL = (roofline, ratio, efficiency, routing, what_if, fit_scatter, speedup, acceptance,
       measured_vs_predicted)


def draw_all(d: Digest, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for draw in ALL:
        path = draw(d, folder)
        if path is not None:
            out[path.stem] = path
    return out
