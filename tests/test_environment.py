"""`aie env`: which low-precision instructions a CPU has, read from what Linux or macOS reports."""

from __future__ import annotations

import pytest

from aie_lessons.infra.environment import (bf16_line, environment_report, int8_line, parse_cpuinfo,
                                           parse_darwin_sysctl)

# The flags lines of the CPU kinds the course has met (and a Skylake-era Xeon: AVX-512 without
# bf16), cut to the flags that matter here plus some that must not be mistaken for them.
CPUINFO = {
    "zen3": ("AuthenticAMD", "AMD EPYC 7B13", "fpu sse2 avx fma avx2 bmi2 sha_ni"),
    "zen4": ("AuthenticAMD", "AMD EPYC 9B14", "fpu avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"),
    "xeon_amx": ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8481C", "avx2 fma avx512f avx512_bf16 "
                 "avx512_vnni avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"),
    "skylake": ("GenuineIntel", "Intel(R) Xeon(R) CPU @ 2.00GHz", "avx2 fma avx512f avx512bw avx512vl"),
}
FALLBACK = "none: bf16 matrix products take a fallback path, many times slower than fp32"
EMULATED = "none: oneDNN converts bf16 with AVX-512, below fp32's speed"
BYTES = "; bf16 still halves the bytes (stage 04 measures what that buys)"
NO_INT8 = "no int8 dot-product instructions: int8 × int8 products are widened first, and run far below fp32's speed"


def cpuinfo(vendor: str, model: str, flags: str) -> str:
    core = f"vendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    return core + "\n" + core  # two logical cores, as Linux lists them


@pytest.mark.parametrize("kind, features, bf16, int8", [
    ("zen3", ["avx2", "fma"], FALLBACK + BYTES, NO_INT8),
    ("zen4", ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"], "AVX-512 BF16", "AVX-512 VNNI"),
    ("xeon_amx", ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16",
                  "amx_tile", "amx_bf16", "amx_int8"],
     "AMX-BF16 tiles and AVX-512 BF16", "AMX-INT8 tiles and AVX-512 VNNI and AVX-VNNI"),
    ("skylake", ["avx2", "fma", "avx512f"], EMULATED + BYTES, NO_INT8),
])
def test_each_cpu_kind_names_its_low_precision_instructions(kind, features, bf16, int8):
    facts = parse_cpuinfo(cpuinfo(*CPUINFO[kind]))
    assert facts["vendor"] == CPUINFO[kind][0] and facts["model"] == CPUINFO[kind][1]
    assert facts["features"] == features
    assert bf16_line(facts) == bf16
    assert int8_line(facts) == int8


def test_arm_features_are_read_from_the_features_line():
    facts = parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd asimddp bf16 i8mm\n")
    assert facts["features"] == ["asimd", "asimddp", "bf16", "i8mm"]
    assert bf16_line(facts) == "Arm BF16"
    assert int8_line(facts) == "Arm I8MM and Arm dot product"


def test_a_mac_reports_its_arm_features_through_sysctl():
    m1 = "hw.optional.arm.FEAT_BF16: 0\nhw.optional.arm.FEAT_I8MM: 0\nhw.optional.arm.FEAT_DotProd: 1\nhw.optional.neon: 1\n"
    m4 = m1.replace("FEAT_BF16: 0", "FEAT_BF16: 1").replace("FEAT_I8MM: 0", "FEAT_I8MM: 1")
    assert parse_darwin_sysctl(m1) == ["asimddp", "asimd"]
    assert parse_darwin_sysctl(m4) == ["bf16", "i8mm", "asimddp", "asimd"]
    assert bf16_line({"features": parse_darwin_sysctl(m4)}) == "Arm BF16"


def test_unknown_features_are_said_to_be_unknown():
    assert bf16_line({"cores": 8}).startswith("unknown")
    assert int8_line({"cores": 8}).startswith("unknown")


def test_the_report_names_the_instruction_sets_and_what_torch_dispatches_to():
    import torch

    rows = dict(line.split("  ", 1) for line in environment_report().splitlines())
    rows = {key.strip(): value.strip() for key, value in rows.items()}
    for row in ("cpu features", "bf16 arithmetic", "int8 arithmetic", "torch cpu kernels"):
        assert row in rows, row
    assert rows["torch cpu kernels"].split(";")[0] == torch.backends.cpu.get_cpu_capability()
