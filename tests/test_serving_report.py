"""The report's serving section and plot, from a hand-made serving document."""

import json

from mac_moesd.reporting import report, serving_section


def leg(server, c, tok_s, flight, status="ok", drafter=None):
    stats = {"p50": 0.01, "p95": 0.02, "n": 5}
    return {"server": server, "drafter": drafter, "gamma": 3 if drafter else None, "concurrency": c,
            "prompts": "code", "window_s": 2.0, "warmup_s": 1.0, "requests": 5, "failed": 0 if status == "ok" else 3,
            "errors": {} if status == "ok" else {"HTTP 500": 3}, "status": status,
            "status_reason": None if status == "ok" else "38% of requests failed (over 5%)",
            "tokens": tok_s * 2, "early_stops": 0, "aggregate_tok_s": tok_s, "per_request_tok_s": stats,
            "ttft_s": stats, "itl_s": stats, "in_flight": flight, "prompt_tokens_mean": 20.0,
            "sd_counters": {"reported": False, "why": "mlx_lm.server reports no accepted or drafted counts"
                            if drafter else "no drafter"},
            "client_cpu": {"cpu_s": 0.2, "wall_s": 2.0, "share_of_one_core": 0.1}}


DOC = {
    "target_name": "tiny", "draft_name": "tiny-draft", "gamma": 3, "tokens": 64, "prompts": ["code"],
    "concurrency": [1, 4], "window_s": 2.0, "warmup_s": 1.0, "complete": True,
    "server": [{"name": "plain", "kind": "mlx_lm.server", "version": "0.32.2", "url": "http://127.0.0.1:1",
                "launched": True, "args": ["--model", "m"]},
               {"name": "sd", "kind": "mlx_lm.server", "version": "0.32.2", "url": "http://127.0.0.1:2",
                "launched": True, "args": ["--model", "m", "--draft-model", "d"]}],
    "legs": [leg("plain", 1, 100.0, {"mean": 0.9, "max": 1}), leg("plain", 4, 300.0, {"mean": 3.6, "max": 4}),
             leg("sd", 1, 120.0, {"mean": 0.9, "max": 1}, drafter="tiny-draft"),
             leg("sd", 4, 110.0, {"mean": 1.0, "max": 1}, status="failed", drafter="tiny-draft")],
    "predicted": [{"prompts": "code", "concurrency": 1, "plain_tok_s": 105.0, "sd_batched_tok_s": 130.0,
                   "sd_all_or_nothing_tok_s": 130.0, "acceptance": 0.7, "acceptance_source": "the suite's acceptance pass"},
                  {"prompts": "code", "concurrency": 4, "plain_tok_s": 320.0, "sd_batched_tok_s": 350.0,
                   "sd_all_or_nothing_tok_s": 200.0, "acceptance": 0.7, "acceptance_source": "the suite's acceptance pass"}],
    "predicted_reason": None, "crossover_concurrency": 1, "crossover_reason": None, "notes": [],
}


def test_table_rows_show_measured_ratio_overlap_and_predicted_lines():
    rows = serving_section.table_rows(DOC, "code")
    # SD at 1: 120 / 100 = 1.20x; at 4 the leg failed, and says so.
    assert rows[0] == ["1", "100", "0.9 / 1", "120 (1.20x)", "0.9 / 1", "105", "130", "130"]
    assert rows[1] == ["4", "300", "3.6 / 4", "110 (failed) (0.37x)", "1.0 / 1", "320", "350", "200"]


def test_meaning_says_queuing_and_what_batching_would_give():
    first, second = serving_section.meaning(DOC)
    assert "from 100 tok/s at 1 request(s) to 300 at 4" in first
    assert "one request at a time" in first  # the SD legs never had two generating together
    assert second == ("SD as served pays up to 1 concurrent requests; a server that verified every request's "
                      "drafts in one batch would pay up to 4 by the fitted model (acceptance per row).")


def test_report_has_the_section_and_its_plot(tmp_path):
    data = {"schema": "mac-moesd/1", "meta": {"chip": "test", "backend": "cpu"}, "serving": {"tiny|tiny-draft": DOC}}
    paths = report.write_report(json.loads(json.dumps(data)), tmp_path)
    markdown = paths["markdown"].read_text()
    assert "## Serving 4 agents: tiny" in markdown
    assert "Leg sd x4 on code: status failed (38% of requests failed (over 5%)" in markdown
    assert "Draft counters: mlx_lm.server reports no accepted or drafted counts." in markdown
    assert (tmp_path / "figures" / "serving-tiny-tiny-draft.png").exists()
    assert "figures/serving-tiny-tiny-draft.png" in markdown


def test_the_servers_own_counters_are_shown_per_leg_with_what_it_said_of_its_drafter():
    counted = dict(leg("sd", 1, 120.0, {"mean": 0.9, "max": 1}, drafter="tiny-draft"),
                   sd_counters={"reported": True, "source": "/metrics (vllm:spec_decode_num_*_total)", "drafts": 100,
                                "drafted": 300, "accepted": 180, "accepted_by_position": [80, 60, 40],
                                "acceptance_rate": 0.6},
                   drafter_reported={"kind": None, "num_draft": 3})
    silent = dict(counted, concurrency=4, drafter_reported={"kind": None, "num_draft": None},
                  sd_counters={"reported": True, "source": "/v1/status (...)", "drafts": 50, "drafted": None,
                               "accepted": None, "accepted_by_position": None, "acceptance_rate": 0.75,
                               "note": "counted once per batched MTP step"})
    doc = dict(DOC, legs=[counted, silent])
    assert serving_section.counter_rows(doc) == [
        ["sd x1 code", "/metrics (vllm:spec_decode_num_*_total)", "100", "300", "180", "0.60", "80 60 40", "3 a round"],
        ["sd x4 code", "/v1/status (...)", "50", "-", "-", "0.75", "-", "reported by the server: none"]]
    assert "SD as the server counted it:" in serving_section.render_serving(doc)
    assert serving_section.counter_rows(DOC) == []  # mlx_lm.server counts nothing
