"""Rollout prefill, rollout decode and learner throughput of a real model, each as a fraction of the
arithmetic bound this machine measures itself (issue 54, item 4).

The bound: FLOPs a token x tokens / the measured matmul rate, in the compute dtype the run would use
(``model.dtype: auto``). FLOPs a token, for N the parameters a token passes through (every Linear of
the decoder and the LM head; the embedding lookup is free): a forward 2N (the attention's own
``QK^T`` and ``PV`` products are counted too, 4 x layers x context x width a token); the learner's
LoRA step 2N forward + 2N for the activations' gradients (the frozen base has no weight gradients; the
adapters' own are negligible at r16). The rate: a (rows x width) by (width x MLP width) matmul, the
shape of the model's largest projections, at the bench's thread count.

Measured through the project's own paths: the rollout's ``SlotDecoder`` (fused projections, LoRA
adapters applied) and the learner's ``sft_step`` under autocast, with a fresh LoRA (r16 on every
projection, B nudged off zero so the adapters compute) or the adapter directory ``--adapter`` names.

    OMP_WAIT_POLICY=PASSIVE python bench/bound.py --model smollm2 --threads 2 --json bench/results/bound_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def matmul_gflops(dtype: torch.dtype, rows: int, width: int, inner: int, seconds: float = 1.0) -> float:
    a = torch.randn(rows, width).to(dtype)
    b = torch.randn(width, inner).to(dtype)
    for _ in range(3):
        a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or reps < 5:
        a @ b
        reps += 1
    return 2 * rows * width * inner * reps / (time.perf_counter() - t0) / 1e9


def linear_params(model) -> int:
    """Parameters a token's forward multiplies by: every Linear's weight (LoRA base layers, the LM head)."""
    seen: set[int] = set()
    total = 0
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear and "lora_" not in name and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            total += mod.weight.numel()
    return total


def attention_flops(cfg, context: float) -> float:
    """FLOPs a token spends in attention products over ``context`` earlier tokens (QK^T and PV)."""
    return 4 * cfg.num_hidden_layers * context * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)


def phase_figures(tokens: int, seconds: float, flops: float, rate: float) -> dict:
    """Throughput of one timed phase: tokens/s, GFLOP/s, and that as a share of the measured matmul rate."""
    gflops = flops / seconds / 1e9
    return {"tokens": tokens, "tokens_per_s": tokens / seconds, "gflops": gflops, "bound_fraction": gflops / rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a checkpoint directory or a GGUF source (smollm2)")
    ap.add_argument("--adapter", default=None, help="a LoRA adapter directory (default: a fresh r16 LoRA)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="auto (the project's probe), bfloat16 or float32")
    ap.add_argument("--rows", type=int, default=128, help="rollout rows (the recipe's eval.batch_size)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens a row (prefill)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed")
    ap.add_argument("--sft-seqs", type=int, default=8, help="sequences an SFT step (the recipe's batch)")
    ap.add_argument("--sft-len", type=int, default=288, help="tokens a sequence (the demonstrations' mean)")
    ap.add_argument("--sft-steps", type=int, default=3, help="timed SFT steps (after one warm-up)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from mentorrl.config import LoraSpec, OptimConfig
    from mentorrl.models.build import load_policy
    from mentorrl.models.device import choose_dtype, resolve_dtype
    from mentorrl.models.lora import apply_lora
    from mentorrl.rollout.decoders import SlotDecoder
    from mentorrl.train.learner import Learner
    from mentorrl.trajectory import Trajectory

    dtype = choose_dtype(torch.device("cpu")).dtype if a.dtype == "auto" else resolve_dtype(a.dtype)
    tok, base = load_policy(a.model, dtype=torch.float32)
    if a.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, a.adapter, is_trainable=True)
    else:
        spec = LoraSpec(r=16, alpha=32.0)
        model = apply_lora(base, spec, seed=0)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    cfg = model.config
    n_lin = linear_params(model)
    rate = matmul_gflops(dtype, 2048, cfg.hidden_size, cfg.intermediate_size)
    out: dict = {
        "model": a.model,
        "adapter": a.adapter or "fresh LoRA r16 (B ~ N(0, 1e-3))",
        "threads": a.threads,
        "dtype": str(dtype).replace("torch.", ""),
        "linear_params": n_lin,
        "matmul_gflops": rate,
        "matmul_shape": [2048, cfg.hidden_size, cfg.intermediate_size],
    }

    # ---- rollout: a copy in the compute dtype, as the hf backend places it
    import copy

    roll = copy.deepcopy(model).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt,), generator=g).tolist() for _ in range(a.rows)]
    dec = SlotDecoder(roll, max_len=a.prompt + a.decode + 8)
    with torch.no_grad():
        dec.reset(a.rows)
        dec.forward([p[:8] for p in prompts])  # warm-up: buffers, rotary tables
        dec.reset(a.rows)
        t0 = time.perf_counter()
        logits = dec.forward(prompts)
        prefill_s = time.perf_counter() - t0
        nxt = logits.argmax(-1).tolist()
        t0 = time.perf_counter()
        for _ in range(a.decode):
            nxt = dec.forward([[x] for x in nxt]).argmax(-1).tolist()
        decode_s = time.perf_counter() - t0
    out["rollout_fused"] = dec.fused is not None
    dec.close()
    pre_tok = a.rows * a.prompt
    pre_flops = pre_tok * (2 * n_lin + attention_flops(cfg, a.prompt / 2))
    dec_tok = a.rows * a.decode
    dec_flops = dec_tok * (2 * n_lin + attention_flops(cfg, a.prompt + a.decode / 2))
    out["prefill"] = {"rows": a.rows, "s": prefill_s, **phase_figures(pre_tok, prefill_s, pre_flops, rate)}
    out["decode"] = {
        "rows": a.rows,
        "steps": a.decode,
        "s": decode_s,
        **phase_figures(dec_tok, decode_s, dec_flops, rate),
        "pass_ms": 1000 * decode_s / a.decode,
    }
    del roll

    # ---- learner: LoRA SFT steps under autocast, fp32 master weights
    learner = Learner(model, OptimConfig(lr=1e-5, micro_batch_size=a.sft_seqs), tok.pad_token_id or 0, precision=dtype)
    model.train()

    def demo(i: int) -> Trajectory:
        ids = torch.randint(0, cfg.vocab_size, (a.sft_len,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        half = a.sft_len // 2
        return Trajectory(
            id=f"bound-{i}",
            task_id=f"bound-{i}",
            family="bench",
            env_name="bench",
            env_version="0",
            token_ids=ids,
            loss_mask=[0] * half + [1] * (a.sft_len - half),
            logprobs=[0.0] * a.sft_len,
        )

    batch = [demo(i) for i in range(a.sft_seqs)]
    learner.sft_step(batch)
    t0 = time.perf_counter()
    for _ in range(a.sft_steps):
        learner.sft_step(batch)
    sft_s = (time.perf_counter() - t0) / a.sft_steps
    sft_tok = a.sft_seqs * a.sft_len
    sft_flops = sft_tok * (4 * n_lin + 2 * attention_flops(cfg, a.sft_len / 2))
    out["learner"] = {"seqs": a.sft_seqs, "s_per_step": sft_s, **phase_figures(sft_tok, sft_s, sft_flops, rate)}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
