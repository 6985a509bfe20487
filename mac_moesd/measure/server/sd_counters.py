"""What a server says about its speculative decoding, read the way each engine reports it and
normalised to one record per leg.

Per response (the last chunk that carries them; ``from_response``):

- llama.cpp's llama-server: top-level ``timings.draft_n`` / ``draft_n_accepted`` on the final
  chunk (tools/server/server-common.cpp ``server_slot_stats::to_json``, present when a draft ran);
- mlx-vlm's server: top-level ``timings.draft_kind``, ``draft_rounds``, ``draft_n``,
  ``draft_n_accepted`` on the usage chunk (mlx_vlm/server/schemas.py ``GenerationTimings``). Its
  rounds are the batch's: each request's counts are diffs of the drafter's lifetime counters
  around it, so under concurrency they overlap and only their ratio means something;
- vllm-mlx: top-level ``generation_metadata.mtp_drafts`` / ``mtp_accepted`` (vllm_mlx/api/models.py;
  one token drafted a round on the text path, so drafts are draft tokens);
- Rapid-MLX: top-level ``metrics.speculative_decoding`` {``verify_calls``, ``bonus_tokens``,
  ``correction_tokens``, ``accepted_by_depth``, ``drafted_by_depth``} on the finishing chunk
  (rapid_mlx/api/models.py ``SpeculativeDecodingMetrics``; index d-1 counts the calls that drafted,
  or accepted, at least d tokens).

Scraped before and after a leg and diffed (``scrape``, ``leg_record``):

- vLLM and vllm-metal, ``/metrics``: ``vllm:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position="k"}``, summed over their ``engine`` and
  ``model_name`` labels; prometheus_client's ``_created`` series are timestamps and are not read
  (vllm/v1/spec_decode/metrics.py; vllm/benchmarks/serve.py reads them the same way);
- llama-server, ``/metrics`` (with ``--metrics``): the same names under ``llamacpp:``, no labels,
  updated when a request finishes; values past 1e6 print with six significant digits;
- vllm-mlx, ``/v1/status``: ``mtp`` {``attempted``, ``accepted``, ``rejected``,
  ``requested_draft_tokens``}, each counted once per batched step, not per token.

mlx_lm.server (0.32) reports nothing of its drafts. A counter that went down between the two
scrapes (the server restarted) makes the leg's counts unknown, never a negative count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import httpx

__all__ = ["Counts", "drafter_reported", "from_metrics", "from_response", "from_status", "leg_record",
           "parse_prometheus", "responses_record", "scrape"]

SCRAPE_TIMEOUT_S = 10.0
PROMETHEUS_FAMILIES = ("vllm", "llamacpp")
# llama-server writes a counter with C++'s default stream precision: six significant digits.
_ROUNDED = 1e6


@dataclass(frozen=True)
class Counts:
    """What one source says about drafts: cumulative (a scrape) or one response's. ``drafts``:
    verify rounds; ``drafted``: draft tokens; ``accepted``: accepted draft tokens (the bonus token
    not counted); ``judged``: what ``accepted`` is a share of, where that is not ``drafted``
    (vllm-mlx's status counts batched steps); None where the source does not say."""

    source: str
    drafts: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    by_position: tuple[int, ...] | None = None
    judged: int | None = None
    kind: str | None = None  # the drafter's kind, where the server names it
    num_draft: int | None = None  # draft tokens a round, where the server says
    note: str | None = None


def _int(value) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def from_response(event: dict) -> Counts | None:
    """The draft counts one streamed chunk (or whole response) of any engine above carries."""
    timings = event.get("timings")
    if isinstance(timings, dict) and _int(timings.get("draft_n")) is not None:
        if "draft_rounds" in timings or "draft_kind" in timings:  # mlx-vlm
            return Counts("responses (timings.draft_rounds, draft_n, draft_n_accepted: mlx-vlm)",
                          drafts=_int(timings.get("draft_rounds")), drafted=_int(timings["draft_n"]),
                          accepted=_int(timings.get("draft_n_accepted")) or 0, kind=timings.get("draft_kind"))
        return Counts("responses (timings.draft_n, draft_n_accepted: llama-server)",
                      drafted=_int(timings["draft_n"]), accepted=_int(timings.get("draft_n_accepted")) or 0)
    metadata = event.get("generation_metadata")
    if isinstance(metadata, dict) and _int(metadata.get("mtp_drafts")) is not None:
        return Counts("responses (generation_metadata.mtp_drafts, mtp_accepted: vllm-mlx)",
                      drafted=_int(metadata["mtp_drafts"]), accepted=_int(metadata.get("mtp_accepted")) or 0,
                      kind="mtp")
    metrics = event.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if isinstance(spec, dict) and isinstance(spec.get("drafted_by_depth"), list):
        accepted = [int(a) for a in spec.get("accepted_by_depth") or []]
        drafted = [int(d) for d in spec["drafted_by_depth"]]
        return Counts("responses (metrics.speculative_decoding: Rapid-MLX)", drafts=_int(spec.get("verify_calls")),
                      drafted=sum(drafted), accepted=sum(accepted), by_position=tuple(accepted),
                      kind="mtp", num_draft=len(drafted) or None)
    return None


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value), comments skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        samples.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return samples


