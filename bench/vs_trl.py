"""TRL's ``GRPOTrainer`` (multi-turn tools through ``environment_factory``) against ``mentorrl train`` GRPO,
side by side on the same agent task, checkpoint and settings.

Each arm runs in its own child process (``python bench/vs_trl.py --arm trl|mentorrl``), so its CPU
time and peak RSS are its own; the arms alternate (TRL, mentorrl, TRL, mentorrl, ...) for ``--reps``
repetitions, rep ``r`` using seed ``--seed + r`` in both arms. Every child runs ``--warmup`` (1) GRPO
step that is not timed, then ``--steps`` timed ones. Children run at one torch thread, with
``OMP_NUM_THREADS=1`` and ``OMP_WAIT_POLICY=PASSIVE`` (an idle OpenMP thread sleeps instead of
spinning, which matters on a machine shared with other jobs) in both arms.

    python bench/vs_trl.py --model runs/demo/sft/final --reps 3 --steps 2 --json bench/results/vs_trl.json
    python bench/vs_trl.py --model runs/smollm2/seed-0/sft/final --config mentorrl/configs/smollm2.yaml \
        --lora --dtype auto --answer typed --tasks 8 --group 4 --trl-micro-batch 8 --reps 3 \
        --json bench/results/vs_trl_smollm2.json

``--model``: a mentorrl checkpoint directory (transformers-loadable: model.safetensors, tokenizer.json and
its chat template), or a LoRA stage's adapter directory (SmolLM2's ``sft/final``: ``adapter_config.json``
naming its base), which the driver merges into its base once, in the work dir
(:func:`merged_model`); default ``runs/demo/sft/final`` when it exists. The bench does not build one: make
it with ``mentorrl demo`` or ``mentorrl train mentorrl/configs/demo.yaml --set recipe=[sft]`` (the demo's
SFT, ~5 minutes on 2 cores); SmolLM2's with ``mentorrl train mentorrl/configs/smollm2.yaml``.
``--config``: the recipe both arms take the prompt format, contract limits' defaults and reward weights
from, and the mentorrl arm trains with (``mentorrl train <config> --set ...``); default the demo's.
Needs the ``bench`` extra (``pip install -e ".[bench]"``: trl 1.16.0, accelerate).

Same for both arms
------------------
* checkpoint, tokenizer, the ``orders`` environment and its tools, the recipe's prompt format
  (the demo's and SmolLM2's: ``prompt.system_turn: false``: no system turn, the policy learnt the tools from
  demonstrations) and the rendering ``mentorrl train`` binds for that checkpoint (see "Format bridging");
* precision (``--dtype``, see "Precision") and, with ``--lora``, the adapters;
* the tasks: each step's 16 tasks are the ones ``mentorrl train`` draws for that seed and step
  (the TRL arm rebuilds the same draw and feeds it in order, ``shuffle_dataset=False``; the bench
  checks the task ids match);
* reward: mentorrl's own. The TRL reward function drives a mentorrl ``Episode`` per rollout: every
  tool call goes through ``Episode.run_tool`` (the environment's validating registry, the same
  ``ToolCall`` records), the episode ends with ``Episode.finish`` (``OrdersEnv.verify`` +
  ``compose_reward`` with the demo's weights). No expert guidance (``grpo.guide=none``), no KL term;
* 16 tasks x 8 samples per step, temperature 1 (top-p 1, no top-k), 64 new tokens per turn,
  6 turns at most, 768 tokens per episode (TRL: ``max_completion_length`` = 768 minus the longest
  prompt of the run, so no TRL episode is longer than mentorrl allows), lr 1e-4 constant (AdamW,
  betas 0.9/0.99, no weight decay, grad-norm clip 1.0), clip epsilon 0.2 low / 0.28 high
  (mentorrl ``grpo.eps_low`` / ``grpo.eps_high``; TRL ``epsilon`` / ``epsilon_high``), group-std
  normalised advantages, token-mean loss over the whole update batch (TRL ``loss_type="dapo"``);
* ``--updates`` (2, mentorrl's ``grpo.updates_per_step`` default) optimizer steps per rollout batch of
  128, on minibatches of 64 (TRL: ``steps_per_generation = updates x gradient_accumulation_steps``);
* sequences per forward/backward: ``--trl-micro-batch`` (32) in both arms (mentorrl
  ``grpo.optim.micro_batch_size``, set by the bench; TRL ``per_device_train_batch_size``).

TRL's settings (its best for this machine, where they are a choice)
-------------------------------------------------------------------
``per_device_train_batch_size`` ``--trl-micro-batch`` (32) with ``gradient_accumulation_steps`` 64 / that,
so each optimizer step still sees 64 trajectories (16 / 32 / 64 cost the same update CPU within noise;
the bench sets mentorrl's ``micro_batch_size`` to it); ``gradient_checkpointing=False`` (TRL's GRPOConfig
defaults to True: ~12% more update CPU here, for ~400 MiB less peak RSS); ``bf16`` from ``--dtype`` (default
float32: ``bf16=False``, as mentorrl's fp32; on the demo's 1M model TRL's default bf16 autocast made a step 4x
slower); generation through ``model.generate``, TRL's default
(``use_transformers_continuous_batching`` took ~17x the generation CPU); ``use_cpu=True``; no vLLM, no
reference model (``beta=0``); ``max_tool_calling_iterations`` 5 (the first turn plus 5 after tool results =
6 turns); logging every step, no checkpoints, no tqdm. ``--trl-set KEY=JSON`` overrides any GRPOConfig field
(how these were tried; the measurements are in ``bench/results/vs_trl.md``); ``--mentorrl-set KEY=VALUE`` adds
a ``--set`` to the mentorrl arm (ablations: ``grpo.optim.pack_prefixes=false``, ``rollout.inline_tool_ms=0``).

What is measured (CPU seconds of the arm's process, ``time.process_time``; wall seconds too)
------------------------------------------------------------------------------------------
* step: one GRPO step = one rollout batch of 128 trajectories and its ``--updates`` optimizer steps.
  mentorrl: the stage's ``step_fn`` (wrapped in the child). TRL: the sum over that batch's optimizer
  steps of ``on_step_begin`` -> ``on_step_end`` (a ``TrainerCallback``; the Trainer's data fetch and its
  logging between steps are outside, which can only favour TRL);
* rollout: generation, tool calls, verification and reward. mentorrl: ``collect_group``. TRL:
  ``GRPOTrainer._generate`` (tokenising prompts, ``generate`` per turn, response parsing, tool calls) plus
  ``_calculate_rewards`` (our reward function: verification and reward composition);
* update: the rest of the step. For TRL that includes its no-grad forward pass over the 128
  trajectories for the behaviour log-probs (``old_per_token_logps``), which it needs because
  ``model.generate`` returns none and the second minibatch is off-policy (reported separately as
  ``trl_old_logp``: what remains of ``_generate_and_score_completions``, plus advantages and padding);
  mentorrl records the behaviour log-probs while sampling;
* policy tokens: tokens the model generated (TRL: ``tool_mask`` ones; mentorrl: ``loss_mask`` ones),
  not prompts or tool results;
* peak RSS: the child's ``ru_maxrss`` from ``wait4`` (model, tokenizer, environments, both arms'
  Python imports: TRL's process also imports datasets/accelerate/trl).

Printed: per arm the median over reps of each figure, and the ratios mentorrl/TRL (the median over
reps of the per-rep ratio; a rep's two arms share a seed, tasks and time of day).

Format bridging (mentorrl -> TRL ``environment_factory``)
--------------------------------------------------------
* tools: TRL exposes an environment's public methods as tools and builds their JSON schemas from the
  type hints and Google docstrings. :func:`environment_class` turns each mentorrl tool schema into such a
  method (``str``/``int``/``float``/... hints from the JSON types, required = no default, the description
  as docstring, an ``Args:`` line per argument); rendered by the checkpoint's chat template, their
  signatures are byte for byte the contract's (``name(arg: type, opt?: type) - description``). A method
  accepts any keyword arguments and hands them to the mentorrl environment, whose registry validates
  them against the real schema (bounds included), as in mentorrl;
* observations: a method returns the contract's observation text (``render_observation_content``: the
  JSON result, or ``error: ...``); TRL wraps it as a ``tool`` message, and the chat template renders
  ``\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n``, the contract's observation;
* chat template (:func:`trl_contract`): the contract is the one ``mentorrl train`` binds for the checkpoint
  (``native_chat_for``); TRL gets :func:`trl_template_for`'s template on its own copy of the tokenizer: the
  contract's own rendering (the demo, here) or a checkpoint's own ChatML template (next section). Both are
  checked at start by :func:`trl_format_check`, which stops the bench on any difference: every task's prompt,
  two observations, and scripted expert episodes through :func:`parity_problems` with the trainer's own
  ``_get_tool_suffix_ids`` (TRL's ids at every turn boundary, its token-in/token-out stream, and its
  ``{% generation %}`` mask against the trajectory's policy tokens);
* mentorrl's own rendering (the demo): its saved template (``mentorrl.contract.CHAT_TEMPLATE``) is
  prefix-preserving and marks assistant turns with ``{% generation %}``, so TRL keeps it (no
  ``get_training_chat_template`` patch) and ``_get_tool_suffix_ids`` works: the tokenizer's EOS is ``<|im_end|>``, TRL trims at it.
  TRL always passes ``tools=``; the template (``mentorrl.contract.chat_template_for`` the recipe's prompt
  format, as checkpoints are saved) then renders the system turn only if the recipe has one, so for a
  ``system_turn: false`` recipe (the demo) the prompt is the one the policy was trained on (the bench also
  passes ``system_turn`` / ``tool_descriptions`` through ``chat_template_kwargs``);
* tool-call parsing: TRL reads tool calls with ``tokenizer.parse_response``, which needs a response
  template; ``add_response_schema`` only knows published model families, so the bench sets
  :data:`RESPONSE_TEMPLATE` (Qwen's ``<tool_call>{json}</tool_call>`` parser without the ``<think>`` field);
* episode ends: TRL ends an episode at the first turn without a parsed tool call. The reward function
  reads the last turn the way mentorrl does (``parse_action``): an answer is the final answer; a turn cut
  at 64 tokens is ``length``; a turn mentorrl would have read as a (malformed) tool call -- TRL's parser
  fell back to text -- ends the episode with no answer (``unparsed``, counted per arm as
  ``unparsed_share``), where mentorrl would have charged the call and gone on. A call TRL refused before
  reaching the environment (unknown tool, arguments not an object) is charged as mentorrl's registry
  answers it. Two calls in one turn run both in TRL (mentorrl: one malformed call; ``multi_call_turns``);
* answers (``--answer``): ``free_text`` (default, the demo's figures) ends both arms' episodes on a reply
  without a tool call. ``typed`` (verifier v4: the answer is a ``final_answer`` call, as SmolLM2's recipe
  trains its policy; under ``free_text`` that policy's answer calls are unknown tools and no episode
  succeeds) ends mentorrl's episode on that call (``Episode.add_policy_turn``, never run). TRL has no tool
  that ends a rollout; its environment method for the call returns a result longer than the completion
  budget, which TRL's tool loop drops, ending that rollout (its own rule for a tool result that does not fit):
  the same turns, the call's tokens the last, and the reward function reads the call as mentorrl does
  (:func:`trl_episode_end`: the call's JSON is the answer, at any turn up to the last).

A checkpoint's own ChatML template (``hermes_prompted``: SmolLM2)
----------------------------------------------------------------
SmolLM2's recipe keeps the model's plain ChatML template unedited (no tools section, no generation markers;
its default system turn when a conversation has none): the rollout renders with it, the tool schemas would go
in the system text (``prompt.system_turn: false``: nowhere), a call is the turn's text
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (plain text: the tokenizer has no such
token) and a tool result is a ``tool`` turn the template renders. The checkpoint records this in its
``tokenizer_config.json`` (``mentorrl_prompt``); ``prompt.tool_format: auto`` resolves to it either way.
TRL's template (:func:`bridge_template`, never written to the checkpoint) is :data:`HERMES_PROMPTED_BRIDGE`:
the same ChatML, the checkpoint's preamble (SmolLM2's default system turn) read off its template, an
assistant message's ``tool_calls`` rendered as the policy writes a call, ``{% generation %}`` around each
assistant turn and its ``<|im_end|>``, ``tools=`` ignored (TRL always passes them; the contract renders
none). It is built only when a probe conversation renders to the same text through it and through the
checkpoint's own template (:func:`bridge_problem`); any other family is refused (:class:`BridgeError`). The
response parser is :data:`RESPONSE_TEMPLATE` (it reads the newlines around the JSON as well), and the reward
function reads a turn with the contract's parser (``hermes_parse``).

Precision (``--dtype``)
-----------------------
``float32`` (default): fp32 in both arms. ``bfloat16``: fp32 weights and optimizer state in both arms, forward
and backward under bf16 autocast (mentorrl ``model.dtype=bfloat16``: the learner's autocast, the rollout on a
bf16 copy of the policy synced after each update; TRL ``bf16=True``: the Trainer's autocast for its
training and log-prob forwards). TRL's ``generate`` decodes in fp32 there (with peft adapters it bypasses
the autocast accelerate wraps the model's forward in), which is TRL's faster choice on this CPU: SmolLM2
with LoRA, 4 rows, one thread, decoded 33 tokens/CPU-s in fp32, 17.5 under bf16 autocast (the weights are
cast at every step) and 32 with bf16 weights, so the bench leaves it as it is. A bf16-loaded model for TRL
was not chosen: it would hold other weights than mentorrl's (a bf16 base, no fp32 copy), so the memory
comparison would not be of the same setting, and it decodes no faster. ``auto``: mentorrl's start-up probe
(``choose_dtype``: bf16 where its matmul measures >= 1.5x fp32, as on AMX CPUs) decides once in the driver and
both arms get the result.

The issue's targets (rollout policy tokens per CPU-second >= 2x TRL, whole-step trajectories per
CPU-second >= 4x TRL) are checked and printed (``--target-step`` / ``--target-rollout`` move them).

LoRA (``--lora``)
-----------------
Both arms train the same adapters (:data:`LORA`: r 16, alpha 32, dropout 0, every attention and MLP projection):
mentorrl through ``model.lora``, TRL through ``peft_config`` (SmolLM2's recipe has the same adapters; without
``--lora`` the bench sets ``model.lora=null``, so both arms train the full model). TRL's KL reference, when
``beta`` > 0, is the policy with its adapters disabled; mentorrl's is ``frozen_copy``, which shares the frozen
base. The 0.5B-shaped run in ``docs/scaling.md`` adds ``--mentorrl-set grpo.kl_coef=0.001 --trl-set beta=0.001``
so that both arms train every row of a random-init model's zero-advantage groups (without a KL term mentorrl
skips them, exactly). SmolLM2's SFT policy solves many tasks already, so whole groups tie too: without those
flags mentorrl skips their update while TRL runs it (the same weights after the step either way).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mentorrl.contract import (  # noqa: E402
    ANSWER_TOOL_NAME,
    IM_END,
    IM_START,
    ParsedAction,
    chat_template_for,
    parse_action,
    render_observation_content,
)
from mentorrl.eval.metrics import mean_interval  # noqa: E402
from mentorrl.trajectory import dumps_compact  # noqa: E402

DEMO_CONFIG = ROOT / "mentorrl" / "configs" / "demo.yaml"
DEFAULT_MODEL = Path("runs/demo/sft/final")
ARMS = ("trl", "mentorrl")
TARGETS = {"rollout_tokens_per_cpu_s": 2.0, "trajectories_per_cpu_s": 4.0}
ASSISTANT_HEADER = f"{IM_START}assistant\n"
# --lora: the same adapters in both arms (mentorrl ``model.lora``; TRL ``peft_config``)
LORA = {
    "r": 16,
    "alpha": 32,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}

# ----------------------------------------------------------------- format bridging (no trl needed) ---
# JSON-schema type -> the Python hint transformers' get_json_schema turns back into that type
JSON_TO_PY: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}

# tokenizer.parse_response template for mentorrl's turns: text, then optionally
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, then <|im_end|> (TRL's Qwen3 parser minus <think>)
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": ASSISTANT_HEADER,
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


# ------------------------------------------- a checkpoint's own ChatML template (hermes_prompted) ------
class BridgeError(ValueError):
    """A checkpoint whose rendering the bench cannot give TRL as a chat template (say which, and why)."""


BRIDGE_PROBE_USER = "vs_trl bridge probe"
# The TRL template for a checkpoint that renders the conversation with its own plain ChatML template and writes
# Hermes calls in its turns (``prompt.tool_format`` hermes_prompted: SmolLM2). ``__PREAMBLE__`` becomes what the
# checkpoint's template writes before a conversation that has no system message (SmolLM2: its default system
# turn), as a Jinja string literal. ``tools`` are never rendered: a prompted format has them in the system
# message's text or (``prompt.system_turn: false``) nowhere; an assistant message's ``tool_calls`` render as
# the policy writes a call (``hermes_render``), inside ``{% generation %}`` with the turn's ``<|im_end|>``.
HERMES_PROMPTED_BRIDGE = (
    "{%- if messages and messages[0]['role'] != 'system' -%}{{- __PREAMBLE__ -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown role ' ~ (message['role'] | tojson)) -}}"
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
    "{{- '<tool_call>\n{\"name\": ' ~ (fn['name'] | tojson) ~ ', \"arguments\": '"
    " ~ (args if args is string else args | tojson) ~ '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- else -%}"
    "{%- if calls -%}{{- raise_exception('only assistant messages carry tool_calls') -}}{%- endif -%}"
    "{{- content ~ '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def _own_render(chat: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """``messages`` as the checkpoint's own template writes them (assistant messages' content as given)."""
    return chat.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def bridge_template(chat: Any) -> str:
    """TRL's chat template for a run that renders with the checkpoint's own template (``chat``: the contract's
    :class:`~mentorrl.chat_templates.TemplateChat`): :data:`HERMES_PROMPTED_BRIDGE` with the template's
    preamble. The checkpoint's template file is not touched: TRL gets this on its own tokenizer copy.

    Checked here, against the checkpoint's template: the format is ``hermes_prompted``, a turn ends with
    ``<|im_end|>``, and a probe conversation (without and with a system message; user, two Hermes calls with
    their tool results, an answer) renders to the same text through both. Anything else is a
    :class:`BridgeError`: the bench covers ChatML templates that render no tools (SmolLM2), and the contract's
    own template (:func:`mentorrl.contract.chat_template_for`)."""
    from mentorrl.chat_templates.formats import HERMES_PROMPTED

    if chat.name != HERMES_PROMPTED:
        raise BridgeError(
            f"the checkpoint renders tool calls in the {chat.name!r} format with its own template; the bench "
            f"bridges {HERMES_PROMPTED!r} (a ChatML template with no tools section, e.g. SmolLM2) and mentorrl's "
            "own template only"
        )
    if chat.stop != IM_END:
        raise BridgeError(f"the checkpoint's template ends a turn with {chat.stop!r}, not {IM_END!r} (not ChatML)")
    user = [{"role": "user", "content": BRIDGE_PROBE_USER}]
    text = _own_render(chat, user, True)
    tail = f"{IM_START}user\n{BRIDGE_PROBE_USER}{IM_END}\n{ASSISTANT_HEADER}"
    if not text.endswith(tail):
        raise BridgeError(f"the checkpoint's template is not ChatML: it renders a user turn as {text[-120:]!r}")
    # a Jinja string literal: JSON's escapes (\n, \", \uXXXX) are Jinja's
    template = HERMES_PROMPTED_BRIDGE.replace("__PREAMBLE__", json.dumps(text[: -len(tail)]))
    problem = bridge_problem(chat, template)
    if problem:
        raise BridgeError(f"the bench's TRL template does not render as the checkpoint's: {problem}")
    return template


def _probe_conversation(chat: Any, system: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(as the checkpoint's template reads it, as TRL holds it) for one probe conversation."""
    calls = [("get_order", {"order_id": "O-1"}), ("cancel_order", {"order_id": "O-1", "reason": 'é "x"'})]
    own = [{"role": "system", "content": system}] if system is not None else []
    own.append({"role": "user", "content": BRIDGE_PROBE_USER})
    trl = [dict(m) for m in own]
    for k, (name, args) in enumerate(calls):
        own.append({"role": "assistant", "content": chat.render_call(name, args)})
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        trl.append({"role": "assistant", "content": "", "tool_calls": [call]})
        result = {"role": "tool", "content": f'{{"probe": {k}}}'}
        own.append(result)
        trl.append({**result, "name": name})
    own.append({"role": "assistant", "content": "It is cancelled."})
    trl.append({"role": "assistant", "content": "It is cancelled."})
    return own, trl


