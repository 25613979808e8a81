"""The token inputs of a forward: ``input_ids``, or embeddings with a step's image rows in place.

A vision-language model's prefill chunk that holds image positions runs on ``inputs_embeds``: the
language model's token embeddings of the packed ids, with each image's embeddings
(:attr:`~.input_batch.ForwardBatch.image_rows`) written over its placeholder rows. Every other step,
text-only models' always, passes ``input_ids`` as before (nothing extra is computed).
"""

from __future__ import annotations

from typing import Any

import torch

from tgi_paged_backend.runner.input_batch import ForwardBatch


def model_inputs(model: Any, batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """``{"input_ids": [1, T]}``, or ``{"inputs_embeds": [1, T, hidden]}`` when the batch carries image rows."""
    if not batch.image_rows:
        return {"input_ids": batch.input_ids.unsqueeze(0)}
    embeds = model.get_input_embeddings()(batch.input_ids)
    for row, values in batch.image_rows:
        embeds[row : row + values.shape[0]] = values.to(embeds.dtype)
    return {"inputs_embeds": embeds.unsqueeze(0)}
