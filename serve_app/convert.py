"""Request conversion: an OpenAI request becomes prompt token ids and one `DecodeConfig` per engine request.

This is where a request enters, so it is checked here, once, in HTTP names. What a field may hold (values a
diffusion LM cannot honour, this deployment's bounds) is the request model's, stated by the OpenAPI schema
(serve_app/protocol.py, serve_app/routes.py); here come the checks a schema cannot state (`x-server-checks`): which
model the request names, rules across fields, then the engine's own rules (`mbd.decoding.validate`, once per prompt,
against the limits a decoder replica reports). What passes is a checked `RequestParams` per prompt, which the engine
admits, and a restarted engine re-admits, without checking again. A structured-output constraint is parsed here into
its `ConstraintSpec` (naming the field it came from) and compiled by the engine that serves it, once; what the
engine cannot honour comes back as a 400 naming that field before any byte of the answer is sent.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from mbd.config import DecodeConfig
from mbd.decoding.constraint_spec import ConstraintError, ConstraintSpec
from mbd.decoding.validate import EngineLimits, RequestError, RequestParams, validate_request
from mbd.tokenizer import Tokenizer, TokenizerError
from serve_app.config import ServeConfig
from serve_app.protocol import APIError, ChatCompletionRequest, SamplingFields, field_path

MBD_FIELDS = ("buffer_size", "tau_add", "tau_semi", "tau_stable", "tau_m2t", "tau_t2t")


class RequestConverter:
    """`limits`: the engine's, as a decoder replica reports them (the ingress sets them before the first request)."""

    def __init__(self, cfg: ServeConfig, tok: Tokenizer):
        self.cfg, self.tok = cfg, tok
        self.limits: EngineLimits | None = None
        self.name = cfg.model.name

    def check_fields(self, req: SamplingFields) -> None:
        """The rules a schema cannot state that need no prompt: which model it names, rules across fields."""
        if req.model != self.name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.name}' "
                                "(see GET /v1/models)", "model", "not_found_error", "model_not_found")
        if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")

    def engine_request(self, req: SamplingFields, prompts: list[list[int]], fields: list[str]
                       ) -> tuple[list[RequestParams], ConstraintSpec | None]:
        """The engine's side of a request with its encoded prompts (in the HTTP fields `fields`): the choices'
        limit, the decoding parameters, the structured-output constraint and the engine's whole request check
        per prompt, whose checked parameters it returns. Raises APIError naming the field."""
        self.check_choices(req, len(prompts))
        params = self.params(req, max(len(p) for p in prompts))
        constraint = self.constraint(req)
        return [self.check_request(ids, params, field, req) for ids, field in zip(prompts, fields)], constraint

    # ---- prompts (these run in the tokenizer pool, off the event loop) ----

    def encode_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> tuple[list[list[int]], list[str]]:
        """One token list per prompt (a string, a token-id list, or a list of either), with its HTTP field."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts, fields = [prompt], ["prompt"]
        else:
            prompts, fields = list(prompt), [f"prompt[{i}]" for i in range(len(prompt))]
        return [self.tok.encode(p) if isinstance(p, str) else list(p) for p in prompts], fields

    @staticmethod
    def messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
        """Messages with plain-string content (a list of text parts is joined)."""
        return [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                 "".join(part.text for part in m.content)} for m in req.messages]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            return self.tok.encode_chat(messages)
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from e

    # ---- structured output ----

    def constraint(self, req: SamplingFields) -> ConstraintSpec | None:
        """The request's one structured-output constraint (the engine compiles it when it admits the request)."""
        specs = self._constraints(req)
        if len(specs) > 1:
            raise APIError(400, f"{specs[0].field} and {specs[1].field} both constrain the output: send one",
                           specs[1].field)
        return specs[0] if specs else None

    @staticmethod
    def _constraints(req: SamplingFields) -> list[ConstraintSpec]:
        rf, so = req.response_format, req.structured_outputs
        shapes = [(f"structured_outputs.{k}", k, getattr(so, "json_" if k == "json" else k) if so else None)
                  for k in ("json", "regex", "choice", "grammar")]
        shapes += [(f"guided_{k}", k, getattr(req, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")]
        try:
            out = [_spec(kind, value, field) for field, kind, value in shapes if value is not None]
            if rf is not None and rf.type == "json_object":
                out.append(ConstraintSpec("json_object", field="response_format"))
            elif rf is not None and rf.type == "json_schema":
                if rf.json_schema is None:
                    raise ConstraintError("response_format.json_schema", "is required when type is json_schema")
                out.append(ConstraintSpec.json_schema(rf.json_schema.schema_))
        except ConstraintError as e:
            raise APIError(400, str(e), e.field) from e
        return out

    # ---- decoding parameters ----

    def check_request(self, ids: list[int], params: DecodeConfig, prompt_field: str, req: SamplingFields
                      ) -> RequestParams:
        """The engine's whole request check (the prompt, the Block Buffer, room to generate, the KV pool) in HTTP
        names; a max_tokens that does not fit the context is refused, not cut."""
        assert self.limits is not None, "the ingress sets the engine's limits before converting requests"
        names = {"prompt_ids": prompt_field, "max_new_tokens": req.token_limit()[1]}
        try:
            return validate_request(ids, params, self.cfg.decode, self.limits, names, whole=True)[1]
        except RequestError as e:
            raise bad_request(e) from e

    def check_choices(self, req: SamplingFields, n_prompts: int) -> None:
        if n_prompts * req.n > self.cfg.limits.max_choices:
            raise APIError(400, f"{n_prompts} prompt(s) x n={req.n} choices exceed the limit of "
                                f"{self.cfg.limits.max_choices} (limits.max_choices)", "n")

    def params(self, req: SamplingFields, n_prompt: int) -> DecodeConfig:
        """Per-request DecodeConfig: the deployment's, overridden by the request within the deployment's bounds."""
        d, lim = self.cfg.decode, self.cfg.limits
        assert self.limits is not None
        # the default: what fits (at least 1, so that a prompt that fills the context is refused by its own check)
        cap = max(min(d.max_new_tokens, self.limits.max_length - n_prompt), 1)
        limit = req.token_limit()[0]
        if req.max_tokens is not None and limit != req.max_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ: send one of them", "max_tokens")
        max_tokens = limit if limit is not None else min(lim.default_max_tokens or cap, cap)
        update: dict[str, Any] = {k: getattr(req, k) for k in MBD_FIELDS if getattr(req, k) is not None}
        update |= {"max_new_tokens": max_tokens, "ignore_eos": req.ignore_eos, "logprobs": req.wants_logprobs()}
        update["top_logprobs"] = req.top_count()
        if req.stream_options is not None and req.stream_options.include_provisional:
            if not req.stream:
                raise APIError(400, "stream_options.include_provisional needs stream=true",
                               "stream_options.include_provisional")
            update["provisional"] = True
        update |= {k: getattr(req, k) for k in ("temperature", "top_p", "seed") if getattr(req, k) is not None}
        if req.top_k is not None:
            update["top_k"] = max(req.top_k, 0)  # vLLM's -1 = all tokens = our 0
        try:
            return DecodeConfig.model_validate(d.model_dump() | update)
        except ValidationError as e:
            err = e.errors()[0]
            param = field_path(tuple(err["loc"]))
            raise APIError(400, f"invalid decoding parameters: {err['msg']}", param or "buffer_size") from e


def bad_request(e: RequestError) -> APIError:
    """The engine's refusal as a 400 naming the field (with OpenAI's code, where it has one)."""
    return APIError(400, str(e), e.field, code=e.code)


def _spec(kind: str, value: Any, field: str) -> ConstraintSpec:
    """One vLLM-shaped constraint (json, regex, choice or grammar) from request field `field`."""
    if kind == "json":
        return ConstraintSpec.json_schema(value, field)
    if kind == "choice":
        return ConstraintSpec.choice(value, field)
    return ConstraintSpec(kind, value, field)
