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
