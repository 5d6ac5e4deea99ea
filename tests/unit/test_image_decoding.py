"""Images as the processors get them: upright, 8-bit RGB, transparency on white."""

import contextlib
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from gateway.errors import APIError
from gateway.images import ImageLoader
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
