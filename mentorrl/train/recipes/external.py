"""``stage: external``: GRPO on an agent that runs in its own harness (docs/bring-your-agent.md).

The stage serves the policy in-process (``mentorrl serve``'s app in recording mode on a daemon thread
of this process, sharing the policy object: the learner's new weights are served from the next round
on) and, every step, launches the agent command once per (task, sample) with the endpoint, keys,
episode id and task in its environment, at most ``external.concurrency`` at once. The agent calls the
endpoint with its own prompts, tools and loop; the server records every completion token in / token
out (:mod:`mentorrl.rollout.recorder`); the harness posts each episode's reward. Then GRPO: the
rewarded episodes of a task form its group (at least ``min_group``), the configured advantage
estimator gives each episode its advantage (every segment of an episode, a trajectory, carries it),
and GRPO's update and after hooks run unchanged (the stage is a :class:`GRPOStage`).

Per episode, a timeout, a crash (a signal), a non-zero exit, a failure to start, no completion or
no reward within ``reward_timeout_s`` drop the episode and are counted (``agent_*``, ``dropped_*``);
none stops the run. The recorder's divergences (``diverged_*``) and the server's generation time
(the HTTP hop's cost is the round's wall time beyond it) are step metrics too."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import sanitize_group_rewards
from mentorrl.rollout.recorder import COUNTERS, RecordedEpisode, Recorder, RecordError
from mentorrl.rollout.rescore import REPLAY_COUNTERS, Replayed, replay_episode
from mentorrl.serve.protocol import DEFAULT_MAX_BATCH
from mentorrl.serve.recording import REWARD_PATH, RunSampling, start_recording_server
from mentorrl.train.agents import AgentJob, AgentOutcome, AgentWorker, outcome_counts, run_agents
from mentorrl.train.loop import StepBatch, run_on_loop
from mentorrl.train.recipes.grpo import GRPOStage, GRPOStepData
from mentorrl.train.stage_helpers import require_consistent, reward_debugger, rollout_metrics
from mentorrl.train.workspace import Workspace
from mentorrl.trajectory import RewardBreakdown, Segment, Trajectory

DROPS = ("failed", "no_completion", "no_reward", "small_group")
MAX_TASK_JSON = 65_536


def task_json(task: Any) -> str:
    """The task as the agent gets it (``MENTORRL_TASK``): its fields as JSON, reference included (the
    harness verifies), bounded."""
    text = json.dumps(dataclasses.asdict(task) if dataclasses.is_dataclass(task) else dict(task), default=str)
    if len(text) > MAX_TASK_JSON:
        raise ValueError(f"task {task.id}: its JSON is over {MAX_TASK_JSON} characters")
    return text


def agent_env(url: str, api_key: str, reward_key: str, episode_id: str, task: Any) -> dict[str, str]:
    """The variables an agent process gets (docs/bring-your-agent.md)."""
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    return {
        "OPENAI_BASE_URL": url,
        "OPENAI_API_KEY": api_key,
        "MENTORRL_EPISODE_ID": episode_id,
        "MENTORRL_TASK_ID": task.id,
        "MENTORRL_TASK_MESSAGE": task.prompt,
        "MENTORRL_TASK": task_json(task),
        "MENTORRL_REWARD_URL": root + REWARD_PATH.format(episode_id=episode_id),
        "MENTORRL_REWARD_KEY": reward_key,
    }


def episode_trajectories(
    ep: RecordedEpisode, task: Any, contract: Any, replayed: Replayed | None = None
) -> list[Trajectory]:
    """One trajectory per recorded segment of ``ep``, each carrying the episode's reward: the
    agent's (``ep.reward``), or with ``replayed`` the verifier's, over the segments cut where the
    in-process episode ends (:func:`~mentorrl.rollout.rescore.replay_episode`)."""
    if replayed is not None:
        ref = replayed.trajectory
        reward, segments = ref.reward, replayed.segments
        extra = dict(finish_reason=ref.finish_reason)
    else:
        details = ep.details or {}
        success = details.get("success")
        reward = RewardBreakdown(
            total=float(ep.reward), success=bool(success) if isinstance(success, bool) else False, details=details
        )
        segments, extra = ep.segments, {}
    out = []
    for i, seg in enumerate(segments):
        out.append(
            Trajectory(
                id=f"{ep.id}-s{i}",
                task_id=task.id,
                family=task.family,
                split=task.split,
                difficulty=task.difficulty,
                token_ids=seg.token_ids,
                loss_mask=seg.loss_mask,
                logprobs=seg.logprobs,
                segments=[Segment(role=r, start=a, end=b) for r, a, b in seg.spans()],
                policy_version=min(seg.versions),
                env_name=contract.env_name,
                env_version=contract.env_version,
                sampling=contract.trajectory_sampling(),
                contract_fingerprint=contract.fingerprint(),
                num_turns=seg.turns,
                reward=reward,
                source="policy",
                **extra,
            )
        )
    if replayed is not None and out:  # the episode's calls and answer once (on its last segment)
        out[-1].tool_calls, out[-1].final_answer = replayed.trajectory.tool_calls, replayed.trajectory.final_answer
    return out


def wait_for_rewards(
    recorder: Recorder, outcomes: list[AgentOutcome], timeout_s: float, poll: Any = None
) -> dict[str, float]:
    """The rewards of the agents that exited 0, waiting for each up to ``timeout_s`` after its exit
    (``poll()``, if given, is called each round: e.g. reading a reward file)."""
    ok = [o for o in outcomes if o.status == "ok"]
    while True:
        if poll is not None:
            poll()
        got = recorder.rewards([o.episode_id for o in ok])
        missing = [o for o in ok if o.episode_id not in got]
        if not missing or time.monotonic() >= max(o.ended_at for o in missing) + timeout_s:
            return got
        time.sleep(0.05)


def time_breakdown(
    outcomes: list[AgentOutcome], server_s: float, batcher: dict[str, float], worker_start_s: float | None
) -> dict[str, float]:
    """Where a round's episode seconds went (``time_*`` metrics, seconds summed over episodes, so
    concurrent episodes each count; ``time_generate_wall_s`` is wall time):

    * ``time_generate_wall_s``: the server's ``generate`` calls (the model decoding), wall seconds, with
      ``gen_calls`` and ``gen_rows_per_call`` (how many turns each decode step carried); under continuous
      batching (:class:`mentorrl.serve.generation.ContinuousBatcher`) a call is one decoder pass, and
      ``gen_prompt_reused_share`` is the share of prompt tokens found in a retained row's KV (an
      episode's earlier turn) rather than prefilled;
    * ``time_server_s``: the server's handling of the recorded requests (render, queue, generation,
      parse, record), summed over requests;
    * ``time_agent_s``: the episodes' wall time as the stage saw them (launch or hand-over to result);
    * with a worker's timings (``model_s``, ``tools_s``, ``episode_s`` per episode): ``time_http_json_s``
      (the agent's time waiting on the model beyond the server's handling: HTTP and JSON both ways),
      ``time_tools_s`` (the agent's tools), ``time_agent_process_s`` (the agent's own code: the
      rest of its episodes);
    * without them (the per-episode mode): ``time_agent_process_s`` is everything of the episodes
      outside the server (process start-up, imports, HTTP, JSON, tools);
    * ``time_worker_start_s``: starting the worker (worker mode)."""
    agent_s = sum(o.wall_s for o in outcomes)
    out = {"time_server_s": server_s, "time_agent_s": agent_s}
    if batcher:
        out["time_generate_wall_s"] = float(batcher.get("busy_s", 0.0))
        calls = float(batcher.get("calls", 0))
        out["gen_calls"] = calls
        rows = float(batcher.get("row_passes", batcher.get("rows", 0)))  # continuous batching: rows per pass
        out["gen_rows_per_call"] = rows / calls if calls else 0.0
        if "reused_tokens" in batcher:
            reused, prompt = float(batcher["reused_tokens"]), float(batcher.get("prefill_tokens", 0))
            out["gen_prompt_reused_share"] = reused / (reused + prompt) if reused + prompt else 0.0
    timed = [o.timings for o in outcomes if o.timings]
    if timed:
        model = sum(float(t.get("model_s", 0.0)) for t in timed)
        tools = sum(float(t.get("tools_s", 0.0)) for t in timed)
        episode = sum(float(t.get("episode_s", 0.0)) for t in timed)
        out.update(
            time_http_json_s=max(0.0, model - server_s),
            time_tools_s=tools,
            time_agent_process_s=max(0.0, episode - model - tools),
        )
    else:
        out["time_agent_process_s"] = max(0.0, agent_s - server_s)
    if worker_start_s is not None:
        out["time_worker_start_s"] = worker_start_s
    return out


class RewardFile:
    """Rewards appended to a JSONL file by the harness (``{"episode_id", "reward", "details"?}`` per
    line), read from where the last read stopped; a bad line or a closed episode's is counted and skipped."""

    def __init__(self, path: str | None, recorder: Recorder):
        self.path, self.recorder, self.offset, self.bad = (Path(path) if path else None), recorder, 0, 0

    def poll(self) -> None:
        if self.path is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(8 * 1024 * 1024)
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self._apply(line)

    def _apply(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
            self.recorder.set_reward(str(rec["episode_id"]), rec["reward"], rec.get("details"))
        except (ValueError, KeyError, TypeError, RecordError):
            self.bad += 1


@dataclasses.dataclass(slots=True)
class ExternalStepData(GRPOStepData):
    """GRPO's step record and ``episodes``: per task with at least ``min_group`` usable episodes, the
    (reward, trajectory indices) of each (the rollout hook's, read by score and advantages)."""

    episodes: list[list[tuple[float, list[int]]]] = dataclasses.field(default_factory=list)


class ExternalStage(GRPOStage):
    """GRPO on the user's agent, recorded over HTTP (see the module docstring)."""

    name = "external"
    data_parallel = False
    step_data = ExternalStepData
    overlappable = False  # the recording server serves the policy itself: no behaviour snapshot to roll ahead with

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        cfg, c = self.cfg, ws.contract
        if not cfg.agent:
            raise ValueError("external.agent: give the agent command as an argv list, e.g. [python, my_agent.py]")
        db = ws.run_dir / "external" / "recordings.sqlite"
        tok = c.tokenizer
        self.recorder = Recorder(
            db,
            close_id=c.im_end_id,
            stop_ids=c.stop_token_ids,
            decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
            max_completions=cfg.max_completions,
            max_tokens=cfg.max_episode_tokens,
        )
        self.recorder.close_open()  # a killed run's unfinished step: never used
        self.api_key, self.reward_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        s = c.sampling
        self.server, self.hook = start_recording_server(
            tok,
            model,
            self.recorder,
            RunSampling(s.temperature, s.top_p, s.max_new_tokens),
            lambda: self.learner.version,
            self.api_key,
            self.reward_key,
            max_batch=max(DEFAULT_MAX_BATCH, cfg.concurrency),  # every running episode's turn in the same passes
        )
        self.hook.pause()  # open only while the step's agents run
        self.reward_file = RewardFile(cfg.reward_file, self.recorder)
        self.worker = (
            AgentWorker(
                cfg.agent,
                {
                    "OPENAI_BASE_URL": self.server.url,
                    "OPENAI_API_KEY": self.api_key,
                    "MENTORRL_REWARD_KEY": self.reward_key,
                },
                cfg.concurrency,
                cfg.output_chars,
            )
            if cfg.mode == "worker"
            else None
        )

    # ---- rollout: the agents ------------------------------------------------------------------
    def rollout(self, b: StepBatch) -> None:
        cfg, t0 = self.cfg, time.perf_counter()
        before, server0 = self.recorder.counters(), dict(self.hook.stats)
        busy0 = dict(self.hook.batcher.stats) if self.hook.batcher is not None else {}
        start0 = self.worker.start_s if self.worker is not None else 0.0
        jobs, tasks = [], {}
        for i, task in enumerate(b.tasks):
            for k in range(cfg.samples_per_task):
                eid = f"{b.step + 1}-{i}-{k}-{uuid.uuid4().hex[:10]}"
                self.recorder.open_episode(eid, task.id)
                tasks[eid] = (i, task)
                jobs.append(AgentJob(eid, agent_env(self.server.url, self.api_key, self.reward_key, eid, task)))
        self.model.eval()
        self.hook.resume()
        try:
            if self.worker is not None:
                outcomes = self.worker.run(jobs, cfg.episode_timeout_s)
            else:
                outcomes = run_agents(cfg.agent, jobs, cfg.concurrency, cfg.episode_timeout_s, cfg.output_chars)
            rewards = (
                wait_for_rewards(self.recorder, outcomes, cfg.reward_timeout_s, self.reward_file.poll)
                if cfg.reward == "agent"
                else {}
            )
        finally:
            self.hook.pause()
            self.recorder.close_episodes(list(tasks))
        self._gather(b, outcomes, rewards, tasks)
        after = self.recorder.counters()
        wall = time.perf_counter() - t0
        b.metrics.update(outcome_counts(outcomes))
        b.metrics.update({f"recorder_{k}": float(after[k] - before[k]) for k in COUNTERS})
        b.metrics.update(
            rollout_s=wall,
            server_generate_s=self.hook.stats["generate_s"] - server0["generate_s"],
            server_requests=float(self.hook.stats["requests"] - server0["requests"]),
            server_overridden=float(self.hook.stats["overridden"] - server0["overridden"]),
            episodes=float(len(jobs)),
            rollouts=float(len(b.trajs)),
        )
        b.metrics.update(
            time_breakdown(
                outcomes,
                self.hook.stats["generate_s"] - server0["generate_s"],
                {k: v - busy0.get(k, 0) for k, v in (self.hook.batcher.stats if self.hook.batcher else {}).items()},
                (self.worker.start_s - start0) if self.worker is not None else None,
            )
        )
        self._log_failures(b, outcomes)

    def _gather(self, b: StepBatch, outcomes: list[AgentOutcome], rewards: dict[str, float], tasks: dict) -> None:
        """The step's trajectories, grouped by task: ``b.data.episodes`` is, per task with at least
        ``min_group`` usable episodes, the list of (reward, trajectory indices) of each."""
        drops = dict.fromkeys(DROPS, 0.0)
        replay = dict.fromkeys(REPLAY_COUNTERS, 0.0)
        verifier = self.cfg.reward == "verifier"
        by_task: dict[int, list[tuple[float, list[Trajectory]]]] = {}
        for o in outcomes:
            i, task = tasks[o.episode_id]
            ep = self.recorder.episode(o.episode_id)
            if o.status != "ok":
                drops["failed"] += 1
            elif ep is None or not ep.segments:
                drops["no_completion"] += 1
            elif verifier:
                got = replay_episode(
                    ep.segments, task, self.ws.contract, self.ws.make_env, self.ws.rollout.weights, self.learner.version
                )
                for k, v in got.counts.items():
                    replay[k] += v
                replay_s = replay.setdefault("tools_s", 0.0)
                replay["tools_s"] = replay_s + got.tools_s
                ts = episode_trajectories(ep, task, self.ws.contract, got)
                by_task.setdefault(i, []).append((got.trajectory.reward.total, ts))
            elif o.episode_id not in rewards:
                drops["no_reward"] += 1
            else:
                by_task.setdefault(i, []).append(
                    (rewards[o.episode_id], episode_trajectories(ep, task, self.ws.contract))
                )
        if verifier:
            b.metrics.update({f"replay_{k}": v for k, v in replay.items()})
        trajs: list[Trajectory] = []
        groups = []
        for i in sorted(by_task):
            eps = by_task[i]
            if len(eps) < self.cfg.min_group:
                drops["small_group"] += len(eps)
                continue
            group = []
            for r, ts in eps:
                group.append((r, list(range(len(trajs), len(trajs) + len(ts)))))
                trajs += ts
            groups.append(group)
        if trajs:
            require_consistent(self.ws, trajs, self.learner.version, f"external step {b.step + 1}")
            b.metrics.update(rollout_metrics(trajs), rollout_backend="external")
        b.trajs, b.data.episodes = trajs, groups
        used = sum(len(g) for g in groups)
        b.metrics.update({f"dropped_{k}": v for k, v in drops.items()}, episodes_used=float(used))
        b.metrics["segments_per_episode"] = len(trajs) / used if used else 0.0

    def _log_failures(self, b: StepBatch, outcomes: list[AgentOutcome]) -> None:
        """RUN_DIR/external/failures-step-N.jsonl: each failed agent's status and stderr tail (no environment)."""
        failed = [o for o in outcomes if o.status != "ok"]
        if not failed or not self.ws.is_main:
            return
        path = self.ws.run_dir / "external" / f"failures-step-{b.step + 1:06d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for o in failed:
                f.write(json.dumps(dataclasses.asdict(o)) + "\n")

    # ---- GRPO on ragged groups ------------------------------------------------------------------
    def score(self, b: StepBatch) -> None:
        """Each used episode's reward, sanitised per group as GRPO's score sanitises each task's group
        (the audit's bounds and outlier rule), and their statistics."""
        audit = self.ws.cfg.audit
        parts, clipped = [], {"clipped": 0.0}
        for g in b.data.episodes:
            raw = torch.tensor([r for r, _ in g], dtype=torch.float32).view(1, -1)
            r, c = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, audit.outlier_z)
            parts.append(r.view(-1))
            clipped["clipped"] += c["clipped"]
        rewards = torch.cat(parts) if parts else torch.zeros(0)
        b.rewards = rewards.view(-1)
        n = b.rewards.numel()
        b.metrics.update(
            reward_mean=float(b.rewards.mean()) if n else 0.0,
            reward_std=float(b.rewards.std()) if n > 1 else 0.0,
            reward_clipped=clipped["clipped"],
        )

    def advantages(self, b: StepBatch) -> None:
        """GRPO's estimator over each task's group of episodes; an episode's segments share its advantage."""
        adv = torch.zeros(len(b.trajs))
        b.groups, start = [], 0
        for group in b.data.episodes:
            r = b.rewards[start : start + len(group)].view(1, -1)
            start += len(group)
            a = self.estimator(r, normalize_std=self.cfg.normalize_std).view(-1)
            for (_, idx), ai in zip(group, a.tolist()):
                adv[idx] = ai
            b.groups.append([i for _, idx in group for i in idx])
        b.adv, b.data.nll = adv, None
        zero = sum(bool((adv[g] == 0).all()) for g in b.groups)
        b.metrics["zero_advantage_groups"] = float(zero)
        step, trajs, audit = b.step, b.trajs, self.ws.cfg.audit
        path = self.ws.run_dir / "audit" / f"flagged-external-step-{step + 1:06d}.jsonl"
        b.metrics.update(self.ws.on_main(lambda: reward_debugger(trajs, audit.flag_reward, path)))

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "reward_file_offset": self.reward_file.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.reward_file.offset = int(state.get("reward_file_offset", 0))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.hook.pause(timeout_s=30)
        self.server.stop()
        self.recorder.close()


run_external = run_on_loop(ExternalStage)
