"""The serving measurement as people read it: the terminal table of `mac-moesd serving`, and the
report's "Serving N agents" section with its plot of aggregate tok/s against concurrency."""

from __future__ import annotations

from pathlib import Path

from mac_moesd.reporting.formatting import Block
from mac_moesd.reporting.numbers import ms, num

__all__ = ["draw", "render_serving", "serving_blocks", "table_rows"]


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
            value = num(leg["aggregate_tok_s"], ".0f")
            if leg["status"] != "ok":
                value += " (failed)"
            plain = legs.get(("plain", c))
            if name != "plain" and plain and plain["aggregate_tok_s"]:
                value += f" ({leg['aggregate_tok_s'] / plain['aggregate_tok_s']:.2f}x)"
            flight = leg["in_flight"]
            row += [value, f"{num(flight['mean'], '.1f')} / {num(flight['max'], '.0f')}"]
        p = predicted.get(c, {})
        row += [num(p.get(k), ".0f") for k in ("plain_tok_s", "sd_batched_tok_s", "sd_all_or_nothing_tok_s")]
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
             ms(leg["ttft_s"]["p50"]), ms(leg["ttft_s"]["p95"]), ms(leg["itl_s"]["p50"]),
             ms(leg["itl_s"]["p95"]), num(leg["per_request_tok_s"]["p50"], ".1f"),
             num(leg["client_cpu"].get("share_of_one_core"), ".0%")]
            for leg in doc["legs"]]


LATENCY_HEADERS = ["server", "prompts", "concurrency", "requests", "failed", "TTFT p50 ms", "TTFT p95 ms",
                   "inter-token p50 ms", "inter-token p95 ms", "per-request tok/s p50", "client CPU"]


COUNTER_HEADERS = ["leg", "source", "rounds", "drafted", "accepted", "rate", "by position", "drafter reported"]


def drafter_reported(leg: dict) -> str:
    """The drafter kind and draft length the server reported on a leg, or that it reported none."""
    said = leg.get("drafter_reported") or {}
    parts = [p for p in (said.get("kind"), f"{said['num_draft']} a round" if said.get("num_draft") else None) if p]
    return ", ".join(parts) if parts else "reported by the server: none"


def counter_rows(doc: dict) -> list[list[str]]:
    """One row per leg whose server reported draft counters (``measure.server.sd_counters``)."""
    rows = []
    for leg in doc["legs"]:
        c = leg.get("sd_counters") or {}
        if not c.get("reported", "source" in c):
            continue
        rate = c.get("acceptance_rate")
        rows.append([f"{leg['server']} x{leg['concurrency']} {leg['prompts']}", c.get("source", "-"),
                     num(c.get("drafts"), ".0f"), num(c.get("drafted"), ".0f"), num(c.get("accepted"), ".0f"),
                     "-" if rate is None else f"{rate:.2f}",
                     " ".join(str(n) for n in c["accepted_by_position"]) if c.get("accepted_by_position") else "-",
                     drafter_reported(leg)])
    return rows


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
    counted = counter_rows(doc)
    if counted:
        out += ["", "SD as the server counted it:"] + _text_table(COUNTER_HEADERS, counted)
    out += ["", crossover_sentence(doc)]
    if doc.get("predicted_reason"):
        out.append(f"Predicted lines: {doc['predicted_reason']}")
    return "\n".join(out)


# ---- the report ----


def _servers_line(doc: dict) -> str:
    parts = []
    for s in doc["server"]:
        if s.get("launched"):
            what = f"{s['kind']} {s.get('version') or ''}, launched with `{' '.join(s['args'])}`"
        else:
            what = f"a running server at {s['url']} serving {', '.join(s.get('models') or [])}"
        parts.append(f"**{s['name']}**: {what}")
    return "; ".join(parts) + "."


def meaning(doc: dict) -> list[str]:
    """Two sentences on what the legs say for this machine."""
    out = []
    for prompts in doc["prompts"][:1]:
        plain = sorted((leg["concurrency"], leg) for leg in doc["legs"]
                       if leg["server"] == "plain" and leg["prompts"] == prompts and leg["status"] == "ok")
        sd = [leg for leg in doc["legs"] if leg["server"] == "sd" and leg["prompts"] == prompts and leg["status"] == "ok"]
        if len(plain) >= 2:
            (c0, a), (c1, b) = plain[0], plain[-1]
            sentence = (f"Plain, the server's aggregate went from {a['aggregate_tok_s']:.0f} tok/s at {c0} "
                        f"request(s) to {b['aggregate_tok_s']:.0f} at {c1} ({b['in_flight']['mean'] or 0:.1f} "
                        f"generating at once on average)")
            if sd:
                most = max(leg["in_flight"]["max"] or 0 for leg in sd)
                top = max(sd, key=lambda leg: leg["concurrency"])
                how = ("one request at a time" if most <= 1 else f"at most {most} requests at once")
                sentence += (f"; with the drafter it generated {how}, {top['aggregate_tok_s']:.0f} tok/s at "
                             f"{top['concurrency']}")
            out.append(sentence + ".")
    c = doc.get("crossover_concurrency")
    predicted = [p for p in doc.get("predicted", []) if p.get("sd_batched_tok_s") is not None]
    wins = [p["concurrency"] for p in predicted if p["sd_batched_tok_s"] > p["plain_tok_s"]]
    served = (f"SD as served pays up to {c} concurrent requests" if c is not None
              else "SD as served never paid here")
    if predicted:
        batched = (f"up to {max(wins)}" if wins else "at none of the concurrencies measured")
        out.append(f"{served}; a server that verified every request's drafts in one batch would pay {batched} "
                   f"by the fitted model (acceptance per row).")
    else:
        out.append(f"{served}.")
    return out