def bridge_problem(chat: Any, template: str) -> str | None:
    """None when ``template`` renders the probe conversations (:func:`_probe_conversation`) as the checkpoint's
    own template does at every turn boundary (with the generation prompt) and whole; else the first difference."""
    from transformers.utils.chat_template_utils import render_jinja_template

    for system in (None, "a system prompt"):
        own, trl = _probe_conversation(chat, system)
        cuts = [i for i, m in enumerate(own) if m["role"] == "assistant"] + [len(own)]
        for cut in cuts:
            gen = cut < len(own)
            want = _own_render(chat, own[:cut], gen)
            got = render_jinja_template([trl[:cut]], chat_template=template, add_generation_prompt=gen)[0][0]
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                return f"after {cut} messages, at character {at}: {got[at : at + 60]!r} vs {want[at : at + 60]!r}"
    return None


def trl_template_for(tokenizer: Any, chat: Any, prompt: Any) -> str:
    """The chat template TRL renders with: mentorrl's own for the run's prompt format when the contract renders
    with it (``chat`` None), else the bridge to the checkpoint's template (:func:`bridge_template`)."""
    return chat_template_for(prompt) if chat is None else bridge_template(chat)


# ----------------------------------------------------------- token parity: TRL's view of a mentorrl episode --
def episode_observations(traj: Any) -> list[tuple[str, str]]:
    """(tool name, observation text) per tool call of a mentorrl trajectory, in order: the tool messages TRL's
    loop appends (the environment methods return the contract's observation text)."""
    return [(str(c.name), render_observation_content(c.error is None, c.result, c.error)) for c in traj.tool_calls]


