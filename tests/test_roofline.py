"""The roofline package and `scaletui roofline`: shipped models' counts, estimate() behaviour under
sharding and dtypes, collectives, the CLI contract (flags, JSON keys, errors)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from scaletui import roofline as rl
from scaletui.cli import main as scaletui_main
from scaletui.commands.roofline import main as roofline_main
from scaletui.specs import HardwareSpec, load_hardware, load_model

CONTRACT_KEYS = [
    "params",
    "param_bytes",
    "flops_per_token",
    "kv_bytes_per_token",
    "kv_bytes_per_seq",
    "memory_bytes",
    "memory_per_chip_bytes",
    "weight_bytes_per_chip",
    "kv_bytes_per_chip",
    "fits",
    "max_batch",
    "min_chips",
    "critical_batch",
    "decode_step_s",
    "decode_comm_s",
    "decode_bound",
    "decode_tokens_per_s",
    "decode_tokens_per_s_per_chip",
    "prefill_s",
    "prefill_matmul_s",
    "ttft_s",
    "arithmetic_intensity",
    "critical_intensity",
    "decode_weight_s",
    "decode_kv_s",
    "decode_matmul_s",
    "prefill_tokens_per_s",
    "kv_transfer_s",
    "prefill_generate_ratio",
]

CPU = HardwareSpec(
    name="cpu-test",
    kind="cpu",
    flops_per_s={"f32": 4e11, "bf16": 2.5e11},
    hbm_bytes=24e9,
    hbm_bw=3.5e10,
    ici_bw=1e10,
    ici_bidirectional=False,
    dcn_bw=1e10,
    chips_per_host=8,
)


@pytest.mark.parametrize(
    ("name", "params"),
    [  # Hugging Face's counts for the released checkpoints (norms included)
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("llama2-13b", 13_015_864_320),
        ("llama3.2-1b", 1_235_814_400),  # tied: one D*V table
        ("llama3.2-3b", 3_212_749_824),
    ],
)
def test_shipped_models_match_released_param_counts(name: str, params: int) -> None:
    assert rl.param_count(load_model(name)) == params


def test_tied_embeddings_count_one_table() -> None:
    m = load_model("llama3.2-1b")
    untied = dataclasses.replace(m, tied_embeddings=False)
    assert rl.param_count(untied) - rl.param_count(m) == m.d_model * m.vocab_size
    assert rl.flops_per_token(untied) - rl.flops_per_token(m) == 2 * m.d_model * m.vocab_size


def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = scaletui_main(["roofline", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_reproduces_book_llama3_70b_step(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_cli(
        capsys,
        *[
            "--model",
            "llama3-70b",
            "--hardware",
            "tpu-v5e",
            "--chips",
            "8",
            "--batch",
            "32",
            "--context",
            "8192",
        ],
        *["--weight-bytes", "1", "--kv-bytes", "1", "--json"],
    )
    assert rc == 0
    d = json.loads(out)
    assert set(CONTRACT_KEYS) <= set(d)
    # Book (Part 8): ~17.5 ms per step, ~230 tokens/s/chip (8.2e11 B/s here vs the book's 8.1e11).
    assert d["decode_step_s"] == pytest.approx(17.5e-3, rel=0.03)
    assert d["decode_tokens_per_s_per_chip"] == pytest.approx(230, rel=0.03)
    assert d["decode_bound"] == "memory"
    assert d["fits"] is True
    assert d["decode_comm_s"] > 0  # tp=8 all-reduces, overlapped: below the step
    assert d["decode_comm_s"] < d["decode_step_s"]


def test_cli_table_has_units(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_cli(capsys, "--model", "llama3-8b", "--hardware", "h100", "--batch", "16")
    assert rc == 0
    for text in ("decode step", "ms", "GB", "tokens/s", "TTFT", "fits"):
        assert text in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "nope", "--hardware", "h100"], "unknown model spec 'nope'"),
        (["--model", "tiny", "--hardware", "h100", "--batch", "0"], "batch"),
        (["--model", "tiny", "--hardware", "h100", "--chips", "8", "--tp", "3"], "tp * dp"),
        (["--model", "tiny", "--hardware", "tpu-v5e", "--compute-dtype", "f32"], "flops_per_s.f32"),
        (["--model", "tiny", "--hardware", "h100", "--mfu", "1.5"], "mfu"),
        (["--model", "tiny", "--hardware", "h100", "--context", "0"], "context"),
        (["--model", "tiny", "--hardware", "./nowhere.yaml"], "does not exist"),
    ],
)
def test_cli_bad_input_names_the_value(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    rc, out, err = _run_cli(capsys, *argv)
    assert rc == 2
    assert needle in err
    assert out == ""


def test_cli_requires_model_and_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        roofline_main(["--model", "tiny"])
    assert exc.value.code == 2
    assert "--hardware" in capsys.readouterr().err


def test_roofline_cli_does_not_import_jax() -> None:
    code = (
        "import sys; from scaletui.commands.roofline import main; "
        "main(['--model','tiny','--hardware','h100','--json']); "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_f32_cpu_config_like_the_tui_uses() -> None:
    m = load_model("small")
    e = rl.estimate(m, CPU, batch=8, chips=8, dp=2, weight_bytes=4, kv_bytes=4, compute_dtype="f32")
    assert e.config["tp"] == 4
    assert e.weight_bytes_per_chip == pytest.approx(rl.param_count(m) * 4 / 4)
    assert e.kv_bytes_per_chip == pytest.approx(8 * 1024 * e.kv_bytes_per_token / 8)
    assert e.kv_bytes_per_token == 2 * m.n_layers * m.n_kv_heads * m.head_dim * 4
    # f32 activations: each all-reduce moves B/dp * D * 4 bytes.
    assert e.collective_bytes == 8 / 2 * m.d_model * 4
    assert e.decode_step_s == pytest.approx(
        max(e.decode_kv_s + max(e.decode_weight_s, e.decode_matmul_s), e.decode_comm_s)
    )
    json.dumps(e.to_dict())  # plain data


def test_data_parallel_replicates_weights_and_splits_kv() -> None:
    m, hw = load_model("llama3-8b"), load_hardware("h100")
    tp8 = rl.estimate(m, hw, batch=64, chips=8)
    dp2 = rl.estimate(m, hw, batch=64, chips=8, dp=2)
    assert dp2.weight_bytes_per_chip == pytest.approx(2 * tp8.weight_bytes_per_chip)
    assert dp2.kv_bytes_per_chip == pytest.approx(tp8.kv_bytes_per_chip)
    assert dp2.decode_weight_s == pytest.approx(2 * tp8.decode_weight_s)
    assert dp2.memory_bytes == tp8.memory_bytes  # weights counted once per replica


def test_single_chip_has_no_collectives_and_comms_can_bound() -> None:
    m, hw = load_model("llama3-8b"), load_hardware("h100")
    assert rl.estimate(m, hw, batch=8).decode_comm_s == 0
    slow = dataclasses.replace(hw, ici_bw=1e8)  # a 100 MB/s "interconnect"
    e = rl.estimate(m, slow, batch=8, chips=8)
    assert e.decode_bound == "comms"
    assert e.decode_step_s == e.decode_comm_s
    assert e.decode_comm_s > e.decode_kv_s + max(e.decode_weight_s, e.decode_matmul_s)


def test_bound_moves_from_memory_to_compute_with_batch() -> None:
    m, hw = load_model("llama3-8b"), load_hardware("h100")
    small = rl.estimate(m, hw, batch=1, context=128)
    big = rl.estimate(m, hw, batch=1024, context=128)
    assert small.decode_bound == "memory"
    assert big.decode_bound == "compute"
    assert small.critical_batch == pytest.approx(9.89e14 / 3.35e12)
    assert small.arithmetic_intensity < small.critical_intensity < big.arithmetic_intensity
    assert big.decode_tokens_per_s > small.decode_tokens_per_s


def test_memory_fit_max_batch_and_min_chips() -> None:
    m, v5e = load_model("llama3-70b"), load_hardware("tpu-v5e")
    one = rl.estimate(m, v5e, context=8192)
    assert not one.fits and one.max_batch == 0
    assert one.min_chips == 16  # 141 GB bf16 -> 9 chips -> 16 (power of two)
    sixteen = rl.estimate(m, v5e, chips=16, context=8192, batch=16)
    assert sixteen.fits and sixteen.max_batch >= 40
    over = rl.estimate(m, v5e, chips=16, context=8192, batch=sixteen.max_batch + 1)
    assert not over.fits


def test_prefill_adds_causal_attention_to_the_book_form() -> None:
    m, hw = load_model("llama3-70b"), load_hardware("tpu-v5e")
    e = rl.estimate(m, hw, chips=16, prompt_len=8192, mfu=0.4)
    # Book, Part 7: 8192 tokens on 16 v5e at 40% MFU -> 0.91 s (matmul FLOPs only).
    assert e.prefill_matmul_s == pytest.approx(0.91, rel=0.02)
    attn = 2 * 8192**2 * m.n_heads * m.head_dim * m.n_layers  # 4*T^2*N*H*L / 2
    assert e.prefill_flops == pytest.approx(e.flops_per_token * 8192 + attn)
    assert e.prefill_s == pytest.approx(e.prefill_flops / (16 * 1.97e14 * 0.4))
    assert e.ttft_s == e.prefill_s > e.prefill_matmul_s


def test_moe_uses_active_experts_for_flops_and_all_for_memory() -> None:
    m = dataclasses.replace(load_model("llama3-8b"), n_experts=8, experts_per_token=2)
    dense = load_model("llama3-8b")
    hw = load_hardware("h100")
    e = rl.estimate(m, hw)
    mlp_dense = rl.params_by_part(dense)["mlp"]
    assert rl.params_by_part(m)["mlp"] == 8 * mlp_dense + m.n_layers * m.d_model * 8
    assert e.flops_per_token < 2 * e.params
    assert e.critical_batch == pytest.approx(rl.estimate(dense, hw).critical_batch * 4)


def test_collectives_shapes() -> None:
    ring = rl.Link(bw=4.5e10, bidirectional=True, latency_s=1e-6)
    switch = rl.Link(bw=4.5e11, switched=True, latency_s=1e-6)
    assert rl.all_gather_s(1e9, 1, ring) == 0
    ag = rl.all_gather_s(1e9, 8, ring)
    assert ag == pytest.approx(1e9 * 7 / 8 / 9e10 + 4e-6)  # both directions, n/2 hops
    assert rl.reduce_scatter_s(1e9, 8, ring) == ag
    assert rl.all_reduce_s(1e9, 8, ring) == pytest.approx(2 * ag)
    assert rl.all_to_all_s(1e9, 8, ring) == pytest.approx(1e9 * 7 / 8 / 4 / 4.5e10 + 4e-6)
    assert rl.all_gather_s(1e9, 8, switch) == pytest.approx(1e9 * 7 / 8 / 4.5e11 + 7e-6)
    assert rl.all_to_all_s(1e9, 8, switch) == pytest.approx(1e9 * 7 / 64 / 4.5e11 + 7e-6)
    with pytest.raises(ValueError, match="bandwidth"):
        rl.Link(bw=0)


def test_kv_transfer_and_ratio() -> None:
    m, hw = load_model("llama3-70b"), load_hardware("tpu-v5e")
    e = rl.estimate(m, hw, chips=8, batch=32, context=8192, prompt_len=8192, decode_len=512)
    prompt_kv = 8192 * e.kv_bytes_per_token
    assert e.kv_transfer_s == pytest.approx(prompt_kv / 8 / hw.ici_bw + hw.ici_latency_s)
    assert e.kv_transfer_dcn_s == pytest.approx(prompt_kv / 8 / hw.dcn_bw)
    assert e.prefill_generate_ratio == pytest.approx(e.prefill_s * 32 / (e.decode_step_s * 512))
