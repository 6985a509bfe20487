"""Measured speculative decoding on this machine, against plain decode of the same target.

- batch 1, ``real``: mlx-lm's own ``speculative_generate_step`` against ``generate_step``, greedy.
- any batch: our loop (mlx-lm offers none for batch > 1): gamma drafter steps, one verify forward
  of gamma+1 tokens (the pending token and the drafts), rejection sampling, KV rollback.
  Its modes: ``real`` (greedy acceptance of the drafter's tokens), ``self-draft`` (draft = target,
  everything accepted) and ``emulated-acceptance`` (each draft token accepted with probability
  alpha, drawn here, so the system cost of SD at any alpha is measured on random-weight models).
  Sequences of a batch accept different counts; the caches are rolled back to the batch's
  shortest accepted prefix (lengths then differ by at most gamma tokens from the ideal, which
  does not change the cost of a step), while each sequence is credited its own accepted tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mac_moesd.errors import BadInput
from mac_moesd.sampling import rejection_sample

__all__ = ["SpecConfig", "run_spec"]

MODES = ("real", "self-draft", "emulated-acceptance")


@dataclass(frozen=True)
class SpecConfig:
    target: str
    draft: str
    batches: tuple[int, ...] = (1, 2, 4)
    gammas: tuple[int, ...] = (2, 4)
    alphas: tuple[float, ...] = (0.7,)
    mode: str = "emulated-acceptance"
    context: int = 64
    new_tokens: int = 32  # tokens each sequence generates per timed run
    repeats: int = 3
    bits: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise BadInput(f"--mode must be one of {', '.join(MODES)}")
        if any(not 0 < a < 1 for a in self.alphas):
            raise BadInput("--alpha values must be in (0, 1)")
        if min(self.batches) < 1 or min(self.gammas) < 1 or self.new_tokens < 1 or self.repeats < 1:
            raise BadInput("--batch, --gamma, --tokens and --repeats must be >= 1")


class Decoder:
    """A target (and drafter) with caches prefilled to the context, for one batch size."""

    def __init__(self, target, draft, batch: int, context: int, vocab: int, rng: np.random.Generator):
        self.target, self.draft, self.batch, self.vocab, self.rng = target, draft, batch, vocab, rng
        prompt = mx.array(rng.integers(0, vocab, (batch, context)))
        self.target_cache = make_prompt_cache(target)
        mx.eval(target(prompt, cache=self.target_cache))
        self.draft_cache = None
        if draft is not None:
            self.draft_cache = make_prompt_cache(draft)
            mx.eval(draft(prompt, cache=self.draft_cache))
        self.start = [c.offset for c in self.target_cache]
        self.draft_start = [c.offset for c in self.draft_cache] if self.draft_cache else None
        self.pending = mx.array(rng.integers(0, vocab, (batch, 1)))

    def reset(self) -> None:
        """Back to the prefilled context (between timed runs)."""
        trim_prompt_cache(self.target_cache, self.target_cache[0].offset - self.start[0])
        if self.draft_cache:
            trim_prompt_cache(self.draft_cache, self.draft_cache[0].offset - self.draft_start[0])

    def plain(self, steps: int) -> int:
        """Greedy one-token steps; returns tokens produced (all sequences)."""
        y = self.pending
        for _ in range(steps):
            logits = self.target(y, cache=self.target_cache)
            y = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(y)
        return steps * self.batch

    def speculative(self, new_tokens: int, gamma: int, mode: str, alpha: float | None) -> tuple[int, int, int]:
        """Rounds until every sequence has ``new_tokens``; returns (tokens, drafted, accepted)."""
        produced = np.zeros(self.batch, dtype=int)
        drafted = accepted_total = 0
        y = self.pending
        while produced.min() < new_tokens:
            x, drafts, draft_logits = y, [], []
            for _ in range(gamma):
                logits = self.draft(x, cache=self.draft_cache)[:, -1:]
                x = mx.argmax(logits, axis=-1)
                drafts.append(x)
                draft_logits.append(logits)
            drafts_arr = mx.concatenate(drafts, axis=1)
            verify = self.target(mx.concatenate([y, drafts_arr], axis=1), cache=self.target_cache)
            if mode == "emulated-acceptance":
                # Pay for rejection sampling, then accept with the chosen alpha.
                counts, _ = rejection_sample(verify, mx.concatenate(draft_logits, axis=1), drafts_arr)
                mx.eval(counts, verify)
                draws = self.rng.random((self.batch, gamma)) < alpha
                accepted = np.cumprod(draws, axis=1).sum(axis=1)
            else:
                greedy = mx.argmax(verify[:, :gamma], axis=-1)
                mx.eval(greedy, verify)
                matches = np.array(greedy == drafts_arr)
                accepted = np.cumprod(matches, axis=1).sum(axis=1)
            shared = int(accepted.min())
            nxt = mx.argmax(verify[:, shared : shared + 1], axis=-1)
            trim_prompt_cache(self.target_cache, gamma - shared)
            if shared == gamma:  # the drafter never saw its last token: feed it, as mlx-lm does
                mx.eval(self.draft(drafts[-1], cache=self.draft_cache))
            else:
                trim_prompt_cache(self.draft_cache, gamma - 1 - shared)
            produced += accepted + 1
            drafted += gamma * self.batch
            accepted_total += int(accepted.sum())
            y = nxt
            mx.eval(y)
        return int(produced.sum()), drafted, accepted_total


def _timed(fn, repeats: int, reset) -> tuple[list[float], object]:
    fn()  # warm-up: compile every shape once
    reset()
    times, last = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
        reset()
    return times, last


def _rate(tokens: int, times: list[float]) -> tuple[float, float]:
    rates = [tokens / t for t in times]
    spread = statistics.stdev(rates) / statistics.mean(rates) if len(rates) > 1 else 0.0
    return statistics.median(rates), spread


def mlx_lm_batch1(target, draft, context, new_tokens, gamma, repeats, vocab, rng) -> dict:
    """Batch 1 with mlx-lm's own speculative decoding against its own plain decode (greedy)."""
    prompt = mx.array(rng.integers(0, vocab, (context,)))

    def plain():
        return sum(1 for _ in generate_step(prompt, target, max_tokens=new_tokens))

    def spec():
        drafted = sum(int(d) for _, _, d in speculative_generate_step(
            prompt, target, draft, num_draft_tokens=gamma, max_tokens=new_tokens))
        return drafted

    plain_times, _ = _timed(plain, repeats, lambda: None)
    spec_times, from_draft = _timed(spec, repeats, lambda: None)
    tps_plain, cv_plain = _rate(new_tokens, plain_times)
    tps_sd, cv_sd = _rate(new_tokens, spec_times)
    return {"tokens_per_s_plain": tps_plain, "tokens_per_s_sd": tps_sd, "cv_plain": cv_plain,
            "cv_sd": cv_sd, "acceptance": from_draft / new_tokens, "engine": "mlx-lm"}


