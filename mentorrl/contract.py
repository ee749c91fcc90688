"""The rollout contract: the one place that says how a conversation becomes token ids.

Both the rollout engine and the learner import this module. It owns

* the chat template (ChatML, the format Qwen-family checkpoints use),
* the tool-call syntax (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
* the stop tokens that end a policy turn,
* the sampling settings, and
* the fingerprint that ties a trajectory to the tokenizer, template and sampling it was made with.

Observations are rendered to text and tokenised **once**, here, and appended to the
trajectory as ids. The learner trains on ``Trajectory.token_ids`` and never re-tokenises.

Control tokens (``<|im_start|>``, ``<|im_end|>``, the tool-call tags, any special token of the
tokenizer) only ever come from the template. A rendering is a list of *pieces*: :class:`Control`
pieces, written by the template, become their token id; every other piece -- a message's
content, a tool observation, the system prompt -- is encoded as plain text by
:class:`ChatEncoder`, so ``"A<|im_end|>"`` in a user message or an observation stays the
characters it is and cannot close a turn or forge another (surrogate code points, which are
not valid Unicode, become U+FFFD there instead of crashing the tokenizer). A policy turn's own
tool-call tags are the policy's control tokens (:func:`turn_pieces`). Untrusted JSON from a turn is parsed
with a bounded nesting depth, and error text shown to the policy is clipped to
:data:`MAX_ERROR_CHARS`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal

from mentorrl.config.prompt import ContractLimits, PromptFormat, SamplingParams
from mentorrl.trajectory import dumps_compact

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]

# Jinja chat template stored with the tokenizer of every checkpoint mentorrl writes, so that
# `apply_chat_template` (and TRL, vLLM's chat endpoint) renders a conversation byte for byte as
# :func:`mentorrl.chat.prompt_text` does (tests/test_chat_template.py checks it on recorded expert
# trajectories):
# * ``tools`` (OpenAI function schemas) render the contract's system turn: the system message's
#   content (or "") + the tool signatures + the call syntax (:func:`system_text`); without
#   ``tools`` a system message is rendered as given (the client sends the full system text);
# * an assistant message is its content (None is "") then one ``<tool_call>{"name": ...,
#   "arguments": ...}</tool_call>`` per tool call; dict arguments are serialised as the contract
#   does (``json.dumps``, ", "/": " separators, no ASCII escaping), string arguments verbatim
#   (the contract re-serialises them, so the two agree for the JSON mentorrl writes);
# * a tool message is its content; ``{% generation %}`` marks the assistant tokens (the policy's
#   turn and its <|im_end|>), for assistant-only losses;
# * an unknown role, a non-string content or tool_calls on a non-assistant message raise.
# Rendering is text: a tokenizer that re-tokenises the text turns a literal "<|im_end|>" inside
# content into the control token; untrusted content must go through ChatEncoder (as serve does).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0, system='', typed=false) -%}"
    "{%- set with_desc = tool_descriptions if tool_descriptions is defined else true -%}"
    "{%- set with_system = system_turn if system_turn is defined else true -%}"
    "{%- if tools and with_system -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.first = 1 -%}"
    "{%- if messages[0]['content'] is defined and messages[0]['content'] is not none -%}"
    "{%- if messages[0]['content'] is not string -%}{{- raise_exception('system message content must be a string') -}}{%- endif -%}"
    "{%- set ns.system = messages[0]['content'] -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\n' ~ ns.system ~ '\nTools:\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = fn['parameters'] if fn['parameters'] is defined and fn['parameters'] else {} -%}"
    "{%- set props = params['properties'] if params['properties'] is defined and params['properties'] else {} -%}"
    "{%- set required = params['required'] if params['required'] is defined and params['required'] else [] -%}"
    "{%- if fn['name'] == 'final_answer' -%}{%- set ns.typed = true -%}{%- endif -%}"
    "{{- '- ' ~ fn['name'] ~ '(' -}}"
    "{%- for key, spec in props.items() -%}"
    "{{- (', ' if not loop.first else '') ~ key ~ ('' if key in required else '?') ~ ': '"
    " ~ (spec['type'] if spec['type'] is defined else 'any') -}}"
    "{%- endfor -%}"
    "{{- ')' -}}"
    "{%- if with_desc -%}{{- ' - ' ~ (fn['description'] if fn['description'] is defined else '') -}}{%- endif -%}"
    "{{- '\n' if not loop.last else '' -}}"
    "{%- endfor -%}"
    '{{- \'\nCall a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>. \' ~ '
    "('End with a final_answer call.' if ns.typed else 'Reply without a tool call to give the final answer.')"
    " ~ '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.index0 >= ns.first -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown role ' ~ (message['role'] | tojson) ~ '; expected one of system, user, assistant, tool') -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] if message['content'] is defined and message['content'] is not none else '' -%}"
    "{%- if content is not string -%}{{- raise_exception(message['role'] ~ ' message content must be a string') -}}{%- endif -%}"
    "{%- set calls = message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else [] -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}"
    "{{- content -}}"
    "{%- for call in calls -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is defined and fn['arguments'] is not none else {} -%}"
    "{{- '<tool_call>{\"name\": ' ~ (fn['name'] | tojson) ~ ', \"arguments\": '"
    " ~ (args if args is string else args | tojson) ~ '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- else -%}"
    "{%- if calls -%}{{- raise_exception('only assistant messages carry tool_calls, not ' ~ (message['role'] | tojson)) -}}{%- endif -%}"
    "{{- content ~ '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def chat_template_for(fmt: "PromptFormat") -> str:
    """The chat template a run with prompt format ``fmt`` saves with its checkpoints: :data:`CHAT_TEMPLATE`
    with the run's ``tool_descriptions`` and ``system_turn`` as the defaults of the template's variables of
    those names, so a plain ``apply_chat_template(messages, tools=...)`` renders the prompt the policy was
    trained on (with ``system_turn: false``, no system turn even though tools are given); a caller may
    still pass either variable."""
    t = CHAT_TEMPLATE
    for name, on in (("tool_descriptions", fmt.tool_descriptions), ("system_turn", fmt.system_turn)):
        if not on:
            default = f"{name} if {name} is defined else true"
            assert t.count(default) == 1
            t = t.replace(default, f"{name} if {name} is defined else false")
    return t


@dataclass
class ParsedAction:
    kind: Literal["tool", "answer", "malformed"]
    raw: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    text: str | None = None  # final answer text
    error: str | None = None
    body: str | None = None  # a tool call's JSON as written (a typed final answer is judged on it)


# malformed-call errors name no tag: an observation never carries a template's control string (a re-render
# with apply_chat_template, serve or vLLM would tokenise it as the control token)
ONE_CALL_ERROR = "malformed tool call: expected exactly one call, opened and closed once by the tool-call tags"
UNBALANCED_ERROR = "malformed tool call: the closing tool-call tag comes before the opening one"
MAX_JSON_DEPTH = 64  # nesting a tool call's JSON may have (deeper: a malformed call, never a RecursionError)
MAX_ERROR_CHARS = 500  # error text shown to the policy (a bad argument is never echoed whole)


class Control(str):
    """A piece of a rendering that is a control token, written by the template (never by content)."""


def message_pieces(role: str, content: str | list[str]) -> list[str]:
    """One message: ``content`` is a string (plain text) or already a list of pieces."""
    body = [content] if isinstance(content, str) else list(content)
    return [Control(IM_START), f"{role}\n", *body, Control(IM_END), "\n"]


def tool_call_pieces(name: str, arguments: dict[str, Any]) -> list[str]:
    return [Control(TOOL_CALL_OPEN), dumps_compact({"name": name, "arguments": arguments}), Control(TOOL_CALL_CLOSE)]


def turn_pieces(text: str) -> list[str]:
    """A policy turn's text as pieces: its tool-call tags are the policy's own control tokens;
    everything else (``<|im_end|>``, ``<|im_start|>`` included) is text."""
    pieces: list[str] = []
    for i, part in enumerate(_TAGS.split(text)):
        if part:
            pieces.append(Control(part) if i % 2 else part)
    return pieces


_TAGS = re.compile(f"({re.escape(TOOL_CALL_OPEN)}|{re.escape(TOOL_CALL_CLOSE)})")


def render_message(role: str, content: str) -> str:
    return "".join(message_pieces(role, content))


def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    return "".join(tool_call_pieces(name, arguments))


_SURROGATES = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> str:
    """``text`` with every surrogate code point (not encodable as UTF-8) replaced by U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