def _first_diff(a: Sequence[int], b: Sequence[int]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token {at} of {len(a)} vs {len(b)}: {list(a[at : at + 6])} vs {list(b[at : at + 6])}"


def parity_problems(
    tok: Any,
    traj: Any,
    head: list[dict[str, Any]],
    user: str,
    tools: Any = None,
    suffix_ids: Callable[[list[dict[str, Any]]], list[int]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """Where TRL's token ids for a mentorrl trajectory ``traj`` differ from the trajectory's (empty: nowhere).

    ``tok``: TRL's tokenizer (its chat template and ``response_template``); ``head`` + a user message ``user``:
    TRL's prompt; ``tools``: what TRL passes as ``tools=``. Checked, for the conversation TRL holds (each policy
    turn as ``tok.parse_response`` reads the turn's ids, then the tool message of the observation):

    * at every turn boundary, ``apply_chat_template`` of the conversation so far with the generation prompt is
      the trajectory's ids up to that turn;
    * the whole conversation renders to the trajectory's ids (then the template's closing newline), and its
      ``{% generation %}`` mask (``return_assistant_tokens_mask``) is exactly the policy's tokens;
    * with ``suffix_ids`` (TRL's ``GRPOTrainer._get_tool_suffix_ids``): TRL's own token-in/token-out stream,
      prompt ids + each turn's generated ids + the tool-result suffix, is the trajectory's ids.

    A template that cannot render TRL's conversation at all (it raises) is one more problem, said as such."""
    problems: list[str] = []
    try:
        _check_parity(problems, tok, traj, head, user, tools, suffix_ids, dict(template_kwargs or {}))
    except Exception as e:  # jinja's errors, a missing variable, raise_exception
        problems.append(f"the template cannot render TRL's conversation: {type(e).__name__}: {e}")
    return problems


def _check_parity(problems: list[str], tok, traj, head, user, tools, suffix_ids, kw: dict[str, Any]) -> None:
    """:func:`parity_problems`' checks, each difference appended to ``problems``."""
    ids = list(traj.token_ids)
    policy = [s for s in traj.segments if s.role == "policy"]
    obs = episode_observations(traj)
    msgs = [*head, {"role": "user", "content": user}]
    stream: list[int] = []
    for k, seg in enumerate(policy):
        at = tok.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
        )
        if list(at) != ids[: seg.start]:
            problems.append(f"rendering before turn {k + 1}: {_first_diff(list(at), ids[: seg.start])}")
        if k == 0:
            stream = list(at)
        turn = ids[seg.start : seg.end]
        msgs.append(tok.parse_response(turn, prefix=ids[: seg.start]))
        stream += turn
        if k < len(obs) and k < len(policy) - 1:
            tool_msg = [{"role": "tool", "name": obs[k][0], "content": obs[k][1]}]
            msgs += tool_msg
            if suffix_ids is not None:
                stream += list(suffix_ids(tool_msg))
    whole = tok.apply_chat_template(
        msgs, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kw
    )
    got, mask = list(whole["input_ids"]), list(whole["assistant_masks"])
    if got[: len(ids)] != ids:
        problems.append(f"whole conversation: {_first_diff(got, ids)}")
    want_mask = [0] * len(ids)
    for s in policy:
        want_mask[s.start : s.end] = [1] * (s.end - s.start)
    if mask[: len(ids)] != want_mask or any(mask[len(ids) :]):
        problems.append(
            f"generation mask: {sum(mask)} tokens marked, the policy wrote {sum(want_mask)} "
            f"({_first_diff(mask, want_mask)})"
        )
    if suffix_ids is not None and stream != ids:
        problems.append(f"TRL's token-in/token-out stream: {_first_diff(stream, ids)}")


def tool_method(schema: dict[str, Any]) -> Callable[..., str]:
    """A method ``name(self, **arguments) -> str`` whose signature, type hints and Google docstring make
    transformers' ``get_json_schema`` give back ``schema``'s name, description, argument names, types and
    required list (what the chat template renders). It calls ``self._call(name, arguments)`` with whatever
    keyword arguments it is given: the environment's registry validates them."""
    fn = schema.get("function", schema)
    name = fn["name"]
    if not name.isidentifier():
        raise ValueError(f"tool name {name!r} is not a Python identifier; TRL calls tools by method name")
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])

    def method(self, **arguments: Any) -> str:
        return self._call(name, arguments)

    sig = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    hints: dict[str, Any] = {}
    lines = []
    for key, spec in props.items():
        hint = JSON_TO_PY.get(spec.get("type"), Any) if isinstance(spec, dict) else Any
        default = inspect.Parameter.empty if key in required else None
        sig.append(inspect.Parameter(key, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=hint))
        hints[key] = hint
        lines.append(f"    {key}: {(spec.get('description') if isinstance(spec, dict) else None) or key}")
    hints["return"] = str
    method.__name__ = method.__qualname__ = name
    method.__signature__ = inspect.Signature(sig, return_annotation=str)
    method.__annotations__ = hints
    desc = " ".join(str(fn.get("description") or name).split())
    method.__doc__ = desc + ("\n\nArgs:\n" + "\n".join(lines) if lines else "") + "\n"
    return method


