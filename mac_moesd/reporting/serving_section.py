"""The serving measurement as people read it: the terminal table of `mac-moesd serving`."""

from __future__ import annotations

__all__ = ["render_serving", "table_rows"]


def _num(x, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def table_rows(doc: dict, prompts: str) -> list[list[str]]:
    """Per concurrency: plain and SD aggregate as served (SD's ratio), how many requests each
    server really generated together, and the predicted lines."""
    legs = {(leg["server"], leg["concurrency"]): leg for leg in doc["legs"] if leg["prompts"] == prompts}
    predicted = {p["concurrency"]: p for p in doc.get("predicted", []) if p.get("prompts") == prompts}
    servers = [s["name"] for s in doc["server"]]
    rows = []
    for c in doc["concurrency"]:
        row = [str(c)]
        for name in servers:
            leg = legs.get((name, c))
            if leg is None:
                row += ["-", "-"]
                continue
            value = _num(leg["aggregate_tok_s"])
            if leg["status"] != "ok":
                value += " (failed)"
            plain = legs.get(("plain", c))
            if name != "plain" and plain and plain["aggregate_tok_s"]:
                value += f" ({leg['aggregate_tok_s'] / plain['aggregate_tok_s']:.2f}x)"
            flight = leg["in_flight"]
            row += [value, f"{_num(flight['mean'], '{:.1f}')} / {_num(flight['max'])}"]
        p = predicted.get(c, {})
        row += [_num(p.get("plain_tok_s")), _num(p.get("sd_batched_tok_s")), _num(p.get("sd_all_or_nothing_tok_s"))]
        rows.append(row)
    return rows


def table_headers(doc: dict) -> list[str]:
    headers = ["concurrency"]
    for s in doc["server"]:
        headers += [f"{s['name']} tok/s", f"{s['name']} generating (mean / max)"]
    return headers + ["predicted plain", "predicted SD, batched", "predicted SD, all-or-nothing"]


def latency_rows(doc: dict) -> list[list[str]]:
    return [[leg["server"], leg["prompts"], str(leg["concurrency"]), str(leg["requests"]),
             f"{leg['failed']}" + (f" ({leg['status']})" if leg["status"] != "ok" else ""),
             _ms(leg["ttft_s"]["p50"]), _ms(leg["ttft_s"]["p95"]), _ms(leg["itl_s"]["p50"]),
             _ms(leg["itl_s"]["p95"]), _num(leg["per_request_tok_s"]["p50"], "{:.1f}"),
             _num(leg["client_cpu"].get("share_of_one_core"), "{:.0%}")]
            for leg in doc["legs"]]


LATENCY_HEADERS = ["server", "prompts", "concurrency", "requests", "failed", "TTFT p50 ms", "TTFT p95 ms",
                   "inter-token p50 ms", "inter-token p95 ms", "per-request tok/s p50", "client CPU"]


def _text_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [line(headers), *[line(r) for r in rows]]


def crossover_sentence(doc: dict) -> str:
    c = doc.get("crossover_concurrency")
    if c is not None:
        return f"SD as served beats plain up to {c} concurrent requests (the crossover)."
    return f"Crossover: none ({doc.get('crossover_reason') or 'not measured'})."


def render_serving(doc: dict) -> str:
    """The terminal rendering of a serving document."""
    out = []
    for s in doc["server"]:
        what = " ".join(s["args"]) if s.get("args") else ", ".join(s.get("models") or [])
        out.append(f"{s['name']}: {s['kind']} {s.get('version') or ''} at {s['url']} ({what})")
    for prompts in doc["prompts"]:
        out += ["", f"aggregate generated tok/s on {prompts} prompts ({doc['tokens']} tokens a request, "
                    f"{doc['window_s']:g} s window):"]
        out += _text_table(table_headers(doc), table_rows(doc, prompts))
    out += ["", "latency per leg:"] + _text_table(LATENCY_HEADERS, latency_rows(doc))
    out += ["", crossover_sentence(doc)]
    if doc.get("predicted_reason"):
        out.append(f"Predicted lines: {doc['predicted_reason']}")
    return "\n".join(out)
