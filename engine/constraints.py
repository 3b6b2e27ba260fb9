"""A request's output constraint as llguidance grammar text, and the limits it must keep to be compiled.

Torch-free, so that the compile sandbox (`engine/grammar_sandbox.py`) imports only this and llguidance.

`grammar_text(kind, text)` turns (kind, text) -- a JSON schema (`json`), a regular expression
(`regex`), a JSON list of strings (`choice`) or a Lark/GBNF grammar (`grammar`) -- into the grammar
llguidance compiles. `check_limits` refuses, before anything native sees it, what would crash,
stall or silently break the compiler or the matcher, each with a message naming the limit:

- sizes: constraint bytes, choices, a schema's nodes, properties, `$defs`, nesting and `$ref` chain
  depth (llguidance resolves references recursively: a chain of 5,000 overflowed an 8 MiB stack);
- optional properties in one object: each is about four items of llguidance's parser row, whose cap
  is 2,000 (`max_items_in_row`); an object of 500 optional properties put the matcher in error at its
  second token;
- bounded repetitions (`a{1000000}`): the expanded repetition counts of a regex (also a schema's
  `pattern`s and a grammar's text), multiplied through nested groups, are capped: past ~250,000
  llguidance's lexer runs out of expressions mid-generation;
- a JSON schema with no finite instance (a `$ref` cycle, a required property that recurses into
  itself) is refused: the matcher could only write until max_tokens, or stop in error.
"""

from __future__ import annotations

import json

from specserve.engine.errors import InvalidRequestError

GUIDED_KINDS = ("json", "regex", "choice", "grammar")

MAX_CONSTRAINT_BYTES = 2 * 1024 * 1024   # any constraint's text (a choice list's JSON included)
MAX_GRAMMAR_BYTES = 256 * 1024           # a Lark/GBNF grammar
MAX_REGEX_BYTES = 64 * 1024              # a regex (also a schema pattern)
MAX_CHOICES = 100_000                    # strings of a choice (or a schema enum: one lexeme either way)
MAX_SCHEMA_NODES = 100_000               # JSON values in a schema document
MAX_SCHEMA_PROPERTIES = 10_000           # properties over all objects of a schema
MAX_OPTIONAL_PROPERTIES = 400            # properties not required in one object
MAX_SCHEMA_DEFS = 10_000                 # entries of $defs / definitions
MAX_SCHEMA_DEPTH = 128                   # nesting of a schema document
MAX_REF_DEPTH = 2_000                    # the longest chain of $ref resolutions
MAX_REPETITION = 100_000                 # a regex's bounded repetitions, expanded


def constraint_param(kind: str) -> str:
    """The request field a constraint of `kind` is named by in errors (OpenAI's for schemas)."""
    return "response_format" if kind == "json" else "structured_outputs"


def _refuse(kind: str, message: str, over_limit: bool = True):
    what = "is over a limit: " if over_limit else ""
    raise InvalidRequestError(f"the {kind} constraint {what}{message}", constraint_param(kind))


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar of a (kind, text) request; InvalidRequestError naming what is wrong."""
    import llguidance

    M = llguidance.LLMatcher
    if kind == "json":
        schema = _schema(text)
        if schema is True or schema == {}:
            schema = {"type": "object"}
        # compact JSON: with whitespace allowed between values, a model can write newlines until max_tokens
        return M.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    if kind == "regex":
        return M.grammar_from_regex(text)
    if kind == "choice":
        # one lexeme (an uppercase Lark rule is a terminal): as alternatives of a rule, each string is an
        # item of one parser row, and past 2,000 the matcher stops in error after the first token
        return M.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in _choices(text)))
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark
        return M.grammar_from_lark(any_to_lark(text))      # GBNF converted, Lark as it is
    raise InvalidRequestError(f"unknown structured output kind {kind!r}", "structured_outputs")


def _schema(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", "response_format") from exc
    except RecursionError as exc:
        raise InvalidRequestError(f"the JSON schema is nested too deeply (the limit is {MAX_SCHEMA_DEPTH} levels)",
                                  "response_format") from exc


def _choices(text: str) -> list[str]:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("choice must be a non-empty list of strings", "structured_outputs")
    return choices


def check_limits(kind: str, text: str) -> None:
    """Refuse a constraint over any of this module's limits (InvalidRequestError naming the limit)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        _refuse(kind, f"{size} bytes (the limit is {MAX_CONSTRAINT_BYTES})")
    if kind == "regex":
        _check_regex(kind, text, "the regex")
    elif kind == "grammar":
        if size > MAX_GRAMMAR_BYTES:
            _refuse(kind, f"the grammar has {size} bytes (the limit is {MAX_GRAMMAR_BYTES})")
        _check_repetition(kind, text, "the grammar", skip_quoted=True)
    elif kind == "choice":
        n = len(_choices(text))
        if n > MAX_CHOICES:
            _refuse(kind, f"{n} choices (the limit is {MAX_CHOICES})")
    elif kind == "json":
        check_schema(_schema(text))


