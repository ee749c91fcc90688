"""The external arm's episodes against the in-process rollout's, episode by episode (issue 55's check).

For ``--tasks`` train tasks, greedy (so both paths take the same turns): the in-process rollout of the
checkpoint, and ``docs/examples/orders_agent.py``'s loop over the recording server in this process.
Printed per task and in total: in-process success, the agent's own verdict, the replay's verdict
(``mentorrl.rollout.rescore``, the stage's default reward), whether the recorded tokens up to the
in-process end equal the rollout's, and the turns the replay cut. With ``--answer-as-tool`` the agent
runs the typed-answer call as a tool and goes on (the example agent before issue 55).

    python bench/external_episode_check.py --model RUNS/s0/sft/final --tasks 8
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "examples"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--answer-as-tool", action="store_true", help="the example agent before issue 55")
    ap.add_argument("--out", type=Path, default=Path("runs/external-episode-check"))
    a = ap.parse_args(argv)

    import orders_agent
    import torch
    from openai import OpenAI

    from mentorrl.contract import ContractLimits, PromptFormat, SamplingParams, contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.models.build import load_policy
    from mentorrl.rollout.recorder import Recorder
    from mentorrl.rollout.rescore import replay_episode
    from mentorrl.rollout.runner import rollout_tasks
    from mentorrl.serve.recording import RunSampling, start_recording_server

    torch.set_num_threads(1)
    tok, model = load_policy(a.model)
    model.eval()
    entry = get_env("orders")
    env = entry.make_env()
    c = contract_for_env(
        tok,
        env,
        SamplingParams(temperature=0.0, max_new_tokens=80),
        ContractLimits(max_turns=6, max_total_tokens=768),
        PromptFormat(system_turn=False),
    )
    env.close()
    tasks = entry.make_tasks().tasks("train", a.tasks, 0)
    trajs = rollout_tasks(model, c, entry.make_env, tasks)
    a.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(a.out / f"rec-{uuid.uuid4().hex[:8]}.sqlite", close_id=c.im_end_id, stop_ids=c.stop_token_ids)
    server, hook = start_recording_server(tok, model, rec, RunSampling(0.0, 1.0, 80), lambda: 0, "k", "rk")
    hook.resume()
    client = OpenAI(base_url=server.url, api_key="k", max_retries=0)
    totals = {"in_process": 0, "agent": 0, "replay": 0, "same_tokens": 0, "turns_cut": 0}
    try:
        for task, t in zip(tasks, trajs):
            eid = "e-" + uuid.uuid4().hex[:8]
            rec.open_episode(eid, task.id)
            env = entry.make_env()
            if a.answer_as_tool:
                env.answer_tool = None  # the agent does not know the call ends the episode
            try:
                answer, _ = orders_agent.run_episode(client, env, task, {"X-Mentorrl-Episode": eid}, False, 6)
                agent_ok = env.verify(answer).success
            finally:
                env.close()
            ep = rec.episode(eid)
            got = replay_episode(ep.segments, task, c, entry.make_env)
            same = bool(got.segments) and got.segments[0].token_ids == t.token_ids
            row = {
                "in_process": t.reward.success,
                "agent": agent_ok,
                "replay": got.trajectory.reward.success,
                "same_tokens": same,
                "turns_cut": got.counts["turns_cut"],
            }
            for k, v in row.items():
                totals[k] += int(v)
            print(task.id, row)
    finally:
        server.stop()
        rec.close()
    print(f"{len(tasks)} tasks: {totals}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