def run_spec(cfg: SpecConfig, predictor=None) -> dict:
    """Measure every (batch, gamma, alpha); ``predictor(batch, gamma, alpha, self_draft)`` gives
    the fitted model's speedup for the same configuration, or None."""
    from mac_moesd import models

    rng = np.random.default_rng(cfg.seed)
    target_src = models.resolve(cfg.target)
    target = models.build(target_src, bits=cfg.bits, seed=cfg.seed)
    target.materialise()
    if cfg.mode == "self-draft":
        draft = target
    else:
        draft = models.build(models.resolve(cfg.draft), bits=cfg.bits, seed=cfg.seed + 1)
        draft.materialise()
        if draft.config["vocab_size"] != target.config["vocab_size"]:
            raise BadInput("target and drafter must share a vocabulary size")
    vocab = target.config["vocab_size"]
    alphas = cfg.alphas if cfg.mode == "emulated-acceptance" else (None,)
    runs = []
    for batch in cfg.batches:
        decoder = Decoder(target.model, draft.model, batch, cfg.context, vocab, rng)
        steps = cfg.new_tokens
        plain_times, _ = _timed(lambda: decoder.plain(steps), cfg.repeats, decoder.reset)
        tps_plain, cv_plain = _rate(steps * batch, plain_times)
        for gamma in cfg.gammas:
            for alpha in alphas:
                if batch == 1 and cfg.mode == "real":
                    row = mlx_lm_batch1(target.model, draft.model, cfg.context, cfg.new_tokens, gamma,
                                        cfg.repeats, vocab, rng)
                    measured_alpha = row.pop("acceptance")
                else:
                    times, (tokens, drafted, accepted) = _timed(
                        lambda: decoder.speculative(cfg.new_tokens, gamma, cfg.mode, alpha),
                        cfg.repeats, decoder.reset)
                    tps_sd, cv_sd = _rate(tokens, times)
                    row = {"tokens_per_s_plain": tps_plain, "tokens_per_s_sd": tps_sd,
                           "cv_plain": cv_plain, "cv_sd": cv_sd, "engine": "mac-moesd loop"}
                    measured_alpha = accepted / drafted
                effective = alpha if alpha is not None else min(max(measured_alpha, 1e-6), 1.0)
                predicted = predictor(batch, gamma, effective, cfg.mode == "self-draft") if predictor else None
                runs.append({
                    "batch": batch, "gamma": gamma, "alpha": effective, "mode": cfg.mode,
                    "measured_acceptance": measured_alpha,
                    "measured_speedup": row["tokens_per_s_sd"] / row["tokens_per_s_plain"],
                    "predicted_speedup": predicted, "repeats": cfg.repeats, **row,
                })
        del decoder
    return {"target": target_src.name, "draft": target_src.name if cfg.mode == "self-draft" else cfg.draft,
            "context": cfg.context, "new_tokens": cfg.new_tokens, "verify_tokens": "gamma+1",
            "runs": runs}
