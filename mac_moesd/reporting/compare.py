"""Several machines' results side by side, with datacenter GPUs as labelled reference rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mac_moesd.analysis import theory  # noqa: E402
from mac_moesd.analysis.digest import Digest  # noqa: E402
from mac_moesd.errors import BadInput  # noqa: E402
from mac_moesd.results import load_results, validate  # noqa: E402

__all__ = ["REFERENCE_GPUS", "compare", "machine_row_of"]

ALPHA, GAMMA = theory.DEFAULT_ALPHA, 4


class ReferenceGPU(TypedDict):
    chip: str
    bandwidth_gbs: float
    tflops: float


# Published, not measured: bandwidth and dense BF16 tensor throughput (no sparsity).
REFERENCE_GPUS: tuple[ReferenceGPU, ...] = (
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 3.35 TB/s, 989 TFLOPS BF16 dense)
    {"chip": "NVIDIA H100 SXM", "bandwidth_gbs": 3350.0, "tflops": 989.0},
    # https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM: 2,039 GB/s, 312 TFLOPS BF16)
    {"chip": "NVIDIA A100 80GB SXM", "bandwidth_gbs": 2039.0, "tflops": 312.0},
)


def machine_row_of(folder: Path) -> dict:
    """``machine_row`` of a results folder (or file)."""
    path = folder / "results.json" if folder.is_dir() else folder
    data = load_results(path)
    with validate.read_guard(path):
        return machine_row(data, str(folder))


def machine_row(data: dict, label: str) -> dict:
    """One machine, or a cluster of n (``ranks`` > 1): a sharded sweep's results set beside a
    single machine's, its predicted speedups including the measured communication."""
    d = Digest(data)
    roof = d.roofline or {}
    shape = d.meta.get("cluster")
    row: dict[str, Any] = {
        "label": label,
        "chip": (f"{shape['ranks']} x {d.meta.get('chip')} ({shape['parallel']}, {shape['backend']})"
                 if shape else d.meta.get("chip")),
        "ranks": shape["ranks"] if shape else 1,
        "parallel": shape["parallel"] if shape else None,
        "comm_share_verify": {},
        "backend": d.meta.get("backend"),
        "measured": True,
        "bandwidth_gbs": roof.get("bandwidth_ceiling_gbs"),
        "tflops": roof.get("flops_tflops", {}).get(roof.get("ridge_dtype")) if roof else None,
        "ridge_flop_per_byte": roof.get("ridge_flop_per_byte"),
        "speedup_batch1": {},
        "curves": {},
    }
    for fit in (f for f in d.fits if f["drafted"]):  # speedups need a measured drafter
        best = max((p for p in fit["predictions"] if p["batch"] == 1 and p["alpha"] == ALPHA),
                   key=lambda p: p["speedup"])
        row["speedup_batch1"][fit["model"]] = {"gamma": best["gamma"], "speedup": best["speedup"]}
        row["curves"][fit["model"]] = [(p["batch"], p["speedup"]) for p in fit["predictions"]
                                       if p["gamma"] == GAMMA and p["alpha"] == ALPHA]
    for fit in d.fits:
        rows = (fit.get("cluster") or {}).get("rows", [])
        share = next((r["comm_share_verify"] for r in rows if r["batch"] == 1 and r["gamma"] == GAMMA), None)
        if share is not None:
            row["comm_share_verify"][fit["model"]] = share
    return row


def compare(folders: list[Path], reference: bool = False) -> dict:
    if not folders:
        raise BadInput("give at least one results folder")
    rows = [machine_row_of(f) for f in folders]
    if reference:
        for gpu in REFERENCE_GPUS:
            rows.append({"label": "published spec, not measured", "chip": gpu["chip"], "backend": "cuda",
                         "ranks": 1, "parallel": None, "comm_share_verify": {},
                         "measured": False, "bandwidth_gbs": gpu["bandwidth_gbs"], "tflops": gpu["tflops"],
                         "ridge_flop_per_byte": gpu["tflops"] * 1e12 / (gpu["bandwidth_gbs"] * 1e9),
                         "speedup_batch1": {}, "curves": {}})
    models = sorted({m for r in rows for m in r["speedup_batch1"]})
    return {"alpha": ALPHA, "gamma_curves": GAMMA, "machines": rows, "models": models}


def draw(doc: dict, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [f"{r['chip']}\n({'measured' if r['measured'] else 'published'})" for r in doc["machines"]]
    ridges = [r["ridge_flop_per_byte"] or 0 for r in doc["machines"]]
    ax.bar(range(len(names)), ridges, color=["C0" if r["measured"] else "C7" for r in doc["machines"]])
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ridge point (FLOP/byte)")
    ax.set_title("Ridge point by machine")
    fig.tight_layout()
    out["ridge"] = folder / "compare_ridge.png"
    fig.savefig(out["ridge"], dpi=110)
    plt.close(fig)
    if doc["models"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, r in enumerate(r for r in doc["machines"] if r["curves"]):
            for j, (model, curve) in enumerate(r["curves"].items()):
                ax.plot([b for b, _ in curve], [s for _, s in curve], color=f"C{i}",
                        ls=["-", "--", ":", "-."][j % 4], label=f"{r['chip']}: {model}")
        ax.axhline(1, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B")
        ax.set_ylabel(f"predicted speedup (gamma={GAMMA}, alpha={ALPHA})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        out["speedup"] = folder / "compare_speedup.png"
        fig.savefig(out["speedup"], dpi=110)
        plt.close(fig)
    return out
