"""Constraints written as Lark text for llguidance: regexes, literals, EBNF, structural tags.

llguidance lexes greedily: a lexeme never ends while it can go on, so a lexeme that could
absorb what the grammar puts after it (GBNF's `word ::= [a-z]+` before `"b"`) makes valid
outputs unreachable. EBNF and the literals of structural tags are therefore written with one
character per lexeme (`_EbnfToLark`, `_chars`), not with llguidance's `gbnf_to_lark`, which
turns whole rules into lexemes (and writes `\\u00e9` as the invalid `\\ue9`). A regex or a
choice is the whole output, where greed changes nothing.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from radixlm.constrained._common import regex_literal, strip_anchors
from radixlm.constrained.errors import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The backend these errors name (llguidance_backend's NAME).
NAME = "llguidance"

# -- literals and regexes ---------------------------------------------------------------------


def lark_json(schema: Any, options: JsonCompileOptions) -> str:
    """A JSON schema as a Lark `%json` with our whitespace (llguidance's `x-guidance`)."""
    body = schema if isinstance(schema, dict) else {} if schema is True else None
    if body is None:
        raise GrammarError("a JSON schema must be an object", kind="json_schema", backend=NAME)
    return "%json " + json.dumps({**body, "x-guidance": options})


def literal(text: str) -> str:
    """`text` as one Lark string literal, one lexeme (llguidance reads JSON escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _chars(text: str) -> str:
    """`text` as a sequence of one-character lexemes (see the module doc)."""
    if not text:
        return '""'
    return "(" + " ".join(literal(char) for char in text) + ")" if len(text) > 1 else literal(text)


def _regex_text(text: str) -> str:
    """A regex matching exactly `text`, for inside a Lark `/.../`."""
    return regex_literal(text).replace("/", "\\/")


# JSON Schema's (and xgrammar's) ASCII shorthands; Rust regex nests classes, so these also
# work inside [...].
_SHORTHANDS = {
    "d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]",
    "s": "[ \\t\\n\\r\\f\\v]", "S": "[^ \\t\\n\\r\\f\\v]",
}  # fmt: skip


def lark_regex(regex: str) -> str:
    """A whole-output regex as the body of a Lark `/.../`: anchors off, `/` and control
    characters escaped, \\d \\w \\s ASCII. (llguidance's `regex_to_lark` drops a trailing
    backslash, turning a bad regex into a different good one.)"""
    regex = strip_anchors(regex)
    if (len(regex) - len(regex.rstrip("\\"))) % 2:
        raise GrammarError("the regex ends in a lone backslash", kind="regex", backend=NAME)
    out = []
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            out.append(_SHORTHANDS.get(regex[i + 1], regex[i : i + 2]))
            i += 2
            continue
        if char == "/":
            out.append("\\/")
        elif ord(char) < 0x20:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _char_class(items: list[tuple[int, int]], negated: bool) -> str:
    """A one-character regex of code point ranges, each bound escaped (Rust regex syntax)."""
    body = "".join(
        f"\\u{{{low:x}}}" if low == high else f"\\u{{{low:x}}}-\\u{{{high:x}}}"
        for low, high in items
    )
    if not body:  # [] matches nothing, [^] any character
        return "/(?s:.)/" if negated else "/[^\\s\\S]/"
    return f"/[{'^' if negated else ''}{body}]/"


# -- EBNF (xgrammar's GBNF dialect) -----------------------------------------------------------

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


class _EbnfError(Exception):
    pass


class _EbnfToLark:
    """xgrammar's EBNF (GBNF: `name ::= alternatives`, start rule `root`, whitespace and
    newlines insignificant, a rule ending where the next `name ::=` starts) as Lark rules in
    which every lexeme is one character (see the module doc)."""

    def __init__(self, text: str, prefix: str = "r_") -> None:
        self.text = text
        self.pos = 0
        self.prefix = prefix
        self.rules: dict[str, str] = {}
        self.used: dict[str, int] = {}

    def convert(self) -> tuple[list[str], str]:
        """The Lark rules and the Lark name of the root rule."""
        self.space()
        while self.pos < len(self.text):
            name = self.name()
            if name in self.rules:
                raise self.error(f"rule {name!r} is defined twice")
            self.space()
            if not self.text.startswith("::=", self.pos):
                raise self.error("expected '::='")
            self.pos += 3
            self.rules[name] = self.alternatives()
            self.space()
        if "root" not in self.rules:
            raise _EbnfError("the grammar has no rule named 'root' (its start rule)")
        for name, at in self.used.items():
            if name not in self.rules:
                self.pos = at
                raise self.error(f"rule {name!r} is not defined")
        return [f"{self.lark_name(n)}: {body}" for n, body in self.rules.items()], self.lark_name(
            "root"
        )

    def lark_name(self, name: str) -> str:
        return self.prefix + re.sub(r"[^A-Za-z0-9_]", lambda m: f"_{ord(m.group()):x}_", name)

    def error(self, message: str) -> _EbnfError:
        line = self.text.count("\n", 0, self.pos) + 1
        column = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
        return _EbnfError(f"{message} at line {line}, column {column}")

    def space(self) -> None:
        text = self.text
        while self.pos < len(text):
            if text[self.pos] in " \t\r\n":
                self.pos += 1
            elif text[self.pos] == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            else:
                break

    def peek(self) -> str:
        self.space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def name(self) -> str:
        found = _NAME.match(self.text, self.pos)
        if not found:
            raise self.error("expected a rule name")
        self.pos = found.end()
        return found.group()

    def at_rule_start(self) -> bool:
        found = _NAME.match(self.text, self.pos)
        return found is not None and self.text[found.end() :].lstrip(" \t\r\n").startswith("::=")

    def alternatives(self) -> str:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return " | ".join(options)

    def sequence(self) -> str:
        items: list[str] = []
        while (char := self.peek()) and char not in "|)" and not self.at_rule_start():
            items.append(self.quantified(self.item()))
        if not items:
            raise self.error("expected an element")
        return " ".join(items)

    def item(self) -> str:
        char = self.text[self.pos]
        if char == '"':
            return _chars(self.string())
        if char == "[":
            return self.char_class()
        if char == "(":
            self.pos += 1
            if self.text.startswith("=", self.pos):
                raise self.error("lookahead assertions '(= ...)' are not supported by llguidance")
            inner = self.alternatives()
            if self.peek() != ")":
                raise self.error("expected ')'")
            self.pos += 1
            return f"({inner})"
        if _NAME.match(self.text, self.pos):
            start = self.pos
            name = self.name()
            self.used.setdefault(name, start)
            return self.lark_name(name)
        raise self.error(f"unexpected {char!r}")

    def quantified(self, item: str) -> str:
        char = self.text[self.pos] if self.pos < len(self.text) else ""
        if char in ("*", "+", "?"):
            self.pos += 1
            return f"({item}){char}"
        if char != "{":
            return item
        found = _REPEAT.match(self.text, self.pos)
        if not found:
            raise self.error("expected a repetition {m}, {m,} or {m,n}")
        self.pos = found.end()
        low = int(found.group(1))
        high = found.group(3) if found.group(2) else found.group(1)
        if high and int(high) < low:
            raise self.error(f"the repetition's upper bound {high} is below {low}")
        return f"({item}){{{low},{high}}}"

    def char(self) -> str:
        """One character of a literal or class, its escape decoded."""
        text = self.text
        if self.pos >= len(text):
            raise self.error("unterminated literal or character class")
        char = text[self.pos]
        self.pos += 1
        if char != "\\":
            return char
        code = text[self.pos] if self.pos < len(text) else ""
        self.pos += 1
        if code in _ESCAPES:
            return _ESCAPES[code]
        size = _HEX_DIGITS.get(code)
        digits = text[self.pos : self.pos + size] if size else ""
        if not size or len(digits) != size or not re.fullmatch("[0-9a-fA-F]+", digits):
            raise self.error(f"invalid escape \\{code}{digits}")
        self.pos += size
        value = int(digits, 16)
        if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
            raise self.error(f"invalid code point \\{code}{digits}")
        return chr(value)

    def string(self) -> str:
        self.pos += 1  # the opening quote
        out = []
        while not self.text.startswith('"', self.pos):
            out.append(self.char())
        self.pos += 1
        return "".join(out)

    def char_class(self) -> str:
        self.pos += 1  # [
        negated = self.text.startswith("^", self.pos)
        self.pos += negated
        items: list[tuple[int, int]] = []
        while not self.text.startswith("]", self.pos):
            low = high = ord(self.char())
            if self.text.startswith("-", self.pos) and not self.text.startswith("-]", self.pos):
                self.pos += 1
                high = ord(self.char())
                if high < low:
                    raise self.error(f"invalid character range {chr(low)!r}-{chr(high)!r}")
            items.append((low, high))
        self.pos += 1
        return _char_class(items, negated)


def ebnf_to_lark(source: str) -> str:
    try:
        rules, root = _EbnfToLark(source).convert()
    except _EbnfError as error:
        raise GrammarError(
            f"the ebnf constraint does not compile: {error}", kind="ebnf", backend=NAME
        ) from None
    return "\n".join([f"start: {root}", *rules])


# -- structural tags --------------------------------------------------------------------------

_ANY_TEXT = "/(?s:.*)/"


class TagToLark:
    """xgrammar's structural tag formats as Lark, where llguidance expresses them exactly:
    const_string, json_schema (style json), grammar (EBNF), sequence, or, optional, tag (string
    begin, end or ends), any_text (a tag's content, up to its end; or the end of the output),
    triggered_tags and tags_with_separator (at the end of the output).

    The text before a triggered tag is one lazy lexeme ending at the first trigger, so that a
    trigger always opens a tag; the text after the last tag holds no trigger."""

    def __init__(self, json_options: JsonCompileOptions) -> None:
        self.json_options = json_options
        self.rules: list[str] = []
        self.count = 0

    def convert(self, node: Any) -> str:
        start = self.format(node, last=True)
        return "\n".join([f"start: {start}", *self.rules])

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"t_{self.count}"
        self.count += 1
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    @staticmethod
    def unsupported(what: str) -> GrammarError:
        return GrammarError(
            f"the structural tag uses {what}, which the llguidance backend cannot enforce "
            "exactly; use the xgrammar backend for it",
            kind="structural_tag",
            backend=NAME,
        )

    @staticmethod
    def invalid(message: str) -> GrammarError:
        return GrammarError(f"the structural tag is malformed: {message}", kind="structural_tag")

    def format(self, node: Any, last: bool, end: str | None = None) -> str:
        """Lark for `node`; `last`: nothing follows it; `end`: the end of the enclosing tag."""
        if not isinstance(node, dict):
            raise self.invalid("a format must be an object")
        kind = node.get("type")
        if node.get("excludes"):
            raise self.unsupported(f"'excludes' in a {kind} format")
        if kind == "const_string":
            return _chars(str(node.get("value", "")))
        if kind == "json_schema":
            if node.get("style", "json") != "json":
                raise self.unsupported(f"a json_schema of style {node.get('style')!r}")
            return lark_json(node.get("json_schema"), self.json_options)
        if kind in ("sequence", "or"):
            elements = node.get("elements")
            if not isinstance(elements, list) or not elements:
                raise self.invalid(f"a {kind} format needs elements")
            if kind == "or":
                return "(" + " | ".join(self.format(e, last) for e in elements) + ")"
            tail = len(elements) - 1
            return (
                "("
                + " ".join(self.format(e, last and i == tail) for i, e in enumerate(elements))
                + ")"
            )
        if kind == "optional":
            return f"({self.format(node.get('content'), last)})?"
        if kind == "tag":
            return self.tag(node)
        if kind == "any_text" and (end is not None or last):
            return self.rule(f"{_ANY_TEXT} {end}", lazy=True) if end is not None else _ANY_TEXT
        if kind == "grammar" and node.get("syntax", "ebnf") == "ebnf":
            try:
                rules, root = _EbnfToLark(str(node.get("grammar", "")), f"g{self.count}_").convert()
            except _EbnfError as error:
                raise self.invalid(f"its grammar does not compile: {error}") from None
            self.count += 1
            self.rules.extend(rules)
            return root
        if kind in ("triggered_tags", "tags_with_separator") and last:
            return self.triggered(node) if kind == "triggered_tags" else self.separated(node)
        if kind in ("any_text", "triggered_tags", "tags_with_separator"):
            raise self.unsupported(f"{kind} where something follows it")
        raise self.unsupported(f"a {kind!r} format")

    def tag(self, node: dict[str, Any], head: str | None = None) -> str:
        begin, end = node.get("begin"), node.get("end")
        ends: list[Any] = end if isinstance(end, list) else [end]
        if not isinstance(begin, str) or not ends or not all(isinstance(e, str) for e in ends):
            raise self.unsupported("a tag whose begin or end is not a string (a token)")
        closing = "(" + " | ".join(_chars(e) for e in ends) + ")"
        content = node.get("content", {"type": "const_string", "value": ""})
        if isinstance(content, dict) and content.get("type") == "any_text" and len(ends) == 1:
            body = self.format(content, last=False, end=literal(ends[0]))  # lazy up to the end
            closing = ""
        else:
            body = self.format(content, last=False)
        return self.rule(f"{_chars(begin) if head is None else head} {body} {closing}".strip())

    def tags_of(self, node: dict[str, Any]) -> list[dict[str, Any]]:
        tags = node.get("tags")
        if not isinstance(tags, list) or not tags or not all(isinstance(t, dict) for t in tags):
            raise self.invalid("it needs a list of tags")
        return tags

    def triggered(self, node: dict[str, Any]) -> str:
        triggers = node.get("triggers")
        if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
            raise self.invalid("triggered tags need non-empty trigger strings")
        if not triggers:
            raise self.invalid("triggered tags need at least one trigger")
        # Text holding no trigger: a terminal, as `&` and `~` work on lexemes only.
        text = f"TEXT_{self.count}"
        self.count += 1
        self.rules.append(
            f"{text}: /(?s:.*)/ & ~/(?s:.*)({'|'.join(map(_regex_text, triggers))})(?s:.*)/"
        )
        reach: dict[str, str] = {}
        direct, after_text = [], []
        for tag in self.tags_of(node):
            begin = str(tag.get("begin"))
            owners = [t for t in triggers if begin.startswith(t)]
            if not isinstance(tag.get("begin"), str) or len(owners) != 1:
                raise self.invalid(f"the tag beginning {begin!r} must start with one trigger")
            trigger = owners[0]
            if trigger not in reach:  # text up to (and with) the first trigger
                reach[trigger] = self.rule(f"{text} {literal(trigger)}", lazy=True)
            direct.append(self.tag(tag))
            after_text.append(self.tag(tag, f"{reach[trigger]} {_chars(begin[len(trigger) :])}"))
        final = self.rule(text)
        first = "(" + " | ".join(direct) + ")"
        later = "(" + " | ".join(after_text) + ")"
        if node.get("at_least_one"):  # the output starts with a tag
            return first if node.get("stop_after_first") else f"{first} {later}* {final}"
        return f"({later} | {final})" if node.get("stop_after_first") else f"{later}* {final}"

    def separated(self, node: dict[str, Any]) -> str:
        one = "(" + " | ".join(self.tag(tag) for tag in self.tags_of(node)) + ")"
        if node.get("stop_after_first"):
            return one if node.get("at_least_one") else f"{one}?"
        many = f"{one} ({_chars(str(node.get('separator', '')))} {one})*"
        return many if node.get("at_least_one") else f"({many})?"
