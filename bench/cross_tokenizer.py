"""Cross-tokenizer OPD alignment: teacher chunk log-probs from one forward pass plus prefix sums,
against the reference path of one teacher forward per chunk, on long texts.

The student tokenizer is the demo's (trained on expert transcripts, 1024 BPE merges); the
teacher has its own byte-level BPE tokenizer with a different vocabulary (``--teacher-vocab``)
trained on other text, and a small Qwen2 model of its own. Texts are expert transcripts of
``orders`` tasks joined until each holds at least ``--min-tokens`` student tokens. Both paths
run on the same aligned chunks in this process; printed: tokens, chunks, seconds for each
path, their ratio, and the largest difference between the two paths' chunk log-probs.

It also checks the alignment itself: a chunk is a *mismatch* when its text differs between
the two sides, or from the text's own slice (each side's chunk decoded on its own; both
tokenizers are byte-level BPE, whose decode of a token run is exactly the bytes it spells).
Texts whose alignment raises :class:`~mentorrl.opd.align.AlignmentError` are counted apart.
The transcripts are ASCII; ``--non-ascii`` adds multi-byte text (CJK, emoji, accents) after
each transcript and to both tokenizers' training text, so that tokens end inside characters.

    python bench/cross_tokenizer.py                       # 8 texts of >= 512 student tokens
    python bench/cross_tokenizer.py --texts 4 --min-tokens 1024
    python bench/cross_tokenizer.py --non-ascii           # the same, with multi-byte text mixed in
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from mentorrl.cli_common import quiet_transformers  # noqa: E402
from mentorrl.envs import get_env  # noqa: E402
from mentorrl.models.build import ModelSpec, build_model, train_tokenizer  # noqa: E402
from mentorrl.models.corpus import expert_transcripts  # noqa: E402
from mentorrl.opd import (  # noqa: E402
    AlignmentError,
    ChunkAlignment,
    align_texts,
    brute_force_chunk_logprobs,
    chunk_sums,
    teacher_token_logprobs,
)

NON_ASCII = [
    "Bestellung für Frau Müller — Rückerstattung: 12,50 €",
    "注文番号 4521 の返金をお願いします。",
    "订单已发货 😀👍🏽",
    "naïve café résumé ✓",
    "Заказ отменён",
    "👩\u200d❤\ufe0f\u200d👩 e\u0301 ñ",
]


def chunk_mismatches(al: ChunkAlignment, student_tok, teacher_tok) -> int:
    """Chunks whose text is not the same on both sides and equal to the text's own slice."""
    bad, start = 0, 0
    for (lo, hi), (tlo, thi), end in zip(al.student_bounds, al.teacher_bounds, al.chunk_ends):
        s_text = student_tok.decode(al.student_ids[lo:hi], clean_up_tokenization_spaces=False)
        t_text = teacher_tok.decode(al.teacher_ids[tlo:thi], clean_up_tokenization_spaces=False)
        bad += not (s_text == t_text == al.text[start:end])
        start = end
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=512, help="student tokens per text, at least")
    ap.add_argument("--teacher-vocab", type=int, default=700)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--non-ascii", action="store_true", help="add multi-byte text after each transcript")
    args = ap.parse_args()
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    con = Console()
    entry = get_env("orders")
    env = entry.make_env()
    try:
        transcripts = list(expert_transcripts(env, entry.make_expert(), entry.make_tasks().tasks("train", 600, 0)))
    finally:
        env.close()
    rng = random.Random(0)
    rng.shuffle(transcripts)
    extra = NON_ASCII * 20 if args.non_ascii else []  # so that both vocabularies hold multi-byte merges
    student_tok = train_tokenizer(transcripts[:300] + extra, 1024)
    teacher_tok = train_tokenizer(transcripts[300:] + extra[::-1][: len(extra) // 2], args.teacher_vocab)
    teacher = build_model(teacher_tok, ModelSpec(vocab_size=args.teacher_vocab, seed=1)).eval()
    texts, pool = [], iter(transcripts)
    while len(texts) < args.texts:
        text = ""
        while len(student_tok(text, add_special_tokens=False)["input_ids"]) < args.min_tokens:
            text += next(pool)
            if args.non_ascii:
                text += "\n" + rng.choice(NON_ASCII) + "\n"
        texts.append(text)
    context = teacher_tok("Transcript:\n", add_special_tokens=False)["input_ids"]
    aligned, errors = [], 0
    for t in texts:
        try:
            aligned.append(align_texts(t, student_tok, teacher_tok))
        except AlignmentError as e:
            errors += 1
            con.print(f"alignment error: {e}")
    if not aligned:
        con.print(f"no text could be aligned ({errors} alignment errors)")
        return 1
    mismatches = sum(chunk_mismatches(a, student_tok, teacher_tok) for a in aligned)

    t0 = time.perf_counter()
    fast = [chunk_sums(teacher_token_logprobs(teacher, context, a.teacher_ids), a.teacher_bounds) for a in aligned]
    t_fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow = [brute_force_chunk_logprobs(teacher, context, a.teacher_ids, a.teacher_bounds) for a in aligned]
    t_slow = time.perf_counter() - t0
    diff = max((f - s).abs().max().item() for f, s in zip(fast, slow))
    s_tok = sum(len(a.student_ids) for a in aligned)
    t_tok = sum(len(a.teacher_ids) for a in aligned)
    chunks = sum(a.num_chunks for a in aligned)
    con.print(
        f"{len(aligned)} texts: {s_tok} student tokens (min {min(len(a.student_ids) for a in aligned)}), "
        f"{t_tok} teacher tokens, {chunks} shared-boundary chunks"
    )
    con.print(f"one teacher pass + prefix sums: {t_fast:.3f}s; one teacher forward per chunk: {t_slow:.2f}s")
    con.print(f"speed ratio: {t_slow / t_fast:.1f}x; largest |difference| of chunk log-probs: {diff:.2e}")
    con.print(
        f"chunk-text mismatches: {mismatches} of {chunks} chunks; alignment errors: {errors} of {len(texts)} texts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
