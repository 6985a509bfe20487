"""A small OpenAI-compatible server on 127.0.0.1 for the serving tests' error paths (stdlib only).

In process: ``with FakeServer(mode) as url: ...``. As a process, standing in for mlx_lm.server
(it takes and ignores mlx_lm.server's own flags): ``python fake_openai_server.py --mode MODE
--port P ...``. Modes:
- ``ok``: streams ``TOKENS`` one-token chunks ``DELAY_S`` apart, then usage and [DONE];
- ``ok-drafts``: as ``ok``, with llama.cpp-style ``timings.draft_n`` / ``draft_n_accepted``;
- ``vllm-metrics``: as ``ok``, with vLLM's ``/metrics`` counters (``VLLM_PER_COMPLETION`` added
  by every completion: rounds, draft tokens, accepted tokens, accepted by position);
- ``500``: every completion answers HTTP 500;
- ``die-after:N``: the process exits (os._exit) when its N-th completion starts;
- ``not-openai``: /v1/models and the completions are 404 pages;
- ``models-empty``: /v1/models answers 200 with an empty body (mlx_lm.server with no Hugging Face
  cache folder: it sends the status before scanning the cache, which raises), completions work;
- ``health-503``: /health answers 503 (mlx_lm.server's word for a model that did not load);
- ``never-ready``: /health answers 404, for ever;
- ``ignore-sigterm``: as ``ok``, in a process that ignores SIGTERM (as process only);
- ``hang``: accepts connections and never answers (in process only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS = 8
DELAY_S = 0.002
DRAFTED, ACCEPTED = 6, 3  # per response in ok-drafts
VLLM_PER_COMPLETION = {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 3, "per_pos": (2, 1, 0)}


def vllm_metrics(completions: int) -> str:
    """vLLM's spec-decode counters after ``completions`` completions (vllm/v1/spec_decode/metrics.py)."""
    labels = 'engine="0",model_name="fake-model"'
    lines = []
    for what in ("drafts", "draft_tokens", "accepted_tokens"):
        name = f"vllm:spec_decode_num_{what}"
        lines += [f"# TYPE {name}_total counter",
                  f"{name}_total{{{labels}}} {float(completions * VLLM_PER_COMPLETION[what])}",
                  f"{name}_created{{{labels}}} 1.7965077429375641e+09"]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f'{name}{{{labels},position="{k}"}} {float(completions * n)}'
              for k, n in enumerate(VLLM_PER_COMPLETION["per_pos"])]
    return "\n".join(lines) + "\n"


def handler_for(mode: str):
    state = {"completions": 0, "lock": threading.Lock()}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, status: int, body: dict | str) -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health" and mode in ("health-503", "never-ready"):
                self._json(503 if mode == "health-503" else 404, {"status": "not ready"})
            elif self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/metrics" and mode == "vllm-metrics":
                with state["lock"]:
                    text = vllm_metrics(state["completions"])
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path.startswith("/v1/models"):
                if mode == "not-openai":
                    self._json(404, "<html>Not Found</html>")
                elif mode == "models-empty":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with state["lock"]:
                state["completions"] += 1
                n = state["completions"]
            if mode.startswith("die-after:") and n >= int(mode.split(":")[1]):
                os._exit(3)
            if mode == "500":
                self._json(500, {"error": "boom"})
                return
            if mode == "not-openai":
                self._json(404, "<html>Not Found</html>")
                return
            tokens = min(int(body.get("max_tokens", TOKENS)), TOKENS)
            if not body.get("stream"):
                self._json(200, {"model": body.get("model", "fake-model"),
                                 "choices": [{"message": {"content": "x" * tokens}, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": tokens}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for i in range(tokens):
                    time.sleep(DELAY_S)
                    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
                if mode == "ok-drafts":
                    final["timings"] = {"draft_n": DRAFTED, "draft_n_accepted": ACCEPTED}
                usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

    return Handler


class FakeServer:
    """An in-process fake on a free loopback port; the context gives its base URL."""

    def __init__(self, mode: str = "ok"):
        self.mode = mode

    def __enter__(self) -> str:
        if self.mode == "hang":
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(16)  # the kernel accepts connections; nobody ever reads them
            return f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(self.mode))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        if self.mode == "hang":
            self.sock.close()
            return
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()  # mlx_lm.server's --model, --draft-model, ... are ignored
    if args.mode == "ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ThreadingHTTPServer((args.host, args.port), handler_for(args.mode)).serve_forever()


if __name__ == "__main__":
    main()
