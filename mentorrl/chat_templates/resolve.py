"""Which rendering a run uses: the checkpoint's own template or the contract's ChatML (``prompt.tool_format``)."""

from __future__ import annotations

from typing import Any

from mentorrl.chat_templates.formats import (
    HERMES_PROMPTED,
    MENTORRL,
    TOOL_FORMATS,
    detect_tool_format,
    get_tool_format,
    renders_tools,
)
from mentorrl.chat_templates.native import TemplateChat, TemplateError
from mentorrl.config import ConfigError, PromptFormat
from mentorrl.contract import tool_schemas

# The key of a run's prompt settings in its tokenizer's ``init_kwargs`` (so ``tokenizer_config.json`` of every
# checkpoint it saves): the rendering the policy was trained on, for a server that loads the checkpoint.
PROMPT_RECORD = "mentorrl_prompt"


def trained_without_tools(tokenizer: Any, fmt_name: str) -> bool:
    """Whether ``tokenizer``'s checkpoint was trained with no tools in its prompt under the native format
    ``fmt_name``: a prompted format (the template renders no tools) with ``prompt.system_turn`` false, or a
    tool-aware one with ``system_turn`` and ``native_tools`` both false (its :data:`PROMPT_RECORD`)."""
    rec = (getattr(tokenizer, "init_kwargs", None) or {}).get(PROMPT_RECORD)
    if not isinstance(rec, dict) or rec.get("tool_format") != fmt_name or rec.get("system_turn") is not False:
        return False
    return get_tool_format(fmt_name).prompted or rec.get("native_tools") is False


def resolve_tool_format(source: str | None, requested: str = "auto") -> str:
    """The tool format a run with chat template ``source`` uses: ``"mentorrl"`` (the contract's ChatML
    template replaces the checkpoint's) or a registered format's name (the checkpoint's template renders
    the conversation).

    ``auto``: no template or the contract's own -> ``mentorrl`` (as for the tiny model); a template that renders
    no tools (SmolLM2's plain ChatML) -> ``hermes_prompted`` (the template is kept; the tools go in the system
    text); a tool-aware template of a registered family -> that family; a tool-aware template of an unknown
    family -> :class:`ConfigError`. A format named explicitly needs a template that renders tools, except a
    prompted one."""
    known = ", ".join(["auto", MENTORRL, *TOOL_FORMATS])
    if requested == MENTORRL:
        return MENTORRL
    if requested != "auto" and requested not in TOOL_FORMATS:
        raise ConfigError(f"prompt.tool_format {requested!r}: unknown; expected one of {known}")
    family = detect_tool_format(source)
    if requested == "auto":
        if family == MENTORRL or not source:
            return MENTORRL
        if family is None and not renders_tools(source):
            return HERMES_PROMPTED
        if family is None:
            raise ConfigError(
                "prompt.tool_format auto: the checkpoint's chat template renders tools, but in no registered "
                f"format (its tool-call syntax is not recognised); set prompt.tool_format to one of {known} "
                "(mentorrl replaces the template with the contract's ChatML one)"
            )
        requested = family
    if get_tool_format(requested).prompted:
        if not source:
            raise ConfigError(f"prompt.tool_format {requested}: the checkpoint has no chat template to render with")
        return requested
    if not source or not renders_tools(source):
        raise ConfigError(
            f"prompt.tool_format {requested}: the checkpoint's chat template cannot render tools "
            f"({'it has none' if not source else 'it never reads the tools variable'}); use a checkpoint whose "
            "template takes tools=, or prompt.tool_format mentorrl to train with the contract's ChatML template"
        )
    return requested


def native_chat_for(tokenizer: Any, env: Any, prompt: PromptFormat) -> TemplateChat | None:
    """The checkpoint template's rendering for ``env`` (system prompt, tool schemas) under ``prompt``, or
    None when the run uses the contract's ChatML template (:func:`resolve_tool_format`).

    ``prompt.system_turn`` false: no system message, and no ``tools=`` where the template does not render
    tools itself (the contract's ChatML, a prompted format: the policy learns the tools from data); a
    template that renders tools natively still gets them (``prompt.native_tools``, default true: a recipe
    written for the tiny model, ``system_turn: false``, would otherwise hide a Qwen or Llama checkpoint's
    tools from it). ``prompt.tool_descriptions`` false: the schemas carry no descriptions."""
    source = getattr(tokenizer, "chat_template", None)
    source = source if isinstance(source, str) else None
    name = resolve_tool_format(source, prompt.tool_format)
    if name == MENTORRL:
        return None
    tools = None
    if prompt.system_turn or (prompt.native_tools and not get_tool_format(name).prompted):
        tools = tool_schemas(env)
        if not prompt.tool_descriptions:
            tools = [{**t, "function": {k: v for k, v in t["function"].items() if k != "description"}} for t in tools]
    try:
        return TemplateChat(tokenizer, get_tool_format(name), env.system_prompt if prompt.system_turn else None, tools)
    except TemplateError as e:
        if prompt.tool_format == "auto" and get_tool_format(name).prompted:
            return None  # a template that cannot hold a conversation at all (no turn markers): the contract's ChatML
        raise ConfigError(f"prompt.tool_format {prompt.tool_format} ({name}): {e}") from None


__all__ = ["PROMPT_RECORD", "native_chat_for", "resolve_tool_format", "trained_without_tools"]
