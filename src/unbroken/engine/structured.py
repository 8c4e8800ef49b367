"""Structured outputs and forced tool calls, as vLLM 0.32 serves them, simulated.

vLLM constrains sampling with a grammar (xgrammar, falling back to guidance); the simulator
instead generates, before the first step, one value that satisfies the constraint: a JSON
value built from the schema, a string matching the regex, one of the choices, a sentence of
the grammar. The value is a pure function of the constraint and of the sequence's cursor (the
model, adapter, sampling salt and whole prompt), so the same request answers the same bytes on
every replica, as the plain text does. Its text is cut into pieces at whitespace, one token
each (`count_tokens` counts the same tokens, `token_ids` gives their ids), so it streams at
the step rate, counts as usage, and `max_tokens` cuts it (a truncated value, as vLLM's).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import re._constants as sre_c
import re._parser as sre_parse
from dataclasses import dataclass, field
from typing import Any, Literal

from unbroken.engine.textmodel import VOCAB
from unbroken.wire.errors import ApiError

__all__ = [
    "Constraint",
    "ToolMode",
    "ToolStream",
    "chat_constraint",
    "completion_constraint",
    "pieces",
    "tool_calls_of",
]

_PIECE = re.compile(r"\s*\S+(?:\s+$)?")


def pieces(text: str) -> list[str]:
    """`text` as tokens: each run of non-whitespace with the whitespace before it (trailing
    whitespace joins the last), so the pieces join to `text` and number `count_tokens(text)`."""
    return _PIECE.findall(text) or ([text] if text else [])


def bad(message: str, param: str | None = None) -> ApiError:
    """vLLM's VLLMValidationError: a 400 with its message."""
    return ApiError(400, message, param=param, code="invalid_value")


class Rng:
    """Deterministic draws from a seed (BLAKE2b in counter mode): the same in every process
    and Python version, unlike `random`."""

    __slots__ = ("_n", "_seed")

    def __init__(self, seed: bytes) -> None:
        self._seed = seed
        self._n = 0

    def below(self, n: int) -> int:
        if n <= 1:
            return 0
        self._n += 1
        d = hashlib.blake2b(self._n.to_bytes(8, "little"), digest_size=16, key=self._seed[:64])
        return int.from_bytes(d.digest(), "little") % n

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def pick(self, seq: list[Any] | tuple[Any, ...]) -> Any:
        return seq[self.below(len(seq))]

    def chance(self) -> bool:
        return self.below(2) == 0

    def words(self, n: int) -> str:
        return " ".join(self.pick(VOCAB) for _ in range(n))


# -- JSON Schema ---------------------------------------------------------------------------------
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_MAX_DEPTH = 6  # beyond it, only what a schema requires (a recursive $ref must end)
# Sizes a schema or regex may ask for beyond any context window: drawn up to this (the output
# is cut by max_tokens long before).
_MAX_SIZE = 1024
_FORMATS: dict[str, str] = {
    "date": "2024-05-17",
    "date-time": "2024-05-17T09:30:00Z",
    "time": "09:30:00Z",
    "duration": "P3D",
    "email": "river@example.com",
    "idn-email": "river@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "192.0.2.17",
    "ipv6": "2001:db8::17",
    "uri": "https://example.com/river",
    "uri-reference": "https://example.com/river",
    "iri": "https://example.com/river",
    "iri-reference": "https://example.com/river",
    "uri-template": "https://example.com/{river}",
    "uuid": "3f2c8a1e-5b7d-4c9e-8f01-23456789abcd",
    "json-pointer": "/river/0",
    "relative-json-pointer": "0/river",
    "regex": "[a-z]+",
}


def _grammar_error(message: str) -> ApiError:
    return bad(f"Grammar error: {message}")


