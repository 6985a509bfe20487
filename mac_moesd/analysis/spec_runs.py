"""What a stored SD run says: the acceptance it realised, the context its forwards saw, and a
spec document's measured acceptance pooled per temperature and acceptance rule.

Plain functions of the spec records (docs/design.md §7.10), used by the SD stage that writes them
(to choose and predict the configurations it times) and by the fit, the verdict and the serving
prediction that read them.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["decoding_context", "feeds_last_draft", "measured_acceptance", "run_alpha", "valid_runs"]


def valid_runs(runs: list[dict]) -> list[dict]:
    """The runs a verdict may use: all but those marked invalid (a failed rollback audit or a
    greedy mismatch that is no near-tie, docs/design.md §4.7); runs made before the audit count."""
    return [r for r in runs if r.get("valid", True)]


def feeds_last_draft(run: Mapping[str, Any]) -> bool | None:
    """Whether the run's loop fed the drafter its last draft on its own after a round that
    accepted every draft (the suite's loop), or with the next round's first step (mlx-lm's);
    None for runs recorded without their engine (``FittedModel.catch_up`` then goes by batch)."""
    return run["engine"] != "mlx-lm" if "engine" in run else None


def decoding_context(prompt: float, new_tokens: int) -> float:
    """The context an SD run's forwards see on average: its prompt, plus half the tokens it
    decodes (the cache grows by every one)."""
    return prompt + new_tokens / 2


def run_alpha(run: dict) -> float | None:
    """The acceptance a timed SD run realised (alpha solved from its mean accepted draft tokens per
    round), else its imposed alpha: a prediction set beside a measured speedup must use the
    acceptance that speedup came from (emulated draws scatter around the imposed alpha: 0.59
    realised for 0.70 in a 3-run, 32-token batch-1 check)."""
    realised = run.get("measured_alpha")
    return realised if realised is not None else run.get("alpha")


def _pooled(summaries: list[dict]) -> dict:
    """One alpha from several gammas' summaries: their solved alphas weighted by rounds."""
    rounds = sum(x["rounds"] for x in summaries)
    return {"alpha": sum(x["alpha"] * x["rounds"] for x in summaries) / rounds, "rounds": rounds,
            "gammas": sorted({x["gamma"] for x in summaries})}


def measured_acceptance(spec_doc: dict) -> list[dict]:
    """Per temperature and acceptance rule, the alpha a real-mode SD run measured on its prompt set
    (``{prompts, temperature, rule, alpha, rounds, gammas}``).

    From the untimed pass over the whole set (``acceptance``) where the run made one: at
    temperature 0 the greedy rule as run; above 0 both rules' expected acceptance, mlx-lm's
    (the target's sampled token must equal the draft) and exact rejection sampling. Else from the
    timed runs, as run. Alphas of several gammas are pooled, weighted by their rounds."""
    prompts = (spec_doc.get("prompts") or {}).get("name") or "random token ids"
    groups: dict[tuple[float, str], list[dict]] = {}
    entries = spec_doc.get("acceptance") or []
    for entry in entries:
        if (entry.get("greedy_check") or {}).get("valid") is False:
            continue  # decoded from a wrong context: its acceptance is not the pair's
        rules = entry.get("rules") or {entry["rule_run"]: entry["measured"]}
        for rule, stats in rules.items():
            groups.setdefault((entry["temperature"], rule), []).append({**stats, "gamma": entry["gamma"]})
    if not entries:
        for run in valid_runs(spec_doc["runs"]):
            if run.get("mode") == "real" and run.get("rounds"):
                rule = "greedy" if run.get("temperature", 0) == 0 else "mlx-lm"
                groups.setdefault((run.get("temperature", 0.0), rule), []).append(
                    {"alpha": run["alpha"], "rounds": run["rounds"], "gamma": run["gamma"]})
    return [{"prompts": prompts, "temperature": temperature, "rule": rule, **_pooled(summaries)}
            for (temperature, rule), summaries in sorted(groups.items())]