def from_metrics(text: str) -> Counts | None:
    """vLLM's or llama-server's cumulative draft counters in a /metrics text, or None."""
    samples = parse_prometheus(text)
    for family in PROMETHEUS_FAMILIES:
        prefix = f"{family}:spec_decode_num_"
        totals: dict[str, float] = {}
        positions: dict[int, float] = {}
        for name, labels, value in samples:
            if not (name.startswith(prefix) and name.endswith("_total")):
                continue  # the _created timestamps, and everything else
            what = name[len(prefix):-len("_total")]
            if what == "accepted_tokens_per_pos" and labels.get("position", "").isdigit():
                positions[int(labels["position"])] = positions.get(int(labels["position"]), 0.0) + value
            elif what in ("drafts", "draft_tokens", "accepted_tokens"):
                totals[what] = totals.get(what, 0.0) + value
        if "draft_tokens" not in totals or "accepted_tokens" not in totals:
            continue
        rounded = family == "llamacpp" and any(v >= _ROUNDED for v in totals.values())
        by_position = tuple(round(positions[k]) for k in sorted(positions)) if positions else None
        return Counts(f"/metrics ({prefix}*_total)", drafts=_rounded(totals.get("drafts")),
                      drafted=round(totals["draft_tokens"]), accepted=round(totals["accepted_tokens"]),
                      by_position=by_position, num_draft=len(by_position) if by_position else None,
                      note=("llama-server prints counters past 1e6 to six significant digits: the leg's "
                            "counts are rounded") if rounded else None)
    return None


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


def from_status(doc: dict) -> Counts | None:
    """vllm-mlx's cumulative MTP counters in its /v1/status document, or None."""
    mtp = doc.get("mtp") if isinstance(doc, dict) else None
    if not isinstance(mtp, dict) or not mtp.get("enabled") or _int(mtp.get("attempted")) is None:
        return None
    accepted, rejected = _int(mtp.get("accepted")) or 0, _int(mtp.get("rejected")) or 0
    return Counts("/v1/status (mtp.attempted, accepted, rejected: vllm-mlx)", drafts=_int(mtp["attempted"]),
                  accepted=accepted, judged=accepted + rejected, kind="mtp",
                  num_draft=_int(mtp.get("requested_draft_tokens")),
                  note="counted once per batched MTP step (every row of the batch must match), not per token")


def scrape(url: str) -> Counts | None:
    """A running server's cumulative draft counters: /metrics, else /v1/status; None if neither."""
    base = url.rstrip("/")
    try:
        response = httpx.get(base + "/metrics", timeout=SCRAPE_TIMEOUT_S)
        if response.status_code == 200:
            found = from_metrics(response.text)
            if found is not None:
                return found
        response = httpx.get(base + "/v1/status", timeout=SCRAPE_TIMEOUT_S)
        if response.status_code == 200:
            return from_status(response.json())
    except (httpx.HTTPError, ValueError):
        return None
    return None


def _by_position(a: tuple[int, ...] | None, b: tuple[int, ...] | None, sign: int = 1) -> tuple[int, ...] | None:
    """``a`` plus (or minus) ``b`` position by position, the shorter padded with zeros."""
    if not a and not b:
        return None
    xs, ys = list(a or ()), list(b or ())
    n = max(len(xs), len(ys))
    xs, ys = xs + [0] * (n - len(xs)), ys + [0] * (n - len(ys))
    return tuple(x + sign * y for x, y in zip(xs, ys))


def _record(counts: Counts) -> dict:
    share_of = counts.judged if counts.judged is not None else counts.drafted
    rate = counts.accepted / share_of if share_of and counts.accepted is not None else None
    record = {"reported": True, "source": counts.source, "drafts": counts.drafts,
              "drafted": counts.drafted if counts.judged is None else None,
              "accepted": counts.accepted if counts.judged is None else None,
              "accepted_by_position": list(counts.by_position) if counts.by_position else None,
              "acceptance_rate": rate}
    if counts.note:
        record["note"] = counts.note
    return record


def leg_record(before: Counts | None, after: Counts | None, why_none: str) -> dict:
    """The leg's counts from two scrapes, or why there are none (``why_none`` when the server
    reports nothing, or a restart between the scrapes)."""
    if after is None:
        return {"reported": False, "why": why_none}
    if before is None or before.source != after.source:
        return {"reported": False, "why": f"{after.source} answered after the leg only"}

    def diff(a, b):
        return None if a is None or b is None else b - a

    fields = ("drafts", "drafted", "accepted", "judged")
    delta = {f: diff(getattr(before, f), getattr(after, f)) for f in fields}
    positions = _by_position(after.by_position, before.by_position, -1) if after.by_position else None
    if any(v is not None and v < 0 for v in delta.values()) or (positions and min(positions) < 0):
        return {"reported": False, "why": f"{after.source}: the counters went back during the leg "
                                          "(the server restarted), so its counts are unknown"}
    return _record(replace(after, by_position=positions, **delta))


def responses_record(counts: list[Counts], concurrency: int) -> dict | None:
    """The leg's counts summed over its finished responses, or None when none carried any. Where
    each response counts the whole batch's rounds (mlx-vlm), concurrent responses overlap: only
    the acceptance rate is kept, and the record says why."""
    if not counts:
        return None
    def summed(field: str) -> int | None:
        values = [getattr(c, field) for c in counts]
        return None if any(v is None for v in values) else sum(values)

    positions = None
    for c in counts:
        positions = _by_position(positions, c.by_position)
    total = replace(counts[0], drafts=summed("drafts"), drafted=summed("drafted"), accepted=summed("accepted"),
                    by_position=positions)
    record = _record(total)
    if "mlx-vlm" in total.source and concurrency > 1:
        record.update(drafts=None, drafted=None, accepted=None,
                      note="each response counts the rounds of the whole batch it ran in, so concurrent "
                           "responses overlap: only their ratio is kept")
    return record


def drafter_reported(counts: Counts | None) -> dict:
    """The drafter kind and draft length a server reported, where it did."""
    return {"kind": counts.kind if counts else None, "num_draft": counts.num_draft if counts else None}
