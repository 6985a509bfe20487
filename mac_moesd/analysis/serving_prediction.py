"""What the suite's fitted model predicts for a server answering B concurrent requests.

For each concurrency B, at the context the requests decode over (their mean prompt plus half the
generated tokens, ``spec_runs.decoding_context``):
- plain: B / T_T(B,1), the aggregate of a server that decodes all B requests in one batch;
- SD batched, acceptance per row: S(B, gamma, alpha) times plain, a server that drafts for every
  request and verifies them in one batch, each row keeping its own accepted prefix (as
  llama.cpp's server does);
- SD batched, all or nothing: a batch position counts only when every row accepted it (one
  rejecting row trims the others, as vllm-mlx's MTP batching does), so the per-position
  acceptance is about alpha^B: S(B, gamma, alpha^B) times plain.

The acceptance comes from the server's own draft counters where it reports them, else from the
suite's acceptance pass of the same pair on the same prompt set (``spec_runs.measured_acceptance``).
"""

from __future__ import annotations

from mac_moesd.analysis import acceptance as acceptance_module
from mac_moesd.analysis.fit import FittedModel
from mac_moesd.analysis.spec_runs import decoding_context, measured_acceptance

__all__ = ["acceptance_from_counters", "acceptance_from_spec", "crossover", "predicted_rows"]


def acceptance_from_counters(counters: dict, gamma: int) -> float | None:
    """alpha from a server's accepted and drafted totals: drafted/gamma rounds, so accepted
    draft tokens per round L = accepted*gamma/drafted, solved for alpha (``solve_alpha``)."""
    drafted, accepted = counters.get("drafted"), counters.get("accepted")
    if not drafted or accepted is None or not 0 <= accepted <= drafted:
        return None
    return acceptance_module.solve_alpha(accepted * gamma / drafted, gamma)


def acceptance_from_spec(spec_doc: dict | None) -> float | None:
    """The greedy (temperature 0) alpha of the suite's acceptance pass, as the server runs at
    temperature 0; None without such a pass."""
    if not spec_doc:
        return None
    rows = [a for a in measured_acceptance(spec_doc) if a["temperature"] == 0]
    return rows[0]["alpha"] if rows else None


def predicted_rows(fit_doc: dict, concurrencies: tuple[int, ...], gamma: int, prompt_tokens: float,
                   new_tokens: int, alpha: float | None, source: str | None) -> list[dict]:
    """One row per concurrency: the plain aggregate and the two batched-SD what-ifs in tokens/s
    (the SD ones null, with why, when the fit has no drafter or no acceptance is known)."""
    model = FittedModel.from_document(fit_doc)
    context = decoding_context(prompt_tokens, new_tokens)
    rows = []
    for b in concurrencies:
        plain = b / float(model.target(b, 1, context, pipelined=True))
        row = {"concurrency": b, "context": context, "plain_tok_s": plain, "sd_batched_tok_s": None,
               "sd_all_or_nothing_tok_s": None, "acceptance": alpha, "acceptance_source": source}
        if not model.drafted:
            row["why"] = "the fit has no drafter step: rerun the sweep with --draft"
        elif alpha is None:
            row["why"] = source or "no acceptance measured for this pair and prompt set"
            row["acceptance_source"] = None
        else:
            # A server's rounds as mlx-lm runs them: the last draft fed with the next round's first step.
            row["sd_batched_tok_s"] = plain * float(model.speedup(b, gamma, alpha, context, catch_up=False))
            row["sd_all_or_nothing_tok_s"] = plain * float(model.speedup(b, gamma, alpha ** b, context,
                                                                         catch_up=False))
        rows.append(row)
    return rows


def crossover(plain: dict[int, float], sd: dict[int, float]) -> int | None:
    """The largest concurrency where SD as served gave more tokens/s than plain (both measured);
    None when it never did."""
    wins = [c for c in plain if c in sd and sd[c] > plain[c]]
    return max(wins) if wins else None
