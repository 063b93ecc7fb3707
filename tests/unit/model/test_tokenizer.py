"""Tokenizer wrapper: BOS rule, chat template, digest, and the incremental detokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.errors import ModelConfigError, ModelFileMissing
from pdserve.model.tokenizer import Tokenizer

MULTIBYTE = ["café au lait", "naïve résumé", "中文字符测试", "emoji 🙂🚀 and ünïcödé", "€100 – ok"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def _copy(src: Path, dst: Path, **config_changes: object) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_round_trip_and_bos_once(tokenizer: Tokenizer) -> None:
    for text in ["The quick brown fox jumps over the lazy dog.", *MULTIBYTE]:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id == 0
        assert ids.count(0) == 1
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.eos_token_ids == (1,)
    assert tokenizer.decode([0, *tokenizer.encode("hi", False), 1], skip_special_tokens=False) == (
        "<s>hi</s>"
    )


def test_common_words_are_single_tokens(tokenizer: Tokenizer) -> None:
    # The BPE was really trained on the corpus: frequent words are one piece each.
    assert len(tokenizer.encode(" the quick brown fox", add_special_tokens=False)) == 4


def test_bos_rule_follows_tokenizer_config(tiny_model_path: Path, tmp_path: Path) -> None:
    off = Tokenizer(_copy(tiny_model_path, tmp_path / "off", add_bos_token=False))
    assert off.encode("hello")[0] != 0
    # Absent flag: tokenizer.json's post-processor decides (ours has none, so no BOS).
    absent = Tokenizer(_copy(tiny_model_path, tmp_path / "absent", add_bos_token=None))
    assert absent.add_bos_token is None
    assert absent.encode("hello") == off.encode("hello")
    as_dict = Tokenizer(
        _copy(tiny_model_path, tmp_path / "dict", bos_token={"content": "<s>", "lstrip": False})
    )
    assert as_dict.encode("hello")[0] == 0


def test_chat_template_renders_and_encodes(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<s><|user|>\nHello there</s>\n<|assistant|>\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<s><|user|>\nHello there</s>\n"
    )
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_is_sandboxed(tiny_model_path: Path, tmp_path: Path) -> None:
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(_copy(tiny_model_path, tmp_path / "evil", chat_template=evil))
    with pytest.raises(ModelConfigError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_file_fallback(tiny_model_path: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_model_path, tmp_path / "jinja", chat_template=None)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    assert Tokenizer(folder).apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    bare = Tokenizer(_copy(tiny_model_path, tmp_path / "bare", chat_template=None))
    with pytest.raises(ModelConfigError, match="chat_template"):
        bare.apply_chat_template([])


def test_digest_covers_config_but_not_key_order(tiny_model_path: Path, tmp_path: Path) -> None:
    base = Tokenizer(tiny_model_path).digest
    reordered = tmp_path / "reordered"
    reordered.mkdir()
    shutil.copy(tiny_model_path / "tokenizer.json", reordered / "tokenizer.json")
    config = json.loads((tiny_model_path / "tokenizer_config.json").read_text())
    (reordered / "tokenizer_config.json").write_text(
        json.dumps(dict(reversed(list(config.items()))), indent=4)
    )
    assert Tokenizer(reordered).digest == base
    assert Tokenizer(_copy(tiny_model_path, tmp_path / "c", add_bos_token=False)).digest != base


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelFileMissing, match=r"tokenizer\.json"):
        Tokenizer(tmp_path)


def _stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detok = tokenizer.detokenizer()
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2047), max_size=40))
def test_incremental_equals_full_decode_on_random_streams(
    tokenizer: Tokenizer, ids: list[int]
) -> None:
    assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30))
def test_incremental_never_emits_replacement_for_valid_text(
    tokenizer: Tokenizer, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    # Special-token text such as "<s>" inside the input is parsed as that token (as in HF
    # tokenizers) and skipped on decode, so compare against the text without it.
    expected = text
    for special in ("<s>", "</s>"):
        expected = expected.replace(special, "")
    assert "".join(deltas) == expected
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer: Tokenizer) -> None:
    for text in MULTIBYTE:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _stream(tokenizer, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
    # A CJK character is 3 bytes, each its own token in this English BPE: two adds hold back.
    ids = tokenizer.encode("中", add_special_tokens=False)
    assert len(ids) == 3
    assert _stream(tokenizer, ids) == ["", "", "中", ""]


# A Hermes-style template in the shape Qwen 2.5's takes (tools listed in the system turn, calls
# and results in tags), written for this test.
HERMES_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}"
    "\n\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools %}"
    "{%- elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <in> a city & region",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny <b>"},
]  # fmt: skip


@pytest.mark.parametrize("template", ["tiny", "hermes-style"])
def test_tools_render_as_transformers_renders_them(
    tiny_model_path: Path, tmp_path: Path, template: str
) -> None:
    from transformers import AutoTokenizer

    folder = (
        _copy(tiny_model_path, tmp_path / "t", chat_template=HERMES_STYLE)
        if template == "hermes-style"
        else tiny_model_path
    )
    ours = Tokenizer(folder).apply_chat_template(CONVERSATION, True, tools=TOOLS)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert '"city": "Zürich"' in ours and "Weather <in> a city & region" in ours
