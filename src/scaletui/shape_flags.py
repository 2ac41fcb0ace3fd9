"""`scaletui serve`'s shape flags: one per `ServerShape` field, with its --help and choices
(`add_flags`), shared by `serve`, `simulate` and `calibrate --model`; `ServerShape.from_args`
reads them back and `ServerShape.to_flags` writes them.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from scaletui.dtypes import DTYPES, STORAGE_DTYPES
from scaletui.shape import KERNELS, MODES, PAGE_SIZES, ServerShape, flag

# Each field's --help; the flag is the field's name with dashes.
FLAG_HELP = {
    "model": "model spec: a name (tiny, small, llama3-8b), a YAML path or an HF checkpoint dir",
    "weights": "HF safetensors dir/file (default: seeded dummy weights)",
    "tokenizer": "HF tokenizer.json (default: the byte tokenizer)",
    "slots": "running sequences at most: the decode batch's rows",
    "max_seq_len": "longest sequence, prompt + output (default: min(1024, model's))",
    "page_size": "KV positions per page",
    "prefix_cache": "prefill every prompt whole (interleaved mode reuses the KV pages of a "
    "cached prefix)",
    "max_batched_tokens": "interleaved: prompt tokens run between two generate calls, long "
    "prompts split in chunks (0: whole prompts)",
    "mixed_batches": "interleaved, with --max-batched-tokens: a pass's first prompt piece runs in "
    "the same forward pass as the decode step (on|off)",
    "kv_pages": "KV pages per data-parallel replica (default: enough for every slot at "
    "max_seq_len)",
    "decode_steps": "decode steps per host sync",
    "tp": "tensor parallelism (the 'model' mesh axis)",
    "dp": "data parallelism over slots (the 'data' mesh axis)",
    "mode": "prefill and generate placement",
    "prefill_devices": "disaggregated: prefill devices (0 = half)",
    "dtype": "compute (activations); also weights and KV cache unless set below (default: bf16; "
    "f32 on a CPU without AVX512_BF16 or the native kernels)",
    "weight_dtype": "weight storage (int8: per output channel, f32 scales; default: --dtype)",
    "kv_dtype": "KV-cache storage (int8: a scale per position and KV head; default: --dtype)",
    "kernels": "native CPU kernels (unsharded, f32 compute, AVX2/AVX-512; auto: where they "
    "build) or XLA ops",
    "min_prefill_bucket": "smallest power-of-two prompt bucket",
    "max_prefill_bucket": "largest prompt bucket (0: max_seq_len); longer prompts are chunked",
    "seed": "dummy-weight seed",
    "max_waiting": "waiting requests beyond which: 429",
    "max_waiting_tokens": "waiting prompt tokens: 429 beyond",
}
_CHOICES = {
    "page_size": PAGE_SIZES,
    "mode": MODES,
    "dtype": DTYPES,
    "weight_dtype": STORAGE_DTYPES,
    "kv_dtype": STORAGE_DTYPES,
    "kernels": KERNELS,
}
_ALIASES = {"slots": ("--max-running",)}


def on_off(text: str) -> bool:
    """An on|off flag's value (yes/no, true/false, 1/0 as well)."""
    word = text.strip().lower()
    if word not in ("on", "off", "yes", "no", "true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return word in ("on", "yes", "true", "1")


def add_flags(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    omit: tuple[str, ...] = (),
    helps: dict[str, str] | None = None,
) -> argparse._MutuallyExclusiveGroup | None:
    """Add a flag per ServerShape field (but `omit`'s) to `p`: --slots (--max-running), ...,
    --no-prefix-cache, each defaulting to the field's default, but for those whose default
    depends on more than the flags (--max-seq-len on the model, --dtype on the devices, the
    storage dtypes on --dtype): None, resolved by `from_args`. `helps` replaces some fields'
    help. Returns the mutually exclusive group that holds --kv-pages (for flags that size the
    KV cache another way), if added."""
    helps = {**FLAG_HELP, **(helps or {})}
    group = None
    for f in fields(ServerShape):
        name = f.name
        if name in omit:
            continue
        unset = name in ("max_seq_len", "dtype") or f.default == ""
        kw: dict = {"dest": name, "help": helps.get(name), "default": None if unset else f.default}
        if name == "model":
            p.add_argument("--model", required=True, help=kw["help"])
        elif name == "prefix_cache":
            p.add_argument("--no-prefix-cache", action="store_false", **kw)
        elif isinstance(f.default, bool):  # --mixed-batches on|off
            p.add_argument(flag(name), type=on_off, choices=(True, False), metavar="on|off", **kw)
        elif name == "kv_pages":
            group = p.add_mutually_exclusive_group()
            group.add_argument("--kv-pages", type=int, **kw)
        else:
            kind = int if isinstance(f.default, int) else str
            flags = (flag(name), *_ALIASES.get(name, ()))
            p.add_argument(*flags, type=kind, choices=_CHOICES.get(name), **kw)
    return group
