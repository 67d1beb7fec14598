"""What this machine is: versions, processor, memory, GPU, Triton. Shown by ``aie env``.

Every number the course measures (tokens/s, bandwidth, the roofline) depends on these facts, so
stage 00 prints them first and a learner can compare their results with someone else's. The
low-precision lines matter most: a CPU without bf16 or int8 dot-product instructions runs those
products in a slow fallback (on an AVX2-only AMD Zen 3, a bf16 matrix product is ~85× slower than
fp32), so which instructions exist decides whether bf16 weights are a gain or a loss there.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

from aie_lessons.infra.paths import default_model_dir

# CPU features that decide which fast paths PyTorch's CPU kernels can take, by the names Linux
# gives them in /proc/cpuinfo (x86 "flags", Arm "Features").
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "bf16", "i8mm", "sve")
# Which instructions multiply bf16 here. Each family rounds and sums bf16 products in its own
# order, so bf16 results (and speed) differ between, say, AMD Zen 4 and Intel Xeon with AMX.
BF16_UNITS = (("amx_bf16", "AMX-BF16 tiles"), ("avx512_bf16", "AVX-512 BF16"), ("bf16", "Arm BF16"))
# Which instructions multiply int8 by int8 and sum into int32 (what `torch._int_mm` wants).
INT8_UNITS = (("amx_int8", "AMX-INT8 tiles"), ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"),
              ("avx_vnni_int8", "AVX-VNNI-INT8"), ("i8mm", "Arm I8MM"), ("asimddp", "Arm dot product"))
# macOS has no /proc/cpuinfo: `sysctl hw.optional` names the same Arm features differently.
DARWIN_FEATURES = {"hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.arm.FEAT_I8MM": "i8mm",
                   "hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.neon": "asimd"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_cpuinfo(text: str) -> dict[str, object]:
    """Model, vendor and the flags of ``CPU_FLAGS`` that a /proc/cpuinfo text lists."""
    facts: dict[str, object] = {}
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "model" not in facts:
            facts["model"] = value.strip()
        elif key == "vendor_id" and "vendor" not in facts:
            facts["vendor"] = value.strip()
        elif key in ("flags", "Features"):
            flags |= set(value.split())
    facts["features"] = [f for f in CPU_FLAGS if f in flags]
    return facts


def parse_darwin_sysctl(text: str) -> list[str]:
    """The flags of ``CPU_FLAGS`` that ``sysctl hw.optional...`` output reports as present (1)."""
    present = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip() == "1":
            present.add(key.strip())
    return [flag for key, flag in DARWIN_FEATURES.items() if key in present]


def _darwin_features() -> list[str] | None:
    """The Arm features an Apple Silicon Mac reports, asked of ``sysctl`` (time-boxed: it answers
    at once); None when it cannot say (an Intel Mac, or sysctl failing), so that the report says
    "unknown" rather than "none"."""
    if platform.machine() != "arm64":
        return None
    try:
        out = subprocess.run(["sysctl", *DARWIN_FEATURES], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_darwin_sysctl(out.stdout) if out.stdout else None


def cpu_facts() -> dict[str, object]:
    facts: dict[str, object] = {"cores": os.cpu_count(), "model": platform.processor() or "?"}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        facts |= parse_cpuinfo(cpuinfo.read_text())
    elif sys.platform == "darwin" and (features := _darwin_features()) is not None:
        facts["features"] = features
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        total_kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        facts["memory_gb"] = round(total_kib / 2**20, 1)
    return facts


def units_line(cpu: dict[str, object], units: tuple[tuple[str, str], ...], missing: str) -> str:
    """The instruction sets of ``units`` that ``cpu_facts`` found, or ``missing`` when none is."""
    if "features" not in cpu:
        return "unknown (this system does not say which instructions its CPU has)"
    return " and ".join(name for flag, name in units if flag in cpu["features"]) or missing


def bf16_line(cpu: dict[str, object]) -> str:
    """Which instructions multiply bf16 here. Without bf16 units, AVX-512 still lets oneDNN
    convert bf16 to fp32 on the fly at a fraction of fp32's speed; with AVX2 alone, products take
    a fallback path that is many times slower (stage 09 measures which)."""
    if "avx512f" in cpu.get("features", ()):
        missing = "none: oneDNN converts bf16 with AVX-512, below fp32's speed"
    else:
        missing = "none: bf16 matrix products take a fallback path, many times slower than fp32"
    return units_line(cpu, BF16_UNITS, missing + "; bf16 still halves the bytes (stage 04 measures what that buys)")


def int8_line(cpu: dict[str, object]) -> str:
    """Which instructions multiply int8 here."""
    return units_line(cpu, INT8_UNITS, "no int8 dot-product instructions: int8 × int8 products are "
                                       "widened first, and run far below fp32's speed")


def torch_kernels_line() -> str:
    """The vector instructions PyTorch's own CPU kernels were dispatched to, and whether its
    oneDNN library multiplies bf16 matrices natively: PyTorch decides both at start-up, and the
    environment can lower them (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return capability
    if not torch.backends.mkldnn.is_available():
        return f"{capability}; oneDNN: not in this torch build (bf16 products take the fallback path)"
    try:
        supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a private op: a torch version may rename it
        return f"{capability}; oneDNN bf16 matrix products: unknown to this torch version"
    return f"{capability}; oneDNN bf16 matrix products: {'supported' if supported else 'not supported (fallback path)'}"


def triton_status() -> tuple[bool, str]:
    """Whether Triton can be used here, and why not when it cannot."""
    if sys.platform == "darwin":
        return False, "Triton has no macOS build: stage 05 runs its PyTorch reference instead"
    version = _version("triton")
    if version is None:
        return False, "triton is not installed (pip install triton, Linux only)"
    import torch

    if torch.cuda.is_available():
        return True, f"triton {version}, compiled kernels on the GPU"
    return True, f"triton {version}, CPU interpreter (TRITON_INTERPRET=1): slow, small shapes only"


def environment_facts() -> dict[str, object]:
    import torch

    facts: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch threads": torch.get_num_threads(),
        "cpu": cpu_facts(),
        "torch cpu kernels": torch_kernels_line(),
        "cuda": torch.cuda.is_available(),
        "triton": triton_status(),
        "transformers": _version("transformers") or "not installed (only the tests need it)",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    model_dir = default_model_dir()
    fetched = (model_dir / "config.json").exists()
    facts["model"] = f"{model_dir}" if fetched else "not fetched yet: run `aie fetch-model`"
    return facts


def environment_report() -> str:
    facts = environment_facts()
    cpu = facts.pop("cpu")
    triton_ok, triton_why = facts.pop("triton")
    rows = [(k, str(v)) for k, v in facts.items()]
    rows[3:3] = [
        ("cpu", f"{cpu['model']} ({cpu.get('vendor', 'vendor unknown')}, {cpu['cores']} logical cores)"),
        ("cpu features", ", ".join(cpu.get("features", [])) or "none detected"),
        ("bf16 arithmetic", bf16_line(cpu)),
        ("int8 arithmetic", int8_line(cpu)),
        ("memory", f"{cpu.get('memory_gb', '?')} GB"),
    ]
    rows.append(("triton", ("available: " if triton_ok else "unavailable: ") + triton_why))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
