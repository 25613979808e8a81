"""Which steps an engine's native decode layers served (``runner.native.layers``): engine tests assert that
LoRA and speculative verify steps ran as one native call per layer, not on the per-op path."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgi_paged_backend.runner.native import layers as native_layers
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer


@dataclass
class StepRecord:
    """Per forward of the engine's runner: its kind; per native layer call: whether it had verify or LoRA rows."""

    forwards: list[tuple[bool, bool]] = field(default_factory=list)
    """``(verify, lora)`` of each forward that continues every request (a decode or verify step)."""
    native: list[tuple[bool, bool]] = field(default_factory=list)
    """``(verify, lora)`` of each native layer call."""

    def count(self, verify: bool | None = None, lora: bool | None = None) -> tuple[int, int]:
        """``(forwards, native calls)`` of that kind (``None``: either)."""

        def fits(kind: tuple[bool, bool]) -> bool:
            return (verify is None or kind[0] == verify) and (lora is None or kind[1] == lora)

        return sum(map(fits, self.forwards)), sum(map(fits, self.native))


def num_native_layers(engine) -> int:
    return sum(isinstance(m, NativeDecoderLayer) for m in engine.runner.model.modules())


def record_steps(engine, monkeypatch) -> StepRecord:
    """Record ``engine``'s steps from now on (after its load-time checks)."""
    record = StepRecord()
    real_layer, real_forward = native_layers.decode_layer, engine.runner.forward

    def layer(*args, **kwargs):
        verify, lora = len(args) > 10 and args[10] is not None, len(args) > 11 and args[11] is not None
        record.native.append((verify, lora))
        return real_layer(*args, **kwargs)

    def forward(batch, *args, **kwargs):
        q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).cpu()
        if bool((batch.seq_lens.cpu() > q_lens).all()):  # every request has context: decode or verify
            lora = batch.lora_slots is not None and bool((batch.lora_slots >= 0).any())
            record.forwards.append((not batch.is_decode, lora))
        return real_forward(batch, *args, **kwargs)

    monkeypatch.setattr(native_layers, "decode_layer", layer)
    monkeypatch.setattr(engine.runner, "forward", forward)
    return record
