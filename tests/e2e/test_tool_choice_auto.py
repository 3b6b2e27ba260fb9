"""`tool_choice: "auto"` through the real `openai` client and a real server: a tiny Llama trained here
to answer one question with a Hermes-style call (`<tool_call>{...}</tool_call>`, its chat template
rendering the tools) and another in text. The server finds the hermes parser from the template
itself; the call comes back as OpenAI `tool_calls` with finish_reason "tool_calls", the text answer
as content; every drafter gives the same answer; streaming sends content deltas up to the call's
marker and the call whole in the last delta. A template that does not render tools gives a 400
saying so (the tiny model of the other tests)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.config import EngineConfig

TOOLS_PREAMBLE = ("{% if tools %}<s>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
                  "\nanswer or call as <tool_call></s>\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"role": "user", "content": "weather in Paris?"}
TEXT = {"role": "user", "content": "Hello world!"}
CALL_ANSWER = 'Looking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TEXT_ANSWER = "Hello! The capital of France is Paris."


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tiny_model_factory):
    """The tiny Llama, its chat template rendering tools, trained until greedy decoding gives each
    answer to its question."""
    import transformers

    path = tiny_model_factory(tmp_path_factory.mktemp("tool_caller"), seed=5)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOLS_PREAMBLE + tok.chat_template
    tok.save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    examples = []
    for message, answer in ((CALL, CALL_ANSWER), (TEXT, TEXT_ANSWER)):
        prompt = tok.apply_chat_template([message], tools=[WEATHER], add_generation_prompt=True, tokenize=False)
        p, a = tok.encode(prompt, add_special_tokens=False), tok.encode(answer, add_special_tokens=False)
        examples.append((torch.tensor([p + a + [tok.eos_token_id]]), len(p)))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = 0.0
        for ids, n in examples:
            logits = model(ids).logits[0, n - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, n:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    with torch.no_grad():
        for ids, n in examples:
            got = model.generate(ids[:, :n], max_new_tokens=ids.shape[1] - n, do_sample=False)
            assert got[0].tolist() == ids[0].tolist(), "the tiny model did not learn its answers"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(serve, tool_model):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tool_model), dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8,
        drafters=("ngram", "draft_model"), draft_budget="fixed", drafter_options={"draft_model": {"draft_layers": 1}}))
    with serve(engine, served_model_name="tiny") as live:
        yield live


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)


def ask(client, message, drafter="none", **fields):
    return client.chat.completions.create(model="tiny", messages=[message], max_tokens=160, temperature=0,
                                          tools=[WEATHER], extra_body={"speculative": {"drafter": drafter}}, **fields)


def test_the_model_calls_a_tool_in_its_own_format(client):
    for drafter in ("none", "ngram", "draft_model"):
        choice = ask(client, CALL, drafter).choices[0]
        assert choice.finish_reason == "tool_calls", (drafter, choice.message)
        assert choice.message.content == "Looking."
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_text_answer_stays_content(client):
    for drafter in ("none", "ngram"):
        choice = ask(client, TEXT, drafter, tool_choice="auto").choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content == TEXT_ANSWER


def test_streaming_sends_content_then_the_call(client):
    deltas = [c.choices[0] for c in ask(client, CALL, stream=True) if c.choices]
    content = "".join(d.delta.content or "" for d in deltas)
    assert content == "Looking." and not any("<" in (d.delta.content or "") for d in deltas)
    [last] = [d for d in deltas if d.finish_reason]
    assert last.finish_reason == "tool_calls"
    [call] = last.delta.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, TEXT, stream=True) if c.choices)
    assert streamed == TEXT_ANSWER


def test_tool_choice_none_renders_no_tools_and_calls_nothing(client):
    choice = ask(client, CALL, tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def test_a_template_without_tools_refuses_auto(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny") as live:
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as exc:
            ask(client, CALL)
    err = exc.value.response.json()["error"]
    assert err["param"] == "tool_choice" and "does not render tools" in err["message"]
