"""Chat prompts as the checkpoint's own Jinja template writes them, rendered in a sandbox as transformers does.

The template a checkpoint ships (`mbd.checkpoint_files.read_chat_template`) decides the prompt; the built-in
templates below are for checkpoints that ship none (the embedded tiny model). They follow the published ones:
- sdar: SDAR-8B-Chat's (Qwen3's) ChatML, without its tool branches: `<|im_start|>user\\n...<|im_end|>\\n`, the
  `<think>...</think>` part of assistant turns before the last user turn dropped;
- llada2_moe: LLaDA2's, which opens every prompt with the authors' system turn
  `<role>SYSTEM</role>detailed thinking off<|role_end|>` (a system message goes before `detailed thinking off`).
Templates run in jinja2's ImmutableSandboxedEnvironment with transformers' options (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a plain `tojson`), so a template cannot reach Python objects
beyond the messages it is given.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")

SDAR = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLADA2 = """\
{%- set thinking_option = 'off' -%}
{{- '<role>SYSTEM</role>' -}}
{%- if messages[0].role == 'system' -%}
{{- messages[0].content + '\\n' -}}
{%- endif -%}
{{- 'detailed thinking ' + thinking_option + '<|role_end|>' -}}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{{- '<role>HUMAN</role>' + message.content + '<|role_end|>' -}}
{%- elif message.role == 'system' and not loop.first -%}
{{- '<role>SYSTEM</role>' + message.content + '<|role_end|>' -}}
{%- elif message.role == 'assistant' -%}
{{- '<role>ASSISTANT</role>' + message.content + '<|role_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<role>ASSISTANT</role>' -}}
{%- endif -%}
"""

BUILTIN = {"sdar": SDAR, "llada2_moe": LLADA2}


class TokenizerError(ValueError):
    """A prompt cannot be made: bad messages, text that is not Unicode, or a template that refuses them."""


def _raise(message: str) -> NoReturn:
    raise TokenizerError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """JSON as transformers' templates expect it (jinja's own tojson escapes <, > and & for HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def check_messages(messages: Sequence[dict]) -> None:
    """OpenAI-style messages: each a {role: system/user/assistant, content: str}."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise TokenizerError(f"messages[{i}].role must be one of system/user/assistant, got "
                                 f"{m.get('role') if isinstance(m, dict) else m!r}")
        if not isinstance(m.get("content"), str):
            raise TokenizerError(f"messages[{i}].content must be a string")
    if not messages:
        raise TokenizerError("messages must not be empty")


class ChatTemplate:
    """One compiled chat template and the special-token texts it may name (`bos_token`, `eos_token`, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            self.template = _environment().from_string(source)
        except TemplateError as e:
            raise TokenizerError(f"the chat template does not compile: {e}") from e
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        check_messages(messages)
        try:
            return self.template.render(messages=[dict(m) for m in messages],
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except TemplateError as e:
            raise TokenizerError(f"the chat template failed on these messages: {e}") from e
