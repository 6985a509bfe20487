"""Prompt lookup: its proposals on hand-worked token sequences, its rounds' bookkeeping, its
acceptance summary, its price, and its output at temperature 0 (plain greedy decoding's)."""

import mlx.core as mx
import numpy as np
import pytest

from mac_moesd.analysis import acceptance
from mac_moesd.measure.decoding.prompt_lookup import PromptLookup, lookup_rule, propose
from mac_moesd.measure.sd.round_parts import RoundParts, lookup_prediction


def proposal(tokens, gamma=3, rule=lookup_rule()):
    return propose(np.array(tokens), gamma, rule).tolist()


def test_the_longest_ngram_that_occurred_before_wins():
    # last 3 tokens (7, 8, 9) occurred at 1..3, followed by 4, 5, 6
    assert proposal([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9]) == [4, 5, 6]
    # gamma caps the proposal, and what follows may run up to the context's end
    assert proposal([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], gamma=2) == [4, 5]
    assert proposal([5, 6, 7, 5, 6], gamma=4) == [7, 5, 6]


def test_falls_back_from_a_3gram_to_a_1gram():
    # (3, 4, 2) and (4, 2) never occurred before; 2 did, at index 1, followed by 3, 4, 2
    assert proposal([1, 2, 3, 4, 2]) == [3, 4, 2]
    # min_ngram 2: the 1-gram is not tried, so nothing is proposed
    assert proposal([1, 2, 3, 4, 2], rule=lookup_rule(3, 2)) == []


def test_the_most_recent_occurrence_and_only_one_followed_by_a_token():
    # (5, 6) at 0 (then 9) and at 3 (then 8): the later one
    assert proposal([5, 6, 9, 5, 6, 8, 1, 5, 6], gamma=2) == [8, 1]
    # a 2-gram occurring only at the end itself is not an earlier occurrence
    assert proposal([1, 2, 3], gamma=2) == []
    assert proposal([4], gamma=2) == []


def test_each_sequence_searches_its_own_context_as_it_grows():
    lookup = PromptLookup(np.array([[1, 2, 3, 1], [4, 5, 6, 7]]))
    assert [p.tolist() for p in lookup.propose(2)] == [[2, 3], []]
    lookup.extend(np.array([[2], [4]]))
    assert [p.tolist() for p in lookup.propose(2)] == [[3, 1], [5, 6]]
    lookup.reset()
    assert [p.tolist() for p in lookup.propose(2)] == [[2, 3], []]


def test_bad_ngram_lengths_are_refused():
    with pytest.raises(ValueError, match="--lookup-min-ngram"):
        lookup_rule(2, 3)


def test_acceptance_by_position_counts_only_the_rounds_that_offered_it():
    # Four rounds at gamma 3: offered 3, 1, 0, 2 tokens; accepted 2, 1, 0, 0.
    summary = acceptance.summarise_rounds([2, 1, 0, 0], 3, proposed=[3, 1, 0, 2])
    assert summary["rounds"] == 4 and summary["mean_accepted"] == 0.75
    # position 1 offered in 3 rounds, accepted in 2; position 2 offered in 2, accepted in 1;
    # position 3 offered in 1, accepted in none
    assert summary["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert acceptance.summarise_rounds([0, 0], 2, proposed=[0, 1])["acceptance_by_position"] == [0.0, None]
    with pytest.raises(ValueError, match="accepted counts"):
        acceptance.summarise_rounds([2], 3, proposed=[1])


def test_a_lookup_round_is_priced_at_the_widths_it_verified():
    parts = RoundParts(batch=1, gamma=2, vocab=10, with_reject=False)
    parts.samples = {"target_step": [0.010], "verify_2": [0.012], "verify": [0.015], "rollback": [0.002],
                     "draft": [0.001]}
    # widths 0, 1, 2 -> forwards of 1, 2, 3 tokens: 10, 12, 15 ms, mean 37/3 ms, synchronous
    # (nothing hides a verify built after the host's lookup); half the rounds rolled back: 1 ms;
    # lookup 1 ms; round 1 + 37/3 + 1 = 43/3 ms
    out = lookup_prediction(parts, 0.009, [0, 1, 2], tokens_per_round=1.5, rolled_back_share=0.5)
    assert out["round_s"] == pytest.approx(0.043 / 3) and out["hidden_s"] == 0.0
    assert out["speedup"] == pytest.approx(1.5 * 0.009 / (0.043 / 3))


@pytest.fixture(scope="module")
def target(tiny_pair):
    from mlx_lm import load

    model, _ = load(tiny_pair[0])
    model.set_dtype(mx.float32)  # the CPU backend's gather_mm runs float32 only
    return model


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair):
    from mac_moesd.inputs import prompts

    return prompts.tokenize(prompts.load_prompts("edit"), prompts.load_tokenizer(tiny_pair[0]))


@pytest.mark.parametrize("batch", [1, 4])
def test_prompt_lookup_at_temperature_0_emits_plain_greedy_decoding(target, prompt_ids, batch):
    from mac_moesd.measure.decoding.sd_loop import Decoder, common_prompt

    decoder = Decoder(target, None, common_prompt(prompt_ids[:batch]), lookup=lookup_rule())
    out = decoder.speculative(40, 4, "real")
    # Every row emits the batch's shared prefix and is credited that: 40 tokens or a round more.
    emitted = out.outputs.shape[1]
    # the cache holds the prompt and exactly the emitted tokens, the last of them pending
    assert decoder.target_cache[0].offset == decoder.context + emitted
    decoder.reset()
    plain = decoder.plain(40)
    assert 40 <= emitted <= 40 + 4 and out.tokens == emitted * batch
    assert np.array_equal(out.outputs[:, :40], plain.outputs)
    # every round is counted, with its proposals and verify width
    rounds = len(out.widths)
    assert out.verifies == rounds
    assert len(out.per_round) == len(out.proposed) == rounds * batch
    assert out.tokens == sum(a + 1 for a in out.per_round)
    # the accepted counts are the kept ones, the same for every row of a round
    assert all(len(set(out.per_round[i * batch:(i + 1) * batch])) == 1 for i in range(rounds))
    assert all(a <= p for a, p in zip(out.per_round, out.proposed))
    assert out.widths == [max(out.proposed[i * batch:(i + 1) * batch]) for i in range(rounds)]
    assert any(out.proposed) and out.lookup_s > 0


