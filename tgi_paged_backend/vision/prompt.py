"""The prompt text of a request with images: text chunks as they are, each image as its placeholders.

Stock TGI's VLM server concatenates the chunks, replacing image ``i`` by the family's placeholder
string (docs/vlm.md has the table); the tokenizer then runs over that text. The family supplies the
placeholder string per image (e.g. LLaVA-NeXT: ``"<image>" * image_token_count(h, w)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tgi_paged_backend.engine.types import ImageInput


def build_prompt(
    chunks: Sequence[str | ImageInput], placeholder: Callable[[int], str], wrap_text: Callable[[str], str] | None = None
) -> str:
    """The chunks joined, the ``i``-th image (in order) replaced by ``placeholder(i)``, each text chunk by
    ``wrap_text(text)`` when given (PaliGemma: ``<bos>`` + text + ``\n``, stock's ``preprocess_text``)."""
    parts: list[str] = []
    index = 0
    for chunk in chunks:
        if isinstance(chunk, ImageInput):
            parts.append(placeholder(index))
            index += 1
        else:
            parts.append(chunk if wrap_text is None else wrap_text(chunk))
    return "".join(parts)