def clip_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def json_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON ``text``, outside strings (linear, no recursion)."""
    brackets = _NOT_BRACKET.sub("", _STRINGS.sub("", text))
    return max(0, max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0))


_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def loads_bounded(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for untrusted text: nesting deeper than ``max_depth`` raises ``ValueError``
    (never ``RecursionError``). Non-finite numbers (NaN, Infinity) parse; tools refuse them."""
    if json_depth(text) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None


def parse_action(text: str) -> ParsedAction:
    """Parse one policy turn (the text before the stop token).

    A turn that contains a tool-call tag is a tool call and must be exactly one
    well-formed ``<tool_call>{json}</tool_call>``; anything else is a final answer.
    Never raises: a call that cannot be parsed (bad JSON, nesting deeper than
    :data:`MAX_JSON_DEPTH`) is ``malformed``.
    """
    raw = text
    if TOOL_CALL_OPEN not in text and TOOL_CALL_CLOSE not in text:
        return ParsedAction("answer", raw=raw, text=text.strip())
    if text.count(TOOL_CALL_OPEN) != 1 or text.count(TOOL_CALL_CLOSE) != 1:
        return ParsedAction("malformed", raw=raw, error=ONE_CALL_ERROR)
    start, end = text.find(TOOL_CALL_OPEN), text.find(TOOL_CALL_CLOSE)
    if end < start:
        return ParsedAction("malformed", raw=raw, error=UNBALANCED_ERROR)
    body = text[start + len(TOOL_CALL_OPEN) : end].strip()
    try:
        obj = loads_bounded(body)
    except json.JSONDecodeError as e:
        return ParsedAction("malformed", raw=body, error=f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})")
    except ValueError as e:
        return ParsedAction("malformed", raw=body, error=f"malformed tool call: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedAction(
            "malformed", raw=body, error='malformed tool call: expected {"name": str, "arguments": object}'
        )
    args = obj.get("arguments", {})
    # Leave argument type checking to the tool's JSON schema (error kind "bad_arguments").
    return ParsedAction("tool", raw=body, name=obj["name"], arguments=args, body=body)


