"""A client's image that the processor or PIL refuses is a 400 naming the image on relax-serve (tiny_vl), never a
500 (which the official `openai` client retries twice): an aspect ratio over the image processor's limit (2000x3) and
an image over PIL's pixel limit (a decompression bomb, 14000x14000), through the OpenAI route and `/generate`."""

from __future__ import annotations

import base64
import io
import re
import struct
import zlib

import openai
import pytest
import requests
from PIL import Image


@pytest.fixture(scope="module")
def server(tiny_vl_server):
    return tiny_vl_server


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def _bomb(width: int = 14000, height: int = 14000) -> bytes:
    """A PNG header declaring width x height pixels (PIL refuses it from the header, over its bomb limit)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


CASES = [(_png((2000, 3)), "2000x3 pixels.*aspect ratio"), (_bomb(), "DecompressionBombError"),
         # PIL's message names its in-memory buffer ("<_io.BytesIO object at 0x...>"): the 400 says what was read
         (b"not an image" * 8, r"the data: URL's image: not a readable image \(UnidentifiedImageError: cannot "
                               r"identify image file\)")]


@pytest.mark.parametrize("image,message", CASES, ids=["aspect_ratio", "decompression_bomb", "not_an_image"])
def test_a_refused_image_is_a_400_naming_it(server, image, message):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    parts = [{"type": "image_url", "image_url": {"url": _url(_png((32, 32)))}},
             {"type": "image_url", "image_url": {"url": _url(image)}}, {"type": "text", "text": "what colour?"}]
    # the chat route names the message part (relax.serve.openai.images.naming_parts), /generate the image_data entry
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: .*" + message) as exc:
        client.chat.completions.create(model="tiny_vl", messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "messages[0].content[1]"
    # /generate: the same image, the same 400
    tokenizer_pad = "<|vision_start|><|image_pad|><|vision_end|>"
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": tokenizer_pad * 2 + "what colour?", "image_data": [_url(_png((32, 32))), _url(image)],
        "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and re.search(r"image_data\[1\].*" + message, r.json()["error"]["message"]), r.text
    # the server still answers a good image (the control: the same request with a readable image)
    ok = client.chat.completions.create(model="tiny_vl", max_tokens=2, messages=[{"role": "user", "content": [
        parts[0], {"type": "image_url", "image_url": {"url": _url(_png((40, 24)))}}, parts[2]]}])
    assert ok.usage.prompt_tokens > 0
