"""Trajectories, corrections and preference pairs <-> Hugging Face ``datasets`` in TRL's formats.

``mentorrl export`` and ``mentorrl import`` (:mod:`mentorrl.cli.data`) are thin wrappers around
this module; docs/datasets.md is the user's page.

**Out.** A recorded :class:`~mentorrl.trajectory.Trajectory` becomes a row of TRL's
*conversational* SFT format, ``{"messages": [...], "tools": [...]}`` plus provenance columns:

* the messages are read from the token ids at the token level: a message is what lies between a
  ``<|im_start|>`` and an ``<|im_end|>`` *control token*, so content that merely contains the
  text ``"<|im_end|>"`` (which the contract always encodes as plain text) cannot split it;
* a policy turn with one well-formed tool call becomes an OpenAI-style assistant message
  (``tool_calls=[{"id", "type": "function", "function": {"name", "arguments": JSON string}}]``,
  any text before the call as ``content``); any other turn (an answer, a malformed call) is its
  text as ``content``; an observation becomes a ``tool`` message (``tool_call_id``, ``name``);
* when the environment is known (``env_info``) and its system prompt and tool schemas render the
  recorded system turn exactly, the system message is the environment's system prompt and
  ``tools`` its OpenAI function schemas, so ``tokenizer.apply_chat_template(messages,
  tools=tools)`` with mentorrl's chat template (what TRL calls) renders the rollout's text;
  otherwise (tools listed without descriptions, an unknown environment) the system message is
  the recorded system text verbatim and ``tools`` is empty (the text already lists them).

A preference pair (flywheel corrections: chosen = verified correction, rejected = the failure;
same prompt ids) becomes TRL's conversational preference row ``{"prompt", "chosen",
"rejected", "tools"}``: the prompt is the shared system and user messages, ``chosen`` and
``rejected`` the rest of each conversation.

Columns are stored with fixed Arrow types (tool-call arguments as JSON strings, as OpenAI
sends them) and ``tools`` as ``List(Json())``, so schemas with different parameters never
merge into one struct padded with nulls. ``datasets.load_dataset("parquet", ...)`` reads the
files back.

**In.** :func:`read_conversations` reads such a dataset (Parquet files, a ``save_to_disk``
folder, JSON lines) with a ``messages`` column, or ``prompt`` + ``completion`` / ``chosen``
(the chosen side of a preference set), validates every row and normalises it; a bad row raises
:class:`DatasetFormatError` naming the row and the field. :func:`conversation_trajectory`
renders one conversation into token ids exactly as a rollout would (prompt, then each
assistant turn plus ``<|im_end|>`` with loss mask 1, each run of other messages as an
observation with loss mask 0); message content is plain text (:class:`~mentorrl.contract.ChatEncoder`),
so control tokens inside content stay characters. A scripted expert's trajectory exported and
imported again has the same token ids.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

from mentorrl.chat import MessageError, message_pieces_of, prompt_pieces, tool_signature
from mentorrl.contract import (
    ANSWER_TOOL_NAME,
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatEncoder,
    Control,
    loads_bounded,
    message_pieces,
    parse_action,
    system_text,
)
from mentorrl.trajectory import Segment, ToolCall, Trajectory, dumps_compact

Kind = Literal["trajectories", "corrections", "preferences"]
KINDS: tuple[str, ...] = ("trajectories", "corrections", "preferences")
TRAIN_SPLIT = "train"
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
DEFAULT_MAX_CHARS = 1_000_000  # characters of content in one row
DEFAULT_MAX_TOKENS = 8192  # tokens of one imported conversation

# which files of a run directory hold what (globs relative to RUN_DIR)
RUN_FILES: dict[str, tuple[str, ...]] = {
    "trajectories": ("samples/*.jsonl", "rft/data-round-*.jsonl", "eval_*.jsonl", "**/trajectories-*.jsonl"),
    "corrections": ("**/corrections_sft.jsonl",),
    "preferences": ("**/preference_pairs.jsonl",),
}

EnvInfo = Callable[[str], "tuple[str, list[dict[str, Any]]] | None"]  # env name -> (system prompt, tool schemas)


class DatasetFormatError(ValueError):
    """A dataset row that is not a conversation mentorrl can train on; the message names the row and field."""


# ------------------------------------------------------------------ trajectory -> messages ----
def _segments(traj: Trajectory) -> list[Segment]:
    """The trajectory's segments, or (for records without them) runs of its loss mask."""
    if traj.segments:
        return list(traj.segments)
    segs: list[Segment] = []
    start = 0
    for i in range(1, len(traj.loss_mask) + 1):
        if i == len(traj.loss_mask) or traj.loss_mask[i] != traj.loss_mask[start]:
            role = "policy" if traj.loss_mask[start] else ("prompt" if not segs else "observation")
            segs.append(Segment(role=role, start=start, end=i))
            start = i
    return segs


