"""Images as the processors get them: upright, 8-bit RGB, transparency on white."""

import asyncio
import base64
import contextlib
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from gateway.errors import APIError
from gateway.images import ImageLoader, ImageSource
from gateway.settings import GatewaySettings


def decoded(image: Image.Image, fmt: str = "PNG", **save) -> Image.Image:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return ImageLoader(GatewaySettings())._decode(out.getvalue(), "image")


def test_transparent_pixels_come_out_white():
    """A logo's transparent background holds some colour (here red); transformers shows it white."""
    image = decoded(Image.new("RGBA", (4, 4), (255, 0, 0, 0)))
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)
    half = decoded(Image.new("LA", (4, 4), (0, 128)))
    assert half.getpixel((0, 0)) == (127, 127, 127)


def test_a_photo_is_turned_as_its_exif_says():
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° to view
    assert decoded(Image.new("RGB", (20, 10)), "JPEG", exif=exif).size == (10, 20)


def test_exif_that_cannot_be_rewritten_leaves_the_image_as_it_is():
    """A tag of the wrong type (ResolutionUnit as text) beside the orientation: Pillow fails to rewrite
    the EXIF while turning the image; the image is taken unturned, not a 500."""
    entries = struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0) + struct.pack("<HHI", 0x0128, 2, 4) + b"abc\0"
    raw = b"Exif\0\0II*\0" + struct.pack("<IH", 8, 2) + entries + struct.pack("<I", 0)
    assert decoded(Image.new("RGB", (20, 10)), "JPEG", exif=raw).size == (20, 10)


def test_gif_avif_and_base64_as_encoders_wrap_it():
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = decoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert gif.mode == "RGB" and gif.getpixel((0, 0)) == (255, 0, 0)  # an animation's first frame
    assert decoded(frames[1], "AVIF").size == (8, 8)
    out = io.BytesIO()
    frames[0].save(out, "PNG")
    wrapped = base64.encodebytes(out.getvalue()).decode()  # a line break every 76 characters
    assert "\n" in wrapped and ImageLoader(GatewaySettings())._base64(wrapped, "image") == out.getvalue()
    # Line breaks are not the image's bytes: an image of exactly the limit, wrapped, was a 413.
    photo = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(photo, "PNG")
    at_limit = ImageLoader(GatewaySettings(max_image_bytes=len(photo.getvalue())))
    assert at_limit._base64(base64.encodebytes(photo.getvalue()).decode(), "image") == photo.getvalue()


def test_an_image_too_thin_for_its_processor_is_refused():
    """CLIP's processor scales the short side up: 100000x1 would be an array of a hundred gigabytes."""
    with pytest.raises(APIError, match="200 times") as refused:
        decoded(Image.new("RGB", (1001, 5)))
    assert refused.value.status == 400
    assert decoded(Image.new("RGB", (1000, 5))).size == (1000, 5)


def test_sixteen_bit_greys_are_scaled_not_clipped():
    grey = Image.fromarray(np.full((4, 4), 32768, np.uint16))
    assert grey.mode == "I;16"
    assert decoded(grey).getpixel((0, 0)) == (128, 128, 128)


def test_a_slow_image_download_ends_at_its_deadline():
    """The request gets its 400 at the deadline; the thread reading the image must stop then
    too (it shares the executor with tokenizing and image work), not read on a byte at a time."""
    class Drip(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(50):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    loader = ImageLoader(GatewaySettings(allow_image_hosts=["127.0.0.1"], image_fetch_timeout_s=0.5))
    started = time.monotonic()
    try:
        with pytest.raises(APIError, match="did not arrive within"):
            loader._download(f"http://127.0.0.1:{server.server_address[1]}/a.png", 0.5, "image")
    finally:
        server.shutdown()
    assert time.monotonic() - started < 2


def test_a_data_url_in_capitals_is_one_too():
    """A URL's scheme means the same in any case (RFC 3986): `DATA:` was refused as no inline image."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(out, "PNG")
    url = "DATA:image/png;BASE64," + base64.b64encode(out.getvalue()).decode()
    assert asyncio.run(ImageLoader(GatewaySettings())._bytes(ImageSource("image", url=url))) == out.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """What opening a PNG reads (its signature, its header, the start of its pixels): a size, and no pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + \
        chunk(b"IDAT", b"")


def test_the_pixel_limit_is_the_servers_not_pillows(monkeypatch):
    """Past twice its own limit (179M pixels) Pillow refused the image as it opened it, whatever the
    server's --max-image-pixels, with a 413 naming that one as the limit passed."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # the loader raises it: for this test only
    loader = ImageLoader(GatewaySettings(max_image_pixels=400_000_000))
    with pytest.raises(APIError) as refused:
        loader._decode(_png_header(20_000, 15_000), "image")  # 300M pixels, within the limit: no pixels to read
    assert refused.value.status == 400 and "corrupt or truncated" in refused.value.message
    with pytest.raises(APIError) as too_large:
        loader._decode(_png_header(25_000, 20_000), "image")
    assert too_large.value.status == 413 and "25000x20000 pixels" in too_large.value.message
