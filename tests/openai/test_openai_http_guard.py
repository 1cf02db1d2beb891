"""``agentx serve``'s refusals that need no model: Host, Origin, content type, CORS preflight,
OpenAI-shaped 404 / 405 bodies, model ids, API keys, the grammar of parallel_tool_calls=false,
the command's flags.

The app is driven with Starlette's TestClient without its lifespan, so no engine is loaded:
every request here is answered before it would reach one.
"""

from starlette.testclient import TestClient

from agentx.openai import ChatService
from agentx.openai.serve_command import build_parser
from agentx.openai.server import create_app
from agentx.session.constraints import make_turn_constraint
from agentx.session.tools import Tool
from tests.helpers.openai_api import ADD_TOOL

ORIGIN = "http://localhost:3000"


def client(**options) -> TestClient:
    app = create_app(ChatService(), **options)
    return TestClient(app, base_url="http://127.0.0.1:8000")


def assert_openai_error(response, status, code):
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_a_foreign_host_header_is_refused():  # DNS rebinding (issue 36.4)
    http = client()
    refused = http.get("/v1/models", headers={"host": "attacker.example"})
    assert_openai_error(refused, 400, "invalid_host")
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000"):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200
    allowed = client(allowed_hosts=["agentx.internal"])
    assert allowed.get("/v1/models", headers={"host": "agentx.internal:80"}).status_code == 200


def test_a_cross_origin_plain_text_post_is_refused():  # CSRF (issue 36.4)
    http = client()
    body = '{"model": "agentx", "messages": [{"role": "user", "content": "hi"}]}'
    cross = http.post(
        "/v1/chat/completions",
        content=body,
        headers={"origin": "http://evil.example", "content-type": "text/plain"},
    )
    assert_openai_error(cross, 403, "origin_not_allowed")
    plain = http.post("/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert_openai_error(plain, 415, "unsupported_media_type")


def test_cors_preflight_for_an_allowed_origin():
    http = client(allowed_origins=[ORIGIN])
    preflight = http.options(
        "/v1/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    models = http.get("/v1/models", headers={"origin": ORIGIN})
    assert models.headers["access-control-allow-origin"] == ORIGIN
    other = http.options("/v1/chat/completions", headers={"origin": "http://evil.example"})
    assert_openai_error(other, 403, "origin_not_allowed")


def test_404_and_405_are_openai_error_objects():
    http = client()
    assert_openai_error(http.get("/nope"), 404, "not_found")
    assert_openai_error(http.get("/v1/nope"), 404, "not_found")
    assert_openai_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")
    assert_openai_error(http.post("/health", json={}), 405, "method_not_allowed")


def test_model_ids_and_unknown_models():
    http = client(served_model_names=["agentx", "smol"])
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["agentx", "smol"]
    assert http.get("/v1/models/smol").json() == {
        "id": "smol",
        "object": "model",
        "created": 0,
        "owned_by": "agentx",
    }
    missing = http.get("/v1/models/gpt-4o")
    assert_openai_error(missing, 404, "model_not_found")
    assert missing.json()["error"]["param"] == "model"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        wrong = http.post(path, json={"model": "gpt-4o", "messages": [], "prompt": "x"})
        assert_openai_error(wrong, 404, "model_not_found")


def test_oversized_body_is_413_before_parsing():
    http = client(max_request_bytes=1024)
    big = http.post("/v1/chat/completions", json={"messages": "x" * 2048})
    assert_openai_error(big, 413, "request_too_large")


def test_an_api_key_is_checked_before_anything_runs():
    http = client(api_key=["k1", "k2"])
    assert_openai_error(http.post("/v1/completions", json={}), 401, "invalid_api_key")
    wrong = http.post("/v1/completions", json={}, headers={"authorization": "Bearer k3"})
    assert_openai_error(wrong, 401, "invalid_api_key")


def test_parallel_tool_calls_false_allows_one_call_in_the_grammar():
    tools = [Tool.from_dict(ADD_TOOL)]
    for choice in ("auto", "required"):
        many = make_turn_constraint(tools, choice).structured.grammar
        one = make_turn_constraint(tools, choice, parallel_calls=False).structured.grammar
        assert '("," " "? call)*' in many and '("," " "? call)*' not in one


def test_serve_flags_default_as_vllm_and_engine():
    args = build_parser().parse_args([])
    assert args.quantization == "auto" and args.max_request_bytes == 8 << 20
    assert args.served_model_name == ["agentx"] and not args.accept_any_model
    for action in build_parser()._actions:
        assert action.help, action.dest
