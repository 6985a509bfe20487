"""Each serving engine's SD counters, parsed from a sample in that engine's own format (written
from its sources, cited per sample) to the record worked out by hand."""

import pytest

from mac_moesd.measure.server import sd_counters
from mac_moesd.measure.server.sd_counters import Counts

# vLLM 0.34.0, vllm/v1/spec_decode/metrics.py (prometheus_client Counters, labels engine and
# model_name, per position 0..k-1), exported with their _created timestamps (single API server).
VLLM = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="Qwen/Qwen3-8B"}} {drafts}
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{{engine="0",model_name="Qwen/Qwen3-8B"}} 1.7965077429375641e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="Qwen/Qwen3-8B"}} {drafted}
vllm:spec_decode_num_draft_tokens_created{{engine="0",model_name="Qwen/Qwen3-8B"}} 1.7965077429375641e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="Qwen/Qwen3-8B"}} {accepted}
vllm:spec_decode_num_accepted_tokens_created{{engine="0",model_name="Qwen/Qwen3-8B"}} 1.7965077429375641e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="Qwen/Qwen3-8B",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="Qwen/Qwen3-8B",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="Qwen/Qwen3-8B",position="2"}} {p2}
vllm:num_requests_running{{engine="0",model_name="Qwen/Qwen3-8B"}} 4.0
"""

# llama.cpp's llama-server (vendored at 0c1e57098 in llama-cpp-python 0.3.36),
# tools/server/server-task.cpp to_metrics: no labels, per position printed after the gauges.
LLAMA = """\
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {drafted}
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {drafts}
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""


def vllm(drafts, drafted, accepted, p0, p1, p2):
    return VLLM.format(drafts=drafts, drafted=drafted, accepted=accepted, p0=p0, p1=p1, p2=p2)


def test_vllm_metrics_diffed_over_a_leg():
    # 120 -> 220 rounds, 360 -> 660 draft tokens, 201 -> 381 accepted (180, a rate of 0.6);
    # per position 98/64/39 -> 178/124/79: 80, 60, 40 (sum 180). The _created timestamps
    # (1.8e9) and the other metrics are not counted.
    before = sd_counters.from_metrics(vllm("120.0", "360.0", "201.0", "98.0", "64.0", "39.0"))
    after = sd_counters.from_metrics(vllm("220.0", "660.0", "381.0", "178.0", "124.0", "79.0"))
    assert before.drafted == 360 and before.accepted == 201 and before.by_position == (98, 64, 39)
    assert sd_counters.leg_record(before, after, "none") == {
        "reported": True, "source": "/metrics (vllm:spec_decode_num_*_total)", "drafts": 100, "drafted": 300,
        "accepted": 180, "accepted_by_position": [80, 60, 40], "acceptance_rate": 0.6}
    assert sd_counters.drafter_reported(after) == {"kind": None, "num_draft": 3}


def test_two_engines_of_one_vllm_server_are_summed():
    text = vllm("1", "3", "2", "1", "1", "0") + vllm("1", "3", "1", "1", "0", "0").replace('engine="0"', 'engine="1"')
    counts = sd_counters.from_metrics(text)
    assert (counts.drafts, counts.drafted, counts.accepted, counts.by_position) == (2, 6, 3, (2, 1, 0))


def test_llama_server_metrics_without_positions_and_with_rounded_counters():
    before = sd_counters.from_metrics(LLAMA.format(drafted=1200, accepted=845, drafts=300))
    after = sd_counters.from_metrics(LLAMA.format(drafted=1500, accepted=1025, drafts=375))
    record = sd_counters.leg_record(before, after, "none")
    assert record == {"reported": True, "source": "/metrics (llamacpp:spec_decode_num_*_total)", "drafts": 75,
                      "drafted": 300, "accepted": 180, "accepted_by_position": None, "acceptance_rate": 0.6}
    # past 1e6, C++'s default precision prints six significant digits: the record says so
    big = sd_counters.from_metrics(LLAMA.format(drafted="1.23457e+06", accepted="845", drafts="300"))
    assert big.drafted == 1234570 and "six significant digits" in big.note


def test_a_server_restarted_during_the_leg_reports_no_counts():
    before = sd_counters.from_metrics(LLAMA.format(drafted=1200, accepted=845, drafts=300))
    after = sd_counters.from_metrics(LLAMA.format(drafted=40, accepted=20, drafts=10))
    record = sd_counters.leg_record(before, after, "none")
    assert record["reported"] is False and "restarted" in record["why"]


def test_no_counters_anywhere_says_why():
    assert sd_counters.from_metrics("# HELP x\nprocess_cpu_seconds_total 12.5\n") is None
    assert sd_counters.leg_record(None, None, "mlx_lm.server reports none") == {
        "reported": False, "why": "mlx_lm.server reports none"}


