"""SGLang's `image_data` on `/generate` for the embedded server (`relax.serve.sglang.request`): a vision-language
model's images, one list per input, read and placed into the input's token ids as SGLang's Qwen-VL processor does.

The field's forms (SGLang's `GenerateReqInput._normalize_image_data`): for a request of one input, one image or a
list of that input's images; for a batch, one image for every input, or a list with one entry per input (None, an
image, or a list of images). An image is a `data:image/...;base64,` URL, base64 text, or a file path on the server's
machine (`relax.data.images.load_image`); an http(s) URL is a 400 (nothing is downloaded), and so are SGLang's
`processor_output` / `precomputed_embedding` dicts (not supported here).

Placement, as SGLang's Qwen-VL processor places them: each `<|vision_start|>` + one or more `<|image_pad|>` +
`<|vision_end|>` span of the input (from `input_ids`, or `text` tokenized) takes the next image, and its pads become
as many image tokens as the processor's grid for that image has merged patches. An input whose placeholders are
already expanded (what Relax's own client sends, the ids the trainer scores) comes out unchanged; one with a single
pad per image is expanded. The image tokens then are the processor's count, never the client's: a client that
expanded them differently sees it in `meta_info.prompt_tokens`.
"""

from __future__ import annotations

from typing import Any, Optional

from relax.data.files import DataError
from relax.data.images import IMAGE_PAD, VISION_END, VISION_START, image_token_count, load_image


class ImageInputs:
    """The `image_data` of /generate bodies for one vision-language model's `processor`; `error` is the exception
    class a bad request raises (the codec's 400)."""

    def __init__(self, processor: Any, error: type[Exception]):
        self.processor = processor
        self.error = error
        tok = processor.tokenizer
        self.start, self.pad, self.end = (int(tok.convert_tokens_to_ids(t)) for t in (VISION_START, IMAGE_PAD,
                                                                                       VISION_END))

    def per_input(self, value: Any, n_in: int, single: bool) -> list[Optional[list]]:
        """The images of each of `n_in` inputs (None: none), as SGLang reads the field."""
        if value is None or value == []:
            return [None] * n_in
        if not isinstance(value, list):
            return [[value]] * n_in
        if single and n_in == 1:  # one input: the list holds its images (or, nested, the one entry per input)
            return [value[0] if len(value) == 1 and isinstance(value[0], list) else value]
        if len(value) != n_in:
            raise self.error(f"image_data has {len(value)} entries for {n_in} inputs (one per input: an image, a "
                             "list of images, or null)")
        return [None if v is None or v == [] else v if isinstance(v, list) else [v] for v in value]

    def place(self, prompt: list[int], images: Optional[list], where: str) -> tuple[list[int], Optional[dict]]:
        """(the input's token ids with each image's placeholder expanded to its image tokens, its vision inputs
        {"pixel_values", "image_grid_thw", "image_tokens"} or None without images)."""
        spans = self._spans(prompt)
        if not images:
            if spans or self.pad in prompt:
                raise self.error(f"{where}: the input holds image placeholders ({VISION_START}{IMAGE_PAD}"
                                 f"{VISION_END}) but no image_data")
            return prompt, None
        if len(spans) != len(images):
            raise self.error(f"{where}: image_data has {len(images)} images but the input holds {len(spans)} image "
                             f"placeholders ({VISION_START}{IMAGE_PAD}...{VISION_END}): one per image")
        pil = [self._load(v, f"{where} image_data[{k}]") for k, v in enumerate(images)]
        out = self._process(pil, where)
        grid = out["image_grid_thw"].long().contiguous()
        merge = int(self.processor.image_processor.merge_size)
        counts = (grid.prod(-1) // (merge * merge)).tolist()
        ids: list[int] = []
        at = 0
        for (s, e), n in zip(spans, counts, strict=True):  # s: the first pad, e: the vision_end
            ids += prompt[at:s] + [self.pad] * int(n)
            at = e
        ids += prompt[at:]
        vision = {"pixel_values": out["pixel_values"].float().contiguous(), "image_grid_thw": grid,
                  "image_tokens": image_token_count(self.processor, grid)}
        return ids, vision

    def _process(self, pil: list, where: str) -> Any:
        """The image processor's output for an input's images; a 400 naming the image it refuses (an aspect ratio
        over its limit, a size it cannot resize), never a 500."""
        try:
            return self.processor.image_processor(images=pil, return_tensors="pt")
        except ValueError as exc:
            bad = 0
            for k, image in enumerate(pil):  # which image: each alone
                try:
                    self.processor.image_processor(images=[image], return_tensors="pt")
                except ValueError:
                    bad = k
                    break
            raise self.error(f"{where} image_data[{bad}]: the image processor refuses the image "
                             f"({image_size(pil[bad])}): {exc}") from None

    def _spans(self, prompt: list[int]) -> list[tuple[int, int]]:
        """(first pad, vision_end) of each vision_start, pad+, vision_end span."""
        spans, i = [], 0
        while i < len(prompt):
            if prompt[i] == self.start and i + 1 < len(prompt) and prompt[i + 1] == self.pad:
                j = i + 1
                while j < len(prompt) and prompt[j] == self.pad:
                    j += 1
                if j < len(prompt) and prompt[j] == self.end:
                    spans.append((i + 1, j))
                    i = j
            i += 1
        return spans

    def _load(self, value: Any, where: str) -> Any:
        if isinstance(value, dict) and value.get("format") in ("processor_output", "precomputed_embedding"):
            raise self.error(f"{where}: format={value['format']!r} is not supported by the embedded server; send the "
                             "image itself (a data: URL, base64 or a file path)")
        if not isinstance(value, str):
            raise self.error(f"{where}: an image is a data: URL, base64 text or a file path, got "
                             f"{type(value).__name__}")
        try:
            return load_image(value, where)
        except DataError as exc:
            raise self.error(str(exc)) from None


def image_size(image: Any) -> str:
    return f"{image.width}x{image.height} pixels"

