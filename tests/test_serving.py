"""The serving stage's client, statistics, launcher and error paths, against a small fake server
(tests/fake_openai_server.py). No test here asserts on speed."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mac_moesd.errors import MacMoesdError
from mac_moesd.measure.server import server_process, serving
from mac_moesd.pipeline import serving_stage
from mac_moesd.measure.server.serving import LegConfig, RequestRecord
from mac_moesd.results import ResultsStore

from fake_openai_server import ACCEPTED, DRAFTED, TOKENS, FakeServer

FAKE = str(Path(__file__).parent / "fake_openai_server.py")
META = {"chip_slug": "test", "backend": "cpu", "versions": {"mlx": "x"}, "blas": {"name": "openblas"}}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
        return True  # exited, not yet reaped by its parent
    # A zombie child of this process still answers kill(0): it has exited if waitpid reaps it.
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


def leg_cfg(url, concurrency=2, window=0.4, warmup=0.1, **kw):
    return LegConfig(url=url, model="m", concurrency=concurrency, prompts=("a", "b"), max_tokens=TOKENS,
                     warmup_s=warmup, window_s=window, **kw)


def fake_model(tmp_path: Path) -> Path:
    """A model folder mlx_lm.server would take (config, tokenizer, float32 weights), for the fake."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8,
                                                    "num_hidden_layers": 1, "vocab_size": 16}))
    (folder / "tokenizer.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    return folder


def store(tmp_path: Path) -> ResultsStore:
    return ResultsStore(tmp_path / "out" / "results.json", META)


# ---- statistics, from hand-made records ----


def test_overlap_mean_and_max_by_hand():
    # Window [0, 10]: A generates 0-10, B 2-6, C 5-12 (clipped to 5-10) -> 10 + 4 + 5 = 19 request-seconds
    # over 10 s = 1.9 on average; at t in [5, 6] all three run at once.
    stats = serving.overlap([(0, 10), (2, 6), (5, 12)], 0, 10)
    assert stats["mean"] == pytest.approx(1.9)
    assert stats["max"] == 3
    # A server that queues: back-to-back intervals never overlap (touching ends do not count twice).
    assert serving.overlap([(0, 5), (5, 10)], 0, 10) == {"mean": 1.0, "max": 1}


def test_tokens_count_by_arrival_inside_the_window():
    cfg = LegConfig(url="u", model="m", concurrency=2, prompts=("p",), max_tokens=4, warmup_s=1.0, window_s=2.0)
    # Window [1, 3]. Request 1 straddles the start: chunks at 0.5 and 1.5 with usage 4 tokens -> 2 tokens a
    # chunk, one chunk inside: 2 tokens. Request 2 inside: 4 chunks, no usage: 4 tokens. Request 3 cut at the
    # end: chunks at 2.5 and 3.5, one inside: 1 token. Total 7 tokens / 2 s = 3.5 tok/s.
    r1 = RequestRecord(start=0.2, chunks=[0.5, 1.5], end=1.6, usage_tokens=4, finish_reason="length")
    r2 = RequestRecord(start=1.6, chunks=[1.8, 2.0, 2.2, 2.4], end=2.5, finish_reason="length")
    r3 = RequestRecord(start=2.4, chunks=[2.5, 3.5], end=3.6, cut=True)
    bad = RequestRecord(start=2.0, end=2.1, error="HTTP 500")
    leg = serving.leg_document(cfg, [r1, r2, r3, bad], {"cpu_s": 0.1, "wall_s": 2.0}, "plain", None, None, "p",
                               {"reported": False, "why": "no drafter"})
    assert leg["tokens"] == pytest.approx(7.0)
    assert leg["aggregate_tok_s"] == pytest.approx(3.5)
    # Finished inside: r1 (ends 1.6) and r2; failed inside: 1 of 3 attempts -> 33% > 5%: failed.
    assert (leg["requests"], leg["failed"], leg["cut"]) == (2, 1, 1)
    assert leg["errors"] == {"HTTP 500": 1}
    assert leg["status"] == "failed"
    # TTFT: r1 0.3, r2 0.2 -> p50 0.25. Inter-token: r1 one gap of 1.0 s over 2 tokens a chunk = 0.5,
    # r2 three gaps of 0.2 -> p50 0.2.
    assert leg["ttft_s"]["p50"] == pytest.approx(0.25)
    assert leg["itl_s"]["p50"] == pytest.approx(0.2)
    # Per request, tokens after the first over first-token-to-end: r1 3/1.1, r2 3/0.7; p50 their mean.
    assert leg["per_request_tok_s"]["p50"] == pytest.approx((3 / 1.1 + 3 / 0.7) / 2)
    assert json.dumps(leg, allow_nan=False)  # never NaN


def test_a_request_whose_usage_came_without_content_is_left_out_of_the_rates():
    # A server may answer with the usage chunk only (no content chunk streamed): it finished, but it
    # has no first token to time a rate from.
    cfg = LegConfig(url="u", model="m", concurrency=1, prompts=("p",), max_tokens=4, warmup_s=0.0, window_s=2.0)
    ok = RequestRecord(start=0.1, chunks=[0.2, 0.4, 0.6, 0.8], end=0.9, finish_reason="length")
    silent = RequestRecord(start=1.0, chunks=[], end=1.5, usage_tokens=4, finish_reason="length")
    leg = serving.leg_document(cfg, [ok, silent], {"cpu_s": 0.1, "wall_s": 2.0}, "plain", None, None, "p", {})
    assert leg["per_request_tok_s"]["p50"] == pytest.approx(3 / 0.7)  # ok alone: 3 tokens after its first, 0.7 s
    json.dumps(leg, allow_nan=False)


def test_empty_leg_is_failed_with_nulls_not_nan():
    cfg = LegConfig(url="u", model="m", concurrency=1, prompts=("p",), max_tokens=4, warmup_s=0.0, window_s=1.0)
    leg = serving.leg_document(cfg, [], {"cpu_s": 0.0, "wall_s": 1.0}, "plain", None, None, "p", {})
    assert leg["status"] == "failed"
    assert leg["ttft_s"]["p50"] is None and leg["ttft_s"]["why"]
    json.dumps(leg, allow_nan=False)


def test_every_prompt_has_its_own_first_line():
    prompts = [serving.unique_prompt(("x", "y"), i) for i in range(6)]
    assert len({p.splitlines()[0] for p in prompts}) == 6
    shared = serving.unique_prompt(("x",), 3, "PREFIX")
    assert shared.startswith("PREFIX\n\nRequest 3.")


# ---- legs against the fake ----


def test_leg_against_a_working_server():
    with FakeServer("ok") as url:
        records, cpu = serving.run_leg(leg_cfg(url))
    leg = serving.leg_document(leg_cfg(url), records, cpu, "plain", None, None, "p", {})
    assert leg["status"] == "ok" and leg["failed"] == 0 and leg["requests"] > 0
    done = [r for r in records if r.end is not None and not r.cut]
    assert done and all(r.tokens == TOKENS and r.prompt_tokens == 5 for r in done)  # the fake's exact counts
    assert all(len(r.chunks) == TOKENS for r in done) and leg["early_stops"] == 0
    assert 0 < leg["tokens"] <= TOKENS * len(records)
    assert leg["in_flight"]["max"] <= 2
    assert leg["client_cpu"]["share_of_one_core"] is not None


def test_http_500s_are_counted_and_fail_the_leg():
    with FakeServer("500") as url:
        records, cpu = serving.run_leg(leg_cfg(url))
    leg = serving.leg_document(leg_cfg(url), records, cpu, "plain", None, None, "p", {})
    assert leg["failed"] > 0 and leg["requests"] == 0
    assert leg["errors"] == {"HTTP 500": leg["failed"]}
    assert leg["status"] == "failed"


def test_a_server_that_never_answers_times_out_per_request():
    with FakeServer("hang") as url:
        records, cpu = serving.run_leg(leg_cfg(url, concurrency=1, window=0.6, warmup=0.0, request_timeout_s=0.2))
    leg = serving.leg_document(leg_cfg(url, concurrency=1, window=0.6, warmup=0.0), records, cpu, "x", None,
                               None, "p", {})
    assert leg["errors"].get("timeout", 0) >= 1
    assert leg["status"] == "failed"


def test_draft_counters_in_responses_are_summed():
    with FakeServer("ok-drafts") as url:
        records, cpu = serving.run_leg(leg_cfg(url))
    leg = serving.leg_document(leg_cfg(url), records, cpu, "sd", None, 3, "p", {"reported": False})
    n = leg["requests"]
    assert leg["sd_counters"]["drafted"] == DRAFTED * n and leg["sd_counters"]["accepted"] == ACCEPTED * n


# ---- --url ----


def test_url_that_never_answers_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(serving_stage, "PROBE_TIMEOUT_S", 0.3)
    with FakeServer("hang") as url:
        cfg = serving_stage.ServingConfig(urls=(("x", url),), prompts=("code",))
        with pytest.raises(MacMoesdError, match="did not answer within"):
            serving_stage.run_serving(cfg, store(tmp_path), "cpu")


def test_url_that_does_not_speak_openai_is_a_clear_error(tmp_path):
    with FakeServer("not-openai") as url:
        cfg = serving_stage.ServingConfig(urls=(("x", url),), prompts=("code",))
        with pytest.raises(MacMoesdError, match="does not speak the OpenAI API"):
            serving_stage.run_serving(cfg, store(tmp_path), "cpu")


def test_url_needs_only_the_completions_route(tmp_path):
    # A stock mlx_lm.server without a Hugging Face cache answers /v1/models with an empty 200:
    # the model's name comes from a one-token completion instead, or from --served-model.
    with FakeServer("models-empty") as url:
        cfg = serving_stage.ServingConfig(urls=(("local", url),), concurrency=(1,), tokens=8, prompts=("code",),
                                          window_s=0.2, warmup_s=0.0)
        steps: list[str] = []
        doc = serving_stage.run_serving(cfg, store(tmp_path / "a"), "cpu", steps.append)
        assert doc["server"][0]["models"] == ["fake-model"] and doc["legs"][0]["requests"] > 0
        assert len(steps) == serving_stage.progress_steps(cfg)  # what a progress bar expects
        named = serving_stage.run_serving(replace(cfg, served_model="my-model"), store(tmp_path / "b"), "cpu")
        assert named["server"][0]["models"] == ["my-model"]


def test_an_interrupted_serving_run_resumes_with_only_the_missing_legs(tmp_path, monkeypatch):
    run_leg, calls = serving.run_leg, []

    def counted(leg):
        calls.append(leg.concurrency)
        if len(calls) == 2 and interrupt:
            raise KeyboardInterrupt  # killed during its second leg
        return run_leg(leg)

    monkeypatch.setattr(serving, "run_leg", counted)
    s = store(tmp_path)
    with FakeServer("ok") as url:
        cfg = serving_stage.ServingConfig(urls=(("x", url),), concurrency=(1, 2, 4), tokens=8, prompts=("code",),
                                          window_s=0.2, warmup_s=0.0)
        interrupt = True
        with pytest.raises(KeyboardInterrupt):
            serving_stage.run_serving(cfg, s, "cpu")
        first = json.loads(s.path.read_text())["serving"]["url:x"]["legs"]
        assert [leg["concurrency"] for leg in first] == [1]
        interrupt, calls[:] = False, []
        doc = serving_stage.run_serving(cfg, s, "cpu")
    assert calls == [2, 4]  # only the missing legs
    assert [leg["concurrency"] for leg in doc["legs"]] == [1, 2, 4] and doc["legs"][0] == first[0]
    assert doc["complete"] and "resumed: 1 legs kept" in doc["notes"][-1]
    # Measured otherwise (another token count), nothing is kept.
    with FakeServer("ok") as url:
        again = serving_stage.run_serving(replace(cfg, urls=(("x", url),), concurrency=(1,), tokens=4), s, "cpu")
    assert calls == [2, 4, 1] and len(again["legs"]) == 1


def test_url_with_nothing_listening_is_a_clear_error(tmp_path):
    port = server_process.free_port()
    cfg = serving_stage.ServingConfig(urls=(("x", f"http://127.0.0.1:{port}"),), prompts=("code",))
    with pytest.raises(MacMoesdError, match="does not answer"):
        serving_stage.run_serving(cfg, store(tmp_path), "cpu")


def test_url_legs_through_the_cli(tmp_path):
    from click.testing import CliRunner

    from mac_moesd.cli import cli

    with FakeServer("ok") as plain, FakeServer("ok-drafts") as sd:
        result = CliRunner().invoke(cli, ["serving", "--url", f"plain={plain}", "--url", f"sd={sd}",
                                          "--concurrency", "1,2", "--window", "0.3", "--warmup", "0.1",
                                          "--tokens", "8", "--prompts", "code", "--out", str(tmp_path), "--json"],
                                    standalone_mode=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [s["name"] for s in doc["server"]] == ["plain", "sd"]
    assert all(s["launched"] is False and s["models"] == ["fake-model"] for s in doc["server"])
    assert [(leg["server"], leg["concurrency"]) for leg in doc["legs"]] == [("plain", 1), ("plain", 2),
                                                                           ("sd", 1), ("sd", 2)]
    for key in ("server", "drafter", "gamma", "concurrency", "prompts", "window_s", "requests", "failed",
                "status", "tokens", "early_stops", "aggregate_tok_s", "per_request_tok_s", "ttft_s", "itl_s",
                "in_flight", "sd_counters", "client_cpu"):
        assert key in doc["legs"][0]
    assert doc["legs"][0]["sd_counters"]["reported"] is False
    assert doc["legs"][2]["sd_counters"]["drafted"] > 0
    assert "crossover_concurrency" in doc and "predicted" in doc
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["serving"]["url:plain,sd"]["complete"] is True


def test_a_url_leg_reads_vllm_metrics_over_the_leg(tmp_path):
    # Every completion adds 2 rounds, 6 draft tokens, 3 accepted (2, 1, 0 by position) to the
    # fake's vLLM counters, so whatever the leg ran: an acceptance rate of 3/6, and by position
    # a third, a sixth and none of the draft tokens.
    with FakeServer("vllm-metrics") as url:
        cfg = serving_stage.ServingConfig(urls=(("vllm", url),), concurrency=(2,), tokens=8, prompts=("code",),
                                          window_s=0.3, warmup_s=0.1)
        doc = serving_stage.run_serving(cfg, store(tmp_path), "cpu")
    (leg,) = doc["legs"]
    counters = leg["sd_counters"]
    assert counters["source"] == "/metrics (vllm:spec_decode_num_*_total)"
    completions = counters["drafts"] // 2
    assert completions >= leg["requests"] > 0
    assert counters["drafted"] == 6 * completions and counters["accepted"] == 3 * completions
    assert counters["acceptance_rate"] == 0.5
    assert counters["accepted_by_position"] == [2 * completions, completions, 0]
    assert leg["drafter_reported"] == {"kind": None, "num_draft": 3}


# ---- launching a server (the fake stands in for mlx_lm.server) ----


def launch_cfg(tmp_path, mode="ok", **kw) -> server_process.ServerConfig:
    return server_process.ServerConfig(name="plain", model=fake_model(tmp_path),
                                       command=(sys.executable, FAKE, "--mode", mode), **{"ready_timeout_s": 20, **kw})


def test_launched_server_is_stopped_on_normal_exit_and_on_error(tmp_path):
    cfg = launch_cfg(tmp_path)
    with server_process.LaunchedServer(cfg, tmp_path) as server:
        pid = server.proc.pid
        assert json.loads((tmp_path / server_process.PID_FILE).read_text())["pid"] == pid
    assert gone(pid) and not (tmp_path / server_process.PID_FILE).exists()
    with pytest.raises(RuntimeError):
        with server_process.LaunchedServer(cfg, tmp_path) as server:
            pid = server.proc.pid
            raise RuntimeError("boom")
    assert gone(pid)
    with pytest.raises(KeyboardInterrupt):
        with server_process.LaunchedServer(cfg, tmp_path) as server:
            pid = server.proc.pid
            raise KeyboardInterrupt
    assert gone(pid)


def test_server_that_dies_mid_leg_is_an_error_naming_its_log_and_keeps_the_legs(tmp_path):
    target = fake_model(tmp_path)
    # Dies at its 40th completion: the probe is the 1st, so some legs run first.
    cfg = serving_stage.ServingConfig(target=str(target), concurrency=(1, 1, 1, 1, 1, 1, 1, 1), tokens=8,
                                      prompts=("code",), window_s=0.3, warmup_s=0.0,
                                      command=(sys.executable, FAKE, "--mode", "die-after:40"), ready_timeout_s=20)
    s = store(tmp_path)
    with pytest.raises(MacMoesdError, match=r"exited .* during a leg; its output is in .*serving-plain.log"):
        serving_stage.run_serving(cfg, s, "cpu")
    doc = json.loads(s.path.read_text())["serving"][f"{target.name}|None"]
    # The legs before the death are kept, clean; the one it died in is not (whether its failed
    # request ended inside the window or just after), so a resume measures it again.
    assert doc["complete"] is False and 0 < len(doc["legs"]) < len(cfg.concurrency)
    assert all(leg["status"] == "ok" and leg["failed"] == 0 for leg in doc["legs"])
    assert gone(doc["server"][0]["pid"])


def test_server_that_cannot_start_names_its_log_and_exits_1(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from mac_moesd.measure.server import server_process
            server_process.default_command = lambda: ["/nonexistent/mlx_lm-server"]
            from mac_moesd.cli import cli
            sys.argv = ["mac-moesd", "serving", {str(fake_model(tmp_path))!r}, "--out", {str(out)!r},
                        "--prompts", "code", "--concurrency", "1"]
            cli()
        """)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: mlx_lm.server (plain) could not be started")
    assert str(out / "serving-plain.log") in last


def test_port_taken_fails_with_the_log(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        cfg = launch_cfg(tmp_path, port=holder.getsockname()[1])
        with pytest.raises(MacMoesdError, match=r"exited with status .* before answering; its output is in"):
            with server_process.LaunchedServer(cfg, tmp_path):
                pass
    assert not (tmp_path / server_process.PID_FILE).exists()


@pytest.mark.parametrize("mode, timeout, said", [
    ("health-503", 20, "could not load its model"),
    ("never-ready", 1, "did not answer within 1 s"),
    ("500", 20, "answered a first request with HTTP 500"),
])
def test_a_server_that_is_never_ready_fails_naming_its_log_and_is_stopped(tmp_path, mode, timeout, said):
    cfg = launch_cfg(tmp_path, mode, ready_timeout_s=timeout)
    server = server_process.LaunchedServer(cfg, tmp_path)
    with pytest.raises(MacMoesdError, match=rf"mlx_lm.server \(plain\) {said}; its output is in .*serving-plain.log"):
        with server:
            pass
    assert server.proc.poll() is not None and not (tmp_path / server_process.PID_FILE).exists()


def test_a_server_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(server_process, "STOP_GRACE_S", 0.5)
    with server_process.LaunchedServer(launch_cfg(tmp_path, "ignore-sigterm"), tmp_path) as server:
        pid = server.proc.pid
    assert server.proc.returncode == -signal.SIGKILL and gone(pid)


@pytest.mark.parametrize("content", ["{half", "[]", json.dumps({"pid": "x", "command": []}), json.dumps({"pid": 1})])
def test_an_unreadable_pid_file_is_removed_and_kills_nothing(tmp_path, content):
    (tmp_path / server_process.PID_FILE).write_text(content)
    assert server_process.reap_stale(tmp_path) == f"removed an unreadable {tmp_path / server_process.PID_FILE}"
    assert not (tmp_path / server_process.PID_FILE).exists()


def test_a_server_left_by_a_killed_run_is_stopped_by_the_next(tmp_path):
    cfg = launch_cfg(tmp_path)
    server = server_process.LaunchedServer(cfg, tmp_path)
    server.start()  # and never stopped: as if this run were killed
    pid = server.proc.pid
    try:
        message = server_process.reap_stale(tmp_path)
        assert message and f"pid {pid}" in message
        server.proc.wait(timeout=10)
        assert gone(pid) and not (tmp_path / server_process.PID_FILE).exists()
    finally:
        server.stop()


def test_a_pid_file_naming_someone_elses_process_kills_nothing(tmp_path):
    (tmp_path / server_process.PID_FILE).write_text(json.dumps({"pid": os.getpid(), "command": ["not", "us"]}))
    assert server_process.reap_stale(tmp_path) is None
    assert not (tmp_path / server_process.PID_FILE).exists()


RUNNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mac_moesd.measure.server import server_process
    cfg = server_process.ServerConfig(name="plain", model=Path(sys.argv[1]),
                                      command=(sys.executable, sys.argv[2], "--mode", "ok"), ready_timeout_s=20)
    with server_process.sigterm_as_interrupt():
        with server_process.LaunchedServer(cfg, Path(sys.argv[3])) as server:
            print(server.proc.pid, flush=True)
            time.sleep(60)
""")


@pytest.mark.timing  # a wall-clock bound on the server's exit (one default-suite run missed 10 s)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_server_goes_when_its_parent_is_terminated_interrupted_or_killed(tmp_path, sig):
    if sig == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("parent-death signalling is Linux's prctl")
    parent = subprocess.Popen([sys.executable, "-c", RUNNER, str(fake_model(tmp_path)), FAKE, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(sig)
        parent.wait(timeout=20)
        deadline = time.monotonic() + 30
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        stat = Path(f"/proc/{pid}/stat")
        assert gone(pid), stat.read_text() if stat.exists() else "no /proc entry"
    finally:
        parent.kill()
        parent.wait()


def test_a_rerun_naming_the_models_otherwise_keeps_the_legs_of_the_same_models():
    # The first run named the folders relatively with a slash, the rerun by absolute paths: the
    # same models (their resolved names, the document's key), so the legs measured are kept.
    legs = [{"server": "plain", "concurrency": 1, "prompts": "code"}]
    common = {"gamma": 4, "tokens": 8, "prompts": ["code"], "window_s": 1.0, "warmup_s": 0.0,
              "shared_prefix": None, "concurrency": [1, 2], "server": [], "target_name": "my-moe",
              "draft_name": "my-draft"}
    earlier = {**common, "target": "models/my-moe/", "draft": "./models/my-draft", "legs": legs}
    rerun = {**common, "target": "/home/me/models/my-moe", "draft": "/home/me/models/my-draft"}
    assert serving_stage._kept(earlier, rerun)[0] == legs
    assert serving_stage._kept(earlier, {**rerun, "target_name": "other-moe"})[0] == []
