"""A closed-loop client of an OpenAI-compatible server, and one leg's statistics.

A leg keeps ``concurrency`` streaming chat completions in flight (a finished request is replaced
at once) for a warm-up and then a measured window. Tokens count by their arrival time inside the
window, so requests straddling its edges count for their part; requests still running when the
window closes are cut (their connection closed) and count for the tokens they had.

Tokens per chunk: a server streams text, not tokens. A request's ``usage.completion_tokens``
(asked for with ``stream_options.include_usage``), where the server sends it, is spread evenly over
its content chunks; otherwise each chunk counts as one token (mlx-lm sends one chunk per token
whose text is complete).

What the server really did: each request generates from its first token to its end; the leg
records how many requests were generating together (mean and max overlap of those intervals
in the window), so a server that queues requests shows an overlap near 1 whatever the
concurrency asked for.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from mac_moesd.measure.server import sd_counters

__all__ = ["LegConfig", "RequestRecord", "leg_document", "overlap", "run_leg", "unique_prompt"]

FAILED_SHARE = 0.05  # a leg with more failed requests than this is marked failed
ERROR_BACKOFF_S = 0.1  # a worker's pause after a failed request: a failing server is not hammered
MAX_REQUESTS = 20000  # per leg, whatever the window: the loop is bounded in count as in time
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LegConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8080
    model: str  # the "model" field of each request
    concurrency: int
    prompts: tuple[str, ...]
    max_tokens: int
    warmup_s: float
    window_s: float
    request_timeout_s: float = 120.0  # a request with no byte for this long fails as a timeout
    shared_prefix: str = ""


@dataclass
class RequestRecord:
    """One request's times (seconds on the leg's clock) and outcome."""

    start: float
    chunks: list[float] = field(default_factory=list)  # arrival times of content chunks
    end: float | None = None
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    cut: bool = False  # still running when the window closed
    sd: sd_counters.Counts | None = None  # draft counters the response carried

    @property
    def first(self) -> float | None:
        return self.chunks[0] if self.chunks else None

    @property
    def tokens(self) -> float:
        return float(self.usage_tokens) if self.usage_tokens is not None else float(len(self.chunks))

    @property
    def weight(self) -> float:
        """Tokens per content chunk."""
        if self.usage_tokens is None or not self.chunks:
            return 1.0
        return self.usage_tokens / len(self.chunks)


def unique_prompt(prompts: tuple[str, ...], index: int, shared_prefix: str = "") -> str:
    """The ``index``-th request's prompt: a prompt of the set under a first line no other request
    has, so a server's prompt cache cannot skip its prefill (after ``shared_prefix``, if any: the
    agents' case of one long shared context)."""
    body = f"Request {index}.\n{prompts[index % len(prompts)]}"
    return f"{shared_prefix}\n\n{body}" if shared_prefix else body


async def _one_request(client: httpx.AsyncClient, cfg: LegConfig, index: int, clock, record: RequestRecord) -> None:
    body = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "max_tokens": cfg.max_tokens,
            "messages": [{"role": "user", "content": unique_prompt(cfg.prompts, index, cfg.shared_prefix)}]}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}"
                return
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ": keepalive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    record.error = "malformed stream"
                    return
                now = clock()
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                        record.chunks.append(now)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    record.usage_tokens = int(usage["completion_tokens"])
                    record.prompt_tokens = usage.get("prompt_tokens")
                record.sd = sd_counters.from_response(event) or record.sd
            if not done and record.finish_reason is None:
                record.error = "stream ended early"
    except httpx.TimeoutException:
        record.error = "timeout"
    except httpx.TransportError as err:
        record.error = f"connection: {type(err).__name__}"
    finally:
        record.end = clock()


