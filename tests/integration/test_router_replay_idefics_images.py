"""The router replay's Idefics3 and Idefics2 image counts (issue 40): stock's router rules
(``router/src/validation.rs`` ``image_tokens`` / ``image_tokens_fixup``), a table per family. Idefics3's is a
budget (SmolVLM's defaults hardcoded: 1456 px longest edge, 364 px tiles, 169 tokens each); Idefics2's is 64
per image, five times with ``do_image_splitting`` in an ``Idefics2Processor`` preprocessor config, touching
separators collapsed over the whole text."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from integration.router_replay.datatypes import GenerateParameters
from integration.router_replay.fake_shard import CharTokenizer
from integration.router_replay.image_tokens import FAKE, IMAGE, idefics3_grid, idefics3_text
from integration.router_replay.images import placeholder_rule
from integration.router_replay.validation import ValidationLimits, Validator


def _uri(height: int, width: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 10)).save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def _input_length(inputs: str, rule) -> int:
    limits = ValidationLimits(max_input_tokens=80_000, max_total_tokens=90_000)
    valid = asyncio.run(Validator(CharTokenizer(), limits, rule).validate(inputs, GenerateParameters(max_new_tokens=4)))
    return valid.input_length


@pytest.mark.parametrize(
    ("height", "width", "grid"),
    [(640, 640, (4, 4)), (480, 640, (3, 4)), (100, 50, (4, 2)), (4000, 100, (4, 1)), (20, 20, (4, 4)),
     (364, 364, (4, 4)), (300, 1200, (1, 4))],
)  # fmt: skip
def test_idefics3_grid_is_stocks(height, width, grid) -> None:
    """Every image is first scaled so its longest edge is 1456 (small ones up too), so it is always split."""
    assert idefics3_grid(height, width) == grid
    text = idefics3_text(height, width)
    rows, cols = grid
    assert text.count(IMAGE) == 169 * (rows * cols + 1) and text.count(FAKE) == rows * cols + 2
    assert text.count("\n") == rows + 1 and f"<row_{rows}_col_{cols}>" in text and text.endswith(f"{IMAGE}{FAKE}")


def test_idefics3_input_length_counts_the_budget() -> None:
    rule = placeholder_rule(SimpleNamespace(model_type="idefics3"))
    length = _input_length(f"a ![]({_uri(480, 640)}) b", rule)
    assert length == 1 + len("a  b") + len(idefics3_text(480, 640))  # one char token each + BOS


@pytest.mark.parametrize(("preprocessor", "crops"), [
    (None, 1), ({"processor_class": "Idefics2Processor", "do_image_splitting": False}, 1),
    ({"processor_class": "Idefics2Processor", "do_image_splitting": True}, 5),
    ({"do_image_splitting": True}, 1),  # no processor_class: stock's router reads no preprocessor config
])  # fmt: skip
def test_idefics2_counts_and_collapses_touching_separators(preprocessor, crops) -> None:
    rule = placeholder_rule(SimpleNamespace(model_type="idefics2"), preprocessor)
    one = rule(30, 40)
    assert one.count(IMAGE) == 64 * crops and one.count(FAKE) == 2 * crops
    two_adjacent = _input_length(f"x![]({_uri(30, 40)})![]({_uri(50, 10)})", rule)
    # <fake><fake> collapse inside each image's crops and between the two images
    assert two_adjacent == 1 + 1 + 2 * 64 * crops * len(IMAGE) + (2 * crops + 1) * len(FAKE)


def test_smolvlm_type_and_text_models_keep_images_as_text() -> None:
    """Stock's router ``Config`` has no ``smolvlm``: its images stay text there (SmolVLM v1 is ``idefics3``)."""
    assert placeholder_rule(SimpleNamespace(model_type="smolvlm")) is None
    assert placeholder_rule(SimpleNamespace(model_type="mistral")) is None


@pytest.mark.parametrize(("height", "width"), [(20, 20), (480, 640), (4000, 100)])
def test_gemma3_counts_stocks_256_soft_tokens_per_image(height, width) -> None:
    """Stock's router hardcodes 256 soft tokens between ``\\n\\n<start_of_image>`` and ``<end_of_image>\\n\\n``,
    whatever the image's size (the shard counts the config's ``mm_tokens_per_image``, 256 when released)."""
    rule = placeholder_rule(SimpleNamespace(model_type="gemma3"))
    text = rule(height, width)
    assert text == "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    assert _input_length(f"a ![]({_uri(height, width)}) b", rule) == 1 + len("a  b") + len(text)


@pytest.mark.parametrize(("height", "width"), [(20, 20), (480, 640)])
def test_paligemma_counts_num_image_tokens(height, width) -> None:
    rule = placeholder_rule(SimpleNamespace(model_type="paligemma", text_config=SimpleNamespace(num_image_tokens=16)))
    assert rule(height, width) == IMAGE * 16
    assert _input_length(f"![]({_uri(height, width)})caption en", rule) == 1 + 16 * len(IMAGE) + len("caption en")
