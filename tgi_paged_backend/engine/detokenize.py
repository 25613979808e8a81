"""Token texts: streaming (incremental) detokenisation, final text, special flags, per-token texts.

Stock semantics (``models/model.py::Model.decode_token``): each request keeps ``prefix_offset`` /
``read_offset`` into its id list, initially ``prompt_len - 5`` (clamped at 0) and ``prompt_len``. For each
new token, ``prefix = decode(ids[prefix:read])`` and ``new = decode(ids[prefix:])`` (both with
``skip_special_tokens=False``); if ``new`` is longer and does not end with U+FFFD, ``new[len(prefix):]`` is
emitted and the offsets advance, otherwise ``""`` is emitted and the bytes are held until the character
completes. Text is therefore never emitted halfway through a UTF-8 character.

Final text (``GeneratedText.text``): ``decode([last prompt id] + generated, skip_special_tokens=True)``
minus the decoded first token, so leading spaces match streaming. Deviation: stock returns ``""`` for
the *whole* text when it ends in U+FFFD (completion cut mid-character, TGI issue #1235); here trailing
U+FFFD characters are dropped and the decodable part is returned, which is exactly what was streamed.

Implementation notes: the ``prefix`` decode is cached between emissions (same result, half the decode
work), and only the last 5 prompt ids are kept per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["IncrementalDetokenizer", "TokenDecoder", "backend_decode", "special_token_ids"]

_REPLACEMENT = "\ufffd"
_PREFIX_WINDOW = 5


def special_token_ids(tokenizer) -> frozenset[int]:
    """``tokenizer.all_special_ids`` plus every added token flagged special."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ())}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(i for i in ids if i is not None and i >= 0)


def backend_decode(tokenizer) -> Callable[..., str] | None:
    """The ``tokenizers`` backend's ``decode`` when ``tokenizer.decode`` would return exactly its text, else ``None``.

    That is a fast tokenizer whose ``decode`` / ``_decode`` are transformers' own (no subclass override) and
    which does not clean up tokenization spaces: transformers' ``decode`` then converts the ids and calls the
    backend, nothing more, at about 3x the cost (5.3 against 1.8 us for SmolLM2, twice per token and request
    on the streaming path)."""
    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    library_methods = (
        getattr(getattr(cls, "decode", None), "__module__", "") == "transformers.tokenization_utils_base"
        and getattr(getattr(cls, "_decode", None), "__module__", "") == "transformers.tokenization_utils_tokenizers"
    )
    if not library_methods or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    return getattr(backend, "decode", None)


class TokenDecoder:
    """Per-tokenizer helpers shared by all requests (not thread-safe for the text cache writes, which are
    idempotent dict stores and therefore harmless)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids: frozenset[int] = special_token_ids(tokenizer)
        self._text_cache: dict[int, str] = {}
        self._backend_decode = backend_decode(tokenizer)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self.special_ids

    def is_special_many(self, ids: Iterable[int]) -> list[bool]:
        sp = self.special_ids
        return [int(i) in sp for i in ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Iterable[int]) -> list[str]:
        """Each id decoded on its own (``skip_special_tokens=False``, no clean-up), as stock does for
        prefill tokens and top-n alternatives. Cached per id."""
        ids = [int(i) for i in ids]
        cache = self._text_cache
        missing = sorted({i for i in ids if i not in cache})
        if missing:
            texts = self.tokenizer.batch_decode(
                [[i] for i in missing], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            cache.update(zip(missing, texts))
        return [cache[i] for i in ids]

    def prefill_texts(self, prompt_ids: Sequence[int]) -> list[str]:
        """``PrefillTokens.texts``: one text per prompt id."""
        return self.token_texts(prompt_ids)

    def new_request(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """One request's streaming detokeniser. Feed generated ids in order with :meth:`step`."""

    __slots__ = ("_dec", "_ids", "_base", "prompt_len", "prefix_offset", "read_offset", "_prefix_text")

    def __init__(self, decoder: TokenDecoder, prompt_ids: Sequence[int]) -> None:
        self._dec = decoder
        self.prompt_len = len(prompt_ids)
        self._base = max(0, self.prompt_len - _PREFIX_WINDOW)  # absolute index of self._ids[0]
        self._ids: list[int] = [int(i) for i in prompt_ids[self._base :]]
        self.prefix_offset = self._base
        self.read_offset = self.prompt_len
        self._prefix_text: str | None = None

    @property
    def generated_ids(self) -> list[int]:
        return self._ids[self.prompt_len - self._base :]

    @property
    def num_generated(self) -> int:
        return len(self._ids) + self._base - self.prompt_len

    def _slice(self, start: int, stop: int | None = None) -> list[int]:
        b = self._base
        return self._ids[start - b : None if stop is None else stop - b]

    def step(self, token_id: int) -> str:
        """Append one generated id; its streaming text (``""`` while a character is incomplete)."""
        self._ids.append(int(token_id))
        if self._prefix_text is None:
            self._prefix_text = self._dec.decode(
                self._slice(self.prefix_offset, self.read_offset), skip_special_tokens=False
            )
        prefix_text = self._prefix_text
        new_text = self._dec.decode(self._slice(self.prefix_offset), skip_special_tokens=False)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ids) + self._base
            self._prefix_text = None
            # Drop ids no longer reachable by prefix_offset, but keep the last prompt id for final_text.
            keep_from = min(self.prefix_offset, max(0, self.prompt_len - 1))
            if keep_from > self._base:
                del self._ids[: keep_from - self._base]
                self._base = keep_from
            return new_text[len(prefix_text) :]
        return ""

    def final_text(self) -> str:
        """The whole completion, ``skip_special_tokens=True``; trailing incomplete characters dropped."""
        generated = self.generated_ids
        if not generated:
            return ""
        anchor = self._slice(self.prompt_len - 1, self.prompt_len) if self.prompt_len > 0 else []
        prefix = self._dec.decode(anchor, skip_special_tokens=True)
        text = self._dec.decode(anchor + generated, skip_special_tokens=True)
        text = text[len(prefix) :] if len(text) > len(prefix) else ""
        return text.rstrip(_REPLACEMENT)
