"""Full depth and the second context, read from stored sweep entries: the points at full depth
(measured, or extrapolated from slices of n and 2n layers) and the one-token points timed at a
second context, each scaled by its twin. Plain functions of the stored records (docs/design.md
§7.5), used both by the sweep that writes them (its ``--json`` document) and by the digest and
the fit that read them.
"""

from __future__ import annotations

from mac_moesd.errors import MacMoesdError

__all__ = ["depth_entries", "extrapolate", "full_depth_points", "kv_in_use", "second_context_points"]


def depth_entries(entries: list[dict]) -> list[dict]:
    """The entries full depth is read from: the full-depth one, else an (n, 2n) pair of slices."""
    for e in entries:
        if e["layers"] == e["layers_full"]:
            return [e]
    by_layers = {e["layers"]: e for e in entries}
    for n, small in sorted(by_layers.items()):
        if 2 * n in by_layers:
            return [small, by_layers[2 * n]]
    raise MacMoesdError("only partial layer slices were measured; rerun the sweep to finish them")


def full_depth_points(entries: list[dict], kind: str = "points") -> tuple[dict, bool]:
    """Points at full depth: measured, or extrapolated from an (n, 2n) pair of slices.
    ``kind``: "points" (synchronous) or "pipelined_points" (empty where not measured)."""
    used = depth_entries(entries)
    if len(used) == 1:
        return used[0].get(kind, {}), False
    small, large = used
    return extrapolate({"points": small.get(kind, {})}, {"points": large.get(kind, {})},
                       small["layers"], small["layers_full"]), True


def second_context_points(entries: list[dict]) -> tuple[int | None, dict]:
    """The second context and the one-token points timed there beside the grid (each scaled by
    its twin, ``kv_in_use``), at full depth; (None, {}) where the sweep timed none or its
    slices were timed at different second contexts."""
    used = depth_entries(entries)
    contexts = {e.get("kv_context") for e in used}
    if len(contexts) != 1 or None in contexts:
        return None, {}
    points, _ = full_depth_points([{**e, "kv_in_use": kv_in_use(e)} for e in used], "kv_in_use")
    return contexts.pop(), points


def extrapolate(small: dict, large: dict, n: int, full: int) -> dict:
    """Full-depth points from slices of n and 2n layers: T = T_n + (T_2n - T_n) * (full - n) / n.

    The estimate is a*T_n + b*T_2n; spreads combine as sqrt(a^2 s_n^2 + b^2 s_2n^2).
    """
    a, b = (2 * n - full) / n, (full - n) / n
    out = {}
    for key in small["points"].keys() & large["points"].keys():
        s, l = small["points"][key], large["points"][key]
        median = a * s["median_s"] + b * l["median_s"]
        iqr = ((a * s["iqr_s"]) ** 2 + (b * l["iqr_s"]) ** 2) ** 0.5
        out[key] = {
            "median_s": median,
            "iqr_s": iqr,
            "cv": iqr / 1.349 / median if median > 0 else 0.0,  # IQR of a normal is 1.349 sd
            "repeats": min(s["repeats"], l["repeats"]),
            "extrapolated": True,
        }
        # Experts per MoE layer do not scale with depth: the deeper slice averages more layers.
        out[key].update({k: l[k] for k in ("unique_experts", "pairs") if k in l})
    return out


def kv_in_use(entry: dict) -> dict:
    """The second-context points the fit uses, each scaled by its grid point over the twin timed
    beside it, so that what the machine did between the grid's session and theirs cancels."""
    context = entry.get("kv_context")
    if not context:
        return {}
    short = entry.get("kv_points", {}).get(str(context), {})
    twins = entry.get("kv_twins", {}).get(str(context), {})
    out = {}
    for key, point in short.items():
        if key in twins and key in entry.get("points", {}):
            scale = entry["points"][key]["median_s"] / twins[key]["median_s"]
            out[key] = {**point, "median_s": point["median_s"] * scale, "scaled_by_twin": scale}
    return out
