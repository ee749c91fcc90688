"""The default backend: the project's own engine on ``transformers`` (:class:`RolloutEngine`).

Its rollouts are the engine's (continuous batching, tool calls overlapping decode, a shared-prefix
prefill), so ``rollout.backend: hf`` gives exactly the numbers the project gave before backends
existed. ``generate`` is the narrow one-turn call of the interface, for comparisons and tools
that want it: a left-padded batched decode with the same sampler (:func:`sample_tokens`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from mentorrl.contract import RolloutContract
from mentorrl.rollout.backends.base import Generation, GenerationBackend
from mentorrl.rollout.dispatch import INLINE_TOOL_S
from mentorrl.rollout.engine import RolloutEngine
from mentorrl.rollout.episode import Episode
from mentorrl.rollout.kvcache import cache_kwarg, make_cache
from mentorrl.rollout.sampling import sample_tokens
from mentorrl.trajectory import Trajectory


class HFBackend(GenerationBackend):
    name = "hf"

    def __init__(
        self,
        model,
        contract: RolloutContract,
        pad_token_id: int | None = None,
        decoder: str = "auto",
        inline_tool_s: float = INLINE_TOOL_S,
        tool_sync: str = "next_step",
    ):
        super().__init__()
        self.model, self.contract, self.decoder, self.inline_tool_s = model, contract, decoder, inline_tool_s
        self.tool_sync = tool_sync
        self.pad_token_id = contract.pad_token_id if pad_token_id is None else pad_token_id

    def run_episodes(self, episodes: list[Episode], seed: int = 0) -> list[Trajectory]:
        engine = RolloutEngine(
            self.model, self.contract, decoder=self.decoder, inline_tool_s=self.inline_tool_s, tool_sync=self.tool_sync
        )
        out = engine.run(episodes, seed=seed)
        self.last_stats = getattr(engine, "last_stats", {})
        return out

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_tokens: Sequence[int],
        stop_ids: Sequence[int],
        seeds: Sequence[int],
    ) -> list[Generation]:
        model = self.model
        device = next(model.parameters()).device
        n = len(prompts)
        if n == 0:
            return []
        params = self.contract.sampling.model_copy(update={"temperature": temperature})
        gens = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
        width = max(len(p) for p in prompts)
        inp = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros(n, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            inp[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attn[i, width - len(p) :] = 1
        inp, attn = inp.to(device), attn.to(device)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        cache, kw = make_cache(model), cache_kwarg(model)
        stops = set(int(s) for s in stop_ids)
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        live = [i for i in range(n) if max_tokens[i] > 0]
        stopped = [False] * n
        while live:
            out = model(
                input_ids=inp, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache}
            )
            tok, lp = sample_tokens(out.logits[:, -1, :], params, gens)
            for i in list(live):
                t = int(tok[i])
                ids[i].append(t)
                lps[i].append(float(lp[i]))
                if t in stops:
                    stopped[i] = True
                if stopped[i] or len(ids[i]) >= max_tokens[i]:
                    live.remove(i)
            # every row is fed its token (finished rows too: they are ignored, and keep the batch whole)
            inp = tok[:, None].to(device)
            pos = pos[:, -1:] + 1
            attn = torch.cat([attn, attn.new_ones(n, 1)], dim=1)
        return [Generation(ids[i], lps[i], stopped[i]) for i in range(n)]

    def set_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict`` into the engine's model (a no-op when it is the model's own state)."""
        own = self.model.state_dict()
        if any(own[k].data_ptr() != v.data_ptr() for k, v in state_dict.items() if k in own):
            self.model.load_state_dict(state_dict)
        self.version = version
        self.weight_syncs += 1
