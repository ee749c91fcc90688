"""Shared fixtures: one tiny model built once per session, contracts, a test-only environment.

The tiny model is a random-init Qwen2-architecture causal LM with a BPE tokenizer trained
on expert transcripts of the orders environment. Everything here is deterministic.
"""

from __future__ import annotations

import copy
import os
import threading

# Two test workers (pytest -n 2) share the two cores: OpenMP must not busy-wait (read when torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# `mentorrl demo` runs as data-parallel ranks by default (--ranks auto): the tests that run a demo run it in
# this process (one rank), unless they ask for ranks (tests/test_parallelism.py checks the default).
os.environ["MENTORRL_DEMO_RANKS"] = "1"
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

try:  # keep test output readable: no warnings or progress bars from transformers
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
except Exception:  # pragma: no cover
    pass

from mentorrl.contract import (
    IM_END,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ContractLimits,
    PromptFormat,
    RolloutContract,
    SamplingParams,
    contract_for_env,
)
from mentorrl.envs import get_env
from mentorrl.envs.base import Task, Tool, ToolRegistry, ToolResult, Verdict
from mentorrl.models.build import ModelSpec, load_policy

# The machine is small and shared: one intra-op thread is the fastest setting for this model size.
torch.set_num_threads(1)

TINY_SPEC = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=600)


# --------------------------------------------------------------------- model ------
@pytest.fixture(scope="session")
def orders_entry():
    return get_env("orders")


@pytest.fixture(scope="module")
def env(orders_entry):
    """An orders environment per test module (a module with another environment defines its own ``env``)."""
    e = orders_entry.make_env()
    yield e
    e.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, orders_entry) -> Path:
    from mentorrl.train.models_init import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_model") / "model"
    return build_tiny_model(orders_entry, path, ModelSpec(**TINY_SPEC), corpus_tasks=60)


_SHARED_TOKENIZERS: list = []  # session tokenizers whose chat template a test may set (bind_tokenizer)


@pytest.fixture(scope="session")
def policy(tiny_model_dir):
    """(tokenizer, model): shared and read-only; tests that train must deep-copy the model."""
    tokenizer, model = load_policy(tiny_model_dir)
    model.eval()
    _SHARED_TOKENIZERS.append(tokenizer)
    return tokenizer, model


@pytest.fixture(autouse=True)
def _restore_shared_chat_templates():
    """``Workspace.bind_tokenizer`` gives a tokenizer its run's chat template (``chat_template_for`` the run's
    prompt format); a test that binds the shared tokenizer must not change what the next test renders."""
    yield
    from mentorrl.contract import CHAT_TEMPLATE

    for tok in _SHARED_TOKENIZERS:
        tok.chat_template = CHAT_TEMPLATE


@pytest.fixture(scope="session")
def tokenizer(policy):
    return policy[0]


@pytest.fixture(scope="session")
def model(policy):
    return policy[1]


@pytest.fixture(scope="session")
def tool_happy_model(policy):
    """A copy of the tiny model whose LM head gets a constant bias towards the tool-call tags
    and the stop token, so even a random-init model writes short turns that (nearly always)
    contain a tool-call tag: the rollout engine then produces long multi-turn trajectories
    with many tool returns. The bias is part of the model, so the engine (sampling) and the
    learner (recomputation) see exactly the same distribution."""
    tok, base = policy
    m = copy.deepcopy(base)
    bias = torch.zeros(m.lm_head.weight.shape[0])
    for t, v in ((TOOL_CALL_OPEN, 5.5), (TOOL_CALL_CLOSE, 3.0), (IM_END, 5.0)):
        bias[tok.convert_tokens_to_ids(t)] = v
    m.lm_head.bias = torch.nn.Parameter(bias)
    m.eval()
    return m


# ------------------------------------------------------------------ contracts -----
@pytest.fixture(scope="session")
def make_contract(tokenizer, orders_entry) -> Callable[..., RolloutContract]:
    def make(
        env: Any = None,
        temperature: float = 1.0,
        max_new_tokens: int = 24,
        max_turns: int = 6,
        max_total_tokens: int = 768,
        tool_descriptions: bool = False,
        tok: Any = None,
    ) -> RolloutContract:
        own = env is None
        env = env if env is not None else orders_entry.make_env()
        try:
            return contract_for_env(
                tok if tok is not None else tokenizer,
                env,
                SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens),
                ContractLimits(max_turns=max_turns, max_total_tokens=max_total_tokens),
                PromptFormat(tool_descriptions=tool_descriptions),
            )
        finally:
            if own:
                env.close()

    return make


@pytest.fixture(scope="session")
def make_demos(orders_entry, make_contract) -> Callable[..., tuple[RolloutContract, list]]:
    """``make_demos(n)``: the contract and verified scripted-expert trajectories on ``n`` train tasks."""
    from mentorrl.rollout.runner import expert_demonstrations

    def make(n: int, seed: int = 0):
        contract = make_contract(max_turns=8, max_total_tokens=2048)
        tasks = orders_entry.make_tasks().tasks("train", n, seed)
        return contract, expert_demonstrations(contract, orders_entry.make_env, orders_entry.make_expert(), tasks)

    return make


