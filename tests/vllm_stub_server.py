"""A stand-in for a vLLM server's start-up endpoints on loopback: what TRL's clients (GRPO's
`trl.generation.vllm_client.VLLMClient`, the async trainer's `trl.experimental.async_grpo.vllm_client.VLLMClient`) ask
before any rollout: `/health`, `/v1/models`, `/server_info` (vLLM's resolved `vllm_config`, with `model_config.
logprobs_mode` as `vllm serve --logprobs-mode` sets it). No engine: used by tests/test_vllm_server_checks.py and
tests/test_async_grpo.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    """A thread serving TRL's start-up endpoints with a given `logprobs_mode`; records the paths it was asked."""

    def __init__(self, logprobs_mode: str):
        self.logprobs_mode, self.paths = logprobs_mode, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                stub.paths.append(path)
                body = {"/health": {}, "/v1/models": {"data": [{"id": "tiny"}]},
                        "/server_info": {"vllm_config": {"model_config": {"logprobs_mode": stub.logprobs_mode},
                                                         "weight_transfer_config": {"backend": "nccl"}}}}.get(path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body or {"detail": "Not Found"}).encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