class ToolEnvBase:
    """What TRL's ``environment_factory`` builds: one per rollout, reused across batches (``reset``).

    Public methods are TRL's tools (added by :func:`environment_class`); everything else is private.
    ``ctx`` holds what the arm shares (mentorrl environment factory, contract, reward weights, tasks)."""

    def __init__(self, ctx: Any):
        self._ctx = ctx
        self._env = ctx.make_env()
        self._ep = None
        self._last: dict[str, Any] = {}

    def reset(self, task_index: int, **_: Any) -> str:
        from mentorrl.rollout.episode import Episode

        task = self._ctx.tasks[task_index]
        self._ep = Episode(self._ctx.contract, self._env, task, weights=self._ctx.weights)
        self._ep.start()  # env.reset(task): the episode's own database
        return task.prompt  # TRL appends it to the (empty) user message

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        """One tool call as mentorrl runs it (``Episode.run_tool``); the observation text. The typed answer's
        call (``--answer typed``) runs nothing: it returns :attr:`ctx.end_text`, a result longer than TRL's
        completion budget, so TRL's tool loop drops it and ends this rollout (its own rule for a tool result
        that does not fit): the episode ends on that call, as in mentorrl."""
        if name is not None and name == getattr(self._ctx, "answer_tool", None):
            return self._ctx.end_text
        raw = dumps_compact({"name": name, "arguments": arguments})
        result = self._ep.run_tool(ParsedAction("tool", raw=raw, name=name, arguments=arguments))
        return render_observation_content(result.ok, result.content, result.error)

    def _score(self, messages: list[dict[str, Any]], completion_ids: Sequence[int]) -> float:
        """The episode's mentorrl reward (``Episode.finish``: verify + compose_reward) from TRL's completion."""
        ep, ctx = self._ep, self._ctx
        stopped = bool(completion_ids) and completion_ids[-1] in ctx.contract.stop_token_ids
        turn = last_turn_text(ctx.contract.tokenizer.decode(list(completion_ids), skip_special_tokens=False), stopped)
        final, reason, _ = trl_episode_end(
            messages, turn, stopped, ctx.max_turns, ctx.contract.parse_action, getattr(ctx, "answer_tool", None)
        )
        refused = refused_calls(messages, set(ctx.tool_names), ctx.max_turns)
        for name, args in refused:  # TRL answered these itself; charge them as mentorrl's registry answers them
            ep.run_tool(
                ParsedAction("tool", raw=dumps_compact({"name": name, "arguments": args}), name=name, arguments=args)
            )
        # Trajectory knows mentorrl's four reasons; TRL's own end ("unparsed": no answer) scores as any other
        # non-answer end (compose_reward only asks whether the episode ended with an answer)
        ep.final_answer, ep.finish_reason = final, (reason if reason != "unparsed" else "max_turns")
        ep.num_turns = sum(m.get("role") == "assistant" for m in messages)
        traj = ep.finish()
        self._last = {
            "task_id": traj.task_id,
            "reward": traj.reward.total,
            "success": traj.reward.success,
            "finish_reason": reason,
            "tool_calls": len(traj.tool_calls),
            "refused_calls": len(refused),
            "multi_call_turns": sum(
                len(m.get("tool_calls") or []) > 1 for m in messages if m.get("role") == "assistant"
            ),
            "unparsed_turn": turn if reason == "unparsed" else None,
        }
        return traj.reward.total


def environment_class(schemas: Sequence[dict[str, Any]], base: type = ToolEnvBase) -> type:
    """A ``base`` subclass with one public method per tool schema (:func:`tool_method`)."""
    methods = {}
    for s in schemas:
        m = tool_method(s)
        if m.__name__ in methods or m.__name__ == "reset" or hasattr(base, m.__name__):
            raise ValueError(f"tool {m.__name__!r} clashes with another tool or an environment method")
        methods[m.__name__] = m
    return type("MentorrlToolEnv", (base,), methods)


def last_turn_text(completion_text: str, stopped: bool) -> str:
    """The last policy turn of a decoded TRL completion (policy turns and tool results, special tokens
    kept), without its stop token: what mentorrl's ``contract.decode_turn`` gives for that turn."""
    turn = completion_text.rsplit(ASSISTANT_HEADER, 1)[-1]
    return turn.removesuffix(IM_END) if stopped else turn


def trl_episode_end(
    messages: list[dict[str, Any]],
    turn_text: str,
    stopped: bool,
    max_turns: int,
    parse: Callable[[str], ParsedAction] = parse_action,
    answer_tool: str | None = None,
) -> tuple[str | None, str, ParsedAction | None]:
    """(final answer, finish reason, mentorrl's reading of the last turn) of a TRL rollout.

    ``messages``: TRL's completion (assistant and tool messages); ``turn_text``: the last turn's raw
    text; ``stopped``: it ended with the stop token. The last turn still holding a tool call means TRL
    stopped the tool loop: at the turn limit (``max_turns``) or because the tool result did not fit
    (``max_tokens``). A turn cut before its stop token is ``length``. Otherwise mentorrl's parser of the
    rendering (``parse``: the contract's ``parse_action``; default the contract's own format) reads the turn:
    an answer is the final answer; a turn it reads as a tool call (or a malformed one) that TRL's parser did
    not is ``unparsed``: the episode ended with no answer. First of all, a stopped last turn that is a call of
    ``answer_tool`` (the typed answer) is the final answer, as ``Episode.add_policy_turn`` reads it (the call's
    JSON as written, :func:`~mentorrl.rollout.episode.answer_call_text`), whatever turn it came at."""
    from mentorrl.rollout.episode import answer_call_text

    action = parse(turn_text) if stopped else None
    if answer_tool is not None and action is not None and action.kind == "tool" and action.name == answer_tool:
        return answer_call_text(turn_text, action.body if action.body is not None else action.raw), "answer", action
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if assistants and assistants[-1].get("tool_calls"):
        return None, ("max_turns" if len(assistants) >= max_turns else "max_tokens"), None
    if action is None:
        return None, "length", None
    if action.kind == "answer":
        return action.text, "answer", action
    return None, "unparsed", action