def render_observation_content(ok: bool, content: Any, error: str | None) -> str:
    return dumps_compact(content) if ok else f"error: {clip_text(str(error))}"


ANSWER_TOOL_NAME = "final_answer"  # an environment's typed-answer tool, by convention (the template names it)


def system_text(system_prompt: str, tool_signatures: list[str]) -> str:
    """The system turn: the prompt, the tools, the call syntax, and how to end (with the typed-answer tool
    when the environment has one, else a reply without a tool call)."""
    tools = "\n".join(f"- {s}" for s in tool_signatures)
    typed = any(s.startswith(ANSWER_TOOL_NAME + "(") for s in tool_signatures)
    ending = f"End with a {ANSWER_TOOL_NAME} call." if typed else "Reply without a tool call to give the final answer."
    return (
        f"{system_prompt}\nTools:\n{tools}\n"
        f'Call a tool with {TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}. {ending}'
    )


def prompt_pieces(system: str | None, user_message: str) -> list[str]:
    """System (if any) and user turns, then the header of the first assistant turn."""
    head = message_pieces("system", system) if system is not None else []
    return head + message_pieces("user", user_message) + [Control(IM_START), "assistant\n"]


def prompt_text(system: str | None, user_message: str) -> str:
    """System (if any) and user turns, then the header of the first assistant turn."""
    return "".join(prompt_pieces(system, user_message))


def observation_pieces(content: str) -> list[str]:
    """A tool observation. The policy's turn ended with <|im_end|>; this closes the line,
    renders the tool turn and opens the next assistant turn."""
    return ["\n", *message_pieces("tool", content), Control(IM_START), "assistant\n"]


def observation_text(content: str) -> str:
    return "".join(observation_pieces(content))


MEMO_TEXTS = 4096  # texts a ChatEncoder remembers the ids of
MEMO_CHARS = 8192  # the longest text it remembers