def _check_regex(kind: str, regex: str, what: str) -> None:
    size = len(regex.encode("utf-8", "surrogatepass"))
    if size > MAX_REGEX_BYTES:
        _refuse(kind, f"{what} has {size} bytes (the limit is {MAX_REGEX_BYTES})")
    _check_repetition(kind, regex, what)


def repetition_size(text: str, skip_quoted: bool = False) -> int:
    """The largest product of bounded repetition counts (`{m}`, `{m,n}`; the larger bound) through
    nested groups of a regex (`(a{100}){100}` is 10,000). Escapes and character classes are skipped;
    with `skip_quoted`, so are "..." strings (a Lark grammar's literals)."""
    stack = [1]            # per open group: the largest product inside it
    last_group = 1         # the product inside the group or atom just closed (what a quantifier repeats)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i, last_group = i + 2, 1
            continue
        if skip_quoted and c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i, last_group = j + 1, 1
            continue
        if c == "[":
            j = i + 1 + (i + 1 < n and text[i + 1] == "^")
            j += j < n and text[j] == "]"
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last_group = j + 1, 1
            continue
        if c == "(":
            stack.append(1)
        elif c == ")":
            last_group = stack.pop() if len(stack) > 1 else 1
            i += 1
            continue
        elif c == "{":
            j = text.find("}", i)
            body = text[i + 1:j] if j > 0 else ""
            bounds = body.split(",")
            if j > 0 and 1 <= len(bounds) <= 2 and all(b.strip().isdigit() or (k and not b.strip())
                                                       for k, b in enumerate(bounds)):
                count = max(int(b) for b in bounds if b.strip())
                stack[-1] = max(stack[-1], count * last_group)
                i, last_group = j + 1, 1
                continue
        last_group = 1
        stack[-1] = max(stack[-1], 1)
        i += 1
    return max(stack)


def _check_repetition(kind: str, text: str, what: str, skip_quoted: bool = False) -> None:
    size = repetition_size(text, skip_quoted)
    if size > MAX_REPETITION:
        _refuse(kind, f"{what} repeats {size} times through its bounded repetitions (the limit is {MAX_REPETITION})")


# ---- JSON schemas ----------------------------------------------------------------------------