def _control_id(tokenizer: Any, token: str) -> int:
    i = tokenizer.convert_tokens_to_ids(token)
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(i, int) or (i == unk and tokenizer.convert_ids_to_tokens(i) != token):
        raise ValueError(f"the tokenizer has no {token} token: use the run's ChatML tokenizer (--model)")
    return i


def _header_messages(ids: list[int], tokenizer: Any, start_id: int, end_id: int) -> list[dict[str, Any]]:
    """The ``role\\ncontent`` messages between ``<|im_start|>`` and ``<|im_end|>`` control tokens
    (a trailing ``<|im_start|>assistant\\n`` header has no end and is not a message)."""
    out: list[dict[str, Any]] = []
    i = 0
    while True:
        try:
            s = ids.index(start_id, i)
            e = ids.index(end_id, s + 1)
        except ValueError:
            return out
        role, _, content = tokenizer.decode(ids[s + 1 : e], skip_special_tokens=False).partition("\n")
        out.append({"role": role, "content": content})
        i = e + 1


def turn_message(text: str, call_id: str) -> dict[str, Any]:
    """An assistant message for one policy turn's text (without its stop token), parsed as a rollout
    parses it: one well-formed call that ends the turn is a tool call (its JSON re-serialised as the
    contract writes it); anything else stays the turn's text."""
    action = parse_action(text)
    if action.kind == "tool" and isinstance(action.arguments, dict) and text.endswith(TOOL_CALL_CLOSE):
        return _call_message(text[: text.find(TOOL_CALL_OPEN)], action.name, action.arguments, call_id)
    return {"role": "assistant", "content": text}


def _call_message(prefix: str, name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": prefix or None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": dumps_compact(arguments)}}
        ],
    }


def _policy_message(ids: list[int], tokenizer: Any, tags: tuple[int, int] | None, call_id: str) -> dict[str, Any]:
    """The assistant message of a policy turn's ids: with exactly one tool-call tag pair as *control
    tokens* the text between them is the call (so tag strings inside its JSON stay text); otherwise
    the decoded text, parsed as a rollout parses it."""

    def decode(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False)

    if tags is not None and ids.count(tags[0]) == 1 and ids.count(tags[1]) == 1:
        o, c = ids.index(tags[0]), ids.index(tags[1])
        if o < c:
            try:
                obj = loads_bounded(decode(ids[o + 1 : c]).strip())
            except ValueError:  # JSONDecodeError included
                obj = None
            if (
                isinstance(obj, dict)
                and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)
                and c == len(ids) - 1
            ):
                return _call_message(decode(ids[:o]), obj["name"], obj.get("arguments", {}), call_id)
    return turn_message(decode(ids), call_id)


