"""`aie env`: which low-precision instructions a CPU has, read from what Linux reports."""

from __future__ import annotations

import pytest

from aie_lessons.infra.environment import bf16_line, environment_report, int8_line, parse_cpuinfo

# The flags lines of the three x86 kinds the course has met, and an Arm server, cut to the flags
# that matter here plus a few that do not.
CPUINFO = {
    "zen3": ("AuthenticAMD", "AMD EPYC 7B13", "fpu sse2 avx fma avx2 bmi2 sha_ni"),
    "zen4": ("AuthenticAMD", "AMD EPYC 9B14", "fpu avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"),
    "xeon_amx": ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8481C", "avx2 fma avx512f avx512_bf16 "
                 "avx512_vnni avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"),
}


def cpuinfo(vendor: str, model: str, flags: str) -> str:
    core = f"vendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    return core + "\n" + core  # two logical cores, as Linux lists them


@pytest.mark.parametrize("kind, bf16, int8", [
    ("zen3", "none", "no int8 dot-product instructions"),
    ("zen4", "AVX-512 BF16", "AVX-512 VNNI"),
    ("xeon_amx", "AMX-BF16 tiles and AVX-512 BF16", "AMX-INT8 tiles and AVX-512 VNNI and AVX-VNNI"),
])
def test_each_cpu_kind_names_its_low_precision_instructions(kind, bf16, int8):
    facts = parse_cpuinfo(cpuinfo(*CPUINFO[kind]))
    assert facts["vendor"] == CPUINFO[kind][0] and facts["model"] == CPUINFO[kind][1]
    assert bf16_line(facts).startswith(bf16)
    assert int8_line(facts).startswith(int8)


def test_a_cpu_without_bf16_says_what_that_costs():
    line = bf16_line(parse_cpuinfo(cpuinfo(*CPUINFO["zen3"])))
    assert "slow fallback" in line and "stage 04" in line


def test_arm_features_are_read_from_the_features_line():
    facts = parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd asimddp bf16 i8mm\n")
    assert facts["features"] == ["asimd", "asimddp", "bf16", "i8mm"]
    assert bf16_line(facts) == "Arm BF16"
    assert int8_line(facts) == "Arm I8MM and Arm dot product"


def test_unknown_features_are_said_to_be_unknown():
    assert bf16_line({"cores": 8}).startswith("unknown")


def test_the_report_names_the_instruction_sets_and_what_torch_dispatches_to():
    report = dict(line.split(None, 1) if "  " not in line else [p.strip() for p in line.split("  ", 1)]
                  for line in environment_report().splitlines())
    for row in ("cpu features", "bf16 arithmetic", "int8 arithmetic", "torch cpu kernels"):
        assert row in report, row
    assert report["torch cpu kernels"].split(";")[0] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NEON", "SVE256", "SVE")
