"""Constrained decoding: whatever token the sampler picks among the allowed ones, the output parses and validates.

A "model" of random logits (arg-max over masked noise) is the harshest sampler there is; it runs on the tiny test
tokenizer (one token per byte) and, marked slow, on the bundled model's real tokenizer (V = 151,936), with
each backend: llguidance (guidance, the default) and XGrammar.
"""

import json
import re

import jsonschema
import pytest
import torch

from minivllm.weights import Tokenizer
from minivllm.structured import (
    GrammarState,
    StructuredOutputError,
    StructuredOutputs,
    StructuredOutputsParams,
    apply_grammar_masks,
    choice_grammar,
)

from conftest import tiny_model_folder

# ~10 schemas of different shapes: nested objects, arrays, enums, bounded numbers, optional fields, $defs, anyOf
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["id", "tags"],
            }
        },
        "required": ["user"],
    },
    "enum_status": {
        "type": "object",
        "properties": {"status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": "string", "maxLength": 12}},
        "required": ["status", "note"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["score", "count"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
        "required": ["a"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "minLength": 1, "maxLength": 6}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
        "required": ["value"],
    },
    "const_and_bool": {
        "type": "object",
        "properties": {"kind": {"const": "tool"}, "ok": {"type": "boolean"}},
        "required": ["kind", "ok"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
    },
}


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory) -> Tokenizer:
    "The tiny test models' byte-level tokenizer (259 tokens; <|im_end|> = 257 ends a sequence)."
    return Tokenizer.from_folder(tiny_model_folder(tmp_path_factory.mktemp("tiny-structured")))


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def so(byte_tok, request) -> StructuredOutputs:
    "StructuredOutputs for a model with 300 logits per row: 41 padding columns beyond the tokenizer."
    return StructuredOutputs(byte_tok, 300, backend=request.param)


def random_decode(so: StructuredOutputs, params: StructuredOutputsParams, seed: int, max_steps: int = 20_000):
    "Arg-max over masked random logits, accept, until the grammar ends -> the text (stop token left out)."
    state = so.matcher(so.compile(params))
    gen = torch.Generator().manual_seed(seed)
    ids = []
    while not state.is_finished:
        assert len(ids) < max_steps, "the grammar never ended"
        logits = torch.randn(1, so.vocab_size, generator=gen)
        apply_grammar_masks(logits, [state])
        ids.append(int(logits.argmax()))
        assert state.accept(ids[-1])
    assert ids[-1] in so.tokenizer.eos_token_ids
    return so.tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_give_valid_json(so, name):
    schema = SCHEMAS[name]
    for seed in range(3):
        text = random_decode(so, StructuredOutputsParams(json=schema), seed)
        jsonschema.validate(json.loads(text), schema)  # strict json: no raw control characters either


def test_length_bounded_strings_hold_no_control_characters(so):
    # xgrammar 0.2.9 lets raw control characters into min/maxLength strings (xgrammar#800); we narrow the class
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}}, "required": ["s"]}
    texts = [random_decode(so, StructuredOutputsParams(json=schema), seed) for seed in range(10)]
    assert not any(c < " " for t in texts for c in json.loads(t)["s"])


def test_json_object_and_no_whitespace(so):
    text = random_decode(so, StructuredOutputsParams(json_object=True), 0)
    assert isinstance(json.loads(text), dict)
    tight = random_decode(so, StructuredOutputsParams(json=SCHEMAS["nested"], disable_any_whitespace=True), 0)
    jsonschema.validate(json.loads(tight), SCHEMAS["nested"])
    structure = re.sub(r'"(?:[^"\\\\]|\\\\.)*"', '""', tight)  # the strings emptied: what is left is structure
    assert not re.search(r"\s", re.sub(r"[,:] ", "", structure))  # one space after each , and :, no other


def test_regex_and_choice(so):
    for seed in range(5):
        assert re.fullmatch(
            r"[A-Z][a-z]{2,5}-\d{3}", random_decode(so, StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5}-\d{3}"), seed)
        )
    choices = ["yes", "no", 'say "maybe"', "back\\slash", "new\nline", "naïve"]
    picked = {random_decode(so, StructuredOutputsParams(choice=choices), seed) for seed in range(30)}
    assert picked <= set(choices) and len(picked) >= 3
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'


def test_grammar_ebnf(so):
    g = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(5):
        assert re.fullmatch(
            r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", random_decode(so, StructuredOutputsParams(grammar=g), seed)
        )