def trajectory_messages(traj: Trajectory, tokenizer: Any) -> list[dict[str, Any]]:
    """The recorded conversation as OpenAI-style messages, read from the token ids.

    The system message (if the prompt had one) is the full system text as rendered (tools included)."""
    start_id, end_id = _control_id(tokenizer, IM_START), _control_id(tokenizer, IM_END)
    stops = {end_id} | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    try:
        tags: tuple[int, int] | None = (_control_id(tokenizer, TOOL_CALL_OPEN), _control_id(tokenizer, TOOL_CALL_CLOSE))
    except ValueError:
        tags = None
    msgs: list[dict[str, Any]] = []
    last_call: dict[str, Any] | None = None
    n_calls = 0
    for seg in _segments(traj):
        ids = traj.token_ids[seg.start : seg.end]
        if seg.role == "policy":
            while ids and ids[-1] in stops:
                ids = ids[:-1]
            msg = _policy_message(ids, tokenizer, tags, f"call_{n_calls}")
            last_call = msg["tool_calls"][0] if msg.get("tool_calls") else None
            n_calls += last_call is not None
            msgs.append(msg)
            continue
        for m in _header_messages(ids, tokenizer, start_id, end_id):
            if m["role"] == "tool" and last_call is not None:
                m["tool_call_id"], m["name"] = last_call["id"], last_call["function"]["name"]
            msgs.append(m)
    return msgs


def with_tools(
    messages: list[dict[str, Any]], info: tuple[str, list[dict[str, Any]]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(messages, tools)`` for TRL: the environment's system prompt and tool schemas when they
    render the recorded system text exactly; else the messages as they are and no tools."""
    if info is None or not messages or messages[0]["role"] != "system":
        return messages, []
    system_prompt, schemas = info
    if messages[0]["content"] != system_text(system_prompt, [tool_signature(t) for t in schemas]):
        return messages, []
    return [{"role": "system", "content": system_prompt}, *messages[1:]], [dict(t) for t in schemas]


def _meta(traj: Trajectory, source_file: str) -> dict[str, Any]:
    r = traj.reward
    return {
        "id": traj.id,
        "task_id": traj.task_id,
        "family": traj.family,
        "split": traj.split,
        "difficulty": traj.difficulty,
        "env_name": traj.env_name,
        "env_version": traj.env_version,
        "source": traj.source,
        "policy_version": traj.policy_version,
        "success": None if r is None else bool(r.success),
        "violations": None if r is None else list(r.violations),
        "reward": None if r is None else float(r.total),
        "finish_reason": traj.finish_reason,
        "num_turns": traj.num_turns,
        "source_file": source_file,
    }


def sft_row(traj: Trajectory, tokenizer: Any, env_info: EnvInfo | None = None, source_file: str = "") -> dict[str, Any]:
    """One row of TRL's conversational SFT format (``messages``, ``tools``) plus provenance."""
    messages, tools = with_tools(trajectory_messages(traj, tokenizer), env_info(traj.env_name) if env_info else None)
    return {"messages": messages, "tools": tools, **_meta(traj, source_file)}


def _prompt_len(messages: list[dict[str, Any]]) -> int:
    return next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))


def preference_row(
    pair: Mapping[str, Any], tokenizer: Any, env_info: EnvInfo | None = None, source_file: str = ""
) -> dict[str, Any]:
    """One row of TRL's conversational preference format from a flywheel preference pair
    (``task_id``, ``failure_type``, ``chosen`` and ``rejected`` trajectories sharing a prompt)."""
    chosen, rejected = Trajectory.model_validate(pair["chosen"]), Trajectory.model_validate(pair["rejected"])
    info = env_info(chosen.env_name) if env_info else None
    c_msgs, tools = with_tools(trajectory_messages(chosen, tokenizer), info)
    r_msgs, r_tools = with_tools(trajectory_messages(rejected, tokenizer), info)
    n = _prompt_len(c_msgs)
    if c_msgs[:n] != r_msgs[: _prompt_len(r_msgs)] or tools != r_tools:
        raise DatasetFormatError(f"pair for task {pair.get('task_id')!r}: chosen and rejected have different prompts")
    return {
        "prompt": c_msgs[:n],
        "chosen": c_msgs[n:],
        "rejected": r_msgs[n:],
        "tools": tools,
        "task_id": chosen.task_id,
        "failure_type": str(pair.get("failure_type", "")),
        "chosen_id": chosen.id,
        "rejected_id": rejected.id,
        "split": rejected.split,
        "env_name": chosen.env_name,
        "env_version": chosen.env_version,
        "source_file": source_file,
    }


