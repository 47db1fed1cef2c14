"""vLLM's `--chat-template` (a file, in place of the model's template) and a request's own
`chat_template` (with `--trust-request-chat-template`), served through the official client
and offline (`LLM.chat(chat_template=...)`); templates that are neither files nor compile
are refused by name. A message's text parts reach a template that loops over content as
parts, and others as text (vLLM's content formats)."""

from __future__ import annotations

import httpx
import openai
import pytest

from model_fixtures import embedded_folder
from server_fixtures import Server, openai_client
from tidal.model.tokenizer import Tokenizer

SERVER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role | upper }}: {{ m.content }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>ANSWER:"
                   "{% endif %}")
REQUEST_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# a template that reads a message's content as OpenAI's parts, one by one
PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% for p in m['content'] %} <{{ p.text }}>"
                  "{% endfor %}|{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
PARTS = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                      {"type": "text", "text": "the capital?"}]}]


def rendered(template: str, messages=MESSAGES) -> list[int]:
    """The ids of `messages` rendered by `template`, as the server must send them."""
    tok = Tokenizer(embedded_folder())
    return tok.encode(tok.apply_chat_template(messages, chat_template=template), False)


def encoded(text: str) -> list[int]:
    return Tokenizer(embedded_folder()).encode(text, False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "chat.jinja"
    path.write_text(SERVER_TEMPLATE)
    s = Server("--chat-template", str(path), "--trust-request-chat-template")
    yield s
    s.stop()


def test_the_servers_template_renders_every_chat(server):
    want = rendered(SERVER_TEMPLATE)
    got = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert got == want
    out = openai_client(server).chat.completions.create(
        model="smollm2-135m", messages=MESSAGES, max_tokens=2,
        extra_body={"return_token_ids": True})
    assert out.model_extra["prompt_token_ids"] == want
    assert want != rendered(None)  # not the model's own


def test_a_requests_template_renders_its_chat(server):
    want = rendered(REQUEST_TEMPLATE)
    out = openai_client(server).chat.completions.create(
        model="smollm2-135m", messages=MESSAGES, max_tokens=2,
        extra_body={"return_token_ids": True, "chat_template": REQUEST_TEMPLATE})
    assert out.model_extra["prompt_token_ids"] == want
    got = httpx.post(server.url + "/tokenize", json={
        "messages": MESSAGES, "chat_template": REQUEST_TEMPLATE}).json()["tokens"]
    assert got == want


def test_a_template_that_loops_over_content_gets_the_requests_parts(server):
    """vLLM's 'auto' content format: a template that iterates a message's content gets
    OpenAI's text parts as the request sent them (text as one part); one that prints it
    gets text, the parts joined with newlines."""
    def prompt(messages, template) -> list[int]:
        out = openai_client(server).chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=1,
            extra_body={"return_token_ids": True, "chat_template": template})
        return out.model_extra["prompt_token_ids"]

    assert prompt(PARTS, PARTS_TEMPLATE) == encoded(
        "[user] <What is> <the capital?>|[assistant]")
    assert prompt(MESSAGES, PARTS_TEMPLATE) == encoded(
        "[user] <What is the capital of France?>|[assistant]")
    assert prompt(PARTS, REQUEST_TEMPLATE) == encoded("[user] What is\nthe capital?\n[assistant]")


def test_a_template_that_does_not_compile_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(server).chat.completions.create(
            model="smollm2-135m", messages=MESSAGES, max_tokens=2,
            extra_body={"chat_template": "{% for m in messages %}"})
    assert err.value.body["param"] == "chat_template"


def test_offline_chat_takes_a_template(tmp_path):
    from tidal import LLM, SamplingParams

    llm = LLM("smollm2-135m", num_kv_blocks=64)
    path = tmp_path / "t.jinja"
    path.write_text(REQUEST_TEMPLATE)
    p = SamplingParams(max_tokens=1)
    for template in (REQUEST_TEMPLATE, str(path)):  # the text, or a file's path
        out = llm.chat(MESSAGES, p, use_tqdm=False, chat_template=template)
        assert out[0].prompt_token_ids == rendered(REQUEST_TEMPLATE)


def test_offline_chat_takes_text_parts():
    """LLM.chat takes OpenAI's text parts as the server does; other parts, and a content
    format that is none, are refused by name."""
    from tidal import LLM, SamplingParams

    llm = LLM("smollm2-135m", num_kv_blocks=64)
    p = SamplingParams(max_tokens=1)
    joined = [{"role": "user", "content": "What is\nthe capital?"}]
    out = llm.chat([PARTS, joined], p, use_tqdm=False)
    assert out[0].prompt_token_ids == out[1].prompt_token_ids == rendered(None, joined)
    looped = llm.chat(PARTS, p, use_tqdm=False, chat_template=PARTS_TEMPLATE)
    assert looped[0].prompt_token_ids == encoded("[user] <What is> <the capital?>|[assistant]")
    forced = llm.chat(PARTS, p, use_tqdm=False, chat_template=REQUEST_TEMPLATE,
                      chat_template_content_format="openai")
    assert forced[0].prompt_token_ids == encoded(
        "[user] [{'type': 'text', 'text': 'What is'}, {'type': 'text', 'text': 'the capital?'}]"
        "\n[assistant]")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="text parts"):
        llm.chat(image, p, use_tqdm=False)
    with pytest.raises(ValueError, match="content_format must be one of auto, string, openai"):
        llm.chat(MESSAGES, p, use_tqdm=False, chat_template_content_format="text")


@pytest.mark.parametrize("template, form", [
    (PARTS_TEMPLATE, "openai"), (REQUEST_TEMPLATE, "string"), (SERVER_TEMPLATE, "string"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% set c = m['content'] %}{% if c is string %}{{ c }}{% else %}"
     "{% for p in c %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for k in m %}{{ k }}{% endfor %}{{ m.content }}{% endfor %}",
     "string")])
def test_auto_reads_the_content_format_from_the_template(template, form):
    assert Tokenizer(embedded_folder()).template(template).content_format == form


def test_a_flag_that_is_no_template_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a template"):
        Tokenizer(embedded_folder(), str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(embedded_folder(), "{% if %}")
