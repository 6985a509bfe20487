"""The report's cluster section: a sharded sweep's ranks, its measured communication, and the
fitted model's SD predictions on that cluster (with the link as measured and with a free one)."""

from __future__ import annotations

from mac_moesd.analysis.digest import Digest
from mac_moesd.reporting.formatting import Block
from mac_moesd.reporting.numbers import f2, pct, seconds
from mac_moesd.results import parse_point_key

__all__ = ["cluster_blocks"]


def cluster_blocks(d: Digest) -> list[Block]:
    shape = d.meta.get("cluster")
    if not shape:
        return []
    hosts = ", ".join(shape["hosts"])
    blocks: list[Block]
    blocks = [("h2", f"Cluster: {shape['ranks']} ranks, {shape['parallel']} parallel"),
              ("p", f"Measured with `mlx.launch` over the **{shape['backend']}** backend on {hosts} "
                    f"(rank order). Every forward ran on all ranks at once and counts as the slowest "
                    f"rank's time. Each collective the sharded forward makes was then timed on its own "
                    f"at that point's size: the communication column is their sum, and the share is "
                    f"of the measured T_T.")]
    for entry in d.data.get("communication", {}).values():
        model = d.model(entry["model"])
        rows = []
        for key, point in sorted(entry["points"].items(), key=lambda kv: parse_point_key(kv[0])):
            batch, tokens = parse_point_key(key)
            total = model.median(batch, tokens) if model else None
            kinds = "; ".join(f"{o['count']} x {o['op']} of {o['bytes']} B at {seconds(o['median_s'])}"
                              for o in point["ops"])
            rows.append([str(batch), str(tokens), seconds(total) if total else "-", seconds(point["total_s"]),
                         pct(point["total_s"] / total if total else None), kinds])
        blocks.append(("h3", f"{entry['model']}: communication per forward"))
        blocks.append(("table", ["B", "t", "T_T", "communication", "share", "collectives"], rows))
    for fit in d.fits:
        section = fit.get("cluster")
        if not section:
            continue
        kinds = fit["communication"]["kinds"]
        blocks.append(("h3", f"{fit['model']}: SD on this cluster"))
        blocks.append(("p", "Communication term fitted to the micro-benchmark (latency plus bytes over "
                            "bandwidth, per kind): " + "; ".join(
                                f"{k['count']} x {k['op']} per forward, {seconds(k['latency_s'])} + "
                                f"{k['bytes_per_token']:.0f} B/token"
                                + (f" at {k['bandwidth_bytes_s'] / 1e9:.2f} GB/s" if k["bandwidth_bytes_s"] else "")
                                for k in kinds)
                         + ". It is added, fixed, to the fitted time model. Its latency does not grow with "
                           "the tokens of a forward, so a verify window pays it once for all its tokens and "
                           "less of it per token than a plain step (last column); whether its share of the "
                           "forward falls too depends on how fast the rest of the forward grows."))
        rows = [[str(r["batch"]), str(r["gamma"]), f2(r["speedup"]), f2(r["speedup_free_link"]),
                 pct(r["comm_share_plain"]), pct(r["comm_share_verify"]),
                 f"{seconds(r['comm_per_token_plain_s'])} / {seconds(r['comm_per_token_verify_s'])}"]
                for r in section["rows"]]
        alpha = section["rows"][0]["alpha"] if section["rows"] else None
        blocks.append(("table", ["B", "gamma", f"S (alpha={alpha})", "S, free link",
                                 "comm share, plain step", f"comm share, verify ({section['verify_tokens']})",
                                 "comm per token, plain / verify"], rows))
        if not fit["drafted"]:
            blocks.append(("note", "No drafter was measured on the cluster, so no speedups: rerun the "
                                   "sharded sweep with --draft DRAFT."))
    blocks.append(("note", "On one host (CI) every rank shares its CPU and the link is the loopback "
                           "interface: these communication figures say nothing of Thunderbolt or "
                           "RDMA between Macs."
                   if len(set(shape["hosts"])) == 1 else
                   "Communication measured between these hosts on this link only."))
    return blocks