def serving_blocks(data: dict, figures: dict) -> list[Block]:
    """The report's serving section, one part per serving measurement in the results."""
    blocks: list[Block] = []
    for key, doc in data.get("serving", {}).items():
        most = max(doc["concurrency"])
        name = doc.get("target_name") or key
        blocks += [("h2", f"Serving {most} agents: {name}"),
                   ("p", f"A closed-loop client kept N streaming requests in flight ({doc['tokens']} tokens each, "
                         f"temperature 0, every prompt unique) for {doc['warmup_s']:g} s of warm-up and a "
                         f"{doc['window_s']:g} s window per leg. " + _servers_line(doc))]
        if not doc.get("complete"):
            blocks.append(("note", "This measurement was interrupted: the legs below are those it finished."))
        for prompts in doc["prompts"]:
            blocks += [("h3", f"Aggregate generated tok/s, {prompts} prompts"),
                       ("table", table_headers(doc), table_rows(doc, prompts))]
        blocks += [("h3", "Latency per leg"), ("table", LATENCY_HEADERS, latency_rows(doc))]
        failed = [leg for leg in doc["legs"] if leg["status"] != "ok"]
        for leg in failed:
            blocks.append(("note", f"Leg {leg['server']} x{leg['concurrency']} on {leg['prompts']}: status failed "
                                   f"({leg['status_reason']}; errors {leg['errors']})."))
        counted = counter_rows(doc)
        if counted:
            blocks += [("h3", "SD as the server counted it"), ("table", COUNTER_HEADERS, counted)]
            notes = sorted({leg["sd_counters"]["note"] for leg in doc["legs"] if leg["sd_counters"].get("note")})
            blocks += [("note", note) for note in notes]
        sd_counts = {leg["sd_counters"].get("why") for leg in doc["legs"] if leg["drafter"] and "why" in leg["sd_counters"]}
        for why in sorted(w for w in sd_counts if w):
            blocks.append(("p", f"Draft counters: {why}."))
        sources = sorted({p["acceptance_source"] for p in doc.get("predicted", []) if p.get("acceptance_source")})
        if sources:
            blocks.append(("p", "Acceptance of the predicted SD lines: " + "; ".join(sources) + "."))
        if doc.get("predicted_reason"):
            blocks.append(("note", f"No predicted lines: {doc['predicted_reason']}."))
        blocks.append(("p", crossover_sentence(doc) + " " + " ".join(meaning(doc))))
        figure = _figure_name(key)
        if figure in figures:
            blocks.append(("figure", figure, f"Aggregate tok/s against concurrent requests: {name}"))
    return blocks


def _figure_name(key: str) -> str:
    import re

    return "serving-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", key).strip("-") or "server")


def draw(data: dict, folder: Path) -> dict[str, Path]:
    """One plot per serving measurement: measured plain and SD as served, with the predicted
    plain, batched-SD and all-or-nothing lines, against concurrency (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, doc in data.get("serving", {}).items():
        fig, ax = plt.subplots(figsize=(7.0, 4.2))
        for i, prompts in enumerate(doc["prompts"]):
            style = "-" if i == 0 else ":"
            for j, server in enumerate(s["name"] for s in doc["server"]):
                points = sorted((leg["concurrency"], leg["aggregate_tok_s"]) for leg in doc["legs"]
                                if leg["server"] == server and leg["prompts"] == prompts and leg["status"] == "ok")
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=f"C{j}", label=f"{server}, measured ({prompts})")
            predicted = [p for p in doc.get("predicted", []) if p.get("prompts") == prompts]
            for field, color, label in (("plain_tok_s", "black", "plain, predicted"),
                                        ("sd_batched_tok_s", "C2", "SD batched, predicted"),
                                        ("sd_all_or_nothing_tok_s", "C3", "SD all-or-nothing, predicted")):
                points = [(p["concurrency"], p[field]) for p in predicted if p.get(field) is not None]
                if points:
                    ax.plot(*zip(*points), style, color=color, alpha=0.6, label=f"{label} ({prompts})")
        if not ax.lines:
            plt.close(fig)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate generated tok/s")
        ax.set_title(f"Serving: {doc.get('target_name') or key}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = folder / f"{_figure_name(key)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out[path.stem] = path
    return out
