import json

import pytest

from mac_moesd.errors import BadInput
from mac_moesd.inputs import prompts


@pytest.mark.parametrize("name", prompts.BUILTIN_SETS)
def test_builtin_sets_hold_about_thirty_prompts(name):
    loaded = prompts.load_prompts(name)
    assert loaded.name == name
    assert 25 <= len(loaded.prompts) <= 40
    assert all(p.strip() and "\n\n" not in p for p in loaded.prompts)
    assert len(set(loaded.prompts)) == len(loaded.prompts)


def test_code_set_spans_several_languages():
    text = "\n".join(prompts.load_prompts("code").prompts)
    for marker in ("def ", "function ", "pub fn ", "func ", "public static", "size_t "):
        assert marker in text


def test_text_file_blocks(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first line\nstill first\n\n  \n\nsecond\n\n\n")
    assert prompts.load_prompts(str(path)).prompts == ("first line\nstill first", "second")


def test_jsonl_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a\n\nb", "id": 1}) + "\n\n" + json.dumps({"prompt": "c"}) + "\n")
    assert prompts.load_prompts(str(path)).prompts == ("a\n\nb", "c")


@pytest.mark.parametrize("content, message", [
    (None, "prompt file not found"),
    ("\n \n", "holds no prompts"),
])
def test_missing_or_empty_file(tmp_path, content, message):
    path = tmp_path / "p.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BadInput, match=message):
        prompts.load_prompts(str(path))


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"text": "x"}', "line 2: needs a JSON object with a string 'prompt' field"),
    ('["x"]', "line 2: needs a JSON object"),
])
def test_malformed_jsonl_names_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(BadInput, match=message):
        prompts.load_prompts(str(path))


def test_errors_are_one_line(tmp_path):
    with pytest.raises(BadInput) as err:
        prompts.load_prompts(str(tmp_path / "nope.txt"))
    assert "\n" not in str(err.value)


class Plain:
    def encode(self, text):
        return [ord(c) for c in text]


class Chat(Plain):
    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt):
        assert add_generation_prompt and messages[0]["role"] == "user"
        return self.encode("<u>" + messages[0]["content"] + "<a>")


def test_tokenize_uses_the_chat_template_when_there_is_one():
    prompt_set = prompts.PromptSet("x", ("hi",))
    assert prompts.tokenize(prompt_set, Plain()) == [[104, 105]]
    assert prompts.tokenize(prompt_set, Chat()) == [[ord(c) for c in "<u>hi<a>"]]


def test_folder_without_tokenizer(tmp_path):
    assert prompts.load_tokenizer(tmp_path) is None
