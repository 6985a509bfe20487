"""`mac-moesd serving` with a real mlx_lm.server on the committed tiny pair, over loopback (slow:
two servers start and load). Short windows, two concurrencies, few tokens; nothing about speed."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mac_moesd.cli import cli

from test_serving import gone


@pytest.mark.slow
def test_serving_launches_plain_and_sd_servers_and_stops_them(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["serving", target, "--draft", draft, "--concurrency", "1,2",
                                      "--tokens", "8", "--window", "1", "--warmup", "0.5", "--prompts", "code",
                                      "--out", str(out), "--json"], standalone_mode=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    plain, sd = doc["server"]
    assert (plain["name"], sd["name"]) == ("plain", "sd")
    assert plain["kind"] == "mlx_lm.server" and plain["launched"] and plain["version"]
    assert "--draft-model" not in plain["args"]
    assert sd["args"][sd["args"].index("--num-draft-tokens") + 1] == "3"
    assert int(plain["args"][plain["args"].index("--decode-concurrency") + 1]) >= 2
    for leg in doc["legs"]:
        assert leg["status"] == "ok", leg
        assert leg["tokens"] > 0 and leg["requests"] > 0
        assert leg["sd_counters"]["reported"] is False
    assert [leg["drafter"] for leg in doc["legs"]] == [None, None, "draft", "draft"]
    # Both servers are gone, with their pid file; their logs stay in --out.
    assert gone(plain["pid"]) and gone(sd["pid"])
    assert not (out / "serving-server.pid").exists()
    assert (out / "serving-plain.log").exists() and (out / "serving-sd.log").exists()
    # No fit in --out: the predicted lines are absent, with why.
    assert doc["predicted"] == [] and "no fit of target" in doc["predicted_reason"]


@pytest.mark.slow
def test_a_stock_mlx_lm_server_without_a_hugging_face_cache_is_measured_by_url(tiny_pair, tmp_path, monkeypatch):
    """As a user starts it: `python -m mlx_lm server --model FOLDER` where no Hugging Face cache
    folder exists, so its /v1/models cannot list anything; the suite measures it by URL."""
    import httpx

    from mac_moesd.measure.server import server_process

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hugging-face-cache"))
    served, _ = server_process.cpu_servable(Path(tiny_pair[0]), tmp_path / "copies")
    cfg = server_process.ServerConfig(name="stock", model=served)
    with server_process.LaunchedServer(cfg, tmp_path / "server") as server:
        listed = httpx.get(server.url + "/v1/models", timeout=30)
        assert listed.status_code == 200 and not listed.content  # nothing a client can read
        result = CliRunner().invoke(cli, ["serving", "--url", f"local={server.url}", "--concurrency", "1,2",
                                          "--tokens", "8", "--window", "1", "--warmup", "0.5", "--prompts", "code",
                                          "--out", str(tmp_path / "out"), "--json"], standalone_mode=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (local,) = doc["server"]
    assert local["launched"] is False and local["models"] and local["models"][0]
    for leg in doc["legs"]:
        assert leg["status"] == "ok" and leg["requests"] > 0, leg
        assert leg["sd_counters"] == {"reported": False, "why": "the server reported no draft counters (in "
                                      "its responses, a /metrics endpoint or /v1/status)"}