async def _leg(cfg: LegConfig) -> tuple[list[RequestRecord], dict]:
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    window = (cfg.warmup_s, cfg.warmup_s + cfg.window_s)
    records: list[RequestRecord] = []
    counter = iter(range(MAX_REQUESTS))
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)

    async def worker() -> None:
        for index in counter:
            if clock() >= window[1]:
                return
            record = RequestRecord(start=clock())
            records.append(record)
            await _one_request(client, cfg, index, clock, record)
            if record.error:
                await asyncio.sleep(ERROR_BACKOFF_S)

    async with httpx.AsyncClient(base_url=cfg.url, timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
        await asyncio.sleep(max(window[0] - clock(), 0.0))
        cpu0, wall0 = time.process_time(), clock()
        await asyncio.sleep(max(window[1] - clock(), 0.0))
        cpu_s, wall_s = time.process_time() - cpu0, clock() - wall0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for r in records:
        if r.error is None and r.finish_reason is None and (r.end is None or r.end >= window[1]):
            r.cut = True
    cpu = {"cpu_s": cpu_s, "wall_s": wall_s, "share_of_one_core": cpu_s / wall_s if wall_s > 0 else None,
           "request_cap_reached": len(records) >= MAX_REQUESTS}
    return records, cpu


def run_leg(cfg: LegConfig) -> tuple[list[RequestRecord], dict]:
    """Run one leg; returns every request's record (times from the leg's start, the window being
    [warmup_s, warmup_s + window_s]) and the client's own CPU use over the window."""
    return asyncio.run(_leg(cfg))


def overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> dict:
    """Mean and max number of ``intervals`` open at once within [lo, hi]."""
    clipped = [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]
    if hi <= lo:
        return {"mean": None, "max": None}
    mean = sum(b - a for a, b in clipped) / (hi - lo)
    events = sorted([(a, 1) for a, _ in clipped] + [(b, -1) for _, b in clipped], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return {"mean": mean, "max": most}


def _percentiles(values: list[float], why_empty: str) -> dict:
    if not values:
        return {"p50": None, "p95": None, "n": 0, "why": why_empty}
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "n": int(a.size)}


def leg_document(cfg: LegConfig, records: list[RequestRecord], cpu: dict, server: str, drafter: str | None,
                 gamma: int | None, prompts: str, scraped: dict,
                 scraped_counts: sd_counters.Counts | None = None) -> dict:
    """One leg as the serving document holds it (seconds and tokens/s; null where a figure
    cannot be computed, with why); ``scraped``: the server's draft counters over the leg
    (``sd_counters.leg_record``), used where its responses carry none."""
    lo, hi = cfg.warmup_s, cfg.warmup_s + cfg.window_s
    tokens = sum(r.weight * sum(1 for t in r.chunks if lo <= t <= hi) for r in records)
    finished = [r for r in records if r.error is None and not r.cut and r.end is not None and lo <= r.end <= hi]
    failed = [r for r in records if r.error is not None and r.end is not None and lo <= r.end <= hi]
    errors: dict[str, int] = {}
    for r in failed:
        assert r.error is not None  # failed: those with an error
        errors[r.error] = errors.get(r.error, 0) + 1
    itl = [(b - a) / r.weight for r in finished for a, b in zip(r.chunks, r.chunks[1:])]
    rates = [(r.tokens - 1) / (r.end - r.first) for r in finished
             if r.tokens >= 2 and r.end is not None and r.first is not None and r.end > r.first]
    # a request with no end is still generating when the window closes (as ``cut`` counts it)
    generating = [(r.first, hi if r.cut or r.end is None else r.end)
                  for r in records if r.first is not None and r.error is None]
    attempts = len(finished) + len(failed)
    share = len(failed) / attempts if attempts else None
    status, why = "ok", None
    if share is None:
        status, why = "failed", "no request finished inside the window"
    elif share > FAILED_SHARE:
        status, why = "failed", f"{share:.0%} of requests failed (over {FAILED_SHARE:.0%})"
    prompt_tokens = [r.prompt_tokens for r in finished if r.prompt_tokens is not None]
    counters, drafter_said = leg_sd_counters(finished, cfg.concurrency, scraped, scraped_counts)
    none = "no request finished inside the window"
    return {
        "server": server, "drafter": drafter, "gamma": gamma, "concurrency": cfg.concurrency,
        "prompts": prompts, "window_s": cfg.window_s, "warmup_s": cfg.warmup_s, "max_tokens": cfg.max_tokens,
        "requests": len(finished), "failed": len(failed), "errors": errors,
        "cut": sum(1 for r in records if r.cut), "status": status, "status_reason": why,
        "tokens": tokens, "early_stops": sum(1 for r in finished if r.finish_reason == "stop"
                                             and r.tokens < cfg.max_tokens),
        "aggregate_tok_s": tokens / cfg.window_s,
        "per_request_tok_s": _percentiles(rates, none),
        "ttft_s": _percentiles([r.first - r.start for r in finished if r.first is not None], none),
        "itl_s": _percentiles(itl, "no finished request streamed two chunks"),
        "in_flight": overlap(generating, lo, hi),
        "prompt_tokens_mean": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "sd_counters": counters,
        "drafter_reported": drafter_said,
        "client_cpu": cpu,
    }


def leg_sd_counters(finished: list[RequestRecord], concurrency: int, scraped: dict,
                    scraped_counts: sd_counters.Counts | None = None) -> tuple[dict, dict]:
    """The leg's draft counters (``sd_counters.responses_record`` of its finished responses where
    they carry them, else ``scraped``: the server's counters diffed over the leg, or why there
    are none) and the drafter the server reported (``sd_counters.drafter_reported``)."""
    counted = [r.sd for r in finished if r.sd is not None]
    from_responses = sd_counters.responses_record(counted, concurrency)
    if from_responses is not None:
        return from_responses, sd_counters.drafter_reported(counted[0])
    return scraped, sd_counters.drafter_reported(scraped_counts)
