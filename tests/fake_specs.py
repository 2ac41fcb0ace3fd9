"""A hand-made CPU hardware spec for tests whose numbers are computed by hand (no calibration)."""

from scaletui.specs import HardwareSpec

CPU = HardwareSpec(
    name="cpu-test",
    kind="cpu",
    flops_per_s={"f32": 4e11, "bf16": 4e11},
    hbm_bytes=24e9,
    hbm_bw=3.2e10,
    ici_bw=1e10,
    ici_bidirectional=False,
    dcn_bw=1e10,
    chips_per_host=1,
)