# ---------------------------------------------------------------------- run dir -> rows ----
@dataclass
class ExportSummary:
    kind: str
    rows: int = 0
    files: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    system_verbatim: int = 0  # rows whose system text could not be split into prompt + tools

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def run_files(run_dir: Path, kind: str) -> list[Path]:
    """The files of ``kind`` under ``run_dir`` (or ``run_dir`` itself when it is a file)."""
    if kind not in RUN_FILES:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if run_dir.is_file():
        return [run_dir]
    found = {p for g in RUN_FILES[kind] for p in run_dir.glob(g) if p.is_file()}
    return sorted(found)


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{path}:{i}: not a JSON object")
                yield i, obj


def export_rows(
    run_dir: Path,
    kind: str,
    tokenizer: Any,
    *,
    env_info: EnvInfo | None = None,
    only_success: bool = False,
    all_splits: bool = False,
) -> tuple[list[dict[str, Any]], ExportSummary]:
    """The rows of ``kind`` recorded in ``run_dir``, de-duplicated by trajectory id.

    Only ``train``-split trajectories are exported unless ``all_splits`` (held-out and hidden
    evaluation episodes are not training data). ``only_success``: trajectories the verifier
    accepted with no violation (for preferences: the chosen side is always verified)."""
    summary = ExportSummary(kind=kind)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    root = run_dir if run_dir.is_dir() else run_dir.parent
    for path in run_files(run_dir, kind):
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        summary.files.append(rel)
        for line, obj in _json_lines(path):
            where = f"{path}:{line}"
            try:
                if kind == "preferences":
                    sides = [obj.get("chosen"), obj.get("rejected")]
                    if not all(isinstance(x, dict) for x in sides):
                        raise ValueError("a preference pair needs 'chosen' and 'rejected' trajectories")
                    key = f"{sides[0].get('id')}|{sides[1].get('id')}"
                    split = sides[1].get("split", TRAIN_SPLIT)
                    ok = True
                else:
                    traj = Trajectory.model_validate(obj)
                    key, split = traj.id, traj.split
                    ok = bool(traj.reward and traj.reward.success and not traj.reward.violations)
            except ValueError as e:
                raise ValueError(f"{where}: not a valid record: {e}") from None
            if key in seen:
                summary.skip("duplicate")
                continue
            if split != TRAIN_SPLIT and not all_splits:
                summary.skip(f"split {split}")
                continue
            if only_success and not ok:
                summary.skip("not a success")
                continue
            seen.add(key)
            try:
                row = (
                    preference_row(obj, tokenizer, env_info, rel)
                    if kind == "preferences"
                    else sft_row(traj, tokenizer, env_info, rel)
                )
            except (ValueError, KeyError) as e:
                raise ValueError(f"{where}: {e}") from None
            first = (row["prompt"] if kind == "preferences" else row["messages"])[:1]
            summary.system_verbatim += bool(first and first[0]["role"] == "system" and not row["tools"])
            rows.append(row)
    summary.rows = len(rows)
    return rows, summary


# ----------------------------------------------------------------- rows -> datasets ----
def _need_datasets():
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - the extra is installed in CI
        raise ImportError(
            "mentorrl export/import need the `datasets` package: pip install 'datasets>=4.7' pyarrow"
        ) from e
    if not hasattr(datasets, "Json"):  # pragma: no cover
        raise ImportError(f"datasets {datasets.__version__} has no Json feature; pip install 'datasets>=4.7'")
    return datasets


