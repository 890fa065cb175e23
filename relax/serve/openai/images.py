"""OpenAI image content parts (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`) in the chat
messages of a vision-language model served by relax-serve (`relax.serve.openai.service`).

Each image part becomes the Qwen-VL family's image placeholder (`<|vision_start|><|image_pad|><|vision_end|>`, what
its chat template renders for an image part) in the message's text, and its URL goes to the engine as SGLang's
`image_data`, in the order of the parts; the engine (`relax.serve.sglang.images`) reads the images and expands each
placeholder into the processor's number of image tokens. A URL is a `data:image/...;base64,` URL, base64 text or a
file path on the server's machine; nothing is downloaded (an http(s) URL is a 400 from the engine).
"""

from __future__ import annotations

from typing import Any

from relax.data.images import IMAGE_PAD, VISION_END, VISION_START
from relax.serve.openai.protocol import APIError

PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END


def take_images(body: Any) -> tuple[Any, list[str]]:
    """(`body` with each image part of its messages replaced by a text part holding `PLACEHOLDER`, the image URLs in
    order); `body` itself when it has none. APIError (400) naming a malformed part."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return body, []
    urls: list[str] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise APIError(f"messages[{i}].content[{j}]: an image_url part needs "
                                   "{'image_url': {'url': 'data:image/png;base64,...'}}",
                                   param=f"messages[{i}].content[{j}]")
                urls.append(url)
                parts.append({"type": "text", "text": PLACEHOLDER})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return ({**body, "messages": out}, urls) if urls else (body, [])