def refused_calls(messages: list[dict[str, Any]], tool_names: set[str], max_turns: int) -> list[tuple[Any, Any]]:
    """Tool calls TRL answered with an error before any tool ran (its tool loop looks the name up and calls
    ``method(**arguments)``): an unknown name, or arguments that are not an object. The last turn's calls
    did not run at all when it is the ``max_turns``-th turn (TRL's loop ends first)."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    out: list[tuple[Any, Any]] = []
    for i, m in enumerate(assistants):
        if i == len(assistants) - 1 and len(assistants) >= max_turns:
            break  # TRL's loop stopped before running them
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            name, args = fn.get("name"), fn.get("arguments")
            if name not in tool_names or not isinstance(args, dict):
                out.append((name, args))
    return out


# --------------------------------------------------------------------------- task draw ---------------
def grpo_step_tasks(entry: Any, seed: int, steps: int, tasks_per_step: int, split: str = "train") -> list[list]:
    """The tasks ``mentorrl train``'s GRPO stage draws at each step for ``seed`` (no hard-task pool):
    its train pool and each step's draw, both seeded by :class:`~mentorrl.train.loop.StepSeeds` as in
    :class:`~mentorrl.train.loop.Stage`. The bench checks the result against the ids the mentorrl arm used."""
    from mentorrl.train.loop import StepSeeds, pool_size

    seeds = StepSeeds(seed, "grpo")
    pool = entry.make_tasks().tasks(split=split, n=pool_size(tasks_per_step, steps), seed=seeds("pool"))
    out = []
    for step in range(steps):
        rng = seeds.at(step).rng("tasks")
        out.append(rng.sample(pool, min(tasks_per_step, len(pool))))
    return out


# ------------------------------------------------------------------------------ summary ---------------
STEP_FIELDS = ("step_cpu_s", "step_wall_s", "rollout_cpu_s", "rollout_wall_s", "update_cpu_s", "update_wall_s")


def rep_metrics(result: dict[str, Any], warmup: int) -> dict[str, float]:
    """One arm's figures for one rep from its steps after the first ``warmup``: seconds per step (means),
    trajectories per step CPU-second, policy tokens per rollout CPU-second and cores kept busy (CPU
    seconds over wall seconds) (totals over totals)."""
    steps = [s for s in result["steps"] if s["step"] >= warmup]
    if not steps:
        raise ValueError(f"{result.get('arm')} rep {result.get('rep')}: no timed steps after {warmup} warm-up")
    n = len(steps)
    tot = {k: sum(s[k] for s in steps) for k in (*STEP_FIELDS, "trajectories", "policy_tokens")}
    out = {f"{k}_per_step": tot[k] / n for k in STEP_FIELDS}
    out.update(
        steps=float(n),
        trajectories_per_cpu_s=tot["trajectories"] / tot["step_cpu_s"],
        trajectories_per_wall_s=tot["trajectories"] / tot["step_wall_s"],
        rollout_tokens_per_cpu_s=tot["policy_tokens"] / tot["rollout_cpu_s"],
        rollout_tokens_per_wall_s=tot["policy_tokens"] / tot["rollout_wall_s"],
        rollout_cores_busy=tot["rollout_cpu_s"] / tot["rollout_wall_s"],
        step_cores_busy=tot["step_cpu_s"] / tot["step_wall_s"],
        policy_tokens_per_step=tot["policy_tokens"] / n,
        success=sum(s["success"] * s["trajectories"] for s in steps) / tot["trajectories"],
        reward_mean=sum(s["reward_mean"] * s["trajectories"] for s in steps) / tot["trajectories"],
    )
    if result.get("peak_rss_mib") is not None:
        out["peak_rss_mib"] = float(result["peak_rss_mib"])
    return out


def ratio_spread(vals: Sequence[float]) -> dict[str, Any]:
    """Per-rep ratios: their range and geometric mean with a Student-t 95% interval (on the logs;
    None with one rep)."""
    iv = mean_interval([math.log(v) for v in vals])
    ci = None if iv["ci95"] is None else [math.exp(iv["ci95"][0]), math.exp(iv["ci95"][1])]
    return {"reps": len(vals), "min": min(vals), "max": max(vals), "geo_mean": math.exp(iv["mean"]), "ci95": ci}


def summarize(
    results: dict[str, list[dict[str, Any]]], warmup: int, targets_at: dict[str, float] | None = None
) -> dict[str, Any]:
    """Per arm the median over reps of every :func:`rep_metrics` figure; ``ratios``: per figure the
    median over reps of mentorrl / TRL, each rep's two arms paired (reps present in both arms).
    ``targets``: the issue's targets against the median ratio (``met``), with the per-rep spread and
    a 95% interval (:func:`ratio_spread`; ``interval_above``: its lower end at or above the target)."""
    per_rep = {arm: {r["rep"]: rep_metrics(r, warmup) for r in rs} for arm, rs in results.items()}
    arms = {
        arm: {k: statistics.median(m[k] for m in reps.values()) for k in next(iter(reps.values()))}
        for arm, reps in per_rep.items()
        if reps
    }
    ratios: dict[str, float] = {}
    spreads: dict[str, dict[str, Any]] = {}
    if "trl" in per_rep and "mentorrl" in per_rep:
        paired = sorted(set(per_rep["trl"]) & set(per_rep["mentorrl"]))
        for k in arms.get("mentorrl", {}):
            vals = [per_rep["mentorrl"][r][k] / per_rep["trl"][r][k] for r in paired if per_rep["trl"][r][k]]
            if vals:
                ratios[k] = statistics.median(vals)
                if k in TARGETS and all(v > 0 for v in vals):
                    spreads[k] = ratio_spread(vals)
    targets = {}
    for k, t in (targets_at or TARGETS).items():
        sp = spreads.get(k)
        targets[k] = {
            "target": t,
            "ratio": ratios.get(k),
            "met": ratios.get(k) is not None and ratios[k] >= t,
            **(sp or {}),
            "interval_above": bool(sp and sp["ci95"] and sp["ci95"][0] >= t),
        }
    return {
        "per_rep": {a: {str(r): m for r, m in reps.items()} for a, reps in per_rep.items()},
        "arms": arms,
        "ratios": ratios,
        "targets": targets,
    }


TABLE_ROWS = (  # (label, key, format); seconds are per GRPO step of 128 trajectories
    ("rollout CPU-s / step", "rollout_cpu_s_per_step", "{:.1f}"),
    ("update CPU-s / step", "update_cpu_s_per_step", "{:.1f}"),
    ("step CPU-s / step", "step_cpu_s_per_step", "{:.1f}"),
    ("rollout wall s / step", "rollout_wall_s_per_step", "{:.1f}"),
    ("update wall s / step", "update_wall_s_per_step", "{:.1f}"),
    ("step wall s / step", "step_wall_s_per_step", "{:.1f}"),
    ("trajectories / step CPU-s", "trajectories_per_cpu_s", "{:.2f}"),
    ("rollout policy tokens / CPU-s", "rollout_tokens_per_cpu_s", "{:.0f}"),
    ("rollout cores busy (CPU-s / wall-s)", "rollout_cores_busy", "{:.2f}"),
    ("step cores busy (CPU-s / wall-s)", "step_cores_busy", "{:.2f}"),
    ("policy tokens / step", "policy_tokens_per_step", "{:.0f}"),
    ("task success (rollouts)", "success", "{:.1%}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
)


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as a markdown table: medians per arm and the ratio mentorrl / TRL."""
    arms, ratios = summary["arms"], summary["ratios"]
    lines = ["| median over reps | TRL 1.16 GRPOTrainer | mentorrl train | mentorrl / TRL |", "|---|---:|---:|---:|"]
    for label, key, fmt in TABLE_ROWS:
        cells = [fmt.format(arms[a][key]) if key in arms.get(a, {}) else "–" for a in ARMS]
        ratio = f"{ratios[key]:.2f}x" if key in ratios else "–"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def target_lines(summary: dict[str, Any]) -> list[str]:
    names = {
        "rollout_tokens_per_cpu_s": "rollout policy tokens per CPU-second",
        "trajectories_per_cpu_s": "whole GRPO step trajectories per CPU-second",
    }
    out = []
    for k, t in summary["targets"].items():
        r = t["ratio"]
        got = "not measured" if r is None else f"{r:.2f}x: {'met' if t['met'] else 'NOT met'}"
        if t.get("reps"):
            got += f" (median of {t['reps']} reps; per rep {t['min']:.2f}-{t['max']:.2f}x; geometric mean {t['geo_mean']:.2f}x"
            got += (
                f", 95% CI {t['ci95'][0]:.2f}-{t['ci95'][1]:.2f}x: {'above' if t['interval_above'] else 'not above'}"
                " the target)"
                if t["ci95"]
                else ")"
            )
        out.append(f"target {names[k]} >= {t['target']:g}x TRL: {got}")
    return out


