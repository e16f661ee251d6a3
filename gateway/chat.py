"""Chat messages -> prompt text with the model's own chat template (the Jinja template in its
`tokenizer_config.json`, which the target's GetInfo carries), rendered the way Hugging Face
tokenizers render it: sandboxed Jinja, `messages`, `add_generation_prompt`, the special tokens,
and `raise_exception` for templates that validate their input."""
from __future__ import annotations

import json

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it: HTTP 400."""


def _token(value) -> str:
    # tokenizer_config stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


class ChatTemplate:
    def __init__(self, tokenizer_config_json: str, model_id: str):
        self.model_id = model_id
        try:
            cfg = json.loads(tokenizer_config_json) if tokenizer_config_json else {}
        except json.JSONDecodeError:
            cfg = {}
        template = cfg.get("chat_template")
        if isinstance(template, list):      # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.source = template if isinstance(template, str) and template.strip() else None
        self.special = {name: _token(cfg.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self._compiled = None
        if self.source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.filters.setdefault("tojson", lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw))
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the chat template of model {model_id!r} does not compile: {exc}") from None

    @property
    def available(self) -> bool:
        return self._compiled is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs) -> str:
        """kwargs: the request's chat_template_kwargs (e.g. enable_thinking), as vLLM passes them.
        tools: the request's tools ([{"type": "function", "function": {name, description,
        parameters}}]), the template's `tools` variable as Hugging Face passes it (undefined
        when the request has none)."""
        if self._compiled is None:
            raise ChatTemplateError(
                f"model {self.model_id!r} has no chat template (no 'chat_template' in its tokenizer_config.json), "
                "so chat messages cannot be turned into a prompt; use /v1/completions with a plain prompt")
        try:
            context = {**self.special, **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt}
            if tools is not None:
                context["tools"] = tools
            return self._compiled.render(**context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - what the request's values make a template do
            # A template does arithmetic and string work on the messages and kwargs it is given
            # (a number where it adds strings, a nesting past the stack): a refusal of this
            # request, not a fault of the server.
            raise ChatTemplateError(f"the chat template failed on the messages: {type(exc).__name__}: "
                                    f"{str(exc)[:300]}") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)
