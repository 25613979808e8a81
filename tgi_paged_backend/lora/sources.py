"""``LORA_ADAPTERS`` as the stock launcher passes it, and request ``adapter_id`` to adapter index.

The launcher's ``--lora-adapters`` reaches the shard only as the ``LORA_ADAPTERS`` environment variable:
a comma-separated list whose entries are ``repo/id``, ``repo/id@revision`` or ``name=/local/path`` (mixed
freely; spaces around an entry ignored, as stock). The adapter's *name*, the string requests put in ``adapter_id``,
is ``repo/id`` (without the revision) or ``name``. Adapters get indices 1, 2, ... in list order; index 0 is
the base model, which also serves every ``adapter_id`` that names no loaded adapter (stock behaviour;
:class:`AdapterNames` counts those so an operator sees them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tgi_paged_backend.config import ConfigError

BASE_MODEL_INDEX = 0
"""Adapter index of the base model (no adapter)."""

_ENTRY = re.compile(r"^(?P<name>[^=@]+)(?:=(?P<path>[^@]+))?(?:@(?P<revision>.+))?$")
"""Stock's grammar (``utils/adapter.py``), with at most one ``=`` and one ``@`` per entry."""


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """One ``LORA_ADAPTERS`` entry."""

    name: str
    """What requests name in ``adapter_id``."""
    path: Path | None = None
    """Local directory (``name=/path``); ``None``: the hub repository ``name`` from the local hub cache."""
    revision: str | None = None
    """Hub revision (``repo/id@revision``)."""

    def __str__(self) -> str:
        text = self.name if self.path is None else f"{self.name}={self.path}"
        return text if self.revision is None else f"{text}@{self.revision}"


def parse_lora_adapters(value: str | None) -> tuple[AdapterSource, ...]:
    """The entries of ``LORA_ADAPTERS`` (empty or unset: none); ``ConfigError`` naming a bad entry."""
    if not value or not value.strip():
        return ()
    sources: list[AdapterSource] = []
    for raw in value.split(","):
        entry = raw.strip()
        match = _ENTRY.match(entry) if entry.count("=") <= 1 and entry.count("@") <= 1 else None
        if match is None:
            raise ConfigError(
                f"LORA_ADAPTERS entry {entry!r} is invalid: expected repo/id, repo/id@revision or name=/local/path"
            )
        name, path, revision = (match.group(k) for k in ("name", "path", "revision"))
        source = AdapterSource(name, None if path is None else Path(path), revision)
        if any(s.name == name for s in sources):
            raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: adapter name {name!r} is given twice")
        sources.append(source)
    return tuple(sources)


@dataclass(slots=True)
class AdapterNames:
    """``adapter_id`` -> adapter index, the way stock serves it: a loaded adapter's name gives its index,
    anything else (unknown names, and the OpenAI routes' model names) the base model."""

    names: tuple[str, ...] = ()
    """Adapter names in index order (index ``i + 1`` is ``names[i]``)."""
    num_unknown: int = 0
    """Requests whose non-empty ``adapter_id`` named no loaded adapter (served by the base model). A total,
    not per id: ids are client input (the OpenAI routes send any model name), unbounded as labels."""
    _index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {name: i + 1 for i, name in enumerate(self.names)}

    def resolve(self, adapter_id: str | None) -> int:
        """The index serving ``adapter_id`` (0: the base model); unknown non-empty ids are counted."""
        if not adapter_id:
            return BASE_MODEL_INDEX
        index = self._index.get(adapter_id)
        if index is None:
            self.num_unknown += 1
            return BASE_MODEL_INDEX
        return index

    def name_of(self, index: int) -> str | None:
        """The adapter name of ``index`` (``None`` for the base model)."""
        return None if index == BASE_MODEL_INDEX else self.names[index - 1]
