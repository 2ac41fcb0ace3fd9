"""Two parts of a summary: the prompt-length check (intended against the server's
`usage.prompt_tokens`) and the per-turn figures of conversations. Pure, like report.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scaletui.latency import stats_ms, tpot_s
from scaletui.loadgen.client import RequestRecord

MISMATCH = 0.01  # a request whose server count is off by more than this fraction is flagged
ESTIMATED = (
    "prompt lengths are estimates (no --tokenizer: one character per token for synthetic text, "
    "--chars-per-token for a dataset); give --tokenizer for exact lengths"
)


def prompt_lengths(records: Sequence[RequestRecord], tokenizer: str | None, api: str) -> dict:
    """How the intended prompt lengths compare with the server's counts of ok requests."""
    pairs = [
        (r.input_len, r.prompt_tokens)
        for r in records
        if r.outcome == "ok" and r.prompt_tokens is not None and not r.warmup
    ]
    diffs = np.array([got - want for want, got in pairs], dtype=float)
    off = [abs(got - want) > MISMATCH * want for want, got in pairs]
    out = {
        "exact": tokenizer is not None,
        "tokenizer": tokenizer,
        "checked": len(pairs),  # ok requests with a server count
        "mismatched": int(sum(off)),  # ... off by more than 1%
        "mean_diff": float(diffs.mean()) if len(pairs) else None,  # server - intended, tokens
        "max_abs_diff": float(np.abs(diffs).max()) if len(pairs) else None,
        "note": None if tokenizer is not None else ESTIMATED,
        "warning": None,
    }
    if tokenizer is not None and out["mismatched"]:
        out["warning"] = (
            f"{out['mismatched']} of {len(pairs)} requests had a server prompt count more than "
            f"{MISMATCH:.0%} off the intended length (mean {out['mean_diff']:+.1f} tokens): "
            + _cause(diffs, api)
        )
    return out


def _cause(diffs: np.ndarray, api: str) -> str:
    """The likely reason, from the shape of the differences."""
    if np.all(diffs == diffs[0]) and diffs[0] > 0:
        return (
            f"every prompt is {diffs[0]:+.0f} tokens longer, a constant: special tokens (a BOS) "
            + ("or the chat template's markup " if api == "chat" else "")
            + "that the server adds and this tokenizer does not"
        )
    if api == "chat" and np.all(diffs > 0):
        return (
            "the server counts more on chat: the chat template's tokens (they grow with "
            "the number of messages); use --api completions for exact lengths"
        )
    return "the server's tokenizer is likely another one: give --tokenizer its tokenizer.json"


def per_turn(records: Sequence[RequestRecord]) -> list[dict] | None:
    """TTFT, TPOT and prompt tokens by turn index; None when no request was a conversation's."""
    turns: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.turn is not None and not r.warmup:
            turns.setdefault(r.turn, []).append(r)
    if not turns:
        return None
    rows = []
    for k in sorted(turns):
        recs = turns[k]
        ok = [r for r in recs if r.outcome == "ok"]
        ttft = np.array([r.t_first - r.t_send for r in ok])
        n_out = np.array([r.output_tokens for r in ok], dtype=float)
        tpot = tpot_s(ttft, np.array([r.t_last - r.t_send for r in ok]), n_out)[n_out > 1]
        prompt = [r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok]
        rows.append(
            {
                "turn": k,
                "sent": len(recs),
                "completed": len(ok),
                "mean_prompt_tokens": float(np.mean(prompt)) if prompt else None,
                "mean_intended_tokens": float(np.mean([r.input_len for r in ok])) if ok else None,
                **stats_ms("ttft", ttft),
                **stats_ms("tpot", tpot),
            }
        )
    return rows