def check_schema(schema) -> None:
    """A JSON schema's sizes, then whether it has a finite instance."""
    kind = "json"
    nodes, properties, defs = 0, 0, 0
    todo = [(schema, 1)]
    while todo:                      # iterative: a schema's depth is what is being checked
        node, depth = todo.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            _refuse(kind, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and not _is_literal(node):
                properties += len(props)
                required = node.get("required") if isinstance(node.get("required"), list) else []
                optional = len(set(props) - set(required))
                if optional > MAX_OPTIONAL_PROPERTIES:
                    _refuse(kind, f"an object has {optional} optional properties (the limit is "
                                  f"{MAX_OPTIONAL_PROPERTIES}; list more of them in `required`)")
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    defs += len(node[key])
            if isinstance(node.get("pattern"), str):
                _check_regex(kind, node["pattern"], "a pattern")
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_CHOICES:
                _refuse(kind, f"an enum has {len(enum)} values (the limit is {MAX_CHOICES})")
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
        if nodes > MAX_SCHEMA_NODES:
            _refuse(kind, f"the schema has more than {MAX_SCHEMA_NODES} values")
    if properties > MAX_SCHEMA_PROPERTIES:
        _refuse(kind, f"the schema has {properties} properties (the limit is {MAX_SCHEMA_PROPERTIES})")
    if defs > MAX_SCHEMA_DEFS:
        _refuse(kind, f"the schema has {defs} definitions (the limit is {MAX_SCHEMA_DEFS})")
    _Schema(schema).check()


def _is_literal(node: dict) -> bool:
    return "const" in node or "enum" in node


class _Schema:
    """A schema document's references: their chain depth, and which subschemas have a finite instance
    (the least fixpoint over references: a reference is finite once its target is shown to be)."""

    def __init__(self, root):
        self.root = root
        self.targets: dict[str, object] = {}     # "$ref" string -> the subschema it resolves to
        self.refs_in: dict[int, list[str]] = {}  # id(target) -> the $refs inside it (its subtree)
        self.finite: dict[str, bool] = {}

    def resolve(self, ref: str):
        if ref in self.targets:
            return self.targets[ref]
        node = None
        if ref == "#" or ref == "":
            node = self.root
        elif ref.startswith("#/"):
            node = self.root
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    node = None
                    break
        self.targets[ref] = node     # None: not resolved here (llguidance reports it)
        return node

    @staticmethod
    def refs_under(node) -> list[str]:
        out, todo = [], [node]
        while todo:
            n = todo.pop()
            if isinstance(n, dict):
                if isinstance(n.get("$ref"), str):
                    out.append(n["$ref"])
                todo.extend(n.values())
            elif isinstance(n, list):
                todo.extend(n)
        return out

    def check(self) -> None:
        order = self._order()          # targets, each after the targets it refers to (cycles cut)
        for _ in range(len(order) + 1):  # Kleene iteration; in that order an acyclic chain settles in one pass
            changed = False
            for ref in order:
                value = self._finite(self.targets[ref])
                if value != self.finite.get(ref, False):
                    self.finite[ref], changed = value, True
            if not changed:
                break
        if not self._finite(self.root):
            _refuse("json", "has no finite instance (a $ref cycle, or a required property or minItems that "
                            "recurses into itself without an end), so no output could ever complete it",
                    over_limit=False)

    def _order(self) -> list[str]:
        """The resolvable $refs in post-order of the reference graph; refuses a chain over MAX_REF_DEPTH."""
        order, state, depth = [], {}, {}
        for start in self.refs_under(self.root):
            if start in state or self.resolve(start) is None:
                continue
            stack = [(start, iter(self._children(start)))]
            state[start] = "open"
            while stack:
                ref, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    stack.pop()
                    state[ref] = "done"
                    depth[ref] = 1 + max((depth.get(c, 0) for c in self._children(ref) if state.get(c) == "done"),
                                         default=0)
                    if depth[ref] > MAX_REF_DEPTH:
                        _refuse("json", f"a chain of more than {MAX_REF_DEPTH} $ref resolutions")
                    order.append(ref)
                elif nxt not in state and self.resolve(nxt) is not None:
                    state[nxt] = "open"
                    stack.append((nxt, iter(self._children(nxt))))
                    if len(stack) > MAX_REF_DEPTH:
                        _refuse("json", f"a chain of more than {MAX_REF_DEPTH} $ref resolutions")
        return order

    def _children(self, ref: str) -> list[str]:
        target = self.targets[ref]
        key = id(target)
        if key not in self.refs_in:
            self.refs_in[key] = self.refs_under(target)
        return self.refs_in[key]

    def _finite(self, node) -> bool:
        """Whether `node` has a finite instance, given the current values of the references."""
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        if "$ref" in node and isinstance(node["$ref"], str):
            if self.resolve(node["$ref"]) is not None and not self.finite.get(node["$ref"], False):
                return False
        if _is_literal(node):
            return True
        for key in ("allOf",):
            if isinstance(node.get(key), list) and not all(self._finite(s) for s in node[key]):
                return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(self._finite(s) for s in node[key]):
                return False
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is not None and not types:
            return False
        if types is not None and any(t not in ("object", "array") for t in types):
            return True                # a scalar type (always finite) is among those allowed
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        objects_ok = all(self._finite(props[r]) for r in required if r in props)
        min_items = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
        arrays_ok = True
        if min_items > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            arrays_ok = all(self._finite(s) for s in prefix[:min_items])
            if min_items > len(prefix) and "items" in node:
                arrays_ok = arrays_ok and self._finite(node["items"])
        if types is None:              # untyped: held to the keywords it has (an object's, an array's)
            has_object, has_array = bool(props or required), min_items > 0
            if has_object or has_array:
                return (has_object and objects_ok) or (has_array and arrays_ok)
            return True
        return ("object" in types and objects_ok) or ("array" in types and arrays_ok)
