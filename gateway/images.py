"""Image inputs: where they may come from, how large they may be, and decoding.

Images come inline (OpenAI `data:` URLs, Anthropic base64 sources) or, only
for hosts named by --allow-image-hosts, from http(s) URLs the gateway fetches
itself, with a size and a time limit and no redirects. Local files are never
read. Only PNG, JPEG, WebP, GIF and AVIF are decoded (an animation's first
frame), and an image's dimensions are checked from its header before its
pixels are.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
from PIL import Image, ImageOps

from gateway.errors import APIError
from gateway.settings import GatewaySettings

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "AVIF")
# Wider than this (either way) is refused: processors that scale the shorter
# side up to their size (CLIP's, LLaVA's) would make a 100000x1 image of a few
# hundred bytes an array of a hundred gigabytes. Qwen's processors refuse 200:1.
MAX_ASPECT_RATIO = 200
_DATA_URL = re.compile(r"data:[^,]*;base64,(?P<data>.*)", re.S | re.I)  # the media type is not trusted: decoding decides
# Image URLs fetched at once; more wait their turn (within their timeout).
FETCH_THREADS = 32
# Images decoded at once (half the cores, two at least), in threads of their own: a large one takes a core and
# hundreds of MB for a second or more, and in the event loop's shared pool a few requests of them held up every
# long prompt's tokenizing.
DECODE_THREADS = max(2, (os.cpu_count() or 2) // 2)
# In place of an image in a tool's result, whose image chat templates do not take.
IMAGE_LEFT_OUT = "[an image, left out: this server passes no images in a tool's result to the model]"


@dataclass
class ImageSource:
    """One image of a request, as the client gave it."""

    param: str  # where it is in the request, for error messages
    data: str | None = None  # base64
    url: str | None = None  # data: or http(s)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} not followed", headers, fp)


_opener = urllib.request.build_opener(_NoRedirects)


class ImageLoader:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.allowed_hosts = {h.lower() for h in settings.allow_image_hosts}
        # Threads of their own: a host that never answers holds a fetch's thread
        # past its timeout (a name lookup has none), and in the event loop's
        # shared pool that held up every request's tokenizing and decoding.
        self._fetchers = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="mlxd-image-fetch")
        self._decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="mlxd-image-decode")
        # Pillow refuses an image past twice its own limit as it opens it: never one within the server's.
        Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, settings.max_image_pixels)

    async def load(self, sources: list[ImageSource]) -> list[Image.Image]:
        """The request's images, decoded; a 400 or 413 naming the first that
        breaks a rule."""
        s = self.settings
        if len(sources) > s.max_images_per_request:
            raise APIError(400, f"the request has {len(sources)} images; this server takes at most "
                                f"{s.max_images_per_request} per request", param=sources[-1].param,
                           code="too_many_images")
        blobs = await asyncio.gather(*(self._bytes(source) for source in sources))
        total = sum(len(b) for b in blobs)
        if total > s.max_request_image_bytes:
            raise APIError(413, f"the request's images hold {total} bytes; this server takes at most "
                                f"{s.max_request_image_bytes} per request", code="image_too_large")
        # One image a job: a request whose client has left (its task cancelled) decodes no more of them.
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(self._decoders, self._decode, blob, source.param)
                for blob, source in zip(blobs, sources)]

    async def _bytes(self, source: ImageSource) -> bytes:
        if source.data is not None:
            return self._base64(source.data, source.param)
        url = source.url or ""
        if url[:5].lower() == "data:":  # a scheme's case means nothing (RFC 3986), as http's does below
            match = _DATA_URL.fullmatch(url)
            if match is None:
                raise APIError(400, "a data: URL for an image must be base64 (data:image/png;base64,...)",
                               param=source.param, code="invalid_image_url")
            return self._base64(match["data"], source.param)
        try:
            scheme = urlsplit(url).scheme.lower()
        except ValueError:  # a bracketed host that is no IPv6 address
            raise APIError(400, "the image URL is not a valid URL", param=source.param,
                           code="invalid_image_url") from None
        if scheme in ("http", "https"):
            fetched = await self._fetch(url, source.param)
            # Kept as the image itself: a stored conversation (the Responses API's) shows its next turns the
            # image its first was shown, without fetching it again (it may have changed, or gone).
            source.data, source.url = base64.b64encode(fetched).decode(), None
            return fetched
        raise APIError(400, "an image must be inline (a data: URL or base64) or an http(s) URL of an allowed "
                            "host; this server never reads local files", param=source.param, code="invalid_image_url")

    def _base64(self, data: str, param: str) -> bytes:
        limit = self.settings.max_image_bytes
        # Line breaks are what `base64` and MIME encoders write every 76 characters: not counted against
        # the limit. (Split and joined: a regular expression's pass took 1.5 ms for a 200 KB image, on
        # the event loop.)
        data = "".join(data.split())
        if len(data) * 3 // 4 > limit + 3:
            raise APIError(413, f"an image is larger than this server's limit of {limit} bytes", param=param,
                           code="image_too_large")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "the image is not valid base64", param=param, code="invalid_image") from None
        if len(raw) > limit:
            raise APIError(413, f"an image is larger than this server's limit of {limit} bytes", param=param,
                           code="image_too_large")
        return raw

    async def _fetch(self, url: str, param: str) -> bytes:
        parts = urlsplit(url)
        if "@" in parts.netloc or "%" in parts.netloc:
            # What urllib connects to would then be the whole netloc, not the host checked below.
            raise APIError(400, "image URLs may not carry credentials or escapes in their host", param=param,
                           code="image_host_not_allowed")
        host = (parts.hostname or "").lower()
        try:
            port = parts.port
        except ValueError:
            raise APIError(400, "the image URL's port is not a port", param=param, code="invalid_image_url") from None
        # A host allowed alone is allowed on its scheme's own port: not every service it runs.
        on_its_port = host in self.allowed_hosts and port in (None, {"http": 80, "https": 443}.get(parts.scheme))
        if not on_its_port and parts.netloc.lower() not in self.allowed_hosts:
            raise APIError(400, f"image URLs of host {host!r} are not allowed on this server "
                                "(see --allow-image-hosts); send the image inline instead", param=param,
                           code="image_host_not_allowed")
        timeout = self.settings.image_fetch_timeout_s
        try:
            fetch = asyncio.get_running_loop().run_in_executor(self._fetchers, self._download, url, timeout, param)
            return await asyncio.wait_for(fetch, timeout)
        except TimeoutError:
            raise APIError(400, f"the image at {url} did not arrive within {timeout:g}s", param=param,
                           code="image_fetch_failed") from None

    def _download(self, url: str, timeout: float, param: str) -> bytes:
        """The image's bytes, read as they come until the deadline: the caller
        stops waiting then, and so does this thread (the socket's own timeout
        is per read: a server sending a byte at a time would hold it)."""
        limit = self.settings.max_image_bytes
        deadline = time.monotonic() + timeout
        chunks: list[bytes] = []
        late = False
        try:
            with _opener.open(urllib.request.Request(url, headers={"User-Agent": "mlxd"}), timeout=timeout) as r:
                length = r.headers.get("Content-Length", "")
                while (size := sum(map(len, chunks))) <= limit:
                    if not (chunk := r.read1(min(1 << 16, limit + 1 - size))):
                        break
                    chunks.append(chunk)
                    if time.monotonic() >= deadline:  # late, unless that was the last of it
                        late = not length.isdigit() or size + len(chunk) < int(length)
                        break
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise APIError(400, f"could not fetch the image at {url}: {e}", param=param,
                           code="image_fetch_failed") from None
        if late:
            raise APIError(400, f"the image at {url} did not arrive within {timeout:g}s", param=param,
                           code="image_fetch_failed")
        data = b"".join(chunks)
        if len(data) > limit:
            raise APIError(413, f"the image at {url} is larger than this server's limit of {limit} bytes",
                           param=param, code="image_too_large")
        return data

    def _decode(self, data: bytes, param: str) -> Image.Image:
        limit = self.settings.max_image_pixels
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError:
            raise APIError(413, f"the image has more than this server's limit of {limit} pixels", param=param,
                           code="image_too_large") from None
        except (OSError, SyntaxError, ValueError):
            raise APIError(400, "the image is not a readable PNG, JPEG, WebP, GIF or AVIF image", param=param,
                           code="invalid_image") from None
        width, height = image.size
        if width * height > limit:
            raise APIError(413, f"the image is {width}x{height} pixels; this server takes at most {limit} pixels "
                                "per image", param=param, code="image_too_large")
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise APIError(400, f"the image is {width}x{height} pixels; this server takes images at most "
                                f"{MAX_ASPECT_RATIO} times as wide as high, or as high as wide", param=param,
                           code="invalid_image")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError):
            raise APIError(400, "the image is corrupt or truncated", param=param, code="invalid_image") from None
        try:
            upright = ImageOps.exif_transpose(image)  # a phone's photo, upright as its EXIF says
        except Exception:  # EXIF that Pillow cannot rewrite (a tag of a wrong type): the image as it is
            upright = image
        return _rgb(upright)


def _rgb(image: Image.Image) -> Image.Image:
    """The image in 8-bit RGB, as processors take it: 16-bit greys scaled
    (a plain conversion clips them to white), transparent pixels on white (as
    transformers' own conversion does; a plain one shows the colour they hold,
    often black)."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L"):
        image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert("RGB")
