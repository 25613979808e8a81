"""Shared fixtures of the runner tests."""

from __future__ import annotations

import pytest

from tests.helpers.family_models import FAMILIES, is_available, write_family_model

FAMILIES_BY_NAME = {family.name: family for family in FAMILIES}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """``family_dir(name)``: a tiny random checkpoint of that family (docs/models.md), written once per module;
    the test is skipped when this transformers lacks the family."""
    made = {}

    def make(name: str):
        family = FAMILIES_BY_NAME[name]
        if not is_available(family):
            pytest.skip(f"{name} is not in this transformers")
        if name not in made:
            made[name] = write_family_model(family, tmp_path_factory.mktemp(name.lower()))
        return made[name]

    return make
