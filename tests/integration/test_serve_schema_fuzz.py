"""The OpenAPI schema says what the server accepts and answers: schemathesis generates request bodies from the live
app's own /openapi.json, positive (the schema admits them) and negative (it refuses them), and sends them over real
HTTP. Both kinds of mismatch are failures: a body the schema admits that the server refuses (unless the refusal
names a field whose rule the schema lists under x-server-checks: rules across fields, lengths in tokens, grammars),
and a body the schema refuses that the server serves. No 5xx either way. Every answer passes schemathesis's
response checks (status code, content type, headers and JSON body as documented), and every `data:` event of a
stream is valid against the schema the document states for it. 405s name the allowed methods.

The deployment is small (max_tokens <= 8, two choices) so that each served case costs a few forwards of the tiny
model; the number of cases is bounded (EXAMPLES per endpoint and mode)."""

import httpx
import pytest

from tests.integration.conftest import serve_apps, tiny_serve_config
from tests.integration.test_serve_units import DECODE

schemathesis = pytest.importorskip("schemathesis")

MODEL = "mbd-fuzz"
EXAMPLES = 40  # per endpoint and mode
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def base(serve_url, ckpt):
    cfg = tiny_serve_config(ckpt, MODEL, decode=DECODE.model_copy(update={"max_new_tokens": 8}).model_dump(),
                            limits={"default_max_tokens": 4, "max_choices": 2},
                            decoder={"max_ongoing_requests": 32, "max_queued_requests": 256})
    for url in serve_apps(serve_url, fuzz=cfg):  # the app deleted after the module
        yield f"{url}/fuzz"


def server_checks(spec: dict, path: str) -> dict[str, str]:
    """The rules the schema lists for the body of POST `path`, by the field a refusal names."""
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]["x-server-checks"]


def mismatch(positive: bool, status: int, error: dict | None, checks: dict[str, str]) -> str | None:
    """Why a response contradicts the schema, or None when it agrees with it."""
    if status >= 500:
        return f"server error {status}"
    if not positive:
        return None if 400 <= status < 500 else f"a body the schema refuses was served ({status})"
    if status == 200:
        return None
    param = (error or {}).get("param") or ""
    if status == 400 and any(param == f or param.startswith((f"{f}.", f"{f}[")) for f in checks):
        return None  # a rule the schema states in text (x-server-checks)
    return f"a body the schema admits was refused ({status}, param {param!r})"


def stream_mismatch(spec: dict, path: str, text: str) -> str | None:
    """Why an SSE body contradicts the events `spec` documents for POST `path` (each `data:` line's JSON against
    its `contentSchema`, and the closing [DONE]), or None."""
    import json

    from jsonschema import Draft202012Validator

    stream = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    payload = next(s for s in stream["properties"]["data"]["anyOf"] if "contentSchema" in s)["contentSchema"]
    check = Draft202012Validator({**payload, "components": spec["components"]})
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    if lines[-1:] != ["[DONE]"]:
        return "a stream that does not end with [DONE]"
    for data in lines[:-1]:
        if err := next(check.iter_errors(json.loads(data)), None):
            return f"an event the schema does not admit ({err.message[:200]}): {data[:200]}"
    return None


def fuzz(spec: dict, path: str, http: httpx.Client, examples: int = EXAMPLES, responses: bool = True) -> None:
    """`examples` positive and as many negative bodies for POST `path` from `spec`, each sent with `http` as
    schemathesis serializes it (a negative body may not be JSON at all); fails listing the mismatches. With
    `responses`, each answer is also checked against the document (schemathesis's response checks, and every
    stream's events)."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    checks = server_checks(spec, path)
    op = schemathesis.openapi.from_dict(spec)[path]["POST"]
    found: list[str] = []
    seen = {True: 0, False: 0}
    served = {True: 0, False: 0}
    def run(positive: bool) -> None:
        mode = GenerationMode.POSITIVE if positive else GenerationMode.NEGATIVE

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def send(case):
            kw = case.as_transport_kwargs(base_url="")
            r = http.post(path, json=kw["json"]) if "json" in kw else \
                http.post(path, content=kw["data"], headers={"content-type": kw["headers"]["Content-Type"]})
            json = r.headers.get("content-type", "").startswith("application/json")
            seen[positive] += 1
            served[positive] += r.status_code == 200
            why = mismatch(positive, r.status_code, r.json().get("error") if json else None, checks)
            if not why and responses:
                try:  # every check but acceptance, which `mismatch` judges with the x-server-checks exceptions
                    case.validate_response(r, excluded_checks=[positive_data_acceptance])
                except Exception as e:  # noqa: BLE001 - schemathesis's failure (group): reported with the case
                    why = f"response checks: {str(e)[:300]}"
            if not why and responses and r.headers.get("content-type", "").startswith("text/event-stream"):
                why = stream_mismatch(spec, path, r.text)
            if why:
                found.append(f"{why}: {case.body!r:.300} -> {r.text[:300]}")

        send()

    run(True)
    run(False)
    assert seen[True] >= examples // 2 and seen[False] >= examples // 2, seen
    assert served[True] >= seen[True] // 4, served  # most valid bodies are served, not refused by a listed rule
    assert not found, "\n".join(found[:10]) + f"\n({len(found)} mismatches)"


@pytest.mark.parametrize("path", ENDPOINTS)
def test_schema_and_server_agree(base, path):
    with httpx.Client(base_url=base, timeout=120) as http:
        fuzz(http.get("/openapi.json").json(), path, http)


@pytest.mark.parametrize("method", ["TRACE", "PUT", "DELETE", "PATCH"])
def test_405_names_the_allowed_methods(base, method):
    for path, allowed in (("/v1/completions", "POST"), ("/v1/models", "GET"), ("/health", "GET")):
        r = httpx.request(method, f"{base}{path}", timeout=30)
        assert r.status_code == 405, (path, r.status_code)
        assert r.headers.get("allow") == allowed
        assert r.json()["error"]["type"] == "invalid_request_error"
