"""Structured outputs and tool calls through the server, with the official `openai` client, on the bundled model.

A real uvicorn server on loopback serves the bundled Qwen2.5-Coder-0.5B (one server for the module):
`chat.completions.parse` with 20 Pydantic models of different shapes (each answer parses and validates), a
sampled and a streamed structured answer, the completions endpoint under a JSON schema, a regex, choices and
a grammar (vLLM's `structured_outputs` and older `guided_*`), unconstrained requests unchanged next to
constrained ones, `max_tokens` mid-JSON, and a two-turn tool loop, whole and streamed.
"""
import asyncio, json, re
from enum import Enum
from typing import Literal, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from minivllm.engine import LLMEngine
from minivllm.weights import load_model
from minivllm.server import BackgroundServer, build_app

pytestmark = pytest.mark.slow

Name = Field(max_length=24)


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)

class Point(BaseModel):
    x: float
    y: float

class Paint(BaseModel):
    color: Literal["red", "green", "blue"]
    glossy: bool

class Item(BaseModel):
    sku: str = Field(max_length=8)
    qty: int = Field(ge=1, le=99)

class Customer(BaseModel):
    name: str = Name
    vip: bool

class Order(BaseModel):
    customer: Customer
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["new", "paid", "shipped"]

class Tags(BaseModel):
    tags: list[str] = Field(max_length=4)

class Rating(BaseModel):
    score: int = Field(ge=1, le=5)
    comment: Optional[str] = Field(default=None, max_length=30)

class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)

class Address(BaseModel):
    street: str = Name
    city: str = Name
    zip: str = Field(pattern=r"^[0-9]{5}$")

class Book(BaseModel):
    title: str = Name
    author: str = Name
    year: int = Field(ge=1000, le=2100)
    isbn: Optional[str] = Field(default=None, max_length=17)

class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=3)

class Flags(BaseModel):
    enabled: bool
    retries: int = Field(ge=0, le=10)

class Event(BaseModel):
    name: str = Name
    date: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")

class Level(str, Enum):
    low = "low"
    high = "high"

class Alert(BaseModel):
    level: Level
    reason: str = Name

class Employee(BaseModel):
    name: str = Name
    manager: Optional[Person] = None

class Ingredient(BaseModel):
    name: str = Field(max_length=16)
    grams: int = Field(ge=0, le=1000)

class Recipe(BaseModel):
    name: str = Name
    ingredients: list[Ingredient] = Field(min_length=1, max_length=4)
    vegan: bool

class Forecast(BaseModel):
    city: str = Name
    days: list[Literal["sun", "rain", "snow"]] = Field(min_length=1, max_length=5)

class Price(BaseModel):
    amount: float = Field(ge=0, le=10000)
    currency: Literal["USD", "EUR", "JPY"]

class Leaf(BaseModel):
    value: int = Field(ge=-100, le=100)

class Tree(BaseModel):
    value: int = Field(ge=-100, le=100)
    children: list[Leaf] = Field(max_length=3)

class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float = Field(ge=0, le=1)

MODELS = [Person, Point, Paint, Order, Tags, Rating, Temperature, Address, Book, Matrix, Flags, Event, Alert,
          Employee, Recipe, Forecast, Price, Tree, Answer, Customer]
QUESTIONS = {Answer: "Is Paris the capital of France?", Temperature: "How warm is a summer day in Rome?",
             Order: "Ada (a VIP) ordered 2 of SKU A-1; it is paid.", Recipe: "A simple pancake recipe."}


@pytest.fixture(scope="module")
def server():
    model, tok = load_model(None, "float32")
    engine = LLMEngine(model, tok, num_kv_blocks=2048, max_num_seqs=32)
    with BackgroundServer(build_app(engine, "minivllm")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=600)


def ask(model: type[BaseModel]) -> list[dict]:
    q = QUESTIONS.get(model, f"Give an example of a {model.__name__}.")
    return [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": q}]


def run_all(server, calls):
    "Run the coroutines `calls(ac)` makes with one AsyncOpenAI client, all at once; their results in order."
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=600) as ac:
            return await asyncio.gather(*calls(ac), return_exceptions=True)
    return asyncio.run(main())


