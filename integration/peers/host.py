"""The host the figures were taken on: CPU model, the ISA flags that decide the kernels, the load.

CPU figures depend on which vector units the host has: the same engine runs AVX2 code on one machine
and AVX-512 / AMX code on another, and bfloat16 is only computed natively with AVX512-BF16 or AMX
(elsewhere it is converted to float32 around every op, slower than float32 itself). So the report starts
with what ``/proc/cpuinfo`` says (:func:`parse_cpuinfo`), what torch picked (its ATen CPU capability and
whether oneDNN takes bf16), and the load average, which moves every figure on a shared box.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The ``/proc/cpuinfo`` flags that change which CPU kernels run (AMX needs both ``amx_*``)."""


@dataclass(frozen=True, slots=True)
class HostInfo:
    model: str
    """``model name`` of the first processor (``unknown`` when cpuinfo has none)."""
    cpus: int
    flags: dict[str, bool] = field(default_factory=dict)
    """Each of :data:`ISA_FLAGS`: present on this host."""
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Load average over 1, 5 and 15 minutes when the run started."""
    torch_capability: str = ""
    """``torch.backends.cpu.get_cpu_capability()``: the ATen kernels torch dispatches to (empty: unknown)."""
    onednn_bf16: bool | None = None
    """Whether oneDNN (mkldnn) reports bf16 support on this host (``None``: unknown)."""

    @property
    def native_bf16(self) -> str:
        """The unit that computes bfloat16 natively: ``AMX``, ``AVX512-BF16``, or empty when none does."""
        if self.flags.get("amx_bf16") and self.flags.get("amx_tile"):
            return "AMX"
        if self.flags.get("avx512_bf16"):
            return "AVX512-BF16"
        return ""


def parse_cpuinfo(text: str) -> tuple[str, dict[str, bool]]:
    """``(model name, {flag: present})`` of the first processor block in ``/proc/cpuinfo`` text.

    x86 lists ``flags``; some kernels (and other architectures) say ``Features``; both are read. The model name
    gains x86's ``cpu family`` and ``model`` numbers where cpuinfo has them: a VM may name only the vendor's line
    (``AMD EPYC``), which then tells a Zen 3 from a Zen 5 host.
    """
    model, found, numbers = "unknown", set(), {}
    for line in text.splitlines():
        if not line.strip():
            if found or model != "unknown":
                break  # the first processor block is enough: every core reports the same
            continue
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and model == "unknown":
            model = value.strip() or model
        elif key in ("flags", "features"):
            found |= set(value.split())
        elif key in ("cpu family", "model") and value.strip().isdigit():
            numbers.setdefault(key, value.strip())
    if model != "unknown" and len(numbers) == 2:
        model = f"{model} (family {numbers['cpu family']}, model {numbers['model']})"
    return model, {flag: flag in found for flag in ISA_FLAGS}


def _torch_view() -> tuple[str, bool | None]:
    try:
        import torch

        capability = str(torch.backends.cpu.get_cpu_capability())
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # report-only: an old torch or no mkldnn is "unknown", not an error
        return "", None
    return capability, bf16


def host_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> HostInfo:
    """This host now (``unknown`` model and no flags where there is no cpuinfo)."""
    try:
        model, flags = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        model, flags = "unknown", dict.fromkeys(ISA_FLAGS, False)
    capability, bf16 = _torch_view()
    return HostInfo(model, os.cpu_count() or 0, flags, os.getloadavg(), capability, bf16)


def describe(host: HostInfo, dtype: str) -> str:
    """Two lines for the top of the report: the CPU and its ISA, then what that means for ``dtype``."""
    isa = ", ".join(f"{flag} {'yes' if host.flags.get(flag) else 'no'}" for flag in ISA_FLAGS)
    torch_part = f"; torch CPU capability {host.torch_capability}" if host.torch_capability else ""
    if host.onednn_bf16 is not None:
        torch_part += f", oneDNN bf16 {'yes' if host.onednn_bf16 else 'no'}"
    native = host.native_bf16
    bf16 = (
        f"bfloat16 computed natively ({native})"
        if native
        else "no native bfloat16 (AVX2/AVX-512F only: bf16 is converted to float32 around each op)"
    )
    load = " / ".join(f"{x:.2f}" for x in host.load)
    lines = [
        f"host: {host.model}, {host.cpus} CPUs; ISA: {isa}{torch_part}",
        f"  {bf16}; this run: {dtype}; load average at start {load} (1 / 5 / 15 min)",
    ]
    if dtype == "bfloat16" and not native:
        lines.append("  (a bfloat16 run on this host measures the conversion, not the goal's native bf16)")
    return "\n".join(lines)
