"""A server's one shape: the admin JSON and `scaletui serve`'s flags round-trip through it, a
value it cannot take fails naming its key, and the dtype rules every side shares."""

from __future__ import annotations

import argparse

import pytest

from scaletui.dtypes import DTYPE_BYTES, Precision, default_compute_dtype
from scaletui.shape import ConfigError, ServerShape, pow2_buckets
from scaletui.shape_flags import add_flags
from scaletui.specs import load_model

TINY, SMALL = load_model("tiny"), load_model("small")
SHAPES = [
    ServerShape(TINY, max_seq_len=128),
    ServerShape(SMALL, slots=6, max_seq_len=2048, page_size=16, kv_pages=40, prefix_cache=False,
                max_batched_tokens=256, decode_steps=8, tp=2, dp=3, mode="disaggregated",
                prefill_devices=2, dtype="bf16", weight_dtype="int8", kv_dtype="bf16",
                kernels="xla", min_prefill_bucket=32, max_prefill_bucket=512,
                weights="/w/model.safetensors", tokenizer="/w/tokenizer.json", seed=7,
                max_waiting=9, max_waiting_tokens=999),
]  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("shape", SHAPES, ids=["defaults", "every-field"])
def test_json_and_flags_round_trip(shape):
    j = shape.to_json()
    assert ServerShape.from_json(j).to_json() == j
    assert ServerShape.from_json(j, model=shape.model) == ServerShape.from_json(j)
    assert ServerShape.from_args(parse(shape.to_flags())) == shape


def test_the_json_is_the_admin_views_resolved_one():
    j = SHAPES[0].to_json()
    assert (j["kv_pages"], j["weight_dtype"], j["kv_dtype"]) == (8 * 2 + 1, "f32", "f32")
    assert (j["weights"], j["tokenizer"]) == ("dummy", "byte")
    assert j["prefill_buckets"] == [16, 32, 64, 128]
    # /stats adds running state to it; from_json reads the shape and leaves the rest
    assert ServerShape.from_json({**j, "kernels_running": "xla", "running": 3}).to_json() == j
    key = {"model": "tiny", "dtype": "f32", "weight_dtype": "f32", "kv_dtype": "f32", "tp": 1,
           "dp": 1, "kernels": "auto"}  # fmt: skip
    assert SHAPES[0].fit_key() == key


def test_flags_left_out_take_the_defaults_and_the_models_length():
    args = parse(["--model", "tiny"])
    assert ServerShape.from_args(args) == ServerShape(TINY, max_seq_len=256)  # min(1024, 256)
    assert ServerShape.from_args(parse(["--model", "small"])).max_seq_len == 1024
    got = ServerShape.from_args(parse(["--model", "tiny", "--max-running", "4"]), dtype="bf16")
    assert (got.slots, got.dtype) == (4, "bf16")
    with pytest.raises(SystemExit):  # argparse: not a choice
        parse(["--model", "tiny", "--page-size", "24"])


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"slots": 0}, "slots", "slots must be in [1, 1024]"),
        ({"slots": 6, "dp": 4}, "slots", "use slots 8 or a dp that divides 6"),
        ({"decode_steps": 65}, "decode_steps", "decode_steps must be in [1, 64]"),
        ({"tp": 0}, "tp", "tp and dp must be >= 1"),
        ({"mode": "split"}, "mode", "mode must be one of"),
        ({"dtype": "int8"}, "dtype", "dtype must be one of ('f32', 'bf16')"),
        ({"dtype": "bf16", "kv_dtype": "f32"}, "kv_dtype", "kv_dtype=f32 is wider than"),
        ({"page_size": 24}, "page_size", "page_size must be one of"),
        ({"kv_pages": 1}, "kv_pages", "kv_pages must be 0"),
        ({"max_seq_len": 257}, "max_seq_len", "max_seq_len must be in [2, 256] for model tiny"),
        ({"min_prefill_bucket": 0}, "min_prefill_bucket", "min_prefill_bucket must be >= 1"),
        ({"max_waiting": 0}, "max_waiting", "must be >= 1"),
    ],
)
def test_a_bad_value_fails_naming_its_key(changes, key, words):
    with pytest.raises(ConfigError) as info:
        ServerShape(TINY, **{"max_seq_len": 128, **changes})
    assert info.value.key == key and words in str(info.value)
    assert info.value.flag_line().startswith(f"--{key.replace('_', '-')} ")
    with pytest.raises(ValueError, match="unknown config key"):
        SHAPES[0].updated(seed=1)  # not reconfigurable live