def features(kind: str):
    """The Arrow schema of an exported dataset (fixed message struct, ``tools`` as ``List(Json())``)."""
    ds = _need_datasets()
    Value, List = ds.Value, ds.List
    call = {
        "id": Value("string"),
        "type": Value("string"),
        "function": {"name": Value("string"), "arguments": Value("string")},
    }
    message = {
        "role": Value("string"),
        "content": Value("string"),
        "tool_calls": List(call),
        "tool_call_id": Value("string"),
        "name": Value("string"),
    }
    conv = List(message)
    common = {
        "tools": List(ds.Json()),
        "split": Value("string"),
        "env_name": Value("string"),
        "env_version": Value("string"),
        "task_id": Value("string"),
        "source_file": Value("string"),
    }
    if kind == "preferences":
        return ds.Features(
            {
                "prompt": conv,
                "chosen": conv,
                "rejected": conv,
                **common,
                "failure_type": Value("string"),
                "chosen_id": Value("string"),
                "rejected_id": Value("string"),
            }
        )
    return ds.Features(
        {
            "messages": conv,
            **common,
            "id": Value("string"),
            "family": Value("string"),
            "difficulty": Value("string"),
            "source": Value("string"),
            "policy_version": Value("int64"),
            "success": Value("bool"),
            "violations": List(Value("string")),
            "reward": Value("float64"),
            "finish_reason": Value("string"),
            "num_turns": Value("int64"),
        }
    )


def _padded(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: m.get(k) for k in MESSAGE_KEYS} for m in msgs]


def to_dataset(rows: Sequence[Mapping[str, Any]], kind: str):
    """A ``datasets.Dataset`` of exported rows with :func:`features`."""
    ds = _need_datasets()
    conv_cols = ("prompt", "chosen", "rejected") if kind == "preferences" else ("messages",)
    feats = features(kind)
    cols: dict[str, list[Any]] = {k: [] for k in feats}
    for r in rows:
        for k in feats:
            cols[k].append(_padded(r[k]) if k in conv_cols else r.get(k))
    return ds.Dataset.from_dict(cols, features=feats)


def write_dataset(rows: Sequence[Mapping[str, Any]], kind: str, out: Path, fmt: str = "parquet") -> Path:
    """``out/<kind>.parquet`` (``Dataset.to_parquet``) or ``out/<kind>/`` (``save_to_disk``); returns the path."""
    dataset = to_dataset(rows, kind)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        path = out / f"{kind}.parquet"
        dataset.to_parquet(str(path))
    elif fmt == "disk":
        path = out / kind
        dataset.save_to_disk(str(path))
    else:
        raise ValueError(f"unknown format {fmt!r}; expected parquet or disk")
    return path


# ------------------------------------------------------------------ datasets -> rows ----
def load_rows(path: Path, split: str | None = None):
    """A dataset from Parquet file(s), a ``save_to_disk`` folder or JSON lines (rows decoded lazily)."""
    ds = _need_datasets()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        data = ds.load_from_disk(str(path))
    else:
        files = (
            [path]
            if path.is_file()
            else sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".json") and p.is_file())
        )
        if not files:
            raise DatasetFormatError(f"{path}: no .parquet, .jsonl or .json files")
        suffixes = {p.suffix for p in files}
        builder = "parquet" if suffixes == {".parquet"} else "json" if suffixes <= {".jsonl", ".json"} else None
        if builder is None:
            raise DatasetFormatError(f"{path}: mixed file types {sorted(suffixes)}; point at one kind")
        data = ds.load_dataset(builder, data_files=[str(p) for p in files], split="train")
    if isinstance(data, ds.DatasetDict):
        name = split or ("train" if "train" in data else next(iter(data)))
        if name not in data:
            raise DatasetFormatError(f"{path}: no split {name!r} (has {', '.join(data)})")
        data = data[name]
    return data


def _clean(value: Any) -> Any:
    """``value`` without None-valued keys (what Arrow structs pad missing keys with)."""
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _text(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)  # content parts: text only
    raise DatasetFormatError(f"{where}: content must be a string (or text parts), not {type(value).__name__}")


