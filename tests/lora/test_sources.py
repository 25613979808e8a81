"""``LORA_ADAPTERS`` parsing (stock TGI's grammar) and ``adapter_id`` -> adapter index."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.lora.sources import AdapterNames, AdapterSource, parse_lora_adapters


def test_all_three_forms_mixed_with_whitespace() -> None:
    sources = parse_lora_adapters(" org/a ,org/b@v1.2,\tlocal=/tmp/x y/adapter  , org/c ")
    assert sources == (
        AdapterSource("org/a"),
        AdapterSource("org/b", None, "v1.2"),
        AdapterSource("local", Path("/tmp/x y/adapter")),
        AdapterSource("org/c"),
    )
    assert [str(s) for s in sources] == ["org/a", "org/b@v1.2", "local=/tmp/x y/adapter", "org/c"]


@pytest.mark.parametrize("value", [None, "", "   "])
def test_empty_or_unset_is_no_adapters(value: str | None) -> None:
    assert parse_lora_adapters(value) == ()


@pytest.mark.parametrize(
    ("value", "entry"),
    [
        ("org/a,,org/b", "''"),
        ("a=b=c", "a=b=c"),
        ("x@1@2", "x@1@2"),
        ("ok/one,=p", "=p"),
        ("n=", "n="),
        ("@rev", "@rev"),
        ("org/a, org/a@v2", "org/a@v2"),
        ("same=/p1,same=/p2", "same=/p2"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(value: str, entry: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(entry)):
        parse_lora_adapters(value)


def test_duplicate_message_names_the_adapter() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        parse_lora_adapters("dup=/a, dup=/b")


def test_adapter_names_resolve_in_order_and_count_unknown_ids() -> None:
    names = AdapterNames(("org/a", "local"))
    assert names.resolve("org/a") == 1
    assert names.resolve("local") == 2
    assert names.resolve("") == 0 and names.resolve(None) == 0
    assert names.num_unknown == 0
    assert names.resolve("org/missing") == 0
    assert names.resolve("gpt-4o") == 0
    assert names.resolve("org/a@v1") == 0  # the revision is not part of the name
    assert names.num_unknown == 3
    assert [names.name_of(i) for i in range(3)] == [None, "org/a", "local"]


def test_no_adapters_serves_everything_from_the_base_model() -> None:
    names = AdapterNames()
    assert names.resolve("anything") == 0 and names.num_unknown == 1