class SchemaGen:
    """A value of a JSON schema: required properties always, optional ones by draw, strings of
    vocabulary words, numbers within their bounds, one branch of anyOf/oneOf, `$ref`s into the
    schema (pydantic's `$defs`)."""

    def __init__(self, root: Any, rng: Rng) -> None:
        self.root, self.rng = root, rng

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise _grammar_error(f"Unsupported $ref: {ref}")
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _grammar_error(f"Unresolvable $ref: {ref}")
        return node

    def value(self, schema: Any, depth: int = 0) -> Any:
        rng = self.rng
        if schema is True:
            return rng.words(1)
        if not isinstance(schema, dict):
            raise _grammar_error(f"Invalid schema: {json.dumps(schema)[:80]}")
        if depth > 64:
            raise _grammar_error("schema recursion too deep")
        if "$ref" in schema:
            target = self.resolve(schema["$ref"])
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            merged = {**target, **rest} if isinstance(target, dict) and rest else target
            return self.value(merged, depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return rng.pick(schema["enum"])
        if "allOf" in schema and isinstance(schema["allOf"], list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for sub in schema["allOf"]:
                if isinstance(sub, dict) and "$ref" in sub:
                    sub = self.resolve(sub["$ref"])
                if isinstance(sub, dict):
                    for k, v in sub.items():
                        if k == "properties" and isinstance(v, dict):
                            merged["properties"] = {**merged.get("properties", {}), **v}
                        elif k == "required" and isinstance(v, list):
                            merged["required"] = [*merged.get("required", []), *v]
                        else:
                            merged.setdefault(k, v)
            return self.value(merged, depth + 1)
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                rest = {k: v for k, v in schema.items() if k != key}
                pool = branches
                if depth >= _MAX_DEPTH:  # end a recursion: prefer a branch without a $ref
                    pool = [b for b in branches if "$ref" not in json.dumps(b)] or branches
                branch = rng.pick(pool)
                if isinstance(branch, dict) and rest:
                    branch = {**rest, **branch}
                return self.value(branch, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise _grammar_error("Invalid type: []")
            for k in kind:
                self._check_type(k)
            kind = "null" if depth >= _MAX_DEPTH and "null" in kind else rng.pick(kind)
        elif kind is None:
            if "properties" in schema or "required" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                kind = "string"
        self._check_type(kind)
        return getattr(self, "_" + kind)(schema, depth)

    @staticmethod
    def _check_type(kind: Any) -> None:
        if kind not in _TYPES:
            raise _grammar_error(f"Invalid type: {kind}")

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or (depth < _MAX_DEPTH and self.rng.chance()):
                out[name] = self.value(sub, depth + 1)
        for name in required:  # required but not described: any value
            if name not in out:
                out[name] = self.rng.words(1)
        extra = schema.get("additionalProperties", not props)
        want = min(int(schema.get("minProperties", 0) or 0), _MAX_SIZE)
        if extra is not False and not props and depth < _MAX_DEPTH:
            want = max(want, self.rng.between(1, 3))
        cap = schema.get("maxProperties")
        if isinstance(cap, int):
            want = min(want, cap)
        i = 0
        while len(out) < want and extra is not False:
            name = self.rng.pick(VOCAB) if i < 32 else f"key{i}"
            i += 1
            if name not in out and name not in props:
                sub = extra if isinstance(extra, dict) else {"type": "string"}
                out[name] = self.value(sub, depth + 1)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {} if not prefix else False)
        lo = min(max(int(schema.get("minItems", 0) or 0), 0), _MAX_SIZE)
        hi = schema.get("maxItems")
        if items is False:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        top = lo if depth >= _MAX_DEPTH else lo + 2
        hi = top if hi is None else min(hi, max(top, lo))
        n = self.rng.between(lo, max(lo, hi))
        out = []
        for i in range(n):
            sub = prefix[i] if i < len(prefix) else items
            out.append(self.value({} if sub is True else sub, depth + 1))
        return out

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMATS:
            return _FORMATS[fmt]
        if isinstance(schema.get("pattern"), str):
            return regex_value(schema["pattern"], self.rng, search=True)
        lo = min(int(schema.get("minLength", 0) or 0), _MAX_SIZE * 8)
        hi = schema.get("maxLength")
        text = self.rng.words(self.rng.between(1, 3))
        while len(text) < lo:
            text += " " + self.rng.words(1)
        if isinstance(hi, int):
            text = text[:hi].rstrip() if len(text[:hi].rstrip()) >= lo else text[:hi]
        return text

    def _number(self, schema: dict[str, Any], depth: int, integer: bool = False) -> float | int:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if xlo is True:  # draft 4: a boolean beside minimum
            xlo, lo = lo, None
        if xhi is True:
            xhi, hi = hi, None
        step = 1 if integer else 0.25
        low = -math.inf
        if isinstance(lo, int | float) and not isinstance(lo, bool):
            low = lo
        if isinstance(xlo, int | float) and not isinstance(xlo, bool):
            low = max(low, xlo + (1 if integer else step / 100))
        high = math.inf
        if isinstance(hi, int | float) and not isinstance(hi, bool):
            high = hi
        if isinstance(xhi, int | float) and not isinstance(xhi, bool):
            high = min(high, xhi - (1 if integer else step / 100))
        if integer:
            low = math.ceil(low) if low > -math.inf else low
            high = math.floor(high) if high < math.inf else high
        if low == -math.inf and high == math.inf:
            low, high = 0, 100
        elif low == -math.inf:
            low = high - 100
        elif high == math.inf:
            high = low + 100
        if low > high:
            raise _grammar_error("minimum is greater than maximum")
        mult = schema.get("multipleOf")
        if isinstance(mult, int | float) and not isinstance(mult, bool) and mult > 0:
            first, last = math.ceil(low / mult), math.floor(high / mult)
            if first > last:
                raise _grammar_error("no multiple of multipleOf within the bounds")
            k = self.rng.between(first, min(last, first + 100))
            v = k * mult
            return int(v) if integer else v
        if integer:
            return self.rng.between(int(low), int(min(high, low + 1000)))
        span = min(high - low, 1000.0)
        v = low + self.rng.below(int(span * 4) + 1) / 4
        v = round(min(max(v, low), high), 2)
        return v if low <= v <= high else low

    def _integer(self, schema: dict[str, Any], depth: int) -> int:
        return int(self._number(schema, depth, integer=True))

    def _boolean(self, schema: dict[str, Any], depth: int) -> bool:
        return self.rng.chance()

    def _null(self, schema: dict[str, Any], depth: int) -> None:
        return None


def json_object_value(rng: Rng) -> dict[str, Any]:
    """`json_object`: an object of one to three vocabulary keys with simple values."""
    out: dict[str, Any] = {}
    for _ in range(rng.between(1, 3)):
        key = rng.pick(VOCAB)
        kind = rng.below(3)
        if kind == 0:
            out[key] = rng.words(rng.between(1, 3))
        else:
            out[key] = rng.below(100) if kind == 1 else rng.chance()
    return out


# -- regular expressions -----------------------------------------------------------------------
_ANY_POOL = "abcdefghijklmnopqrstuvwxyz0123456789"
_CAT = {
    sre_c.CATEGORY_DIGIT: "0123456789",
    sre_c.CATEGORY_WORD: "abcdefghijklmnopqrstuvwxyz0123456789_",
    sre_c.CATEGORY_SPACE: " ",
    sre_c.CATEGORY_NOT_DIGIT: "abcdefghijklmnopqrstuvwxyz",
    sre_c.CATEGORY_NOT_WORD: " -.",
    sre_c.CATEGORY_NOT_SPACE: _ANY_POOL,
}
_PRINTABLE = [chr(c) for c in range(0x20, 0x7F)]


def _set_chars(items: list[Any]) -> list[str]:
    negate = False
    allowed: list[str] = []
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            allowed.append(chr(av))
        elif op is sre_c.RANGE:
            lo, hi = av
            allowed += [chr(c) for c in range(lo, min(hi, lo + 95) + 1)]
        elif op is sre_c.CATEGORY:
            allowed += list(_CAT.get(av, _ANY_POOL))
    if negate:
        banned = set(allowed)
        return [c for c in _PRINTABLE if c not in banned and c.isalnum()] or [
            c for c in _PRINTABLE if c not in banned
        ]
    return allowed


class _RegexGen:
    def __init__(self, rng: Rng) -> None:
        self.rng = rng
        self.groups: dict[int, str] = {}

    def seq(self, items: Any) -> str:
        return "".join(self.one(op, av) for op, av in items)

    def one(self, op: Any, av: Any) -> str:
        rng = self.rng
        if op is sre_c.LITERAL:
            return chr(av)
        if op is sre_c.NOT_LITERAL:
            return rng.pick([c for c in _ANY_POOL if ord(c) != av])
        if op is sre_c.ANY:
            return rng.pick(_ANY_POOL)
        if op is sre_c.IN:
            chars = _set_chars(av)
            if not chars:
                raise ValueError("empty character class")
            return rng.pick(chars)
        if op is sre_c.BRANCH:
            return self.seq(rng.pick(av[1]))
        if op is sre_c.SUBPATTERN:
            gid, _, _, sub = av
            text = self.seq(sub)
            if gid is not None:
                self.groups[gid] = text
            return text
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            lo = min(lo, _MAX_SIZE)
            hi = lo + 3 if hi is sre_c.MAXREPEAT else min(hi, lo + 3)
            return "".join(self.seq(sub) for _ in range(rng.between(lo, hi)))
        if op is sre_c.AT:
            return ""
        if op is sre_c.GROUPREF:
            return self.groups.get(av, "")
        if op is sre_c.ATOMIC_GROUP:
            return self.seq(av)
        if op is sre_c.CATEGORY:
            return rng.pick(_CAT.get(av, _ANY_POOL))
        raise ValueError(f"unsupported regex construct {op}")


def regex_value(pattern: str, rng: Rng, *, search: bool = False) -> str:
    """A string the pattern matches in full (`search`: a JSON schema `pattern`, which need
    only be found in the string; the generated one matches whole anyway)."""
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise bad(f"Grammar error: invalid regex {pattern!r}: {e}") from None
    for _ in range(8):
        try:
            text = _RegexGen(rng).seq(tree)
        except (ValueError, RecursionError) as e:
            raise bad(f"Failed to transform regex into a grammar: {e}") from None
        if (re.search if search else re.fullmatch)(pattern, text) is not None:
            return text
    raise bad(f"Failed to transform regex into a grammar: {pattern!r}")


# -- constraints -------------------------------------------------------------------------------
Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's constraint (vLLM's StructuredOutputsParams, one kind set)."""

    kind: Kind
    spec: Any = None  # the schema, pattern, choices or grammar

    def text(self, seed: bytes) -> str:
        try:
            return self._text(Rng(seed))
        except ApiError:
            raise
        except (AttributeError, TypeError, ValueError, KeyError, IndexError, RecursionError) as e:
            # A malformed schema (a property list that is not an object, a bound that is not
            # a number ...): vLLM's grammar compiler refuses it.
            raise bad(f"Failed to transform json schema into a grammar: {e}") from None

    def _text(self, rng: Rng) -> str:
        if self.kind == "json":
            return json.dumps(SchemaGen(self.spec, rng).value(self.spec), ensure_ascii=False)
        if self.kind == "json_object":
            return json.dumps(json_object_value(rng), ensure_ascii=False)
        if self.kind == "regex":
            return regex_value(self.spec, rng)
        return rng.pick(self.spec)

    def check(self) -> None:
        """The 400s vLLM answers before generating: the value is drawn once with a fixed seed,
        so an impossible schema or pattern fails here, not mid-request."""
        self.text(b"check")


@dataclass(frozen=True, slots=True)
class ToolMode:
    """A forced tool call: `name` for a named tool_choice (the output is its arguments),
    None for "required" (the output is a JSON array of {"name", "parameters"})."""

    name: str | None
    tools: tuple[str, ...] = field(default=())


def _schema_of_format(rf: dict[str, Any]) -> Constraint | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if js is None:
            raise bad(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                "response_format",
            )
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise bad("response_format.json_schema: a name is required", "response_format")
        schema = js.get("schema")
        if schema is None:
            raise bad(
                "You must use one kind of structured outputs constraint but none are specified"
            )
        return Constraint("json", _schema(schema))
    if kind in ("structural_tag",):
        raise ApiError(
            400,
            "structural_tag response formats are not supported by the simulator",
            param="response_format",
            code="unsupported",
        )
    raise bad(
        "response_format.type: Input should be 'text', 'json_object' or 'json_schema'",
        "response_format",
    )


def _schema(schema: Any) -> Any:
    if isinstance(schema, str):
        if not schema.strip():
            raise bad("structured_outputs.json cannot be an empty string")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise bad("Invalid JSON grammar specification.") from None
    if not isinstance(schema, dict | bool):
        raise bad("Invalid JSON grammar specification.")
    return schema


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(so: Any) -> Constraint | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad("structured_outputs: Input should be an object", "structured_outputs")
    if "structural_tag" in so and so["structural_tag"] is not None:
        raise ApiError(
            400,
            "structural_tag is not supported by the simulator",
            param="structured_outputs",
            code="unsupported",
        )
    set_ = [k for k in _SO_KINDS if so.get(k) is not None]
    if len(set_) > 1:
        raise bad(
            "You can only use one kind of structured outputs constraint but multiple are "
            f"specified: {', '.join(set_)}"
        )
    if not set_:
        raise bad("You must use one kind of structured outputs constraint but none are specified")
    kind = set_[0]
    v = so[kind]
    if kind == "json":
        return Constraint("json", _schema(v))
    if kind == "json_object":
        if v is not True:
            raise bad(
                "structured_outputs.json_object must be True if set; omit structured_outputs "
                "to disable structured outputs"
            )
        return Constraint("json_object")
    if kind == "regex":
        if not isinstance(v, str):
            raise bad("structured_outputs.regex: Input should be a valid string")
        if "\x00" in v:
            raise bad("structured_outputs.regex must not contain a NUL character ('\\x00')")
        return Constraint("regex", v)
    if kind == "choice":
        if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
            raise bad("structured_outputs.choice: Input should be a list of strings")
        if not v:
            raise bad(f"Choice '{v}' cannot be an empty list")
        return Constraint("choice", list(v))
    if not isinstance(v, str):
        raise bad("structured_outputs.grammar: Input should be a valid string")
    if not v.strip():
        raise bad("structured_outputs.grammar cannot be an empty string")
    raise ApiError(
        400,
        "structured_outputs.grammar is not supported by the simulator",
        param="structured_outputs",
        code="unsupported",
    )


def _tool_function(t: Any) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
        raise bad("tools: each tool needs a function", "tools")
    f = t["function"]
    if not isinstance(f.get("name"), str):
        raise bad("tools: each function needs a name", "tools")
    return f


def schema_value(schema: Any) -> Any:
    """A schema as a request gives it (an object, or JSON text), checked as vLLM reads it."""
    return _schema(schema)


def params_schema(f: dict[str, Any]) -> Any:
    """vLLM's _params_or_empty_object."""
    return _params(f)


def _params(f: dict[str, Any]) -> Any:
    """vLLM's _params_or_empty_object."""
    p = f.get("parameters")
    return {"type": "object", "properties": {}} if p is None else p


def required_schema(fns: list[dict[str, Any]], parallel: Any) -> dict[str, Any]:
    """vLLM's _get_json_schema_from_tools: an array of {"name", "parameters"}, at least one."""
    defs: dict[str, Any] = {}
    branches = []
    for f in fns:
        params = _params(f)
        if isinstance(params, dict) and "$defs" in params:
            params = dict(params)
            d = params.pop("$defs")
            if not isinstance(d, dict):
                raise bad(
                    f"`$defs` in the parameters of tool '{f['name']}' must be an object, got "
                    f"{type(d).__name__}.",
                    "tools",
                )
            for k, v in d.items():
                if k in defs and defs[k] != v:
                    raise bad(
                        f"Tool definition '{k}' has multiple schemas, which is not supported.",
                        "tools",
                    )
                defs[k] = v
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def chat_tools(raw: dict[str, Any]) -> tuple[Constraint | None, ToolMode | None]:
    """vLLM's check_tool_usage (its messages), then the constraint of a forced tool call."""
    tools = raw.get("tools")
    if tools == []:
        raise bad(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    choice = raw.get("tool_choice", "auto" if tools else "none")
    if choice in ("none", None):
        return None, None
    if not tools:
        raise bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise bad(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" '
            'or "required" are supported.',
            "tool_choice",
        )
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    fns = [_tool_function(t) for t in tools]
    if isinstance(choice, dict):
        fn = choice.get("function")
        if not isinstance(fn, dict):
            raise bad(
                f"Invalid value for `function`: `{fn}` in `tool_choice`! {usage}",
                "tool_choice.function",
            )
        if "name" not in fn:
            raise bad(
                f"Expected field `name` in `function` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        name = fn["name"]
        if not isinstance(name, str) or not name:
            raise bad(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        match = [f for f in fns if f["name"] == name]
        if not match:
            raise bad(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return Constraint("json", _schema(_params(match[0]))), ToolMode(name)
    if choice == "auto":
        return None, None  # vLLM without a tool parser answers text
    schema = required_schema(fns, raw.get("parallel_tool_calls"))
    return Constraint("json", schema), ToolMode(None, tuple(f["name"] for f in fns))


def chat_constraint(raw: dict[str, Any]) -> tuple[Constraint | None, ToolMode | None]:
    """The constraint of a chat request, validated as vLLM validates it: response_format and
    structured_outputs (response_format wins, as vLLM's structured_outputs_from_response_format
    overrides), and tool_choice required / named, which replaces both."""
    so = raw.get("structured_outputs")
    if isinstance(so, dict) and any(so.get(k) is not None for k in ("json", "regex", "choice")):
        n = sum(so.get(k) is not None for k in ("json", "regex", "choice"))
        if n > 1:
            raise bad(
                "You can only use one kind of constraints for structured outputs ('json', "
                "'regex' or 'choice')."
            )
        if raw.get("tool_choice", "none") not in ("none", "auto", "required"):
            raise bad(
                "You can only either use constraints for structured outputs or tools, not both."
            )
    constraint, mode = chat_tools(raw)
    if mode is not None:
        assert constraint is not None
        constraint.check()
        return constraint, mode
    constraint = completion_constraint(raw)
    return constraint, None


def completion_constraint(raw: dict[str, Any]) -> Constraint | None:
    rf = raw.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise bad("response_format: Input should be an object", "response_format")
    so = raw.get("structured_outputs")
    constraint = _schema_of_format(rf) if rf is not None else None
    if constraint is None:
        constraint = _structured_outputs(so)
    elif isinstance(so, dict):
        # vLLM replaces the format's kind in structured_outputs: any other kind set there
        # makes two.
        others = [k for k in _SO_KINDS if k != constraint.kind and so.get(k) is not None]
        if others:
            raise bad(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {', '.join([constraint.kind, *others])}"
            )
    if constraint is not None:
        constraint.check()
    return constraint


def tool_calls_of(text: str, mode: ToolMode) -> list[tuple[str, str]] | None:
    """(name, arguments) of the calls in a finished output, as vLLM's parser reads them: a
    named choice's whole text is its arguments (None when empty); "required" parses the array
    (no calls when it does not parse, e.g. cut by max_tokens)."""
    if mode.name is not None:
        return [(mode.name, text)] if text.strip() else None
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(calls, list):
        return []
    out = []
    for c in calls:
        # vLLM's FunctionDefinition: a string name, parameters an object or absent.
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return []
        params = c.get("parameters")
        if params is not None and not isinstance(params, dict):
            return []
        out.append((c["name"], json.dumps(params, ensure_ascii=False)))
    return out


class ToolStream:
    """A forced tool call's text as vLLM 0.32's parser streams it, one choice: `feed` takes
    the next text delta and returns the calls it advances, as (index, name, arguments delta),
    `name` set on a call's first delta only. A named call starts with the first text and then
    forwards every delta (an empty one too, as vLLM's last chunk carries); "required" scans the
    array of calls and streams each once its name is complete and its parameters began."""

    __slots__ = ("announced", "mode", "sent", "spans")

    def __init__(self, mode: ToolMode, script: list[str] | None) -> None:
        self.mode = mode
        self.sent = ""
        self.announced = False
        self.spans = required_spans("".join(script or ())) if mode.name is None else []

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        prev, cur = self.sent, self.sent + text
        self.sent = cur
        if self.mode.name is not None:
            if self.announced:
                return [(0, None, text)]
            if not text:
                return []
            self.announced = True
            return [(0, self.mode.name, text)]
        out: list[tuple[int, str | None, str]] = []
        n, p = len(cur), len(prev)
        for index, sp in enumerate(self.spans):
            if not (sp.name_end <= n and sp.args_start < n):
                break  # in order: nothing later is ready
            end = min(sp.args_end, n)
            if sp.name_end <= p and sp.args_start < p:
                if new := cur[min(end, p) : end]:
                    out.append((index, None, new))
                continue
            out.append((index, sp.name, cur[sp.args_start : end]))
        if out:
            self.announced = True
        return out


@dataclass(slots=True)
class CallSpan:
    """Where one call of a "required" array sits in its text (vLLM's _RequiredToolCallSpan)."""

    name: str
    name_end: int
    args_start: int
    args_end: int


def required_spans(text: str) -> list[CallSpan]:
    """The spans of the calls in the full text the simulator generated for "required" (its
    own layout: `[{"name": "f", "parameters": {...}}, ...]`)."""
    spans = []
    calls = json.loads(text)
    at = 1
    for i, c in enumerate(calls):
        if i:
            at += 2  # ", "
        head = '{"name": ' + json.dumps(c["name"], ensure_ascii=False)
        name_end = at + len(head)
        args_start = name_end + len(', "parameters": ')
        args = json.dumps(c["parameters"], ensure_ascii=False)
        spans.append(CallSpan(c["name"], name_end, args_start, args_start + len(args)))
        at = args_start + len(args) + 1  # "}"
    return spans