def normalize_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI function schemas from a ``tools`` cell (a list, a JSON string, or None)."""
    if tools is None:
        return []
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DatasetFormatError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(tools, list):
        raise DatasetFormatError(f"{where}: must be a list of function schemas")
    out = []
    for j, t in enumerate(tools):
        t = _clean(json.loads(t) if isinstance(t, str) else t)
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DatasetFormatError(f"{where}[{j}]: a tool needs function.name")
        if not isinstance(fn.get("parameters", {}), Mapping):
            raise DatasetFormatError(f"{where}[{j}]: function.parameters must be an object")
        out.append(dict(t))
    return out


def normalize_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Validated OpenAI-style messages: roles in order, one tool call per assistant turn
    (mentorrl's contract), tool messages only after an assistant turn; keys other than
    role, content, tool_calls, tool_call_id and name are dropped."""
    if not isinstance(messages, list) or not messages:
        raise DatasetFormatError(f"{where}: must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for j, m in enumerate(messages):
        out.append(normalize_message(m, j, f"{where}[{j}]", out[-1]["role"] if out else None))
    n = _prompt_len(out)
    if n == len(out):
        raise DatasetFormatError(f"{where}: no assistant message (nothing to learn)")
    if not any(m["role"] == "user" for m in out[:n]):
        raise DatasetFormatError(f"{where}[{n}]: the first assistant message comes before any user message")
    return out


def normalize_message(m: Any, j: int, at: str, previous_role: str | None) -> dict[str, Any]:
    """Message ``j`` of a conversation (``at`` names it in errors), validated after a message of
    ``previous_role`` (None for the first)."""
    if not isinstance(m, Mapping):
        raise DatasetFormatError(f"{at}: a message must be an object, not {type(m).__name__}")
    role = m.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise DatasetFormatError(f"{at}.role: {role!r} is not one of system, user, assistant, tool")
    if role == "system" and j != 0:
        raise DatasetFormatError(f"{at}.role: a system message must come first")
    if role == "tool" and previous_role not in ("assistant", "tool"):
        raise DatasetFormatError(f"{at}.role: a tool message must follow an assistant turn")
    msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{at}.content")}
    calls = m.get("tool_calls") or []
    if calls:
        if role != "assistant":
            raise DatasetFormatError(f"{at}.tool_calls: only assistant messages carry tool calls")
        msg["tool_calls"] = [normalize_tool_call(calls, at)]
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
    try:
        message_pieces_of(msg)  # the tool call's arguments parse (bounded depth) to a JSON object
    except MessageError as e:
        raise DatasetFormatError(f"{at}: {e}") from None
    return msg


def normalize_tool_call(calls: Any, at: str) -> dict[str, Any]:
    """The one tool call of an assistant message's ``tool_calls``, as ``{"type": "function", "function":
    {"name", "arguments" (a JSON string)}}`` with its ``id`` when it has one."""
    if not isinstance(calls, list) or len(calls) != 1:
        raise DatasetFormatError(
            f"{at}.tool_calls: mentorrl's contract makes one tool call per turn, "
            f"this message has {len(calls) if isinstance(calls, list) else 'malformed'}"
        )
    c = calls[0]
    fn = c.get("function", c) if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DatasetFormatError(f"{at}.tool_calls[0].function.name: missing")
    args = fn.get("arguments")
    args = {} if args is None else args
    if isinstance(args, Mapping):
        args = dumps_compact(_clean(dict(args)))
    if not isinstance(args, str):
        raise DatasetFormatError(f"{at}.tool_calls[0].function.arguments: a JSON object or string")
    call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(c.get("id"), str):
        call = {"id": c["id"], **call}
    return call


@dataclass
class Conversation:
    """One imported row: normalised messages, tools and what the row said about itself."""

    row: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)


def conversation_columns(columns: Iterable[str]) -> tuple[str, ...]:
    """Which columns hold the conversation: ``messages``, or ``prompt`` + ``completion`` / ``chosen``."""
    cols = set(columns)
    if "messages" in cols:
        return ("messages",)
    for second in ("completion", "chosen"):
        if {"prompt", second} <= cols:
            return ("prompt", second)
    raise DatasetFormatError(
        f"missing columns: need 'messages' (conversational SFT), 'prompt' + 'completion' or "
        f"'prompt' + 'chosen' (preference); the dataset has {sorted(cols)}"
    )


