"""Where the native kernel builds are cached (:mod:`tgi_paged_kernels.cpu_native`) and what of this CPU keys them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["cache_dir", "cpu_signature"]


def cpu_signature() -> str:
    """Model name and flags of this CPU (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def cache_dir() -> Path:
    """The kernel cache directory: ``$TGI_PAGED_KERNEL_CACHE``, default ``~/.cache/tgi-paged-backend/kernels``."""
    default = Path.home() / ".cache" / "tgi-paged-backend" / "kernels"
    return Path(os.environ.get("TGI_PAGED_KERNEL_CACHE", default))
