"""Pixtral's processor (Mistral 3's vision models) in the gateway, where
transformers' own needs PyTorch. Its image processor (transformers' PIL one)
resizes each image within the longest edge in whole token cells and pads a
request's images to one size; here each image placeholder of the prompt
becomes the image's rows of image tokens, a break token between rows and an
end token after the last."""

from __future__ import annotations

from typing import Any

import numpy as np


class PixtralProcessor:
    def __init__(self, image_processor: Any, tokenizer: Any, settings: dict, chat_template: str | None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # A token covers a cell of patches merged spatial_merge_size x spatial_merge_size.
        self.cell = settings.get("patch_size", 16) * settings.get("spatial_merge_size", 1)
        self.image_token = settings.get("image_token", "[IMG]")
        self.break_token = settings.get("image_break_token", "[IMG_BREAK]")
        self.end_token = settings.get("image_end_token", "[IMG_END]")

    def __call__(self, text: list[str], images: list, return_tensors: str = "np",
                 add_special_tokens: bool = False) -> dict[str, np.ndarray]:
        """The prompt's token ids with each placeholder expanded, the images'
        pixels (padded to the largest) and each image's size before padding."""
        (prompt,) = text
        out = self.image_processor(images, patch_size={"height": self.cell, "width": self.cell}, return_tensors="np")
        sizes = out["image_sizes"].tolist()
        parts = prompt.split(self.image_token)
        if len(parts) - 1 != len(sizes):
            raise ValueError(f"the prompt has {len(parts) - 1} image placeholders for {len(sizes)} images")
        expanded = parts[0] + "".join(self._image_tokens(h, w) + rest for (h, w), rest in zip(sizes, parts[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": np.array([ids]), "pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}

    def _image_tokens(self, height: int, width: int) -> str:
        row = self.image_token * (width // self.cell)
        return self.break_token.join([row] * (height // self.cell)) + self.end_token
