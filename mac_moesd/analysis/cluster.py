"""The communication term of a sharded forward, and what it does to SD's payoff on a cluster.

A forward sharded over n machines makes, per layer, all-reduces (tensor, expert) or hops and an
all-gather (pipeline). Each kind of collective costs a latency plus bytes over the link's
bandwidth (Hockney's model, R. W. Hockney, "The communication challenge for MPP", Parallel
Computing 20, 1994), fitted here to the sweep's micro-benchmark of that kind at each point's
size. Its bytes grow with the n = B*t tokens of the forward, so per forward

    C(n) = sum over kinds k of count_k * (latency_k + seconds_per_byte_k * bytes_per_token_k * n)

and the fitted time model becomes T(n) = Algorithm 1 + C(n). The latency part does not grow
with n: a verify forward of gamma+1 tokens pays it once for gamma+1 tokens (docs/design.md §2.9).
Pure numpy and scipy: no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from mac_moesd.analysis import theory
from mac_moesd.results import parse_point_key, schema

__all__ = ["CommTerm", "kind_time", "cluster_rows", "comm_term"]


def kind_time(kind: schema.CommunicationKind, n) -> np.ndarray:
    """Seconds of one kind of collective in one forward of n = B*t tokens."""
    n = np.asarray(n, dtype=float)
    return kind["count"] * (kind["latency_s"] + kind["seconds_per_byte"] * kind["bytes_per_token"] * n)


@dataclass(frozen=True)
class CommTerm:
    kinds: tuple[schema.CommunicationKind, ...]

    def time(self, n) -> np.ndarray:
        """Seconds of communication in one forward of n = B*t tokens."""
        return sum((kind_time(k, n) for k in self.kinds), np.zeros_like(np.asarray(n, dtype=float)))

    def to_dict(self) -> schema.FitCommunication:
        return {"kinds": list(self.kinds)}

    @classmethod
    def from_dict(cls, doc: schema.FitCommunication) -> CommTerm:
        return cls(tuple(doc["kinds"]))


def _fit_kind(op: str, rows: list[tuple[int, int, float, int]]) -> schema.CommunicationKind:
    """rows: (tokens n, bytes, seconds, count). Latency and seconds per byte, both >= 0."""
    sizes = sorted({(b, s) for _, b, s, _ in rows})
    nbytes = np.array([b for b, _ in sizes], dtype=float)
    secs = np.array([s for _, s in sizes])
    if len(set(nbytes)) > 1:
        scale = nbytes.max()
        (latency, per_byte), _ = nnls(np.column_stack([np.ones_like(nbytes), nbytes / scale]), secs)
        per_byte /= scale
    else:
        latency, per_byte = float(np.median(secs)), 0.0
    per_token = float(np.mean([b / n for n, b, _, _ in rows]))
    return {"op": op, "count": max(c for *_, c in rows), "bytes_per_token": per_token,
            "latency_s": float(latency), "seconds_per_byte": float(per_byte), "points": len(sizes),
            "bandwidth_bytes_s": 1 / float(per_byte) if per_byte > 0 else None}


def comm_term(data: dict, model: str | None = None) -> CommTerm | None:
    """The communication term of ``model``'s sharded sweep in a results file; None for one machine."""
    entries = [e for e in data.get("communication", {}).values()
               if e.get("points") and (model is None or e["model"] == model)]
    if not entries:
        return None
    rows: dict[str, list] = {}
    for key, point in entries[0]["points"].items():
        batch, tokens = parse_point_key(key)
        for o in point["ops"]:
            rows.setdefault(o["op"], []).append((batch * tokens, o["bytes"], o["median_s"], o["count"]))
    return CommTerm(tuple(_fit_kind(op, r) for op, r in sorted(rows.items())))


def cluster_rows(target, comm: CommTerm, speedup, window=lambda gamma: gamma + 1, batches=(1, 4, 16),
                 gammas=(2, 4, 8), alpha: float = theory.DEFAULT_ALPHA) -> list[dict]:
    """Per (batch, gamma): predicted SD speedup with the measured communication and with a free
    link, and the communication share of a plain step and of a verify forward of ``window(gamma)``
    tokens (gamma+1 as the loops run it).
    ``target(batch, tokens)`` and ``target(batch, tokens, comm=False)`` are T_T with and without
    C(n); ``speedup(batch, gamma, alpha, with_comm)`` is S, or None when no drafter was measured."""
    out = []
    for b in batches:
        plain = float(target(b, 1))
        for g in gammas:
            n = b * window(g)
            verify = float(target(b, window(g)))
            out.append({
                "batch": b, "gamma": g, "alpha": alpha,
                "speedup": speedup(b, g, alpha, True),
                "speedup_free_link": speedup(b, g, alpha, False),
                "comm_share_plain": float(comm.time(b)) / plain,
                "verify_tokens": window(g),
                "comm_share_verify": float(comm.time(n)) / verify,
                "comm_per_token_verify_s": float(comm.time(n)) / n,
                "comm_per_token_plain_s": float(comm.time(b)) / b,
            })
    return out