# --- response_format through chat.completions.parse -------------------------------------------------------------
def test_parse_returns_a_valid_object_for_20_schemas(server):
    "20 Pydantic models, all at once, greedy: every answer parses into its model (the client validates it)."
    def calls(ac):
        return [ac.chat.completions.parse(model="minivllm", messages=ask(m), response_format=m, max_tokens=160,
                                          temperature=0) for m in MODELS]
    results = run_all(server, calls)
    valid = 0
    for m, r in zip(MODELS, results):
        if isinstance(r, openai.LengthFinishReasonError):
            print(m.__name__, repr(r.completion.choices[0].message.content))
            continue
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (m.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, m)
        m.model_validate_json(choice.message.content)  # and the text itself validates
        valid += 1
    print(f"schema-valid answers: {valid}/{len(MODELS)}; e.g. {results[3].choices[0].message.parsed!r}")
    assert valid == 20


def test_sampled_and_streamed_answers_follow_the_schema(server):
    "Sampled at temperature 1 (any allowed token may be picked) and streamed: the text still validates."
    schema = Order.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "Order", "schema": schema, "strict": True}}
    kw = dict(model="minivllm", messages=ask(Order), response_format=fmt, max_tokens=120)

    async def streamed(ac):
        chunks = [c async for c in await ac.chat.completions.create(**kw, temperature=0, stream=True)]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1]

    def calls(ac):
        sampled = [ac.chat.completions.create(**kw, temperature=1.0, seed=seed) for seed in (1, 2, 3)]
        return [*sampled, ac.chat.completions.create(**kw, temperature=0), streamed(ac)]
    *sampled, whole, (text, last) = run_all(server, calls)
    for r in sampled + [whole]:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert text == whole.choices[0].message.content and last.choices[0].finish_reason == "stop"
    print("sampled:", [r.choices[0].message.content for r in sampled])


def test_completions_with_vllm_extras_and_json_object(server):
    "The completions endpoint under vLLM's structured_outputs and guided_* fields, and a json_object format."
    colors = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 3, "maxItems": 3}
    grammar = 'root ::= "[" color ", " color "]"\ncolor ::= "\\"red\\"" | "\\"green\\"" | "\\"blue\\""'
    extras = [{"structured_outputs": {"json": colors}}, {"guided_choice": ["red", "blue"]},
              {"structured_outputs": {"choice": ["red", "blue"]}}, {"guided_regex": "[A-Z][a-z]+"},
              {"guided_grammar": grammar}, {"response_format": {"type": "json_object"}}]
    prompt = "The three primary colors, as a JSON list, are:"

    def calls(ac):
        return [ac.completions.create(model="minivllm", prompt=prompt, max_tokens=40, temperature=0, extra_body=e)
                for e in extras]
    texts = [r.choices[0].text for r in run_all(server, calls)]
    assert len(json.loads(texts[0])) == 3 and texts[1] in ("red", "blue") and texts[2] in ("red", "blue")
    assert re.fullmatch(r"[A-Z][a-z]+", texts[3]) and set(json.loads(texts[4])) <= {"red", "green", "blue"}
    assert isinstance(json.loads(texts[5]), dict)
    print("completions:", texts)


def test_max_tokens_mid_json_is_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "R", "schema": Recipe.model_json_schema()}}
    r = client.chat.completions.create(model="minivllm", messages=ask(Recipe), max_tokens=5, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_unconstrained_requests_are_unchanged_next_to_constrained_ones(server):
    "Greedy: free requests give the same tokens alone and in a batch where most rows carry a grammar."
    free = [[{"role": "user", "content": q}] for q in ("What is a mutex?", "Name a prime number.", "Say hello.")]
    def plain(ac):
        return [ac.chat.completions.create(model="minivllm", messages=m, max_tokens=24, temperature=0,
                                           logprobs=True) for m in free]
    def mixed(ac):
        constrained = [ac.chat.completions.parse(model="minivllm", messages=ask(m), response_format=m,
                                                 max_tokens=60, temperature=0) for m in MODELS[:6]]
        return plain(ac) + constrained
    alone, together = run_all(server, plain), run_all(server, mixed)[:3]
    tokens = lambda r: [t.token for t in r.choices[0].logprobs.content]
    for a, b in zip(alone, together):
        assert tokens(a) == tokens(b) and a.choices[0].message.content == b.choices[0].message.content
    print(f"unconstrained next to 6 constrained: {len(alone)}/{len(alone)} identical")


# --- tool calls --------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def reassemble(chunks) -> tuple[str | None, list[dict], str]:
    "The content, tool calls and finish_reason of a streamed chat answer, put back together from its deltas."
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or "" if tc.function else ""
            call["arguments"] += tc.function.arguments or "" if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


REPORT = {"type": "json_schema", "json_schema": {"name": "Report", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 100}, "temperature": {"type": "integer"},
                                     "sky": {"type": "string", "maxLength": 20}},
    "required": ["answer", "temperature", "sky"]}}}


