"""SmolLM2 behind TGI's HTTP API on this backend, with preemption: see ``integration/serve_demo.py``.

Usage::

    python examples/serve_smollm2.py [--requests 8] [--max-new-tokens 48] [--fit 4]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.serve_demo import main  # noqa: E402

if __name__ == "__main__":
    main()
