"""Qwen-VL checkpoints of the real architectures, written as Hugging Face directories for `model.path` (nothing is
downloaded): the published configs of Qwen2.5-VL-3B-Instruct and Qwen3-VL-2B-Instruct (their config.json and
preprocessor_config.json, written out here), built from config with random weights, at their real size (tests/gpu)
or sized down (fewer layers, smaller widths) with every structural choice of the real one kept: vision patch size,
spatial merge, temporal patch, window attention with its full-attention blocks (Qwen2.5-VL), the learned position
grid and the deepstack layers (Qwen3-VL), the head dimension and the mrope sections, GQA, tied embeddings, the
vocabulary size and the special token ids.

The tokenizer: the 256 byte symbols (byte-level, no merges: every text encodes and decodes losslessly), filler
entries up to Qwen's 151643 base tokens (never produced by encoding), then the family's special tokens in their
order, so that each has its real id (`<|im_end|>` 151645, `<|image_pad|>` 151655, ...), and the family's chat
template (the Instruct models' template, as their tokenizer_config.json / chat_template.json ship it).
"""

# ruff: noqa: E501  (the templates keep the lines they ship with)
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------------------------ published configs
# Qwen/Qwen2.5-VL-3B-Instruct config.json (the fields transformers reads)
QWEN2_5_VL_3B = {
    "model_type": "qwen2_5_vl",
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "use_sliding_window": False, "vocab_size": 151936,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
# Qwen/Qwen2.5-VL-3B-Instruct preprocessor_config.json
QWEN2_5_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# Qwen/Qwen3-VL-2B-Instruct config.json
QWEN3_VL_2B = {
    "model_type": "qwen3_vl", "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": True,
    "text_config": {"attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
                    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
                    "max_position_embeddings": 262144, "num_attention_heads": 16, "num_hidden_layers": 28,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 5000000,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "tie_word_embeddings": True, "vocab_size": 151936},
    "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1024, "in_channels": 3, "intermediate_size": 4096, "num_heads": 16,
                      "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
}
# Qwen/Qwen3-VL-2B-Instruct preprocessor_config.json
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}

# Sized down: fewer layers and narrower, the structural choices kept (head_dim 128 for the mrope sections, GQA,
# window attention with full-attention blocks every other block, 3 deepstack layers fed into the first 3 text layers)
SMALL = {
    "qwen2_5_vl": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "num_hidden_layers": 2, "max_position_embeddings": 4096,
                   "vision_config": {"depth": 4, "hidden_size": 160, "intermediate_size": 256, "num_heads": 2,
                                     "out_hidden_size": 256, "fullatt_block_indexes": [1, 3]}},
    "qwen3_vl": {"text_config": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "num_hidden_layers": 3, "max_position_embeddings": 4096},
                 "vision_config": {"depth": 6, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2,
                                   "out_hidden_size": 128, "deepstack_visual_indexes": [1, 3, 5]}},
}
REAL = {"qwen2_5_vl": QWEN2_5_VL_3B, "qwen3_vl": QWEN3_VL_2B}
PREPROCESSOR = {"qwen2_5_vl": QWEN2_5_VL_PREPROCESSOR, "qwen3_vl": QWEN3_VL_PREPROCESSOR}
CONF = {"qwen2_5_vl": "qwen2_5_vl_3b", "qwen3_vl": "qwen3_vl_2b"}  # conf/model/<name>.yaml

# ------------------------------------------------------------------------------------------------ tokenizers
QWEN_BASE_VOCAB = 151643  # Qwen2/2.5/3 tokenizers: byte-level BPE entries, then the special tokens
QWEN2_5_VL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                      "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                      "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                      "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                      "<|repo_name|>", "<|file_sep|>"]
# Qwen3's tokenizer adds these after Qwen2.5's (151665..151668)
QWEN3_VL_SPECIAL = QWEN2_5_VL_SPECIAL + ["<tool_response>", "</tool_response>", "<think>", "</think>"]
# not special in the real tokenizers (an agent loop reads them as text)
_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

# Qwen2-VL / Qwen2.5-VL-Instruct chat template (chat_template.json)
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)

_VISION_PARTS = """{%- for content in CONTENT %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}"""
# Qwen3-VL-Instruct chat template (chat_template.json of the Instruct checkpoints)
QWEN3_VL_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            """ + _VISION_PARTS.replace("CONTENT", "message.content") + """
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            """ + _VISION_PARTS.replace("CONTENT", "message.content") + """
        {%- endif %}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
TEMPLATES = {"qwen2_5_vl": QWEN2_5_VL_TEMPLATE, "qwen3_vl": QWEN3_VL_TEMPLATE}
SPECIAL = {"qwen2_5_vl": QWEN2_5_VL_SPECIAL, "qwen3_vl": QWEN3_VL_SPECIAL}


def qwen_vl_tokenizer(arch: str) -> Any:
    """A byte-level tokenizer with Qwen's layout: 151643 base entries (the 256 byte symbols, then fillers that
    encoding never produces), then `arch`'s special tokens at their real ids, and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({f"fill{i}": i for i in range(len(alphabet), QWEN_BASE_VOCAB)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for text in SPECIAL[arch]:  # one at a time, in order: ids QWEN_BASE_VOCAB, +1, ...
        tok.add_tokens([AddedToken(text, special=text not in _NOT_SPECIAL, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = TEMPLATES[arch]
    return fast


# ------------------------------------------------------------------------------------------------ configs, directories
def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def vl_config(arch: str, real_size: bool = False) -> Any:
    """The transformers config of `arch`'s published checkpoint, sized down unless `real_size`."""
    from transformers import AutoConfig

    fields = REAL[arch] if real_size else _merge(REAL[arch], SMALL[arch])
    fields = copy.deepcopy(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return config


PROCESSOR_CLASS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def _update_json(path: Path, **fields: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))


def write_vl_dir(path: Path, arch: str, *, real_size: bool = False, seed: int = 0, device: str = "cpu",
                 dtype: Any = None) -> Path:
    """An HF directory of `arch` (random weights from `vl_config` under `seed`), its image processor with the
    published settings, the Qwen-layout tokenizer and the chat template: loadable by `model.path` offline."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = vl_config(arch, real_size)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype or torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    Qwen2VLImageProcessorPil(**PREPROCESSOR[arch]).save_pretrained(str(path))
    tokenizer = qwen_vl_tokenizer(arch)
    tokenizer.save_pretrained(str(path))
    # the class names the published files carry, so that AutoProcessor / AutoTokenizer of other versions (a real
    # SGLang server's transformers) read the directory as they read the checkpoint
    _update_json(path / "preprocessor_config.json", processor_class=PROCESSOR_CLASS[arch])
    _update_json(path / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATES[arch]}))
    return path
