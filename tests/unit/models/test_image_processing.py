"""The largest image grid the processor admits: what the engine measures the vision encoder on."""

import itertools

from omnistage.models.qwen3_omni.image_processing import ImageProcessorConfig, image_grid, largest_grid


def test_no_image_resizes_to_more_patches_than_the_largest_grid():
    for cfg in (ImageProcessorConfig(), ImageProcessorConfig(max_pixels=1_000_000)):
        _, h, w = largest_grid(cfg)
        sides = [1, 7, 100, 449, 1080, 1920, 2160, 3583, 3584, 3585, 3840, 9000, 20000]
        most = max(image_grid(a, b, cfg)[1] * image_grid(a, b, cfg)[2] for a, b in itertools.product(sides, sides)
                   if max(a, b) <= 200 * min(a, b))  # fmt: skip
        assert most <= h * w
        assert h * w * cfg.patch_size**2 <= cfg.max_pixels and h % cfg.merge_size == w % cfg.merge_size == 0


def test_the_released_processor_admits_3584_pixels_square():
    assert largest_grid(ImageProcessorConfig()) == (1, 224, 224)  # 50,176 patches, 12,544 Thinker tokens


def test_an_image_past_max_pixels_is_resized_down_and_the_log_says_so(caplog):
    from PIL import Image

    from omnistage.models.qwen3_omni.image_processing import preprocess_image

    cfg = ImageProcessorConfig(max_pixels=64 * 64)
    with caplog.at_level("INFO", logger="omnistage.models.qwen3_omni.image_processing"):
        patches, (_, h, w) = preprocess_image(Image.new("RGB", (200, 100)), cfg)
        preprocess_image(Image.new("RGB", (32, 32)), cfg)
    assert h * w * cfg.patch_size**2 <= cfg.max_pixels and len(patches) == h * w
    (record,) = caplog.records  # the small one is not mentioned
    assert "200x100 is resized to" in record.getMessage() and "max_pixels 4096" in record.getMessage()
