"""Images on the wire and in rollouts: decoding data URLs, the size rule's checks of image
tokens, and MicroBatch's image arrays (validation, a round trip through the codec)."""

import base64
import io

import numpy as np
import pytest
from PIL import Image as PILImage
from primerl_protocol import BatchMessage, Decoder, Encoder, MicroBatch, TrainBatch
from primerl_protocol.images import Image, ImageError, ImageSpec, decode_data_url, placeholder_runs, tokens_problem
from primerl_protocol.testing import micro_batch

SPEC = ImageSpec(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=1024 * 1024)
PAD = 7  # the image token in these tests


def data_url(picture: PILImage.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    picture.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_png_data_url_decodes_to_its_rgb_pixels():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)
    image = decode_data_url(data_url(PILImage.fromarray(pixels)))
    assert (image.height, image.width) == (48, 80)
    assert np.frombuffer(image.rgb, np.uint8).reshape(48, 80, 3).tolist() == pixels.tolist()


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://example.com/cat.png", "must be inline"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/<format>;base64"),
        ("data:image/png,rawbytes", "data:image/<format>;base64"),
        ("data:image/png;base64,@@@@", "does not decode"),
        ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not a readable image"),
        (data_url(PILImage.new("RGBA", (32, 32))), "mode RGBA: give RGB"),
        (data_url(PILImage.new("L", (32, 32))), "mode L: give RGB"),
    ],
)
def test_what_cannot_be_read_alike_is_refused_saying_why(url, message):
    with pytest.raises(ImageError, match=message):
        decode_data_url(url)


def test_image_needs_its_bytes():
    with pytest.raises(ValueError, match="needs 12 RGB bytes, got 11"):
        Image(height=2, width=2, rgb=bytes(11))


def test_runs_of_image_tokens_are_found_in_order():
    assert placeholder_runs([1, PAD, PAD, 2, PAD, 3, PAD, PAD, PAD], PAD) == [(1, 2), (4, 1), (6, 3)]
    assert placeholder_runs([1, 2], PAD) == []


def test_image_tokens_are_checked_against_each_images_size():
    # 64 x 96 pixels: 4 x 6 patches of 16, merged 2 x 2 -> 6 tokens; 32 x 32 -> 1 token
    ids = [1] + [PAD] * 6 + [2, 3] + [PAD] + [4]
    assert tokens_problem(ids, [(64, 96), (32, 32)], SPEC, PAD) is None
    assert "2 images but 1 runs" in tokens_problem(ids[:8], [(64, 96), (32, 32)], SPEC, PAD)
    assert "image 2 (64 x 64 pixels) makes 4 image tokens but its run has 1" in tokens_problem(
        ids, [(64, 96), (64, 64)], SPEC, PAD
    )
    assert "image 1: an image of 60 x 96 pixels would be resized to 64 x 96" in tokens_problem(
        ids, [(60, 96), (32, 32)], SPEC, PAD
    )
    assert "0 images but 2 runs" in tokens_problem(ids, [], SPEC, PAD)


def with_images(mb: MicroBatch, sizes, pixels) -> dict:
    return {name: getattr(mb, name) for name in mb.__struct_fields__} | {"image_sizes": sizes, "image_pixels": pixels}


@pytest.mark.parametrize(
    "sizes, pixels, message",
    [
        (np.array([[2, 2]], np.int32), np.zeros(11, np.uint8), "need 12 bytes of pixels but `image_pixels` has 11"),
        (
            np.array([2, 2], np.int32),
            np.zeros(12, np.uint8),
            "must be an int32 array \\[images, 2\\], got int32 \\[2\\]",
        ),
        (np.array([[2, 2]], np.int64), np.zeros(12, np.uint8), "must be an int32 array"),
        (np.array([[0, 2]], np.int32), np.zeros(0, np.uint8), "must all be positive"),
        (np.array([[2, 2]], np.int32), np.zeros(12, np.float32), "must be a 1-D uint8 array"),
    ],
)
def test_inconsistent_images_are_refused_naming_the_field(sizes, pixels, message):
    with pytest.raises(ValueError, match=message):
        MicroBatch(**with_images(micro_batch(), sizes, pixels))


def test_images_travel_as_raw_frames_and_come_back_whole():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, (2, 3, 3), dtype=np.uint8), rng.integers(0, 256, (4, 1, 3), dtype=np.uint8)
    mb = MicroBatch(
        **with_images(
            micro_batch(), np.array([[2, 3], [4, 1]], np.int32), np.concatenate([a.reshape(-1), b.reshape(-1)])
        )
    )
    batch = TrainBatch(step=0, rank=0, num_ranks=1, micro_batches=[mb, micro_batch()], num_loss_tokens=1)
    got = Decoder(BatchMessage, "batches").decode(Encoder().encode(batch))
    first, plain = got.micro_batches
    assert [x.tolist() for x in first.images()] == [a.tolist(), b.tolist()]
    assert plain.image_sizes.shape == (0, 2) and plain.images() == []


def test_a_picture_kept_encoded_gives_the_same_pixels_when_read():
    """SFT holds a dataset's pictures as their files: checked when read, the same pixels when
    a row is built; a file that does not match its recorded size is refused."""
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)
    url = data_url(PILImage.fromarray(pixels))
    kept = decode_data_url(url, keep_encoded=True)
    assert (kept.height, kept.width, kept.rgb) == (32, 64, b"") and kept.encoded.startswith(b"\x89PNG")
    assert kept.pixels() == decode_data_url(url).rgb == pixels.tobytes()
    with pytest.raises(ImageError, match="mode RGBA"):  # checked when read, as the decoded path
        decode_data_url(data_url(PILImage.new("RGBA", (32, 32))), keep_encoded=True)
    with pytest.raises(ValueError, match="an encoded image of 32 x 64 pixels, recorded as 64 x 32"):
        Image(height=64, width=32, encoded=kept.encoded).pixels()
    with pytest.raises(ValueError, match="needs its RGB bytes or its encoded file"):
        Image(height=2, width=2)