def test_one_precision_one_bytes_table_one_bucket_rule():
    p = Precision("f32", "int8", "bf16")
    assert p.describe() == "f32 compute, int8 weights, bf16 KV"
    assert p.label() == "f32·w int8·kv bf16"
    assert Precision("bf16", "bf16", "bf16").describe() == "bf16"
    assert SHAPES[1].precision == Precision("bf16", "int8", "bf16")
    assert DTYPE_BYTES["fp8"] == DTYPE_BYTES["int8"] == 1 and DTYPE_BYTES["f32"] == 4
    assert pow2_buckets(16, 100) == (16, 32, 64, 100)
    assert ServerShape(TINY, max_seq_len=8).prefill_buckets == (8,)  # none past max_seq_len
    assert ServerShape(TINY, max_seq_len=200, page_size=64).decode_buckets == (64, 128, 256)


def test_the_default_compute_dtype_rule():
    yes, no = (lambda: True), (lambda: False)
    assert default_compute_dtype("gpu", no) == "bf16"
    assert default_compute_dtype("gpu", no, weight_dtype="f32") == "f32"
    assert default_compute_dtype("cpu", yes) == "bf16"
    assert default_compute_dtype("cpu", no) == "f32"
    assert default_compute_dtype("cpu", yes, kernels="xla") == "f32"
    assert default_compute_dtype("cpu", yes, tp=2) == "f32"

    def never() -> bool:
        raise AssertionError("asked the kernels where the rule does not need them")

    assert default_compute_dtype("cpu", never, tp=2) == "f32"


def test_serve_simulate_and_calibrate_read_the_same_flags():
    """`scaletui serve`'s argv for a shape parses back to it in serve itself; simulate and
    calibrate take the same flags for what they model (not the weights, tokenizer, queue)."""
    from scaletui.commands import calibrate_engine
    from scaletui.commands import simulate as simulate_cli
    from scaletui.commands.serve import parser

    shape = SHAPES[1]
    argv = shape.to_flags()
    assert ServerShape.from_args(parser().parse_args(argv)) == shape
    drop = {"--weights", "--tokenizer", "--seed", "--max-waiting", "--max-waiting-tokens"}
    kept, rest = [], list(argv)
    while rest:  # every flag takes a value but --no-prefix-cache
        flag = rest.pop(0)
        given = [flag] if flag == "--no-prefix-cache" else [flag, rest.pop(0)]
        kept += [] if flag in drop else given
    sim = simulate_cli.build_parser().parse_args([*kept, "--qps", "1"])
    fit = calibrate_engine.build_parser().parse_args(kept)
    for args in (sim, fit):
        got = ServerShape.from_args(args, ("weights", "tokenizer", "seed", "max_waiting",
                                           "max_waiting_tokens"))  # fmt: skip
        assert got.fit_key() == shape.fit_key() and got.slots == shape.slots


def test_part_of_a_shape_is_checked_by_the_same_rules():
    """`check` runs each rule whose fields it is given (the TUI's knobs check theirs by it), and
    `to_flags(keys)` spells those fields alone, in field order."""
    from scaletui.shape import check

    check({"slots": 8, "dp": 2, "weight_dtype": "f32"})  # no dtype: the width rule waits
    with pytest.raises(ConfigError, match="use slots 8") as info:
        check({"slots": 6, "dp": 4})
    assert info.value.key == "slots"
    with pytest.raises(ConfigError, match="kv_dtype=f32 is wider"):
        check({"dtype": "bf16", "weight_dtype": "", "kv_dtype": "f32"})
    shape = SHAPES[1]
    assert shape.to_flags(("kv_dtype", "slots", "model")) == [
        "--model", "small", "--slots", "6", "--kv-dtype", "bf16",
    ]  # fmt: skip
    assert SHAPES[0].to_flags(("weight_dtype", "prefix_cache")) == []  # unset, default
