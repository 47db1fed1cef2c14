"""vLLM's `--chat-template` (a file, in place of the model's template) and a request's own
`chat_template` (with `--trust-request-chat-template`), served through the official client
and offline (`LLM.chat(chat_template=...)`); templates that are neither files nor compile
are refused by name."""

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


def rendered(template: str, messages=MESSAGES) -> list[int]:
    """The ids of `messages` rendered by `template`, as the server must send them."""
    tok = Tokenizer(embedded_folder())
    return tok.encode(tok.apply_chat_template(messages, chat_template=template), False)


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


def test_a_flag_that_is_no_template_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a template"):
        Tokenizer(embedded_folder(), str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(embedded_folder(), "{% if %}")
