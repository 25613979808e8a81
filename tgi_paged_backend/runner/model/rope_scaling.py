"""``ROPE_SCALING`` / ``ROPE_FACTOR`` (the launcher's ``--rope-scaling`` / ``--rope-factor``) applied to
the model's transformers config.

Stock (``layers/rotary.py::_get_rope_config``) replaces the model's whole RoPE scaling entry with
``{"type": ROPE_SCALING, "factor": ROPE_FACTOR}`` whenever ``ROPE_SCALING`` is set; any scaling in
``config.json`` (llama3, yarn, ...) is dropped. The same replacement is made here, and transformers'
own rotary embedding then implements it, so the output is what HF produces for a ``config.json``
carrying that scaling. (Stock's flash layers implement ``dynamic`` with the factor but, in
``PositionRotaryEmbedding.static``, leave ``linear`` unscaled; here ``linear`` scales positions by
``1 / factor`` as transformers does.)

transformers >= 5 keeps RoPE settings in ``config.rope_parameters`` (``rope_theta`` included, nested
per layer type for some families); 4.x keeps them in ``config.rope_scaling`` next to
``config.rope_theta``. A config with neither has no RoPE and is left alone, as stock ignores the
variables for such models.
"""

from __future__ import annotations

from typing import Any

_KEPT_KEYS = ("rope_theta", "partial_rotary_factor")
"""``rope_parameters`` entries that describe the base RoPE, not its scaling: kept."""


def apply_rope_scaling(config: Any, scaling: str, factor: float) -> bool:
    """Replace the RoPE scaling of ``config`` (its text config for multimodal ones) in place.

    Returns whether the model has RoPE at all (``False``: nothing changed).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict):  # transformers >= 5
        if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
            text.rope_parameters = {kind: _scaled(p, scaling, factor) for kind, p in params.items()}
        else:
            text.rope_parameters = _scaled(params, scaling, factor)
        return True
    if getattr(text, "rope_theta", None) is not None or getattr(text, "rope_scaling", None) is not None:
        text.rope_scaling = {"rope_type": scaling, "type": scaling, "factor": float(factor)}  # 4.x
        return True
    return False


def _scaled(params: dict[str, Any], scaling: str, factor: float) -> dict[str, Any]:
    kept = {k: params[k] for k in _KEPT_KEYS if k in params}
    return {**kept, "rope_type": scaling, "factor": float(factor)}