def test_vllm_mlx_status_counts_batched_steps():
    # vllm-mlx 0.6.0, vllm_mlx/server.py GET /v1/status -> "mtp" (scheduler.py): per batched step.
    def status(attempted, accepted, rejected):
        return {"model": "m", "mtp": {"enabled": True, "requested_draft_tokens": 3, "effective_draft_tokens": 1,
                                      "mode": "always_advance_verified", "attempted": attempted,
                                      "accepted": accepted, "rejected": rejected, "errors": 2,
                                      "acceptance_rate": 0.7457627118644068, "bypass_counts": {"prefill": 4}}}
    before = sd_counters.from_status(status(120, 88, 30))
    after = sd_counters.from_status(status(170, 124, 42))
    # 50 steps; 36 accepted of 36 + 12 judged: 0.75. Not tokens, so no drafted/accepted counts.
    record = sd_counters.leg_record(before, after, "none")
    assert record["drafts"] == 50 and record["drafted"] is None and record["accepted"] is None
    assert record["acceptance_rate"] == pytest.approx(0.75) and "batched MTP step" in record["note"]
    assert sd_counters.drafter_reported(after) == {"kind": "mtp", "num_draft": 3}
    assert sd_counters.from_status({"mtp": {"enabled": False}}) is None


def test_per_response_counters_of_each_engine():
    # llama-server: top-level timings on the usage chunk (server-task.cpp)
    llama = {"choices": [], "usage": {"completion_tokens": 200}, "timings": {
        "predicted_n": 200, "predicted_per_second": 48.8, "draft_n": 347, "draft_n_accepted": 190}}
    # mlx-vlm 0.7.10, mlx_vlm/server/schemas.py GenerationTimings on the usage chunk
    vlm = {"choices": [], "timings": {"predicted_n": 111, "peak_memory": 5.1, "draft_kind": "mtp",
                                      "draft_rounds": 30, "draft_n": 90, "draft_n_accepted": 81}}
    # vllm-mlx 0.6.0, vllm_mlx/api/models.py generation_metadata
    mlx = {"choices": [], "generation_metadata": {"no_final_content_watchdog_enforced": False,
                                                  "mtp_drafts": 57, "mtp_accepted": 41, "specprefill_requested": None}}
    # Rapid-MLX 0.16.10, rapid_mlx/api/models.py SpeculativeDecodingMetrics on the finishing chunk
    rapid = {"choices": [{"delta": {}, "finish_reason": "stop"}], "metrics": {"speculative_decoding": {
        "verify_calls": 40, "correction_tokens": 12, "bonus_tokens": 28, "accepted_by_depth": [36, 31, 28],
        "drafted_by_depth": [40, 40, 40]}}}
    got = {name: sd_counters.from_response(event) for name, event in
           {"llama": llama, "vlm": vlm, "mlx": mlx, "rapid": rapid}.items()}
    assert (got["llama"].drafted, got["llama"].accepted, got["llama"].drafts) == (347, 190, None)
    assert (got["vlm"].drafts, got["vlm"].drafted, got["vlm"].accepted, got["vlm"].kind) == (30, 90, 81, "mtp")
    assert (got["mlx"].drafted, got["mlx"].accepted) == (57, 41)
    assert (got["rapid"].drafts, got["rapid"].drafted, got["rapid"].accepted) == (40, 120, 95)
    assert got["rapid"].by_position == (36, 31, 28) and got["rapid"].num_draft == 3
    # chunks without counters: mlx-vlm's nulls when no drafter ran, an ordinary delta
    assert sd_counters.from_response({"timings": {"draft_kind": None, "draft_n": None}}) is None
    assert sd_counters.from_response({"choices": [{"delta": {"content": "x"}}], "generation_metadata": None}) is None


def test_a_legs_responses_are_summed():
    rapid = [Counts("r", drafts=40, drafted=120, accepted=95, by_position=(36, 31, 28)),
             Counts("r", drafts=10, drafted=20, accepted=5, by_position=(4, 1))]
    assert sd_counters.responses_record(rapid, 2) == {
        "reported": True, "source": "r", "drafts": 50, "drafted": 140, "accepted": 100,
        "accepted_by_position": [40, 32, 28], "acceptance_rate": pytest.approx(100 / 140)}
    assert sd_counters.responses_record([], 1) is None


def test_mlx_vlm_responses_overlap_under_concurrency_so_only_the_rate_is_kept():
    vlm = [Counts("responses (... mlx-vlm)", drafts=30, drafted=90, accepted=81),
           Counts("responses (... mlx-vlm)", drafts=30, drafted=90, accepted=72)]
    alone = sd_counters.responses_record(vlm, 1)
    assert (alone["drafted"], alone["accepted"]) == (180, 153)
    shared = sd_counters.responses_record(vlm, 4)
    assert shared["drafted"] is None and shared["accepted"] is None
    assert shared["acceptance_rate"] == pytest.approx(153 / 180) and "overlap" in shared["note"]


def test_prometheus_text_parses_labels_exponents_and_timestamps():
    text = 'a_total{x="1",y="with \\"quote\\""} 1.5e+03 1700000000000\nb 7\n# comment\nbad line here\n'
    assert sd_counters.parse_prometheus(text) == [("a_total", {"x": "1", "y": 'with \\"quote\\"'}, 1500.0),
                                                  ("b", {}, 7.0)]
