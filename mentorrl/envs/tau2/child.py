"""The child side of the τ²-bench bridge: run by the clone's own interpreter (``python -I child.py
CLONE DOMAIN``), standard library only, never importing mentorrl.

It loads ``tau2.domains.<DOMAIN>.environment`` (``get_environment(solo_mode=True)`` with a third
argument ``solo``) from ``CLONE/src`` (the user's clone: the upstream
package with its dependencies in that interpreter, or any package of the same layout), with
``TAU2_DATA_DIR`` set to ``CLONE/data`` before the import, and answers one JSON object per line
on the stdout it was given; everything the domain prints goes to stderr instead. Requests:

* ``hello``: the interpreter's version, the domain policy, the agent tools' OpenAI schemas and
  which of them change state;
* ``reset``: a fresh environment (the domain's ``get_environment()``), with the task's initial state;
* ``call``: one agent tool call on it: ``{"ok": true, "content": text}`` or ``{"ok": false, "error": ...}``;
* ``evaluate``: the gold actions replayed on another fresh environment and the two DB hashes (agent
  and user DB) compared; each env assertion run on the live environment.

Any exception is an ``{"ok": false, "error": ...}`` reply; the parent treats this process's output
as untrusted (bounded, parsed strictly) and kills it when it misbehaves.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Any

MAX_TEXT = 65536  # characters of one tool result or error sent back (the parent clips again)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"... [{len(text) - MAX_TEXT} more characters]"


class Domain:
    def __init__(self, clone: str, domain: str, solo: bool = False):
        self.domain, self.solo = domain, solo
        self.module = importlib.import_module(f"tau2.domains.{domain}.environment")
        self.env: Any = None

    def fresh(self, initial_state: Any, solo: bool = False) -> Any:
        env = self.module.get_environment(solo_mode=True) if solo else self.module.get_environment()
        if isinstance(initial_state, dict):
            data = initial_state.get("initialization_data") or {}
            if data.get("agent_data"):
                env.tools.update_db(data["agent_data"])
            if data.get("user_data") and env.user_tools is not None:
                env.user_tools.update_db(data["user_data"])
            for call in initial_state.get("initialization_actions") or []:
                self.function_call(env, call)
            env.sync_tools()
        return env

    @staticmethod
    def function_call(env: Any, call: dict[str, Any]) -> Any:
        """One initialization action or assertion, then a sync, as upstream's ``run_env_function_call``
        (telecom: the user's device must see a line suspended by the previous action)."""
        kit = env.user_tools if call.get("env_type") == "user" else env.tools
        if kit is None:
            raise ValueError(f"no {call.get('env_type')} tools for {call.get('func_name')}")
        result = getattr(kit, str(call["func_name"]))(**dict(call.get("arguments") or {}))
        env.sync_tools()
        return result

    def hello(self) -> dict[str, Any]:
        env = self.fresh(None, self.solo)
        kits = [(env.tools, env.get_tools())]
        if self.solo and env.user_tools is not None:  # solo mode: the agent has the user's tools too
            kits.append((env.user_tools, env.get_user_tools()))
        mutating = []
        for kit, tools in kits:
            mutates = getattr(kit, "tool_mutates_state", None)
            mutating += [t.name for t in tools if mutates is None or mutates(t.name)]
        return {
            "python": list(sys.version_info[:3]),
            "policy": env.get_policy(),
            "tools": [t.openai_schema for _, tools in kits for t in tools],
            "mutating": mutating,
            "user_tools": env.user_tools is not None,
        }

    def reset(self, initial_state: Any) -> dict[str, Any]:
        self.env = self.fresh(initial_state, self.solo)
        return {}

    def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        if self.env is None:
            raise ValueError("call before reset")
        try:
            resp = self.env.make_tool_call(name, requestor="assistant", **arguments)
            self.env.sync_tools()
        except Exception as e:  # noqa: BLE001 - a tool's refusal is the agent's observation
            return {"ok": False, "error": _clip(f"Error: {e}")}
        to_json = getattr(type(self.env), "to_json_str", None)
        text = to_json(resp) if to_json is not None else json.dumps(resp, default=str)
        return {"content": _clip(text if isinstance(text, str) else str(text))}

    def evaluate(self, actions: list[dict[str, Any]], assertions: list[dict[str, Any]], initial_state: Any):
        if self.env is None:
            raise ValueError("evaluate before reset")
        gold = self.fresh(initial_state)  # never in solo mode: the user's gold actions are the user's
        gold_errors = []
        for a in actions:
            try:
                gold.make_tool_call(
                    a["name"], requestor=a.get("requestor") or "assistant", **(a.get("arguments") or {})
                )
                gold.sync_tools()
            except Exception as e:  # noqa: BLE001 - upstream logs and goes on
                gold_errors.append(_clip(f"{a.get('name')}: {e}"))
        db_match = gold.get_db_hash() == self.env.get_db_hash()
        user_match = gold.get_user_db_hash() == self.env.get_user_db_hash()
        met = []
        for a in assertions:
            try:
                res = self.function_call(self.env, a)
                met.append(isinstance(res, bool) and res == bool(a.get("assert_value", True)))
            except Exception:  # noqa: BLE001 - a failing assertion function is an unmet assertion
                met.append(False)
        return {"db_match": bool(db_match and user_match), "assertions": met, "gold_errors": gold_errors[:20]}


def serve(domain: Domain, out: Any) -> None:
    for line in sys.stdin:
        op = None
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "hello":
                reply = domain.hello()
            elif op == "reset":
                reply = domain.reset(req.get("initial_state"))
            elif op == "call":
                reply = domain.call(str(req["name"]), dict(req.get("arguments") or {}))
            elif op == "evaluate":
                reply = domain.evaluate(req.get("actions") or [], req.get("assertions") or [], req.get("initial_state"))
            elif op == "bye":
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            reply.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 - every failure is a reply
            reply = {"ok": False, "error": _clip(f"{type(e).__name__}: {e}"), "fatal": op == "hello"}
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()


def main() -> None:
    clone, domain_name, solo = sys.argv[1], sys.argv[2], sys.argv[3:] == ["solo"]
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the domain's prints never reach the protocol
    sys.stdout = sys.stderr
    sys.path.insert(0, os.path.join(clone, "src"))
    try:
        domain = Domain(clone, domain_name, solo)
    except BaseException as e:  # noqa: BLE001 - an import failure is the parent's config error
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        out.write(json.dumps({"ok": False, "fatal": True, "error": _clip(tb)}) + "\n")
        out.flush()
        return
    serve(domain, out)


if __name__ == "__main__":
    main()
