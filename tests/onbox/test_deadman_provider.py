"""`python3 -m onbox.deadman.provider lambda-terminate`: against a Lambda API stand-in on 127.0.0.1."""
from __future__ import annotations

import http.server
import io
import json
import threading
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from onbox.deadman.provider import lambda_terminate, main

KEY = "lambda-secret-key-0123456789"


class FakeLambda:
    """Answers POST /api/v1/instance-operations/terminate with `status` and `body` (the key echoed
    back when asked, to prove it never reaches our output)."""

    def __init__(self) -> None:
        self.requests: List[Dict[str, Any]] = []
        self.status = 200
        self.body: Dict[str, Any] = {"data": {"terminated_instances": [{"id": "i-1"}]}}
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                fake.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                      "type": self.headers.get("Content-Type"),
                                      "body": json.loads(self.rfile.read(length))})
                payload = json.dumps(fake.body).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fake-lambda",
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)


@pytest.fixture
def api() -> Iterator[FakeLambda]:
    fake = FakeLambda()
    try:
        yield fake
    finally:
        fake.close()


def run(instance: str, env: Dict[str, str]) -> Tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = lambda_terminate(instance, env, out, err)
    return code, out.getvalue(), err.getvalue()


def test_terminate_posts_the_instance_with_the_key_as_a_bearer_token(api: FakeLambda) -> None:
    code, out, err = run("i-1", {"LAMBDA_API_KEY": KEY, "RGT_LAMBDA_API_URL": api.url})
    assert code == 0, err
    assert api.requests == [{"path": "/api/v1/instance-operations/terminate", "auth": f"Bearer {KEY}",
                             "type": "application/json", "body": {"instance_ids": ["i-1"]}}]
    assert json.loads(out) == {"instance_id": "i-1", "status": 200, "terminated": ["i-1"]}
    assert KEY not in out + err


def test_a_refusal_is_exit_1_and_never_shows_the_key(api: FakeLambda) -> None:
    api.status, api.body = 403, {"error": {"message": f"key {KEY} is not allowed"}}
    code, out, err = run("i-1", {"LAMBDA_API_KEY": KEY, "RGT_LAMBDA_API_URL": api.url})
    assert code == 1 and "HTTP 403" in err and "***" in err
    assert KEY not in out + err


def test_no_key_or_a_bad_id_is_a_usage_error_and_nothing_is_sent(api: FakeLambda) -> None:
    assert run("i-1", {"RGT_LAMBDA_API_URL": api.url})[0] == 2
    assert run("i 1; rm", {"LAMBDA_API_KEY": KEY, "RGT_LAMBDA_API_URL": api.url})[0] == 2
    assert api.requests == []


def test_an_unreachable_api_is_exit_1(api: FakeLambda) -> None:
    dead = api.url
    api.close()
    code, _out, err = run("i-1", {"LAMBDA_API_KEY": KEY, "RGT_LAMBDA_API_URL": dead})
    assert code == 1 and "could not be reached" in err


def test_the_module_entry_point(api: FakeLambda, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lambda-terminate", "i-1"], {"LAMBDA_API_KEY": KEY, "RGT_LAMBDA_API_URL": api.url}) == 0
    assert json.loads(capsys.readouterr().out)["terminated"] == ["i-1"]
