"""OpenAI image content parts (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`) in the chat
messages of a vision-language model served by relax-serve (`relax.serve.openai.service`).

Each image part becomes the Qwen-VL family's image placeholder (`<|vision_start|><|image_pad|><|vision_end|>`, what
its chat template renders for an image part) in the message's text, and its URL goes to the engine as SGLang's
`image_data`, in the order of the parts; the engine (`relax.serve.sglang.images`) reads the images and expands each
placeholder into the processor's number of image tokens. A URL is a `data:image/...;base64,` URL, base64 text or a
file path on the server's machine; nothing is downloaded (an http(s) URL is a 400 from the engine).
"""

from __future__ import annotations

import re
from typing import Any

from relax.data.images import IMAGE_PAD, VISION_END, VISION_START
from relax.serve.openai.protocol import APIError

PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
_IMAGE_DATA = re.compile(r"(?:input \d+ )?image_data\[(\d+)\]")


def take_images(body: Any) -> tuple[Any, list[str], list[str]]:
    """(`body` with each image part of its messages replaced by a text part holding `PLACEHOLDER`, the image URLs in
    order, where each came from: `messages[i].content[j]`, what an error about the engine's `image_data[k]` names);
    `body` itself when it has none. APIError (400) naming a malformed part."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return body, [], []
    urls: list[str] = []
    places: list[str] = []
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
                places.append(f"messages[{i}].content[{j}]")
                parts.append({"type": "text", "text": PLACEHOLDER})
            else:
                parts.append(part)
        if len(parts) > 1 and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                  for p in parts) and any(p["text"] == PLACEHOLDER for p in parts):
            # a message with an image: its parts one text, written as the processor's chat template writes them (no
            # separator), not joined by newlines as the text parts of a text-only message are
            parts = [{"type": "text", "text": "".join(p["text"] for p in parts)}]
        out.append({**m, "content": parts})
    return ({**body, "messages": out}, urls, places) if urls else (body, [], [])


def naming_parts(exc: APIError, places: list[str]) -> APIError:
    """The engine's 400 `exc` for a request whose k-th image came from `places[k]` (`take_images`): where it names
    `image_data[k]` (`relax.serve.sglang.images`: "input 0 image_data[1]: ..."), the same 400 naming that message part
    instead, its `param` too; else `exc` itself."""
    found = _IMAGE_DATA.search(str(exc))
    if exc.status != 400 or exc.param is not None or found is None or int(found.group(1)) >= len(places):
        return exc
    part = places[int(found.group(1))]
    return APIError(_IMAGE_DATA.sub(part, str(exc), count=1), param=part, kind=exc.kind, code=exc.code)
