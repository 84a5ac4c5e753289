"""The fast variant of tests/integration/test_serve_schema_fuzz.py, without Ray: the same schema-driven fuzzer
against the real HTTP app (routes, error handling, request models) in process, whose ingress makes the real
ingress's checks (`RequestConverter`) and then the real engine's admission check (`Engine.compile_constraint`,
all a decoder checks of a checked request) instead of decoding: 200 when the engine would admit the request."""

import pytest

from mbd.decoding.constraints import ConstraintError
from serve_app.convert import RequestConverter
from serve_app.protocol import APIError
from tests.integration.test_serve_schema_fuzz import ENDPOINTS, fuzz

pytest.importorskip("schemathesis")


class AdmittingIngress:
    """`OpenAIIngress`'s checks in its order (serve_app/ingress.py `_generate`), then the engine's own check in
    place of a decoder."""

    def __init__(self, cfg, engine, tok):
        self.cfg, self.engine, self.metrics = cfg, engine, None
        self.convert = RequestConverter(cfg, tok)
        self.convert.limits = engine.limits

    async def completions(self, req):
        self.convert.check_fields(req)
        return self._admit(req, *self.convert.encode_prompts(req.prompt))

    async def chat(self, req):
        self.convert.check_fields(req)
        return self._admit(req, [self.convert.encode_chat(self.convert.messages(req))], ["messages"])

    def _admit(self, req, prompts: list[list[int]], fields: list[str]) -> dict:
        params, constraint = self.convert.engine_request(req, prompts, fields)
        assert len(params) == len(prompts)
        try:
            self.engine.compile_constraint(constraint)  # what the engine checks when it admits a checked request
        except ConstraintError as e:
            raise APIError(400, str(e), e.field) from e
        return {"admitted": len(prompts) * req.n}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from mbd.decoding import Engine, EngineConfig
    from mbd.model import load_checkpoint
    from mbd.tokenizer import Tokenizer
    from serve_app.config import ServeConfig
    from serve_app.routes import http_app
    from tests.integration.test_serve_units import DECODE, make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("schema") / "ck")
    decode = DECODE.model_copy(update={"max_new_tokens": 8})
    cfg = ServeConfig.model_validate({"model": {"path": str(ckpt), "name": "mbd-fuzz"}, "decode": decode.model_dump(),
                                      "limits": {"default_max_tokens": 4, "max_choices": 2}})
    model, mcfg = load_checkpoint(ckpt)
    tok = Tokenizer.from_dir(ckpt, mcfg)
    engine = Engine(model, tok, decode, EngineConfig(max_batch_rows=2))
    with TestClient(http_app(AdmittingIngress(cfg, engine, tok), api_key=None)) as c:
        yield c


@pytest.mark.parametrize("path", ENDPOINTS)
def test_schema_and_checks_agree(client, path):
    fuzz(client.get("/openapi.json").json(), path, client, responses=False)  # a stand-in answers, not the API


def test_405_names_the_allowed_methods(client):
    r = client.request("TRACE", "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_schema_uses_only_json_schema_keywords(client):
    """A bound pydantic cannot translate is written under its own name ('ge', 'le'), which no schema tool reads:
    a client would be told the field is unbounded."""
    def keys(node):
        if isinstance(node, dict):
            yield from node
            for v in node.values():
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert not {"ge", "gt", "le", "lt", "min_length", "max_length"} & set(keys(schemas))
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[2]["items"]["minimum"] == 0 and prompt[2]["items"]["exclusiveMaximum"] > 0