class ChatEncoder:
    """Pieces -> token ids for one tokenizer, with control tokens from the template only.

    A :class:`Control` piece becomes its token id (or, for a tokenizer without that token, its
    text, encoded with the text around it as ``tokenizer.encode`` of the whole rendering would). Runs of
    other pieces are joined and encoded as plain text: any control string in them (the contract's tokens
    and every special token the tokenizer has) is cut after its first character, so no run can match it, whatever the tokenizer's added-token settings
    (no tokenizer state is changed, so this is thread-safe). Surrogate code points (a lone
    ``"\\ud800"`` in a tool's output or a user's message is not valid Unicode, and tokenizers
    raise on it) become U+FFFD, one per code point, so bad content never crashes an episode.
    Other text without control strings encodes exactly as ``tokenizer.encode`` would."""

    def __init__(self, tokenizer: Any, extra_controls: Any = ()):
        """``extra_controls``: more strings to treat as control tokens (a checkpoint template's added,
        non-special tokens such as Qwen's ``<tool_call>``)."""
        self.tokenizer = tokenizer
        unk = getattr(tokenizer, "unk_token_id", None)
        names = set(SPECIAL_TOKENS) | set(getattr(tokenizer, "all_special_tokens", []) or []) | set(extra_controls)
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                names.add(str(tok.content))
        self.control_ids: dict[str, int] = {}
        for name in names:
            i = tokenizer.convert_tokens_to_ids(name)
            # a name that maps to the unknown id is absent, unless it *is* the unknown token
            # (the tiny tokenizers use <|endoftext|> as unk: it is still a control token)
            if isinstance(i, int) and (i != unk or tokenizer.convert_ids_to_tokens(i) == name):
                self.control_ids[name] = i
        # only strings that are tokens of this tokenizer can become control tokens: text is cut at those alone,
        # so a template string this tokenizer lacks (SmolLM2 has no <tool_call>) encodes as plain text would
        names = sorted((n for n in self.control_ids if n), key=len, reverse=True)
        self._control = re.compile("|".join(re.escape(n) for n in names)) if names else None
        # text -> ids: a GRPO group's episodes encode the same prompt, and often the same observations
        self._memo: dict[str, tuple[int, ...]] = {}

    def text(self, text: str) -> list[int]:
        """Plain text: control strings in ``text`` stay characters, never control tokens. Short texts
        are remembered (encoding is a pure function of the text and this tokenizer)."""
        if not text:
            return []
        hit = self._memo.get(text)
        if hit is not None:
            return list(hit)
        ids = self._encode(text)
        if len(text) <= MEMO_CHARS:
            if len(self._memo) >= MEMO_TEXTS:
                self._memo.clear()  # a plain dict (picklable, atomic under the GIL): start over when full
            self._memo[text] = tuple(ids)
        return ids

    def _encode(self, text: str) -> list[int]:
        text = replace_surrogates(text)
        pieces = [text]
        if self._control is not None:
            cuts = [m.start() + 1 for m in self._control.finditer(text)]
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
        ids: list[int] = []
        for piece in pieces:
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
        bad = set(ids) & set(self.control_ids.values())
        if bad:  # only a one-character control token (or a normalising match) gets here
            raise ValueError(f"text {clip_text(text, 80)!r} encodes to control token ids {sorted(bad)}")
        return ids

    def pieces(self, pieces: list[str]) -> list[int]:
        ids: list[int] = []
        run: list[str] = []
        for p in pieces:
            i = self.control_ids.get(p) if isinstance(p, Control) else None
            if i is not None:
                ids += self.text("".join(run))
                run = []
                ids.append(i)
            else:  # text, or a template string this tokenizer has no token for: part of the text around it
                run.append(str(p))
        return ids + self.text("".join(run))


MAX_STATED_CONTEXT = 10**7  # a tokenizer's model_max_length at or above this is transformers' "unset" sentinel
# a trajectory's record of its episode's whole token budget; its ``max_total_tokens`` is the configured limit.
# Trajectories written before this key existed recorded the budget under ``max_total_tokens``.
EFFECTIVE_BUDGET_KEY = "effective_max_total_tokens"