META_KEYS = ("id", "task_id", "family", "split", "difficulty", "env_name", "env_version", "source")


def read_conversations(
    data: Any,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    all_splits: bool = False,
    skip_invalid: bool = False,
    errors: list[str] | None = None,
) -> Iterator[Conversation]:
    """Validated conversations of a dataset (anything with ``column_names`` and row iteration,
    e.g. :func:`load_rows`'s result). A bad row raises :class:`DatasetFormatError` naming the row
    and field, or with ``skip_invalid`` is left out and its message appended to ``errors``.
    Rows of another split than ``train`` (a ``split`` column) are refused unless ``all_splits``."""
    cols = conversation_columns(data.column_names)
    for i, row in enumerate(data):
        try:
            yield _conversation(i, row, cols, max_chars, all_splits)
        except DatasetFormatError as e:
            if not skip_invalid:
                raise
            if errors is not None:
                errors.append(str(e))


def _conversation(
    i: int, row: Mapping[str, Any], cols: tuple[str, ...], max_chars: int, all_splits: bool
) -> Conversation:
    where = f"row {i}"
    split = row.get("split")
    if split not in (None, TRAIN_SPLIT) and not all_splits:
        raise DatasetFormatError(
            f"{where}.split: {split!r} rows are evaluation data, not demonstrations "
            "(pass --all-splits to import them anyway)"
        )
    parts: list[Any] = []
    for c in cols:
        v = row.get(c)
        if not isinstance(v, list):
            raise DatasetFormatError(f"{where}.{c}: must be a list of messages, not {type(v).__name__}")
        parts += v
    size = sum(len(v) for m in parts if isinstance(m, Mapping) for v in _strings(m))
    if size > max_chars:
        raise DatasetFormatError(
            f"{where}.{'+'.join(cols)}: {size} characters, over the limit of {max_chars} (--max-chars)"
        )
    messages = normalize_messages(parts, f"{where}.{'+'.join(cols)}")
    tools = normalize_tools(row.get("tools"), f"{where}.tools")
    meta = {k: row[k] for k in META_KEYS if isinstance(row.get(k), str)}
    return Conversation(row=i, messages=messages, tools=tools, meta=meta)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


