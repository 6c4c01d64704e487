"""The edge's tokenizer (tokenizers + jinja2, no transformers) against transformers'
AutoTokenizer on the same folder: prompt ids, chat rendering, decoding, stop ids."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from edge.prompts import encode_prompt
from edge.tokenizer import EdgeTokenizer
from shared.errors import ConfigError
from tests.tiny_models import tiny_tokenizer

PROMPTS = ["w5 w6 w7", "w1 w2 w3 w3 w3", "w90 w0 w17 nonsense w4", ""]
# A template in the style of Qwen2.5's: a default system prompt, tool JSON, loop controls.
QWEN_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{%- else %}{%- if messages[0]['role'] == 'system' %}{{- 'w10 ' + messages[0]['content'] + ' w11 ' }}
{%- else %}{{- 'w10 w12 w13 w11 ' }}{%- endif %}{%- endif %}
{%- for message in messages %}{%- if message.role == 'system' %}{% continue %}{% endif %}
{{- 'w20 ' + message.role|replace('user', 'w21') + ' ' + message.content + ' w22 ' }}
{%- endfor %}{%- if add_generation_prompt %}{{- 'w20 w23 ' }}{%- endif %}"""


QWEN = (Path(__file__).parents[2] / "data" / "qwen2.5-coder_chat_template.jinja").read_text()


@pytest.fixture(params=["plain", "qwen-style", "qwen2.5-coder"])
def folder(request, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    tokenizer = tiny_tokenizer()
    if request.param != "plain":
        tokenizer.chat_template = QWEN_STYLE if request.param == "qwen-style" else QWEN
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_prompt_ids_equal_transformers(folder: Path) -> None:
    ours, theirs = EdgeTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in PROMPTS:
        rendered = theirs.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        assert ours.render_chat([{"role": "user", "content": text}]) == rendered
        assert encode_prompt(ours, text, chat=True) == theirs(rendered, add_special_tokens=False).input_ids
        if text:
            assert encode_prompt(ours, text, chat=False) == theirs(text).input_ids
    system = [{"role": "system", "content": "w40"}, {"role": "user", "content": "w41"}]
    assert ours.render_chat(system) == theirs.apply_chat_template(system, tokenize=False, add_generation_prompt=True)
    turns = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}, {"role": "user", "content": "w8"}]
    assert ours.render_chat(turns) == theirs.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def test_decode_and_stop_ids_equal_transformers(folder: Path) -> None:
    ours, theirs = EdgeTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    ids = [5, 1, 7, 0, 9]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert len(ours) == len(theirs)
    assert ours.stop_token_ids == {theirs.eos_token_id}


def test_generation_config_eos_ids_are_stop_ids(tmp_path: Path) -> None:
    tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 7]}')
    assert EdgeTokenizer(tmp_path).stop_token_ids == {1, 7}


def test_a_folder_without_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        EdgeTokenizer(tmp_path)