@pytest.mark.parametrize(
    "params, param",
    [
        (StructuredOutputsParams(), "structured_outputs"),
        (StructuredOutputsParams(regex="a", json={"type": "string"}), "structured_outputs"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(json=[1]), "json"),
        (StructuredOutputsParams(choice="yes"), "choice"),
        (StructuredOutputsParams(choice=[]), "choice"),
        (StructuredOutputsParams(grammar=""), "grammar"),
        (StructuredOutputsParams(json={"type": "strin"}), "json"),
        (StructuredOutputsParams(json={"type": "object", "properties": 3}), "json"),
        (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "json"),
        (StructuredOutputsParams(regex="(ab"), "regex"),
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(grammar='root ::= "a" | item'), "grammar"),
        (StructuredOutputsParams(grammar='start ::= "a"'), "grammar"),
    ],
)
def test_bad_constraints_raise_structured_output_error(so, params, param):
    with pytest.raises(StructuredOutputError) as e:
        so.compile(params)
    assert isinstance(e.value, ValueError) and e.value.param == param
    assert "/project/cpp" not in str(e.value)


def test_compile_is_cached_by_canonical_schema(so):
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    a = so.compile(StructuredOutputsParams(json=schema))
    assert so.compile(StructuredOutputsParams(json=json.dumps(schema, indent=4))) is a
    assert so.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True)) is not a
    small = StructuredOutputs(so.tokenizer, 300, cache_size=2)
    for r in ("a", "b", "c"):
        small.compile(StructuredOutputsParams(regex=r))
    assert [k[1] for k in small.cache] == ["b", "c"]  # least recently used first out


def test_masks_leave_unconstrained_rows_untouched_and_padding_masked(so):
    logits = torch.randn(4, 300)
    before = logits.clone()
    states = [
        None,
        so.matcher(so.compile(StructuredOutputsParams(regex=r"[0-9]+"))),
        None,
        so.matcher(so.compile(StructuredOutputsParams(json_object=True))),
    ]
    apply_grammar_masks(logits, states)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    digits = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert so.tokenizer.decode(digits) == "0123456789"
    assert torch.equal(logits[1, digits], before[1, digits])
    assert torch.isinf(logits[[1, 3], 259:]).all()  # padding columns beyond the tokenizer's 259 tokens
    assert torch.isinf(logits[[1, 3], 256]).all() and torch.isinf(logits[[1, 3], 258]).all()  # special tokens
    apply_grammar_masks(logits, [None] * 4)  # nothing constrained: nothing happens
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_state_accept_finish_and_fork(so, byte_tok):
    state = so.matcher(so.compile(StructuredOutputsParams(choice=["ab", "ac"])))
    assert state.accept(byte_tok.encode("a")[0])
    twin = state.fork()
    assert not state.accept(byte_tok.encode("x")[0])  # refused: nothing changes
    assert state.accept(byte_tok.encode("b")[0]) and twin.accept(byte_tok.encode("c")[0])
    assert not state.is_finished
    eos = byte_tok.eos_token_ids[0]
    bits = torch.zeros(1, 10, dtype=torch.int32)
    state.fill_mask(bits, 0)
    assert [j for j in range(300) if bits[0, j // 32] >> (j % 32) & 1] == [eos]  # complete: only the stop token
    assert state.accept(eos) and state.is_finished and not twin.is_finished
    assert not state.accept(eos) and state.num_accepted == 3
    state.fill_mask(bits, 0)  # a finished state allows the stop tokens, and does not raise
    assert [j for j in range(300) if bits[0, j // 32] >> (j % 32) & 1] == [eos]
    assert isinstance(twin, GrammarState)


# The bundled model's real tokenizer: V = 151,936, byte-level BPE with multi-byte tokens


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def real_so(request) -> StructuredOutputs:
    from minivllm.weights import load_model

    model, tok = load_model(None)
    return StructuredOutputs(tok, model.config.vocab_size, backend=request.param)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("disable_any_whitespace", [False, True])
def test_real_tokenizer_random_walks_give_valid_json(real_so, name, disable_any_whitespace):
    schema = SCHEMAS[name]
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace)
    jsonschema.validate(json.loads(random_decode(real_so, params, 0, max_steps=5000)), schema)


@pytest.mark.slow
def test_real_tokenizer_regex_choice_and_padding(real_so):
    assert re.fullmatch(r"\d{3}-\d{4}", random_decode(real_so, StructuredOutputsParams(regex=r"\d{3}-\d{4}"), 0))
    choices = ["Paris", "London", "New York"]
    assert random_decode(real_so, StructuredOutputsParams(choice=choices), 0) in choices
    logits = torch.zeros(2, real_so.vocab_size)
    apply_grammar_masks(logits, [real_so.matcher(real_so.compile(StructuredOutputsParams(json_object=True))), None])
    allowed = torch.isfinite(logits[0])
    assert 0 < int(allowed.sum()) < real_so.vocab_size and torch.isfinite(logits[1]).all()
    specials = [i for i, a in real_so.tokenizer.tok.get_added_tokens_decoder().items() if a.special]
    assert not allowed[specials].any()  # <|im_start|> and friends never appear in constrained output