def test_spec_with_prompt_lookup_records_its_kind_proposals_and_audit(tiny_pair, tmp_path):
    import json

    from click.testing import CliRunner

    from mac_moesd.cli import cli

    result = CliRunner().invoke(cli, ["spec", tiny_pair[0], "--draft", "prompt-lookup", "--batch", "1,2",
                                      "--gamma", "3", "--tokens", "12", "--repeats", "2", "--budget", "0.5",
                                      "--prompts", "edit", "--max-prompts", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "a proposal in" in result.output and "differs from greedy in 0 of" in result.output
    doc = json.loads((tmp_path / "results.json").read_text())["spec"]["target|prompt-lookup|real|edit"]
    assert doc["drafter_kind"] == "prompt-lookup" and doc["lookup"] == {"max_ngram": 3, "min_ngram": 1}
    assert doc["layers"]["draft"] is None and doc["valid"]
    for run in doc["runs"]:
        assert run["drafter_kind"] == "prompt-lookup" and run["mode"] == "real"
        assert 0 < run["lookup"]["proposal_rate"] <= 1 and 1 <= run["lookup"]["mean_proposal"] <= 3
        assert run["engine"].startswith("mac-moesd loop")
        assert run["pooled_tokens_per_round"] is None  # rounds of different widths: each run's own rate
        assert set(run["rollback"]["rounds"]) == {"target"} and run["rollback"]["audit"]["ok"]
        # the timed-parts prediction priced the lookup and each verify width it ran
        assert run["predicted_from"] == "measured" and run["round"]["draft_s"] > 0
        assert set(run["round"]["verify_by_tokens"]) == {"2", "3"}
    assert doc["acceptance"][0]["proposal_rate"] > 0


def _run(batch, gamma, speedup, ci, accepted, temperature=0.0, valid=True, **extra):
    return {"batch": batch, "gamma": gamma, "temperature": temperature, "measured_speedup": speedup,
            "measured_ci": ci, "pairs": 8, "stopped": "precision", "mean_accepted": accepted,
            "valid": valid, **extra}


def test_the_lookup_verdict_takes_the_fastest_valid_run_and_its_break_even():
    from mac_moesd.analysis import verdict

    runs = [_run(1, 2, 1.10, [1.05, 1.15], 0.5, predicted_speedup=1.2, lookup={"proposal_rate": 0.6}),
            _run(1, 4, 1.30, [1.25, 1.35], 0.9, valid=False),  # failed its audit: not a measurement
            _run(1, 4, 0.95, [0.90, 1.02], 0.4, predicted_speedup=1.0, lookup={"proposal_rate": 0.6}),
            _run(2, 2, 0.80, [0.75, 0.85], 0.3, predicted_speedup=0.9, lookup={"proposal_rate": 0.5})]
    rows = verdict.lookup_rows(runs, "edit", (1, 2))
    assert [(r["batch"], r["gamma"], r["answer"]) for r in rows] == [(1, 2, "pays off"), (2, 2, "does not pay off")]
    # (0.5 + 1) / 1.10 plain steps a round, less the token every round gives
    assert rows[0]["break_even_accepted"] == pytest.approx(1.5 / 1.1 - 1)
    assert rows[0]["drafter_kind"] == "prompt-lookup" and rows[0]["proposal_rate"] == 0.6
    assert verdict.measured_answer(runs[2]) == "breaks even"


def test_the_report_ranks_the_drafters_measured_on_the_same_prompts():
    from mac_moesd.analysis.digest import Digest
    from mac_moesd.reporting.pair_sections import drafter_blocks

    pair = {"target": "T", "prompt_sets": ["edit"], "spec_batches": [1, 2], "temperatures": [0.0]}
    data = {"pairs": {"T|D": {**pair, "draft": "D", "drafter_kind": "model"},
                      "T|prompt-lookup": {**pair, "draft": "prompt-lookup", "drafter_kind": "prompt-lookup"}},
            "spec": {"T|D|real|edit": {"runs": [_run(1, 2, 0.9, [0.85, 0.95], 0.4)]},
                     "T|prompt-lookup|real|edit": {"runs": [_run(1, 4, 1.2, [1.1, 1.3], 0.5),
                                                            _run(2, 4, 0.7, [0.6, 0.8], 0.2)]}}}
    blocks = drafter_blocks(Digest(data))
    lead = blocks[1][1][0]
    assert lead.startswith("On edit at temperature 0, batch 1: **prompt lookup is fastest**, 1.20 [1.10-1.30]")
    assert lead.endswith("(pays off); then drafter model 0.90.")
    table = blocks[2][2]
    assert [row[3] for row in table] == ["prompt lookup (prompt-lookup)", "drafter model (D)",
                                         "prompt lookup (prompt-lookup)"]
    assert table[0][-1] == "best" and table[1][-1] == ""
    # one drafter measured: nothing to compare
    assert drafter_blocks(Digest({**data, "pairs": {"T|D": data["pairs"]["T|D"]}})) == []