@pytest.fixture(scope="session")
def orders_tasks(orders_entry) -> list[Task]:
    return orders_entry.make_tasks().tasks(split="train", n=300, seed=1)


@pytest.fixture(scope="session")
def find_task(orders_tasks) -> Callable[..., Task]:
    def find(family: str, kind: str = "normal") -> Task:
        for t in orders_tasks:
            if t.family == family and t.reference["kind"] == kind:
                return t
        raise AssertionError(f"no {family}/{kind} task among the generated train tasks")

    return find


# The real model's tests are the longest (minutes, in stage processes): started first, a two-worker run does not
# end on them while the other worker idles.
FIRST_MODULES = ("test_smollm2.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST_MODULES)  # stable: the rest keep their order


# ------------------------------------------------------- test-only environment -----
def random_weights(model, scale: float, seed: int = 0):
    """A copy of ``model`` (eval mode) whose matrices are redrawn from N(0, ``scale``^2): what it writes then
    depends on the prompt (the random-init tiny model writes newlines after any prompt), so a padding or
    caching mistake shows in its tokens."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return m.eval()


def _obj_schema(**props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class ToyEnv:
    """A minimal Environment: ``echo`` works, ``boom`` raises, ``slow`` sleeps past the timeout.

    Success iff ``echo`` was called successfully and the final answer contains "ok".
    ``forbidden`` is a hard constraint: calling it is a violation.
    """

    name = "toy"
    version = "0.1"
    system_prompt = "You are a test agent. Use the tools, then answer."

    def __init__(self, timeout_s: float = 0.2):
        self.echoed: list[str] = []
        self.forbidden_called = False
        self.registry = ToolRegistry(
            [
                Tool("echo", "Echo the text back.", _obj_schema(text={"type": "string", "minLength": 1}), self._echo),
                Tool("boom", "A tool with a bug.", _obj_schema(), self._boom),
                Tool("slow", "Sleep for some seconds.", _obj_schema(seconds={"type": "number"}), self._slow),
                Tool("forbidden", "Never call this.", _obj_schema(), self._forbidden),
            ],
            timeout_s=timeout_s,
        )

    def _echo(self, text: str) -> dict:
        self.echoed.append(text)
        return {"echo": text}

    def _boom(self) -> dict:
        raise RuntimeError("kaboom")

    def _slow(self, seconds: float) -> dict:
        threading.Event().wait(seconds)
        return {"slept": seconds}

    def _forbidden(self) -> dict:
        self.forbidden_called = True
        return {"done": True}

    def reset(self, task: Task) -> str:
        self.echoed, self.forbidden_called = [], False
        return task.prompt

    def step(self, name: Any, arguments: Any) -> ToolResult:
        return self.registry.call(name, arguments)

    def verify(self, final_answer: str | None) -> Verdict:
        violations = ["called forbidden"] if self.forbidden_called else []
        ok = final_answer is not None and "ok" in final_answer.lower() and bool(self.echoed)
        return Verdict(success=ok and not violations, violations=violations)

    def close(self) -> None:
        self.registry.close()


@pytest.fixture
def toy_env():
    env = ToyEnv()
    yield env
    env.close()


@pytest.fixture(scope="session")
def toy_task() -> Task:
    return Task(id="toy-0", family="toy", split="train", prompt="Please echo hello, then say ok.", seed=0)


@pytest.fixture(scope="session")
def toy_env_cls():
    return ToyEnv


@pytest.fixture
def env_task():
    """A fresh code environment reset to the first of four train tasks: ``(env, tasks)``, closed after."""
    entry = get_env("code")
    env = entry.make_env()
    tasks = entry.make_tasks().tasks("train", 4, 0)
    env.reset(tasks[0])
    yield env, tasks
    env.close()


# ------------------------------------------------------------- scripted HTTP -----
class HTTPScript:
    """What a scripted local HTTP server answers and what it was asked.

    ``plans[route]``: the answers to POSTs under ``/route/...`` in turn, each ``(status, body)``
    or ``(status, body, headers, delay_s)``; the last one repeats."""

    def __init__(self):
        self.plans: dict[str, list[tuple]] = {}
        self.hits: dict[str, int] = {}
        self.auth: list[str | None] = []
        self.requests: list[dict] = []


@pytest.fixture()
def server():
    """A real local ``ThreadingHTTPServer`` that misbehaves on purpose, as scripted: ``(script, base_url)``."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    script = HTTPScript()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            script.auth.append(self.headers.get("authorization"))
            try:
                script.requests.append(json.loads(body))
            except ValueError:
                script.requests.append({"raw": body.decode(errors="replace")})
            route = self.path.split("/")[1]
            plan = script.plans[route]
            i = script.hits.get(route, 0)
            script.hits[route] = i + 1
            status, text, headers, delay = (tuple(plan[min(i, len(plan) - 1)]) + ({}, 0.0))[:4]
            time.sleep(delay)
            try:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text.encode())
            except (BrokenPipeError, ConnectionResetError):
                pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield script, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