def test_two_turn_tool_loop(server, client):
    "The model calls get_weather with valid arguments (whole and streamed alike), reads the result, and answers."
    kw = dict(model="minivllm", tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=0,
              parallel_tool_calls=False)  # left free, the model calls get_time too, then get_weather again

    async def streamed(ac):
        return reassemble([c async for c in await ac.chat.completions.create(messages=QUESTION, stream=True, **kw)])
    first, (content, calls, finish) = run_all(server, lambda ac: [ac.chat.completions.create(messages=QUESTION, **kw),
                                                                  streamed(ac)])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # streamed, the deltas put back together give the same content, calls and finish_reason
    assert (content, finish) == (None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                             for c in choice.message.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    # second turn: the call and its result go back (the template renders both); the model answers from it
    result = {"city": args["city"], "temperature": 18, "unit": args["unit"], "sky": "cloudy"}
    history = QUESTION + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    second = client.chat.completions.create(model="minivllm", messages=history, tools=[WEATHER, TIME], max_tokens=80,
                                            temperature=0, response_format=REPORT)
    answer = second.choices[0]
    print(f"call: {call.function.name}({call.function.arguments}); answer: {answer.message.content}")
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    report = json.loads(answer.message.content)
    assert (report["temperature"], report["sky"]) == (18, "cloudy")


def test_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="minivllm", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=40, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME["function"]["parameters"])


# --- tool_choice "auto": the bundled model's bare JSON calls, arguments streamed token by token ------------------
def streamed_chunks(client, **kw) -> list:
    return list(client.chat.completions.create(stream=True, **kw))


def test_auto_reads_the_bundled_models_bare_calls_once_checked(client):
    """A bare call (the bundled model's habit in auto) is read once its arguments are whole and bare_call_check
    agrees (12): streamed, its first delta goes out alone, then its arguments in one piece (tagged calls, as in
    required mode, stream theirs token by token: tests/test_tool_calls.py)."""
    kw = dict(model="minivllm", tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              messages=[{"role": "user", "content": "What is the weather in Tokyo?"}])
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Tokyo"
    chunks = streamed_chunks(client, **kw)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == "" and all(d.id is None and d.function.name is None for d in rest)
    assert len(rest) == 1 and rest[0].function.arguments == call.function.arguments
    chunk_of = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(chunk_of) == 2 and chunk_of[0] < chunk_of[1]  # the first delta alone in its chunk
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    print(f"{len(rest)} argument deltas: {[d.function.arguments for d in rest]}")


@pytest.mark.parametrize("question", ["Write a haiku about the sea.", "Explain what a mutex is in one sentence.",
                                      "What does HTTP stand for?"])
def test_auto_answers_in_words_when_no_tool_is_needed(client, question):
    r = client.chat.completions.create(model="minivllm", tools=[WEATHER, TIME], max_tokens=40, temperature=0,
                                       messages=[{"role": "user", "content": question}])
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content


def test_auto_with_a_response_format_keeps_json_as_the_answer(client):
    "With a response_format the answer is JSON of that schema, even one shaped like a call: content, not a call."
    call_like = {"type": "json_schema", "json_schema": {"name": "call", "schema": {
        "type": "object", "properties": {"name": {"enum": ["get_weather"]},
                                         "arguments": {"type": "object", "properties": {"city": {"enum": ["Tokyo"]}},
                                                       "required": ["city"]}},
        "required": ["name", "arguments"]}}}
    r = client.chat.completions.create(model="minivllm", tools=[WEATHER], max_tokens=40, temperature=0,
                                       response_format=call_like,
                                       messages=[{"role": "user", "content": "What is the weather in Tokyo?"}])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert json.loads(r.choices[0].message.content)["name"] == "get_weather"


def test_parallel_tool_calls_false_holds_in_auto_and_required(client):
    "Asked for two things, the model may call twice; with parallel_tool_calls false every choice has one call."
    q = [{"role": "user", "content": "What is the weather in Paris and what time is it in Tokyo?"}]
    for choice in ("auto", "required"):
        r = client.chat.completions.create(model="minivllm", messages=q, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, temperature=0.8, n=4, seed=1)
        for c in r.choices:
            assert len(c.message.tool_calls or []) <= 1, c
        assert any(c.message.tool_calls for c in r.choices)