@dataclass
class RolloutContract:
    """Tokenizer + template + tool syntax + sampling + limits, shared by rollout and learner."""

    tokenizer: Any
    system_prompt: str
    tool_signatures: list[str]
    env_name: str
    env_version: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    limits: ContractLimits = field(default_factory=ContractLimits)
    system_turn: bool = True
    # the checkpoint's own chat template as the rendering (mentorrl.chat_templates.TemplateChat), or None:
    # the contract's ChatML rendering and tool-call syntax below
    chat: Any = None

    def __post_init__(self) -> None:
        if self.chat is not None:
            self._bind_chat()
            return
        tok = self.tokenizer
        ids = [tok.convert_tokens_to_ids(t) for t in (IM_END, IM_START)]
        unk = getattr(tok, "unk_token_id", None)
        if any(i is None or (unk is not None and i == unk) for i in ids):
            raise ValueError(
                f"tokenizer lacks the chat-template special tokens {IM_START} / {IM_END}; "
                "use a ChatML tokenizer (Qwen family) or one built by `mentorrl init-model`"
            )
        self.im_end_id = ids[0]
        stops = {self.im_end_id}
        if tok.eos_token_id is not None:
            stops.add(tok.eos_token_id)
        self.stop_token_ids = sorted(stops)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_token_id = int(pad)
        self.encoder = ChatEncoder(tok)
        self._bind_budget()

    def _bind_chat(self) -> None:
        """Stop tokens, pad and encoder for the checkpoint template's rendering (``self.chat``)."""
        tok, chat = self.tokenizer, self.chat
        self.im_end_id = chat.stop_id  # the token that ends a policy turn, as the template writes it
        stops = {self.im_end_id} | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        self.stop_token_ids = sorted(stops)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_token_id = int(pad if pad is not None else self.im_end_id)
        self.encoder = ChatEncoder(tok, chat.control_names)
        self._bind_budget()

    def _bind_budget(self) -> None:
        """The token budget of an episode (:attr:`max_total_tokens`): ``limits.max_total_tokens`` for the
        task's message, the policy's turns and the observations, plus the system turn (:attr:`system_tokens`:
        the system prompt and the tool schemas, however many tools there are), at most the model's
        context (:attr:`context_tokens`, the tokenizer's ``model_max_length`` when it states one)."""
        bare = (
            self.chat.render([{"role": "user", "content": ""}], add_generation_prompt=True, with_tools=False)
            if self.chat is not None
            else prompt_pieces(None, "")
        )
        self.system_tokens = max(0, len(self.prompt_ids("")) - len(self.encoder.pieces(bare)))
        stated = getattr(self.tokenizer, "model_max_length", None)
        self.context_tokens = stated if isinstance(stated, int) and 0 < stated < MAX_STATED_CONTEXT else None
        total = self.limits.max_total_tokens + self.system_tokens
        self.max_total_tokens = min(total, self.context_tokens) if self.context_tokens else total
        self._fingerprint = self._compute_fingerprint()

    # ---- rendering (text) -------------------------------------------------
    def system_text(self) -> str | None:
        return system_text(self.system_prompt, self.tool_signatures) if self.system_turn else None

    def prompt_text(self, user_message: str) -> str:
        if self.chat is not None:
            return "".join(self.chat.prompt_pieces(user_message))
        return prompt_text(self.system_text(), user_message)

    def observation_text(self, content: str) -> str:
        if self.chat is not None:
            return "".join(self.chat.observation_pieces(content))
        return observation_text(content)

    # ---- tool calls in the policy's format ------------------------------------
    def parse_action(self, text: str) -> ParsedAction:
        """A policy turn's text (before the stop token) as an action, in the rendering's tool-call format."""
        return self.chat.parse(text) if self.chat is not None else parse_action(text)

    def render_tool_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One tool call as the policy writes it (a scripted expert's turn)."""
        return self.chat.render_call(name, arguments) if self.chat is not None else render_tool_call(name, arguments)

    # ---- token ids (rendered once) ---------------------------------------
    def encode(self, text: str) -> list[int]:
        """The tokenizer's own encoding of template text: control strings in it become control
        tokens. Never for content (use :meth:`ChatEncoder.text`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, user_message: str) -> list[int]:
        """The prompt; the system prompt and the user's message are plain text."""
        if self.chat is not None:
            return self.encoder.pieces(self.chat.prompt_pieces(user_message))
        return self.encoder.pieces(prompt_pieces(self.system_text(), user_message))

    def observation_ids(self, content: str) -> list[int]:
        """A tool observation; ``content`` (the environment's output) is plain text."""
        if self.chat is not None:
            return self.encoder.pieces(self.chat.observation_pieces(content))
        return self.encoder.pieces(observation_pieces(content))

    def policy_turn_ids(self, text: str) -> list[int]:
        """Ids for a policy turn written by someone else (expert demos, a teacher's reply): the
        text plus the stop token. Its tool-call tags are control tokens; the rest is plain text."""
        pieces = self.chat.turn_pieces(text) if self.chat is not None else turn_pieces(text)
        return self.encoder.pieces(pieces) + [self.im_end_id]

    def decode_turn(self, ids: list[int]) -> str:
        """Text of a generated turn, without the stop token."""
        ids = [i for i in ids if i not in self.stop_token_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- provenance -------------------------------------------------------
    def fingerprint(self) -> str:
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        vocab = self.tokenizer.get_vocab()
        h = hashlib.sha256()
        h.update(json.dumps(sorted(vocab.items()), separators=(",", ":")).encode())
        h.update(self.prompt_text("").encode())
        h.update(self.observation_text("").encode())
        h.update(json.dumps(self.sampling.model_dump(), sort_keys=True).encode())
        h.update(json.dumps(self.limits.model_dump(), sort_keys=True).encode())
        h.update(f"{self.env_name}:{self.env_version}".encode())
        h.update(b"content:plain-text")  # message content never encodes to control tokens
        if self.chat is not None:  # the checkpoint's template and its tool-call format
            h.update(f"chat:{self.chat.name}".encode())
        return h.hexdigest()[:16]

    def sampling_dict(self) -> dict[str, Any]:
        return {**self.sampling.model_dump(), **self.limits.model_dump()}

    def trajectory_sampling(self, budget: int | None = None) -> dict[str, Any]:
        """What a trajectory records of its contract: the sampling parameters and the configured limits
        (``max_total_tokens`` is ``limits.max_total_tokens``, as configured), plus the episode's whole
        budget under its own key, ``EFFECTIVE_BUDGET_KEY`` (``budget``, default :attr:`max_total_tokens`:
        the limit plus the system turn, capped by the context; an episode's own token budget may lower it)."""
        return {**self.sampling_dict(), EFFECTIVE_BUDGET_KEY: self.max_total_tokens if budget is None else budget}


def tool_signatures(env: Any, fmt: PromptFormat | None = None) -> list[str]:
    fmt = fmt or PromptFormat()
    return [t.signature(with_description=fmt.tool_descriptions) for t in env.registry.tools.values()]


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """The environment's tools as OpenAI function schemas (``tools=`` of ``apply_chat_template`` or
    a chat-completions request); rendered, they give the contract's tool signatures."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in env.registry.tools.values()
    ]


def contract_for_env(
    tokenizer: Any,
    env: Any,
    sampling: SamplingParams | None = None,
    limits: ContractLimits | None = None,
    prompt: PromptFormat | None = None,
    chat: Any = None,
) -> RolloutContract:
    """The contract of ``env`` for ``tokenizer``; ``chat``: the checkpoint template's rendering
    (:func:`mentorrl.chat_templates.native_chat_for`), or None for the contract's ChatML one."""
    prompt = prompt or PromptFormat()
    return RolloutContract(
        tokenizer=tokenizer,
        system_prompt=env.system_prompt,
        tool_signatures=tool_signatures(env, prompt),
        env_name=env.name,
        env_version=env.version,
        sampling=sampling or SamplingParams(),
        limits=limits or ContractLimits(),
        system_turn=prompt.system_turn,
        chat=chat,
    )


__all__ = [
    "CHAT_TEMPLATE",
    "chat_template_for",
    "ChatEncoder",
    "Control",
    "MAX_ERROR_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_STATED_CONTEXT",
    "EFFECTIVE_BUDGET_KEY",
    "ContractLimits",
    "ParsedAction",
    "PromptFormat",
    "RolloutContract",
    "SPECIAL_TOKENS",
    "SamplingParams",
    "contract_for_env",
    "clip_text",
    "loads_bounded",
    "message_pieces",
    "observation_pieces",
    "parse_action",
    "prompt_pieces",
    "render_message",
    "render_observation_content",
    "render_tool_call",
    "replace_surrogates",
    "tool_call_pieces",
    "tool_schemas",
    "turn_pieces",
]
