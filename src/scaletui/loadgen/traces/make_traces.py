"""Make the two small traces shipped beside this script (run it to remake them, byte for byte).

- mooncake_style.jsonl: Mooncake's fields (`timestamp` ms, `input_length`, `output_length`,
  `hash_ids`) at 16 tokens per hash_id block (replay with `--trace-block-size 16`), so its
  prompts (32-200 tokens) fit a small test model. Requests draw a shared document prefix
  (8 documents, the popular ones more often) and end with blocks of their own: the prefix cache
  has something to hit. Poisson arrivals at 20 req/s.
- burstgpt_style.csv: BurstGPT's columns (`Timestamp` s, `Model`, `Request tokens`,
  `Response tokens`, `Total tokens`, `Log Type`), gamma arrivals with burstiness 0.25 (CV 2)
  at 10 req/s, log-normal request lengths; failed requests have 0 response tokens, as there.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import orjson

HERE = Path(__file__).parent
ROWS = 300
BLOCK = 16  # tokens per hash_id in the Mooncake-style trace


def mooncake_rows(rng: np.random.Generator) -> list[dict]:
    docs = [list(range(d * 100, d * 100 + int(rng.integers(2, 8)))) for d in range(8)]
    popularity = 1.0 / np.arange(1, len(docs) + 1)
    t, fresh, rows = 0.0, 10_000, []
    for _ in range(ROWS):
        doc = docs[rng.choice(len(docs), p=popularity / popularity.sum())]
        shared = doc[: int(rng.integers(1, len(doc) + 1))]
        own = int(rng.integers(1, 5))
        hash_ids = shared + list(range(fresh, fresh + own))
        fresh += own
        length = (len(hash_ids) - 1) * BLOCK + int(rng.integers(1, BLOCK + 1))
        rows.append(
            {
                "timestamp": int(round(t)),
                "input_length": min(length, 200),
                "output_length": int(rng.integers(4, 33)),
                "hash_ids": hash_ids[: -(-min(length, 200) // BLOCK)],
            }
        )
        t += rng.exponential(1e3 / 20)
    return rows


def burstgpt_rows(rng: np.random.Generator) -> list[list]:
    t, rows = 0.0, []
    for _ in range(ROWS):
        request = int(np.clip(rng.lognormal(4.0, 0.8), 4, 200))
        response = 0 if rng.random() < 0.02 else int(np.clip(rng.lognormal(3.0, 0.7), 1, 64))
        model = "ChatGPT" if rng.random() < 0.8 else "GPT-4"
        rows.append([f"{t:.3f}", model, request, response, request + response, "Conversation log"])
        t += rng.gamma(0.25, 1.0 / (10 * 0.25))
    return rows


def main() -> None:
    rng = np.random.default_rng(41)
    lines = [orjson.dumps(r) for r in mooncake_rows(rng)]
    (HERE / "mooncake_style.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with open(HERE / "burstgpt_style.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(
            ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
        )
        out.writerows(burstgpt_rows(rng))


if __name__ == "__main__":
    main()
