"""Chat templates in the styles of real model families, written by the project (not downloaded), and
copies of the tiny tokenizer carrying each family's special tokens: the fixtures of the native-template
tests. They render like the families' released templates where it matters to a rollout (system and tool
turns, tool-call syntax, tool results, generation prompt); the prose is the project's own."""

from __future__ import annotations

import copy

# Qwen2.5 / Hermes style: tools listed in the system turn as JSON inside <tools></tools>, calls as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, results in a user turn inside <tool_response>.
QWEN25_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call functions to help with the request. Their signatures, inside "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments inside "
    '<tool_call></tool_call>:\\n<tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <arguments>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1 style: tools in the first user message as indented JSON, calls as a bare JSON object
# {"name": ..., "parameters": ...}, results in an ipython turn (a string result rendered with tojson).
LLAMA31_STYLE = (
    "{{- bos_token }}"
    "{%- if tools_in_user_message is not defined %}{%- set tools_in_user_message = true %}{%- endif %}"
    "{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if tools is not defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools_in_user_message and tools is not none %}"
    "{%- if messages | length == 0 %}{{- raise_exception('tools go in the first user message, and there is none') }}"
    "{%- endif %}"
    "{%- set first_user_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Answer with a JSON function call when one of these functions helps, written as '"
    ' + \'{"name": function name, "parameters": dictionary of arguments}.\\n\\n\' }}'
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{%- if builtin_tools is defined %}{{- '<|eom_id|>' }}{%- else %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Qwen3 style: as Qwen2.5, plus reasoning: an assistant turn's <think>...</think> block is rendered for
# the latest assistant turn only -- earlier turns lose theirs, which breaks the prefix property.
QWEN3_STYLE = (
    QWEN25_STYLE.replace(
        "{%- for message in messages %}",
        "{%- set ns = namespace(last=-1) %}"
        "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set ns.last = loop.index0 %}{%- endif %}"
        "{%- endfor %}"
        "{%- for message in messages %}",
        1,
    )
    .replace(
        "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
        "{%- set content = message.content or '' %}{%- set reasoning = '' %}"
        "{%- if '</think>' in content %}"
        "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- endif %}"
        "{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if reasoning and loop.index0 == ns.last %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
        "{{- content }}",
        1,
    )
    # the call follows the header (or the reasoning) directly
    .replace('{{- \'\\n<tool_call>\\n{"name": "\' }}', '{{- \'<tool_call>\\n{"name": "\' }}', 1)
)

# Tool-aware, but in a tool-call syntax no registered format knows.
UNKNOWN_TOOL_STYLE = (
    "{%- for tool in tools or [] %}{{- 'TOOL ' + tool.function.name + '\\n' }}{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- 'CALL ' + c.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Renders no tools (a plain ChatML template).
PLAIN_CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# SmolLM2-135M-Instruct's own template, verbatim (its GGUF file's): plain ChatML with a default system turn
SMOLLM2_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]


def family_tokenizer(tokenizer, family: str):
    """A copy of the tiny tokenizer with ``family``'s special tokens and chat template
    (``qwen25``, ``qwen3``, ``llama31``)."""
    tok = copy.deepcopy(tokenizer)
    if family in ("qwen25", "qwen3"):
        tok.add_tokens([t for t in QWEN_ADDED if t not in tok.get_vocab()], special_tokens=False)
        tok.chat_template = QWEN25_STYLE if family == "qwen25" else QWEN3_STYLE
    elif family == "llama31":
        tok.add_tokens(LLAMA_SPECIAL, special_tokens=True)
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
        tok.chat_template = LLAMA31_STYLE
    else:
        raise ValueError(family)
    return tok
