"""Checkpoints' own chat templates as the rollout contract's rendering.

:mod:`~mentorrl.chat_templates.formats` holds the registry of tool-call formats keyed by template family;
:mod:`~mentorrl.chat_templates.native` renders a conversation with the checkpoint's template, token in /
token out. :func:`native_chat_for` picks what a run uses from ``prompt.tool_format``."""

from mentorrl.chat_templates.formats import (
    MENTORRL,
    TOOL_FORMATS,
    ToolFormat,
    detect_tool_format,
    get_tool_format,
    register_tool_format,
    renders_tools,
)
from mentorrl.chat_templates.native import TemplateChat, TemplateError
from mentorrl.chat_templates.resolve import PROMPT_RECORD, native_chat_for, resolve_tool_format, trained_without_tools

__all__ = [
    "MENTORRL",
    "PROMPT_RECORD",
    "TOOL_FORMATS",
    "TemplateChat",
    "TemplateError",
    "ToolFormat",
    "detect_tool_format",
    "get_tool_format",
    "native_chat_for",
    "register_tool_format",
    "renders_tools",
    "resolve_tool_format",
    "trained_without_tools",
]
