"""LLaVA-NeXT embeddings from the model's own vision path, merged per prefill chunk: the language model
on our merged embeddings gives HF's logits (tiny random model: CLIP tower, Llama LM)."""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from tgi_paged_backend.vision.image_keys import placeholder_positions
from tgi_paged_backend.vision.llava_next_encoder import LlavaNextEncoder, merge_chunk_embeddings

IMAGE_TOKEN = 60
PINPOINTS = [[32, 64], [64, 32], [64, 64]]


@pytest.fixture(scope="module")
def tiny() -> tuple[transformers.PreTrainedModel, object]:
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    config = transformers.LlavaNextConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1, vision_feature_select_strategy="default",
    )  # fmt: skip
    config.vision_config.model_type = "clip_vision_model"
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
    )
    return model, processor


def _image(height: int, width: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(pixels)


@pytest.mark.parametrize("height, width", [(32, 32), (20, 50), (70, 30), (100, 100), (5, 90)])
def test_embedding_count_equals_the_placeholder_rule(tiny, height, width) -> None:
    encoder = LlavaNextEncoder(*tiny)
    (feature,) = encoder.encode([_image(height, width, 1)])
    assert feature.shape == (encoder.token_count(_image(height, width, 1)), tiny[0].config.text_config.hidden_size)


def test_merged_embeddings_give_hfs_logits_and_chunks_cut_inside_images(tiny) -> None:
    model, processor = tiny
    encoder = LlavaNextEncoder(model, processor)
    images = [_image(40, 24, 2), _image(24, 64, 3)]
    counts = [encoder.token_count(im) for im in images]
    ids = [1, 5, 7] + [IMAGE_TOKEN] * counts[0] + [9, 11] + [IMAGE_TOKEN] * counts[1] + [13, 2]
    input_ids = torch.tensor([ids])
    hf_inputs = processor(images, return_tensors="pt")
    with torch.inference_mode():
        expected = model(input_ids=input_ids, pixel_values=hf_inputs["pixel_values"],
                         image_sizes=hf_inputs["image_sizes"]).logits[0]  # fmt: skip
        spans = placeholder_positions(0, ids, IMAGE_TOKEN, counts)
        features = encoder.encode(images)
        token_embeds = model.get_input_embeddings()(input_ids[0])
        full = merge_chunk_embeddings(token_embeds, 0, spans, features)
        got = model(inputs_embeds=full[None]).logits[0]
        torch.testing.assert_close(got, expected)
        # Chunks of 5 positions (cutting inside both images) reassemble to the same embeddings.
        pieces = [merge_chunk_embeddings(token_embeds[s : s + 5], s, spans, features) for s in range(0, len(ids), 5)]
        torch.testing.assert_close(torch.cat(pieces), full)
    assert not torch.equal(full, token_embeds)


def test_chunk_without_images_is_returned_unchanged(tiny) -> None:
    embeds = torch.randn(4, 32)
    assert merge_chunk_embeddings(embeds, 100, [range(0, 10)], [torch.zeros(10, 32)]) is embeds