def merge_runs(docs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The arms' results of several runs (``--json`` files) as one set of reps: run ``i``'s rep ``r``
    becomes rep ``1000 * i + r``, so reps pair within their run only."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for i, doc in enumerate(docs):
        for arm, rs in doc["runs"].items():
            merged.setdefault(arm, []).extend({**r, "rep": 1000 * i + r["rep"]} for r in rs)
    return merged


def summarize_files(paths: Sequence[str]) -> dict[str, Any]:
    """``--summarize``: the table and targets over every rep of the given ``--json`` runs."""
    docs = []
    for p in paths:
        try:
            docs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as exc:
            sys.exit(f"--summarize {p}: cannot read a bench result ({exc})")
    warm = {d["settings"]["warmup"] for d in docs}
    if len(warm) != 1:
        sys.exit(f"--summarize: the runs used different --warmup ({sorted(warm)})")
    summary = summarize(merge_runs(docs), warm.pop())
    print(f"{len(docs)} runs: {', '.join(paths)}")
    print(markdown_table(summary))
    for line in target_lines(summary):
        print(line)
    return summary


# --------------------------------------------------------------------------------- arms -----------
class Clock:
    """Wall and CPU seconds (this process, all threads) per (step, part)."""

    def __init__(self) -> None:
        self.spans: dict[int, dict[str, list[float]]] = {}

    def add(self, step: int, part: str, wall: float, cpu: float) -> None:
        acc = self.spans.setdefault(step, {}).setdefault(part, [0.0, 0.0])
        acc[0] += wall
        acc[1] += cpu

    def span(self, step: int, part: str):
        clock = self

        class _Span:
            def __enter__(self):
                self.t = (time.perf_counter(), time.process_time())

            def __exit__(self, *exc):
                clock.add(step, part, time.perf_counter() - self.t[0], time.process_time() - self.t[1])

        return _Span()

    def get(self, step: int, part: str) -> tuple[float, float]:
        w, c = self.spans.get(step, {}).get(part, (0.0, 0.0))
        return w, c


# --answer's default: both arms read free-text answers. TRL's tool loop runs every call it parses and generates
# on, so it has no way of its own to end an episode on the typed answer's final_answer call (verifier v4); the
# arms stay comparable (the same environment, verifier and reward in both). A policy trained on typed answers
# (SmolLM2's recipe) needs ``--answer typed``: TRL's episode then ends on that call through its overlong rule
# (``ToolEnvBase._call``).
ENV_ANSWER = "free_text"
ANSWERS = ("free_text", "typed")


def bench_env_factory(entry: Any, answer: str = ENV_ANSWER):
    """The bench's environment factory: the orders environment with ``answer`` answers (``--answer``)."""
    return functools.partial(entry.make_env, answer=answer)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def arm_context(args) -> dict[str, Any]:
    """Shared by both arms: the recipe's (``--config``) contract settings and reward weights, the task draw."""
    from mentorrl.config import load_config
    from mentorrl.envs import get_env

    cfg = load_config(recipe_path(args))
    entry = get_env("orders")
    steps = grpo_step_tasks(entry, args.seed, args.warmup + args.steps, args.tasks)
    return {"cfg": cfg, "entry": entry, "step_tasks": steps}


def recipe_path(args) -> Path:
    """The recipe both arms take their settings from (``--config``; default the demo's)."""
    return Path(getattr(args, "config", None) or DEMO_CONFIG)


def mentorrl_overrides(args, run_dir: Path) -> list[str]:
    """``--set`` overrides of ``mentorrl train <--config>`` for the mentorrl arm."""
    return [
        f"model.path={args.model}",
        "recipe=[grpo]",
        f"run_dir={run_dir}",
        f"seed={args.seed}",
        "threads=1",
        "audit.preflight=false",
        "eval.num_tasks=0",
        "audit.eval_every=0",
        "grpo.guide=none",
        f"env.answer={getattr(args, 'answer', ENV_ANSWER)}",
        "grpo.kl_coef=0",
        f"grpo.steps={args.warmup + args.steps}",
        f"grpo.tasks_per_step={args.tasks}",
        f"grpo.samples_per_task={args.group}",
        f"grpo.updates_per_step={args.updates}",
        f"grpo.optim.lr={args.lr}",
        "grpo.optim.warmup_steps=0",
        f"grpo.eps_low={args.eps_low}",
        f"grpo.eps_high={args.eps_high}",
        "grpo.checkpoint_every=1000",
        "sampling.temperature=1.0",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"limits.max_turns={args.max_turns}",
        f"limits.max_total_tokens={args.max_total_tokens}",
        f"grpo.optim.micro_batch_size={args.trl_micro_batch}",
        f"model.dtype={getattr(args, 'dtype', 'float32')}",
        lora_override() if getattr(args, "lora", False) else "model.lora=null",
        *getattr(args, "mentorrl_set", []),
    ]


def lora_override() -> str:
    """:data:`LORA` as a ``--set`` of ``mentorrl train``."""
    return (
        f"model.lora={{r: {LORA['r']}, alpha: {LORA['alpha']}, target_modules: [{', '.join(LORA['target_modules'])}]}}"
    )


def run_mentorrl_arm(args, work: Path) -> dict[str, Any]:
    """``mentorrl train`` (its CLI, in this process) with timing wrappers around the GRPO stage's
    ``step_fn``, ``collect_group`` (rollout) and ``pg_update`` (update)."""
    import torch

    torch.set_num_threads(1)
    import mentorrl.train.loop as loop_mod
    import mentorrl.train.recipes.grpo as grpo
    from mentorrl.cli import app

    clock, info = Clock(), {}
    cur = {"step": -1}
    # the GRPO stage's hooks run on the RL loop: rollouts through loop.collect_group (Stage.collect), the
    # step loop loop.run_stage (RLLoop.run), the update through grpo.pg_update (GRPOStage.update)
    orig_collect, orig_update, orig_run_stage = loop_mod.collect_group, grpo.pg_update, loop_mod.run_stage

    def collect_group(ws, model, chosen, *a, **kw):
        with clock.span(cur["step"], "rollout"):
            grp = orig_collect(ws, model, chosen, *a, **kw)
        trajs = grp.trajs
        info[cur["step"]] = {
            "task_ids": [t.id for t in chosen],
            "trajectories": len(trajs),
            "policy_tokens": sum(t.num_policy_tokens for t in trajs),
            "success": sum(bool(t.reward.success) for t in trajs) / len(trajs),
            "reward_mean": sum(t.reward.total for t in trajs) / len(trajs),
            "finish": _counts(t.finish_reason for t in trajs),
            "rss_after_rollout_mib": peak_rss_mib(),
        }
        return grp

    def pg_update(*a, **kw):
        with clock.span(cur["step"], "update_pg"):
            return orig_update(*a, **kw)

    def run_stage(ws, stage, model, learner, steps, step_fn, *a, **kw):
        def timed(step):
            cur["step"] = step
            with clock.span(step, "step"):
                m = step_fn(step)
            info.setdefault(step, {})["rss_after_step_mib"] = peak_rss_mib()
            return m

        return orig_run_stage(ws, stage, model, learner, steps, timed, *a, **kw)

    loop_mod.collect_group, grpo.pg_update, loop_mod.run_stage = collect_group, pg_update, run_stage
    run_dir = work / f"mentorrl-rep{args.rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = ["train", str(recipe_path(args))]
    for ov in mentorrl_overrides(args, run_dir):
        argv += ["--set", ov]
    t0, c0 = time.perf_counter(), time.process_time()
    app(argv, standalone_mode=False)
    total = (time.perf_counter() - t0, time.process_time() - c0)
    steps = []
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    logged = {r["step"] - 1: r for r in logged if r.get("stage") == "grpo"}
    for step in sorted(info):
        sw, sc = clock.get(step, "step")
        rw, rc = clock.get(step, "rollout")
        uw, uc = clock.get(step, "update_pg")
        m = logged.get(step, {})
        steps.append(
            {
                "step": step,
                "step_wall_s": sw,
                "step_cpu_s": sc,
                "rollout_wall_s": rw,
                "rollout_cpu_s": rc,
                "update_wall_s": sw - rw,
                "update_cpu_s": sc - rc,
                "pg_update_wall_s": uw,
                "pg_update_cpu_s": uc,
                **info[step],
                "logged": {
                    k: m.get(k)
                    for k in (
                        "rollout_s",
                        "update_s",
                        "step_s",
                        "cpu_s",
                        "rollout_cpu_util",
                        "trained_trajectories",
                        "rollout_tokens",
                        "task_success",
                    )
                },
            }
        )
    return {
        "arm": "mentorrl",
        "steps": steps,
        "total_wall_s": total[0],
        "total_cpu_s": total[1],
        "command": "mentorrl " + " ".join(argv),
        "peak_rss_mib_self": peak_rss_mib(),
    }


def _counts(xs) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


class _TrlContext:
    def __init__(self, entry, contract, weights, tasks, max_turns, tool_names, answer=ENV_ANSWER, answer_tool=None):
        self.make_env, self.contract, self.weights = bench_env_factory(entry, answer), contract, weights
        self.tasks, self.max_turns, self.tool_names = tasks, max_turns, tool_names
        # the typed answer's tool (None: free-text answers) and the result that ends TRL's rollout on its call
        self.answer_tool, self.end_text = answer_tool, ""

    def set_end_text(self, tok, max_completion: int) -> None:
        """:attr:`end_text`: a tool result of more than ``max_completion`` tokens (TRL drops it, ending the
        rollout)."""
        self.end_text = "end " * (max_completion + 1)
        if len(tok.encode(self.end_text, add_special_tokens=False)) <= max_completion:
            raise SystemExit("--answer typed: the end-of-episode tool result does not exceed TRL's completion budget")


def trl_config_kwargs(
    args, max_completion_length: int, system_turn: bool, tool_descriptions: bool, out_dir: str
) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for the TRL arm (see the module docstring for why each is set)."""
    per_update = args.tasks * args.group // args.updates
    if per_update % args.trl_micro_batch:
        raise SystemExit(
            f"--trl-micro-batch {args.trl_micro_batch} must divide the {per_update} trajectories of one optimizer step"
        )
    accum = per_update // args.trl_micro_batch
    return dict(
        output_dir=out_dir,
        seed=args.seed,
        use_cpu=True,
        bf16=getattr(args, "dtype", "float32") == "bfloat16",
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum * args.updates,
        num_generations=args.group,
        max_steps=(args.warmup + args.steps) * args.updates,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=args.eps_low,
        epsilon_high=args.eps_high,
        loss_type="dapo",
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=max_completion_length,
        generation_kwargs={"max_new_tokens": args.max_new_tokens},
        max_tool_calling_iterations=args.max_turns - 1,
        chat_template_kwargs={"system_turn": system_turn, "tool_descriptions": tool_descriptions},
        shuffle_dataset=False,
        remove_unused_columns=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        use_transformers_continuous_batching=bool(getattr(args, "trl_continuous_batching", False)),
    )


def trl_contract(args, cfg, entry, tok) -> tuple[Any, list[dict[str, Any]], Any, list[dict[str, Any]]]:
    """The TRL arm's (contract, tool schemas, TRL's tokenizer, the head of TRL's prompt).

    The contract is what ``mentorrl train`` binds for this checkpoint and recipe
    (:meth:`~mentorrl.train.workspace.Workspace.bind_tokenizer`): the checkpoint's own template when it renders
    the conversation (``hermes_prompted``: SmolLM2), else mentorrl's template for the recipe's prompt format.
    TRL gets a copy of the tokenizer with :func:`trl_template_for`'s template and the response parser; the
    contract keeps the checkpoint's. The head: the system message the contract renders (none for
    ``prompt.system_turn: false``)."""
    import copy

    from mentorrl.chat_templates import native_chat_for
    from mentorrl.contract import contract_for_env, tool_schemas

    probe = bench_env_factory(entry, getattr(args, "answer", ENV_ANSWER))()
    try:
        chat = native_chat_for(tok, probe, cfg.prompt)
        if chat is None:
            tok.chat_template = chat_template_for(cfg.prompt)  # what a checkpoint of this recipe is saved with
        sampling = cfg.sampling.model_copy(update={"temperature": 1.0, "max_new_tokens": args.max_new_tokens})
        limits = cfg.limits.model_copy(update={"max_turns": args.max_turns, "max_total_tokens": args.max_total_tokens})
        contract = contract_for_env(tok, probe, sampling, limits, cfg.prompt, chat=chat)
        schemas, system_prompt = tool_schemas(probe), probe.system_prompt
    finally:
        probe.close()
    try:
        template = trl_template_for(tok, chat, cfg.prompt)
    except BridgeError as e:
        raise SystemExit(f"--model {args.model}: {e}") from None
    trl_tok = copy.deepcopy(tok)
    trl_tok.chat_template = template
    trl_tok.response_template = RESPONSE_TEMPLATE
    trl_tok.padding_side = "left"
    if chat is not None:
        head = [{"role": "system", "content": chat.system}] if chat.system is not None else []
    else:
        head = [{"role": "system", "content": system_prompt}] if cfg.prompt.system_turn else []
    return contract, schemas, trl_tok, head


def run_trl_arm(args, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer with mentorrl's environment and reward bridged in, timed by overriding
    ``_generate`` / ``_calculate_rewards`` / ``_generate_and_score_completions`` and a step callback."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mentorrl.models.build import load_policy

    t0, c0 = time.perf_counter(), time.process_time()
    ctx0 = arm_context(args)
    cfg, entry = ctx0["cfg"], ctx0["entry"]
    flat = [t for step in ctx0["step_tasks"] for t in step]
    tok, model = load_policy(args.model)
    contract, schemas, tok, head = trl_contract(args, cfg, entry, tok)
    longest_prompt = max(len(contract.prompt_ids(t.prompt)) for t in flat)
    max_completion = args.max_total_tokens - longest_prompt
    answer = getattr(args, "answer", ENV_ANSWER)
    names = [s["function"]["name"] for s in schemas]
    answer_tool = ANSWER_TOOL_NAME if answer == "typed" else None
    if answer_tool is not None and answer_tool not in names:
        raise SystemExit(f"--answer typed: the environment has no {answer_tool} tool")
    ctx = _TrlContext(entry, contract, cfg.reward, flat, args.max_turns, names, answer, answer_tool)
    ctx.set_end_text(tok, max_completion)
    env_cls = environment_class(schemas)
    data = Dataset.from_list(
        [{"prompt": head + [{"role": "user", "content": ""}], "task_index": i} for i in range(len(flat))]
    )
    updates = args.updates
    clock: Clock = Clock()
    info: dict[int, dict[str, Any]] = {}

    def batch_of(trainer) -> int:
        return trainer.state.global_step // updates

    class StepClock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = (time.perf_counter(), time.process_time())

        def on_step_end(self, a, state, control, **kw):
            g = (state.global_step - 1) // updates
            clock.add(g, "step", time.perf_counter() - self.t[0], time.process_time() - self.t[1])
            info.setdefault(g, {})["rss_after_step_mib"] = peak_rss_mib()

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            with clock.span(batch_of(self), "score_total"):
                return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            g = batch_of(self)
            with clock.span(g, "generate"):
                out = super()._generate(prompts)
            completion_ids, tool_mask = out[1], out[2]
            toks = sum(sum(m) for m in tool_mask) if tool_mask is not None else sum(len(c) for c in completion_ids)
            info.setdefault(g, {}).update(trajectories=len(prompts), policy_tokens=int(toks))
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            g = batch_of(self)
            with clock.span(g, "reward"):
                out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            last = [e._last for e in self.environments]
            n = len(last)
            info.setdefault(g, {}).update(
                task_ids=list(dict.fromkeys(x["task_id"] for x in last)),
                success=sum(bool(x["success"]) for x in last) / n,
                reward_mean=sum(x["reward"] for x in last) / n,
                finish=_counts(x["finish_reason"] for x in last),
                unparsed_share=sum(x["finish_reason"] == "unparsed" for x in last) / n,
                unparsed_examples=[x["unparsed_turn"] for x in last if x["unparsed_turn"] is not None][:3],
                refused_calls=sum(x["refused_calls"] for x in last),
                multi_call_turns=sum(x["multi_call_turns"] for x in last),
                tool_calls_per_traj=sum(x["tool_calls"] for x in last) / n,
                rss_after_rollout_mib=peak_rss_mib(),
            )
            return out

    def mentorrl_reward(completions, completion_ids, environments, **_):
        return [env._score(c, ids) for c, ids, env in zip(completions, completion_ids, environments)]

    out_dir = work / f"trl-rep{args.rep}"
    shutil.rmtree(out_dir, ignore_errors=True)
    kw = trl_config_kwargs(args, max_completion, cfg.prompt.system_turn, cfg.prompt.tool_descriptions, str(out_dir))
    for kv in getattr(args, "trl_set", []):
        key, _, value = kv.partition("=")
        kw[key] = json.loads(value)
    peft = {}
    if getattr(args, "lora", False):
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=list(LORA["target_modules"])
        )
    trainer = TimedGRPOTrainer(
        model=model,
        **peft,
        reward_funcs=[mentorrl_reward],
        args=GRPOConfig(**kw),
        train_dataset=data,
        processing_class=tok,
        environment_factory=lambda: env_cls(ctx),
        callbacks=[StepClock()],
    )
    fmt_check = trl_format_check(trainer, contract, flat, head, entry, answer)
    setup = (time.perf_counter() - t0, time.process_time() - c0)
    t1, c1 = time.perf_counter(), time.process_time()
    trainer.train()
    train = (time.perf_counter() - t1, time.process_time() - c1)
    steps = []
    for g in sorted(info):
        sw, sc = clock.get(g, "step")
        gw, gc = clock.get(g, "generate")
        rw, rc = clock.get(g, "reward")
        tw, tc = clock.get(g, "score_total")
        steps.append(
            {
                "step": g,
                "step_wall_s": sw,
                "step_cpu_s": sc,
                "rollout_wall_s": gw + rw,
                "rollout_cpu_s": gc + rc,
                "update_wall_s": sw - gw - rw,
                "update_cpu_s": sc - gc - rc,
                "generate_wall_s": gw,
                "generate_cpu_s": gc,
                "reward_wall_s": rw,
                "reward_cpu_s": rc,
                "trl_old_logp_wall_s": tw - gw - rw,
                "trl_old_logp_cpu_s": tc - gc - rc,
                **info[g],
            }
        )
    logs = [h for h in trainer.state.log_history if "loss" in h or "reward" in h]
    return {
        "arm": "trl",
        "steps": steps,
        "setup_wall_s": setup[0],
        "setup_cpu_s": setup[1],
        "total_wall_s": train[0],
        "total_cpu_s": train[1],
        "max_completion_length": max_completion,
        "longest_prompt": longest_prompt,
        "format_check": fmt_check,
        "grpo_config": {k: v for k, v in kw.items() if k != "output_dir"},
        "trl_log": logs,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "peak_rss_mib_self": peak_rss_mib(),
    }


def trl_format_check(
    trainer, contract, tasks, head, entry, answer: str = ENV_ANSWER, episodes: int = 4
) -> dict[str, Any]:
    """Do TRL's token ids equal the contract's? Every task's prompt as TRL tokenises it (its
    ``_tokenize_prompts`` call: the environment's tools, the trainer's template and kwargs) against
    ``contract.prompt_ids``; TRL's tool-result suffix (``_get_tool_suffix_ids``) against
    ``contract.observation_ids`` for a success and an error observation; and ``episodes`` scripted expert
    episodes through :func:`parity_problems` with the trainer's own suffix function (every turn boundary, the
    generation mask, TRL's token-in/token-out stream). Any difference stops the bench: the arms would not be
    training on the same token streams."""
    tok = trainer.processing_class
    kw = dict(trainer.chat_template_kwargs)
    tools = trainer._env_tools[None] or None
    same = 0
    for t in tasks:
        ids = tok.apply_chat_template(
            [*head, {"role": "user", "content": t.prompt}],
            tools=tools,
            chat_template=trainer.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **kw,
        )["input_ids"]
        same += list(ids) == contract.prompt_ids(t.prompt)
    observations = [
        render_observation_content(True, {"order_id": "O-123", "status": "shipped", "total": 38.5}, None),
        render_observation_content(False, None, "order O-999 not found"),
    ]
    obs_same = all(
        trainer._get_tool_suffix_ids([{"role": "tool", "name": "get_order", "content": o}])
        == contract.observation_ids(o)
        for o in observations
    )
    problems = scripted_parity(trainer, contract, head, entry, tools, kw, episodes, answer)
    out = {
        "prompts_equal": same,
        "prompts": len(tasks),
        "observations_equal": obs_same,
        "episodes_checked": episodes,
        "episode_problems": problems,
        "trl_kept_chat_template": trainer.chat_template is None,
        "rendering": contract.chat.name if contract.chat is not None else "mentorrl",
    }
    if same != len(tasks) or not obs_same or problems:
        raise SystemExit(f"TRL's token ids differ from mentorrl's rollout: {json.dumps(out)}")
    return out


def scripted_parity(trainer, contract, head, entry, tools, kw, episodes: int, answer: str = ENV_ANSWER) -> list[str]:
    """:func:`parity_problems` over ``episodes`` scripted expert episodes of the contract (train tasks)."""
    from mentorrl.rollout.episode import run_scripted_episode

    if trainer.chat_template is not None:
        return ["TRL replaced the chat template (it found it not prefix-preserving)"]
    env, out = bench_env_factory(entry, answer)(), []
    try:
        for task in entry.make_tasks().tasks("train", episodes, 12345):
            traj = run_scripted_episode(contract, env, task, entry.make_expert())
            user = env.reset(task)
            for p in parity_problems(
                trainer.processing_class, traj, head, user, tools, trainer._get_tool_suffix_ids, kw
            ):
                out.append(f"{task.id}: {p}")
    finally:
        env.close()
    return out


# -------------------------------------------------------------------------------- driver ----------
def child_command(args, arm: str, rep: int, out: Path, work: Path) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--arm",
        arm,
        "--rep",
        str(rep),
        "--arm-out",
        str(out),
        "--work",
        str(work),
        "--model",
        str(args.model),
        "--seed",
        str(args.seed + rep),
        "--config",
        str(recipe_path(args)),
        "--dtype",
        str(getattr(args, "dtype", "float32")),
        "--answer",
        str(getattr(args, "answer", ENV_ANSWER)),
    ]
    for flag in (
        "steps",
        "warmup",
        "tasks",
        "group",
        "updates",
        "lr",
        "eps_low",
        "eps_high",
        "max_new_tokens",
        "max_turns",
        "max_total_tokens",
        "trl_micro_batch",
    ):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.trl_continuous_batching:
        cmd.append("--trl-continuous-batching")
    if getattr(args, "lora", False):
        cmd.append("--lora")
    for kv in args.trl_set:
        cmd += ["--trl-set", kv]
    for kv in getattr(args, "mentorrl_set", []):
        cmd += ["--mentorrl-set", kv]
    return cmd


def run_child(cmd: list[str], log: Path) -> dict[str, Any]:
    """Run one arm; its result JSON with the child's CPU seconds and peak RSS from ``wait4``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"`{' '.join(cmd)}` exited {proc.returncode}; log {log}:\n{tail}")
    out = json.loads(Path(cmd[cmd.index("--arm-out") + 1]).read_text())
    out.update(
        peak_rss_mib=usage.ru_maxrss / 1024.0,
        process_cpu_s=usage.ru_utime + usage.ru_stime,
        process_wall_s=time.perf_counter() - t0,
    )
    return out


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help=f"mentorrl checkpoint dir, or a LoRA stage's adapter dir (merged into its base once, in the work dir) "
        f"(default: {DEFAULT_MODEL} if it exists)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the recipe both arms take their prompt format, reward and contract settings from, and the mentorrl arm "
        "trains with (default: mentorrl/configs/demo.yaml; the SmolLM2 checkpoints: mentorrl/configs/smollm2.yaml)",
    )
    p.add_argument(
        "--answer",
        choices=ANSWERS,
        default=ENV_ANSWER,
        help="how an episode ends in both arms: free_text (default; a reply without a tool call, the v3 reader) or "
        "typed (a final_answer call, verifier v4, as SmolLM2's recipe trains; TRL's rollout ends on that call "
        "through its own rule for a tool result that does not fit)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "auto"),
        default="float32",
        help="compute precision of both arms: fp32 weights and optimizer state, forward and backward (and generation) "
        "under bf16 autocast for bfloat16 (mentorrl model.dtype; TRL bf16=True); auto: mentorrl's start-up probe "
        "decides once, in the driver, for both arms (default float32)",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions; each runs TRL then mentorrl (default 3)")
    p.add_argument("--steps", type=int, default=2, help="timed GRPO steps per arm and rep (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps first (default 1)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--seed", type=int, default=0, help="rep r uses seed + r in both arms")
    p.add_argument("--tasks", type=int, default=16, help="tasks per step")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout batch (minibatches)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eps-low", type=float, default=0.2)
    p.add_argument("--eps-high", type=float, default=0.28)
    p.add_argument("--max-new-tokens", type=int, default=64, help="per turn")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-total-tokens", type=int, default=768)
    p.add_argument(
        "--trl-micro-batch",
        type=int,
        default=32,
        help="sequences per forward/backward in both arms: TRL per_device_train_batch_size, mentorrl "
        "grpo.optim.micro_batch_size (default 32)",
    )
    p.add_argument(
        "--trl-set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override one GRPOConfig field of the TRL arm, e.g. --trl-set bf16=true (repeatable)",
    )
    p.add_argument(
        "--mentorrl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more --set of the mentorrl arm (an ablation), e.g. --mentorrl-set "
        "grpo.optim.pack_prefixes=false (repeatable)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="LoRA adapters in both arms (r 16, alpha 32, every attention and MLP projection; mentorrl "
        "model.lora, TRL peft_config): only the adapters train",
    )
    p.add_argument(
        "--trl-continuous-batching",
        action="store_true",
        help="TRL use_transformers_continuous_batching (off: far slower here, see the results)",
    )
    p.add_argument("--target-step", type=float, default=None, help="whole-step target ratio (default 4)")
    p.add_argument("--target-rollout", type=float, default=None, help="rollout target ratio (default 2)")
    p.add_argument("--work", default=None, help="run directories and logs (default: a temporary dir, removed)")
    p.add_argument("--json", default=None, metavar="OUT", help="write everything as JSON")
    p.add_argument(
        "--summarize",
        nargs="+",
        default=None,
        metavar="RUN_JSON",
        help="no run: print the table and targets over every rep of these --json results",
    )
    p.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--arm-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def targets_of(args) -> dict[str, float]:
    """The targets checked: the issue's (``TARGETS``) unless ``--target-step`` / ``--target-rollout`` move them."""
    return {
        "rollout_tokens_per_cpu_s": args.target_rollout or TARGETS["rollout_tokens_per_cpu_s"],
        "trajectories_per_cpu_s": args.target_step or TARGETS["trajectories_per_cpu_s"],
    }


def resolve_model(arg: str | None) -> Path:
    if arg is not None:
        path = Path(arg)
    else:
        path = next((c for c in (DEFAULT_MODEL, ROOT / DEFAULT_MODEL) if (c / "config.json").exists()), None)
        if path is None:
            sys.exit(
                f"no --model and no {DEFAULT_MODEL}: build the demo's SFT checkpoint first "
                "(`mentorrl train mentorrl/configs/demo.yaml --set recipe=[sft]`) and pass its sft/final"
            )
    if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
        sys.exit(
            f"--model {path}: neither a checkpoint directory (no config.json) nor a LoRA adapter "
            "(no adapter_config.json)"
        )
    return path.resolve()


def merged_model(path: Path, work: Path) -> Path:
    """The checkpoint both arms load: ``path`` itself, or for a LoRA stage's adapter directory (SmolLM2's
    ``sft/final``) the adapter merged into the base it names, once, under ``work``
    (:func:`mentorrl.models.lora.export_merged`: merged in fp32, saved in the base's dtype, with the
    adapter's tokenizer, chat template and prompt record). ``--lora`` then trains fresh adapters on it in both
    arms (zero-initialised: the starting policy is the adapted model's)."""
    from mentorrl.models.lora import export_merged, is_adapter_dir

    if not is_adapter_dir(path):
        return path
    out = work / "merged-model"
    if not (out / "config.json").exists():
        try:
            export_merged(path, out)
        except (OSError, ValueError) as e:
            sys.exit(f"--model {path}: cannot merge the adapter into its base ({e})")
    return out


def resolve_precision(name: str) -> str:
    """``--dtype`` as both arms get it: ``auto`` decided once here by mentorrl's start-up probe (printed)."""
    if name != "auto":
        return name
    import torch

    from mentorrl.models.device import choose_dtype

    choice = choose_dtype(torch.device("cpu"))
    picked = str(choice.dtype).removeprefix("torch.")
    print(f"--dtype auto: {picked} ({choice.reason})", flush=True)
    return picked


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.summarize:
        return summarize_files(args.summarize)
    args.model = resolve_model(args.model)
    if args.arm is not None:  # child: one arm, one rep
        work = Path(args.work)
        res = (run_trl_arm if args.arm == "trl" else run_mentorrl_arm)(args, work)
        res.update(rep=args.rep, seed=args.seed)
        Path(args.arm_out).write_text(json.dumps(res, indent=1))
        return None

    own_work = args.work is None
    work = Path(tempfile.mkdtemp(prefix="vs-trl-")) if own_work else Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run_reps(args, argv, work)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def run_reps(args, argv: list[str] | None, work: Path) -> dict[str, Any]:
    """The driver: the checkpoint and precision both arms get, then the reps, the summary and ``--json``."""
    args.model_source, args.model = args.model, merged_model(args.model, work)
    args.dtype = resolve_precision(args.dtype)
    print(
        f"model {args.model_source}{'' if args.model == args.model_source else f' (merged: {args.model})'}; "
        f"recipe {recipe_path(args)}; {args.dtype}; {args.answer} answers; {args.reps} reps x {args.warmup} warm-up + "
        f"{args.steps} timed steps per arm; "
        f"{args.tasks} tasks x {args.group} samples; work dir {work}",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {a: [] for a in args.arms}
    started = time.perf_counter()
    for rep in range(args.reps):
        for arm in [a for a in ARMS if a in args.arms]:  # TRL first, then mentorrl, every rep
            out = work / f"{arm}-rep{rep}.json"
            res = run_child(child_command(args, arm, rep, out, work), work / f"{arm}-rep{rep}.log")
            results[arm].append(res)
            m = rep_metrics(res, args.warmup)
            print(
                f"rep {rep} {arm:8s}: step {m['step_cpu_s_per_step']:.1f} CPU-s (rollout "
                f"{m['rollout_cpu_s_per_step']:.1f}, update {m['update_cpu_s_per_step']:.1f}); "
                f"{m['trajectories_per_cpu_s']:.2f} traj/CPU-s, {m['rollout_tokens_per_cpu_s']:.0f} rollout "
                f"tok/CPU-s; success {m['success']:.1%}; peak RSS {res['peak_rss_mib']:.0f} MiB "
                f"[{time.perf_counter() - started:.0f}s]",
                flush=True,
            )
    summary = summarize(results, args.warmup, targets_of(args))
    same = None
    if "trl" in results and "mentorrl" in results:
        same = all(
            s_t.get("task_ids") == s_m.get("task_ids")
            for rt, rm in zip(results["trl"], results["mentorrl"])
            for s_t, s_m in zip(rt["steps"], rm["steps"])
        )
    print(markdown_table(summary))
    print(
        "(seconds and RSS: mentorrl / TRL below 1 means mentorrl takes less; per-CPU-second rates: above 1 "
        "means mentorrl is faster)"
    )
    for line in target_lines(summary):
        print(line)
    mem = summary["ratios"].get("peak_rss_mib")
    if mem is not None:
        print(f"peak RSS mentorrl / TRL: {mem:.2f}x ({'no more' if mem <= 1 else 'MORE'} memory than TRL)")
    print(f"same tasks in both arms at every step: {same}")
    doc = {
        "command": " ".join(["python", "bench/vs_trl.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("arm", "rep", "arm_out", "json")
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": 1,
            "omp": "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE",
        },
        "versions": _versions(),
        "same_tasks": same,
        "summary": summary,
        "runs": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    main()