# --------------------------------------------------------------- messages -> token ids ----
class ConversationEncoder:
    """Renders conversations into token ids the way a rollout does, for one ChatML tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.im_end_id = _control_id(tokenizer, IM_END)
        _control_id(tokenizer, IM_START)
        self.encoder = ChatEncoder(tokenizer)

    def segments(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[tuple[str, list[int]]]:
        """``(role, ids)`` per segment: the prompt (messages before the first assistant turn,
        the system turn with ``tools`` as the contract renders it), each assistant turn with its
        ``<|im_end|>``, each run of other messages between assistant turns (trailing ones are
        dropped: nothing after them is learnt)."""
        n = _prompt_len(messages)
        out = [("prompt", self.encoder.pieces(prompt_pieces(messages[:n], tools or None)))]
        pending: list[str] = []
        for m in messages[n:]:
            if m["role"] == "assistant":
                if out[-1][0] == "policy":  # the observation run between two turns (at least the next header)
                    out.append(("observation", self.encoder.pieces(["\n", *pending, Control(IM_START), "assistant\n"])))
                pending = []
                out.append(("policy", self.encoder.pieces(message_pieces_of(m)) + [self.im_end_id]))
            else:
                pending += message_pieces(m["role"], message_pieces_of(m))
        return out


def _digest(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps([messages, tools], sort_keys=True).encode()).hexdigest()[:10]


def conversation_trajectory(
    conv: Conversation, encoder: ConversationEncoder, *, max_tokens: int = DEFAULT_MAX_TOKENS
) -> Trajectory:
    """A demonstration trajectory (loss mask 1 on assistant turns, log-probs 0) for SFT."""
    segs = encoder.segments(conv.messages, conv.tools)
    total = sum(len(ids) for _, ids in segs)
    if total > max_tokens:
        raise DatasetFormatError(f"row {conv.row}: {total} tokens, over the limit of {max_tokens} (--max-tokens)")
    ids: list[int] = []
    mask: list[int] = []
    segments: list[Segment] = []
    for role, seg_ids in segs:
        segments.append(Segment(role=role, start=len(ids), end=len(ids) + len(seg_ids)))  # type: ignore[arg-type]
        ids += seg_ids
        mask += [1 if role == "policy" else 0] * len(seg_ids)
    calls: list[ToolCall] = []
    turns = 0
    final: str | None = None
    msgs = conv.messages
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        turns += 1
        if m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            nxt = msgs[j + 1] if j + 1 < len(msgs) and msgs[j + 1]["role"] == "tool" else None
            if fn["name"] == ANSWER_TOOL_NAME and nxt is None and j == len(msgs) - 1:
                # the conversation ends with the typed answer (a last call nothing answers): its JSON is the answer
                final = dumps_compact({"name": fn["name"], "arguments": json.loads(fn["arguments"])})
                continue
            calls.append(
                ToolCall(
                    turn=turns,
                    name=fn["name"],
                    arguments=json.loads(fn["arguments"]),
                    raw=dumps_compact({"name": fn["name"], "arguments": json.loads(fn["arguments"])}),
                    result=None if nxt is None else nxt["content"],
                )
            )
            final = None
        else:
            final = (m["content"] or "").strip()
    meta = conv.meta
    tid = meta.get("task_id") or meta.get("id") or f"import-{_digest(msgs, conv.tools)}"
    source = meta.get("source") if meta.get("source") in ("policy", "expert", "teacher") else "expert"
    return Trajectory(
        id=meta.get("id") or f"import-{_digest(msgs, conv.tools)}-{conv.row:06d}",
        task_id=tid,
        family=meta.get("family") or "imported",
        split=meta.get("split") or TRAIN_SPLIT,
        difficulty=meta.get("difficulty") or "normal",
        token_ids=ids,
        loss_mask=mask,
        logprobs=[0.0] * len(ids),
        segments=segments,
        env_name=meta.get("env_name") or "imported",
        env_version=meta.get("env_version") or "",
        tool_calls=calls,
        final_answer=final,
        finish_reason="answer" if final is not None else "max_turns",
        num_turns=turns,
        source=source,  # type: ignore[arg-type]
    )


def import_demos(
    data: Any,
    tokenizer: Any,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    all_splits: bool = False,
    skip_invalid: bool = False,
    errors: list[str] | None = None,
) -> list[Trajectory]:
    """SFT demonstrations (trajectories) from a dataset; see :func:`read_conversations`."""
    encoder = ConversationEncoder(tokenizer)
    out: list[Trajectory] = []
    for conv in read_conversations(
        data, max_chars=max_chars, all_splits=all_splits, skip_invalid=skip_invalid, errors=errors
    ):
        try:
            out.append(conversation_trajectory(conv, encoder, max_tokens=max_tokens))
        except (DatasetFormatError, ValueError) as e:
            msg = str(e) if str(e).startswith("row ") else f"row {conv.row}: {e}"
            if not skip_invalid:
                raise DatasetFormatError(msg) from None
            if errors is not None:
                errors.append(msg)
    return out


__all__ = [
    "Conversation",
    "ConversationEncoder",
    "DatasetFormatError",
    "ExportSummary",
    "KINDS",
    "RUN_FILES",
    "conversation_columns",
    "conversation_trajectory",
    "export_rows",
    "features",
    "import_demos",
    "load_rows",
    "normalize_messages",
    "normalize_tools",
    "preference_row",
    "read_conversations",
    "run_files",
    "sft_row",
    "to_dataset",
    "trajectory_messages",
    "turn_message",
    "with_tools",
    "write_dataset",
]
