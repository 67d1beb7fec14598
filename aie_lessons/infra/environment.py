"""What this machine is: versions, processor, memory, GPU, Triton. Shown by ``aie env``.

Every number the course measures (tokens/s, bandwidth, the roofline) depends on these facts, so
stage 00 prints them first and a learner can compare their results with someone else's.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from aie_lessons.infra.paths import default_model_dir

# CPU features that decide which fast paths PyTorch's CPU kernels can take.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "neon", "asimd")
# Which instructions multiply bf16 here. Each family rounds and sums bf16 products in its own
# order, so bf16 results (and speed) differ between, say, AMD Zen 4 and Intel Xeon with AMX.
BF16_UNITS = (("amx_bf16", "AMX-BF16 tiles"), ("avx512_bf16", "AVX-512 BF16"), ("bf16", "Arm BF16"))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_facts() -> dict[str, object]:
    facts: dict[str, object] = {"cores": os.cpu_count(), "model": platform.processor() or "?"}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        text = cpuinfo.read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                facts["model"] = line.split(":", 1)[1].strip()
                break
        for line in text.splitlines():
            if line.startswith("vendor_id"):
                facts["vendor"] = line.split(":", 1)[1].strip()
                break
        flags = set()
        for line in text.splitlines():
            if line.startswith(("flags", "Features")):
                flags |= set(line.split(":", 1)[1].split())
        facts["features"] = [f for f in CPU_FLAGS if f in flags]
        facts["bf16"] = [name for flag, name in BF16_UNITS if flag in flags]
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        total_kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        facts["memory_gb"] = round(total_kib / 2**20, 1)
    return facts


def bf16_line(cpu: dict[str, object]) -> str:
    """Which instructions multiply bf16 here, as ``cpu_facts`` found them."""
    if "bf16" not in cpu:
        return "unknown (no /proc/cpuinfo to read)"
    return " and ".join(cpu["bf16"]) or "no bf16 instructions: bf16 is converted to fp32"


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
        ("memory", f"{cpu.get('memory_gb', '?')} GB"),
    ]
    rows.append(("triton", ("available: " if triton_ok else "unavailable: ") + triton_why))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
