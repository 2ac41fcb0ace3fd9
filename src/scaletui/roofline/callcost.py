"""What one engine call is expected to take: the simulator's price for a call, and what the
server compares its own calls with (its speed factor, docs/serve.md "Metrics"). One pricing
for both, so a server running at factor 1.0 is one the simulator reproduces.

`CallCosts` prices, for one server shape and cost model, each verb the scheduler calls:
1. a generate call of `steps` steps over the running rows' KV lengths (`generate_s`): XLA's
   engine computes every slot row over the KV bucket of the longest row; the native kernels'
   attention reads each running row's own positions (`_row_costs`);
2. a prefill of a whole prompt, less a cached prefix (`prefill_s`: disaggregated);
3. a piece of a prompt whose earlier tokens are in its pages (`piece_s`: interleaved);
4. what such pieces add to the generate call they ride in (`mixed_s`: mixed batches): one
   call, the weights read once by the decode step, so the pieces add the dense FLOPs of the
   call's compiled prompt rows, their attention and their K/V writes.
Every price is the cost model's expected (median) time, memoized per call shape: the hot path
pays a dict look-up (and, native, a sum over the running rows).
"""

from __future__ import annotations

from collections.abc import Sequence

from scaletui.roofline.costmodel import CostModel
from scaletui.shape import ServerShape

__all__ = ["ROW_GRAIN", "CallCosts"]

ROW_GRAIN = 8  # native kernels: a running row's attention cost at its length rounded up to this


class CallCosts:
    """Expected seconds per engine call of a server of `shape` whose calls cost what `decode`
    (generate) and `prefill` (prefill; default `decode`) say. `padded_decode`: the engine's
    shapes (slots rows x KV bucket; False: the running rows at their mean length)."""

    def __init__(
        self,
        shape: ServerShape,
        decode: CostModel,
        prefill: CostModel | None = None,
        padded_decode: bool = True,
    ) -> None:
        self.shape, self.decode, self.prefill = shape, decode, prefill or decode
        self.padded = padded_decode
        self._pbuckets = shape.prefill_buckets
        self._chunk = self._pbuckets[-1]
        self._dbuckets = shape.decode_buckets
        # the native kernels' attention skips inactive rows (they attend position 0 only)
        self.live_rows = padded_decode and decode.kernels == "native"
        self._prefill_memo: dict[tuple[int, int], float] = {}
        self._call_memo: dict[tuple[int, int, int], float] = {}  # (batch, bucket, steps)
        self._row_memo: dict[tuple[int, int], tuple[float, list[float]]] = {}

    def generate_s(self, steps: int, lengths: list[int]) -> float:
        """One generate call of `steps` steps whose running rows hold `lengths` KV positions
        each before it (at least one row)."""
        if self.padded:
            need = max(lengths) + steps
            ctx = next((b for b in self._dbuckets if b >= need), self._dbuckets[-1])
            batch = self.shape.slots
        else:
            ctx = sum(lengths) // len(lengths) + steps // 2
            batch = len(lengths)
        return self.call_s(batch, ctx, steps, lengths)

    def call_s(self, batch: int, ctx: int, steps: int, lengths: list[int]) -> float:
        """One generate call at `batch` rows over bucket `ctx` for running rows of `lengths`.
        XLA's engine computes every row over the bucket; the native attention reads each
        running row's own positions (0..pos, `kernels.cc`), so there the call is the
        `batch`-row call at the smallest bucket plus, per running row, 1 / batch of what
        `batch` rows at that row's mid-call length add to it (charging each row the bucket
        over-read the server's calls: docs/roofline.md, "Three levels of prediction")."""
        if not self.live_rows:
            key = (batch, ctx, steps)
            full = self._call_memo.get(key)
            if full is None:
                full = self._call_memo[key] = self.decode.decode_call_s(batch, ctx, steps)
            return full
        table = self._row_memo.get((batch, steps))
        if table is None:
            table = self._row_memo[batch, steps] = self._row_costs(batch, steps)
        base, rows = table
        up = steps // 2 + ROW_GRAIN - 1  # mid-call, rounded up
        return base + sum(rows[(n + up) // ROW_GRAIN] for n in lengths)

    def _row_costs(self, batch: int, steps: int) -> tuple[float, list[float]]:
        """(the call at the smallest bucket, each running row's share by its positions //
        ROW_GRAIN, never below the smallest bucket's): one table for every bucket, as a row's
        cost is its own length's (rounded up, it may pass its bucket by < ROW_GRAIN)."""
        base = self.decode.decode_call_s(batch, self._dbuckets[0], steps)
        top = self.shape.max_seq_len // ROW_GRAIN + steps + 2
        return base, [
            max(self.decode.decode_call_s(batch, k * ROW_GRAIN, steps) - base, 0.0) / batch
            for k in range(top)
        ]

    def prefill_s(self, n: int, cached: int = 0) -> float:
        """Prefill of an n-token prompt whose first `cached` tokens are in cached pages: padded
        to its bucket, past the largest bucket in bucket-sized chunks."""
        s = self._prefill_memo.get((n, cached))
        if s is None:
            cost, chunk, left = self.prefill, self._chunk, n - cached
            if left <= chunk:
                s = cost.prefill_s(next(b for b in self._pbuckets if b >= left), cached)
            else:
                s = sum(cost.prefill_s(chunk, start) for start in range(cached, n, chunk))
            self._prefill_memo[(n, cached)] = s
        return s

    def piece_s(self, start: int, stop: int) -> float:
        """Prefill of prompt tokens start..stop-1 of a sequence whose earlier ones are in its
        pages (a budget's piece): the engine's bucket-sized chunks from `start`."""
        key = (-start - 1, stop)  # apart from prefill_s's (n, cached) keys
        s = self._prefill_memo.get(key)
        if s is None:
            cost, chunk, buckets = self.prefill, self._chunk, self._pbuckets
            s = sum(
                cost.prefill_s(next(b for b in buckets if b >= min(chunk, stop - c)), c)
                for c in range(start, stop, chunk)
            )
            self._prefill_memo[key] = s
        return s

    def mixed_s(self, pieces: Sequence[tuple[int, int]]) -> float:
        """What prompt pieces (start, stop) of their sequences add to the generate call whose
        first step they ride in: the dense FLOPs of the call's compiled prompt rows (the token
        budget: `ServerShape.mixing`), each piece's attention and its rows' K/V writes (a
        piece writes the compiled rows from its own), at the prefill rates; no call overhead
        and no second weight read."""
        cap = self.shape.mixing or sum(stop - start for start, stop in pieces)
        key = ("mixed", cap, *pieces)  # apart from prefill_s's and piece_s's keys
        s = self._prefill_memo.get(key)
        if s is None:
            c = self.prefill
            attn_rate = c.prefill_attn_flops_per_s or c.prefill_flops_per_s
            attn = sum(c.prefill_attn_flops(stop - start, start) for start, stop in pieces)
            s = (
                len(pieces) * cap * c.kv_bytes_per_token / c.tp / c.read_bw
                + c.prefill_dense_flops(cap) / c.prefill_flops_per_s
                + attn / attn_rate
            )
            self._prefill_memo[key] = s
        return s
