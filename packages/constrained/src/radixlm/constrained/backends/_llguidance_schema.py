"""JSON schemas too large for llguidance's JSON compiler, written as Lark: the outer structure as
rules, every small part as one `%json` block.

llguidance's JSON compiler refuses a schema past a fixed size (about 16,000 subschemas,
whatever the parser limits say), but a Lark grammar may hold any number of `%json` blocks, each
compiled on its own, and llguidance builds lexer and parser states only as the output needs
them. `write_large_schema` writes a normalized schema (`_schema.py`) as:

- objects (`properties`, `required`, `additionalProperties`), arrays (`prefixItems`, `items`,
  `minItems`, `maxItems`), `anyOf` and the parts of a schema of several types as Lark rules;
- every `$ref` as the rule of its definition, written once (recursion stays recursion);
- every subtree of at most `BLOCK_NODES` subschemas, the definitions it refers to included, as
  one `%json` block that carries those definitions, and so every part that rules cannot
  express, up to `FALLBACK_NODES`. A block (by its JSON text) and a rule (by its body) are
  written once, so repeated subtrees share one rule.

The rules follow llguidance's own JSON compiler (`parser/src/json/compiler.rs`): members in the
schema's order, optional ones free to be absent, further members (`additionalProperties`) after
the listed ones under names that are not listed; the blocks' separators and `x-guidance`
options, and whitespace exactly where a block allows it (one run of the whitespace pattern
between two tokens, none around the document). What rules cannot express (`patternProperties`,
`maxProperties`, ...) must fit in a block; a larger such part is a `GrammarError` naming it.

An llguidance grammar holds at most 65,535 symbols, and every occurrence of a literal is a
symbol of its own: separators, brackets, whitespace and repeated member names are shared rules,
and an optional member costs about two symbols (its name and its optional group).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixlm.constrained.backends._llguidance_lark import NAME, literal
from radixlm.constrained.errors import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: A schema with more subschemas than this is written here (llguidance's JSON compiler takes
#: about 16,000 of the simplest ones).
LARGE_NODES = 10_000
#: A subtree of at most this many subschemas (with the definitions it refers to) is one block.
#: Small, because rules cost fewer grammar symbols than llguidance's JSON compiler spends on
#: the same objects (measured: 500 objects of 12 subschemas, 2,059 symbols as rules and 29,008
#: as blocks).
BLOCK_NODES = 8
#: A part that rules cannot express (`patternProperties`, `maxProperties`, long arrays) is one
#: block up to this size, the definitions it refers to included.
FALLBACK_NODES = 2_000
# Arrays whose bounds or prefix pass this (llguidance unrolls them) go into a block.
_MAX_UNROLLED_ITEMS = 100
_EMPTY = '""'
_MEMBERS_PER_RULE = 8  # object members written in one rule before splitting in halves
# Names of members `properties` does not list, as llguidance's JSON compiler writes them
# (measured on llguidance 1.9): where no property is listed, a JSON string as it writes strings
# (characters raw but for the quote, the backslash and control characters, \uXXXX only for
# control characters without a short escape and DEL); beside listed properties, any character
# also as \uXXXX (surrogates in pairs), less the listed names as written.
_ANY_NAME = r'/"([^"\\\x00-\x1F\x7F]|\\(["\\bfnrt]|u00[01][0-9a-fA-F]|u007[fF]))*"/'
_OTHER_NAME = (
    r'/"([^"\\\x00-\x1F\x7F]|\\(["\\bfnrt]|u([0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}'
    r'|[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})))*"/'
)
_OBJECT_KEYS = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KEYS = frozenset({"items", "prefixItems", "minItems", "maxItems"})
_OBJECT_ONLY = _OBJECT_KEYS | {
    "patternProperties", "minProperties", "maxProperties", "propertyNames",
    "unevaluatedProperties", "dependentRequired", "dependentSchemas", "dependencies",
}  # fmt: skip
_ARRAY_ONLY = _ARRAY_KEYS | {
    "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedItems",
}  # fmt: skip
_SCALAR_KEYS = frozenset({
    "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format",
})  # fmt: skip
_SCALAR_TYPES = ("null", "boolean", "number", "string")
_KNOWN = _OBJECT_ONLY | _ARRAY_ONLY | _SCALAR_KEYS | {"type", "anyOf"}
# Rule names in a rule body, outside its string literals: the rules it refers to.
_NAMES = re.compile(r'"(?:[^"\\]|\\.)*"|\b([a-z][a-z0-9_]*)\b')
# Where subschemas sit: in a map of them, a list of them, or alone.
_APPLICATORS = {
    **dict.fromkeys(("properties", "patternProperties", "dependentSchemas"), "map"),
    **dict.fromkeys(("$defs", "definitions"), "map"),
    **dict.fromkeys(("prefixItems", "anyOf", "oneOf", "allOf"), "list"),
    **dict.fromkeys(
        ("additionalProperties", "items", "contains", "not", "if", "then", "else",
         "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems"),
        "one",
    ),
}  # fmt: skip


def subschemas(schema: Any) -> list[Any]:
    """The subschemas directly inside `schema` (definitions included)."""
    out: list[Any] = []
    if not isinstance(schema, dict):
        return out
    for key, found in schema.items():
        where = _APPLICATORS.get(key)
        if where == "map" and isinstance(found, dict):
            out.extend(found.values())
        elif where == "list" and isinstance(found, list):
            out.extend(found)
        elif where == "one" and isinstance(found, (dict, bool)):
            out.append(found)
    return out


def count_nodes(schema: Any) -> int:
    """How many subschemas `schema` holds, itself and its definitions included."""
    count = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(subschemas(node))
    return count


@dataclass(frozen=True, slots=True)
class LargeSchema:
    """A schema written as Lark (`text`, without the `%llguidance` header) and the figures that
    size llguidance's limits and stack for it: `nodes` subschemas, `width` the most
    alternatives one parser row may start (optional members, `anyOf` branches), `depth` a bound
    on how deep rules refer to rules (llguidance compiles them recursively), `rules` and
    `blocks` how many of each were written."""

    text: str
    nodes: int
    width: int
    depth: int
    rules: int
    blocks: int


def write_large_schema(
    schema: dict[str, Any], options: JsonCompileOptions, *, block_nodes: int = BLOCK_NODES
) -> LargeSchema:
    """`schema` (normalized: its definitions under the root's `$defs` / `definitions`, every
    `$ref` to one of them or to `#`) as Lark whose JSON is what `%json` with `options` allows,
    subtrees of at most `block_nodes` subschemas as blocks; `GrammarError` for a part that
    neither rules nor a block can take."""
    return _Writer(schema, options, block_nodes).write()


class _Writer:
    def __init__(
        self, schema: dict[str, Any], options: JsonCompileOptions, block_nodes: int
    ) -> None:
        self.block_nodes = block_nodes
        self.root = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
        self.definitions: dict[str, Any] = {}  # "#/$defs/name" -> schema
        for container in ("$defs", "definitions"):
            for name, target in (schema.get(container) or {}).items():
                self.definitions[f"#/{container}/{_pointer_part(name)}"] = target
        self.nodes = count_nodes(schema)
        self.options = options
        self.lines: list[str] = []
        self.edges: dict[str, list[str]] = {}  # rule -> the rules its body names
        self.bodies: dict[str, str] = {}  # body -> rule
        self.blocks: dict[str, str] = {}  # block JSON -> rule
        self.named: dict[str, str] = {}  # $ref -> rule
        self.pending: list[tuple[str, str]] = []  # ($ref, rule) still to write
        self.sizes: dict[int, tuple[Any, int]] = {}  # id -> (the node, kept alive; its size)
        self.carried: dict[str, frozenset[str] | None] = {}
        self.terminals = 0
        self.width = block_nodes  # grows with the largest block (rows inside it)
        self.punctuation(options)
        names: Counter[str] = Counter()
        stack = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, dict) and isinstance(node.get("properties"), dict):
                names.update(node["properties"].keys())
            stack.extend(subschemas(node))
        self.shared_names = {name for name, count in names.items() if count > 1}

    def punctuation(self, options: JsonCompileOptions) -> None:
        """Separators and brackets as rules, with whitespace (one run of the pattern, or none)
        between every two tokens when it is flexible."""
        comma = literal(str(options.get("item_separator") or ","))
        colon = literal(str(options.get("key_separator") or ":"))
        pattern = options.get("whitespace_pattern")
        space = " ws " if pattern else " "
        rules = {
            "sep": f"{space}{comma}{space}",
            "colon": f"{space}{colon}{space}",
            "lbrace": f'"{{"{space}',
            "rbrace": f'{space}"}}"',
            "eobj": f'"{{"{space}"}}"',
            "lbrack": f'"["{space}',
            "rbrack": f'{space}"]"',
            "earr": f'"["{space}"]"',
        }
        if pattern:
            escaped = str(pattern).replace("/", "\\/")
            self.lines += ['ws: WS | ""', f"WS: /{escaped}/"]
            self.edges["ws"] = []
        for name, body in rules.items():
            self.lines.append(f"{name}: {body.strip()}")
            self.edges[name] = ["ws"] if pattern else []

    # -- output -----------------------------------------------------------------------------

    def write(self) -> LargeSchema:
        self.carry_definitions()
        start = self.value(self.root, "")
        while self.pending:
            ref, rule = self.pending.pop()
            target = self.value(self.definitions[ref], ref[1:]) if ref != "#" else start
            self.lines.append(f"{rule}: {target}")
            self.edges[rule] = [target]
        self.lines.append(f"start: {start}")
        self.edges["start"] = [start]
        return LargeSchema(
            text="\n".join(self.lines),
            nodes=self.nodes,
            width=self.width,
            depth=_depth_bound(self.edges, "start"),
            rules=len(self.edges),
            blocks=len(self.blocks),
        )

    def rule(self, body: str) -> str:
        """The rule with this body, written once."""
        found = self.bodies.get(body)
        if found is None:
            found = self.bodies[body] = f"r{len(self.bodies)}"
            self.lines.append(f"{found}: {body}")
            self.edges[found] = [name for name in _NAMES.findall(body) if name]
        return found

    # -- sizes and blocks -------------------------------------------------------------------

    def size(self, node: Any) -> int:
        """Subschemas in `node`, not following references."""
        found = self.sizes.get(id(node))
        if found is None:
            found = self.sizes[id(node)] = (node, 1 + sum(map(self.size, subschemas(node))))
        return found[1]

    def carry_definitions(self) -> None:
        """For each definition, the definitions a block of it carries (itself and all it refers
        to, transitively), or None where they hold more than `FALLBACK_NODES` subschemas (or
        `block_nodes`, if more) or refer to the root. Strongly connected definitions share
        one answer."""
        most = max(FALLBACK_NODES, self.block_nodes)
        graph = {ref: sorted(_refs(target)) for ref, target in self.definitions.items()}
        for component in _components(graph):  # each after every component it refers to
            members = frozenset(component)
            carried: set[str] | None = set(members)
            for ref in component:
                for target in graph[ref]:
                    if target in members:
                        continue
                    inner = self.carried.get(target)  # None for "#" too
                    if inner is None or carried is None:
                        carried = None
                        break
                    carried |= inner
            if carried is not None:
                total = sum(self.size(self.definitions[ref]) for ref in carried)
                carried = carried if total <= most else None
            for ref in component:
                self.carried[ref] = None if carried is None else frozenset(carried)

    def block(self, node: Any, most: int) -> str | None:
        """`node` as the rule of one `%json` block, or None when it holds more than `most`
        subschemas with the definitions it refers to."""
        if self.size(node) > most:
            return None
        carried: set[str] = set()
        for ref in _refs(node):
            inner = self.carried.get(ref)
            if inner is None:
                return None
            carried |= inner
        total = self.size(node) + sum(self.size(self.definitions[r]) for r in carried)
        if total > most:
            return None
        self.width = max(self.width, total)
        body = dict(node)
        for ref in sorted(carried):
            container, _, name = ref[2:].partition("/")
            body.setdefault(container, {})[name.replace("~1", "/").replace("~0", "~")] = (
                self.definitions[ref]
            )
        body["x-guidance"] = self.options
        text = json.dumps(body, separators=(",", ":"))
        found = self.blocks.get(text)
        if found is None:
            found = self.blocks[text] = f"j{len(self.blocks)}"
            self.lines.append(f"{found}: %json {text}")
            self.edges[found] = []
        return found

    # -- schemas ----------------------------------------------------------------------------

    def value(self, node: Any, path: str) -> str:
        """The rule for the values of `node`, the subschema at `path`."""
        if node is True:
            node = {}
        if not isinstance(node, dict):  # normalization leaves `false` only where it is read
            raise GrammarError(
                f"JSON schema at {path or '/'}: the schema `false` allows no value",
                kind="json_schema",
                backend=NAME,
                path=path or "/",
            )
        if set(node) == {"$ref"}:
            return self.definition(node["$ref"], path)
        found = self.block(node, self.block_nodes)
        if found is not None:
            return found
        unknown = sorted(set(node) - _KNOWN)
        if unknown or ("anyOf" in node and len(node) > 1):
            found = self.block(node, FALLBACK_NODES)
            if found is None:
                keyword = (unknown or sorted(set(node) - {"anyOf"}))[0]
                raise self.too_large(path, keyword, f"{keyword!r} there")
            return found
        if "anyOf" in node:
            branches = [self.value(b, f"{path}/anyOf/{i}") for i, b in enumerate(node["anyOf"])]
            unique = list(dict.fromkeys(branches))
            self.width = max(self.width, len(unique))
            return self.rule(" | ".join(unique))
        parts = []
        for kind, part in _by_type(node):
            if kind == "object":
                parts.append(self.object(part, path))
            elif kind == "array":
                parts.append(self.array(part, path))
            else:
                found = self.block(part, 1)
                if found is None:  # pragma: no cover - scalar keywords hold no subschemas
                    raise self.too_large(path, "type", "scalar keywords")
                parts.append(found)
        return parts[0] if len(parts) == 1 else self.rule(" | ".join(parts))

    def definition(self, ref: str, path: str) -> str:
        """The rule of the definition `ref` points to (written once, after the rest)."""
        found = self.named.get(ref)
        if found is None:
            if ref != "#" and ref not in self.definitions:
                raise GrammarError(
                    f"JSON schema at {path or '/'}: $ref {ref!r} points to nothing",
                    kind="json_schema",
                    backend=NAME,
                    keyword="$ref",
                    path=path or "/",
                )
            found = self.named[ref] = f"d{len(self.named)}"
            self.pending.append((ref, found))
        return found

    def object(self, node: dict[str, Any], path: str) -> str:
        other = sorted(set(node) - _OBJECT_KEYS - {"type"})
        if other:
            found = self.block(node, FALLBACK_NODES)
            if found is None:
                raise self.too_large(path, other[0], f"{other[0]!r} on an object")
            return found
        required = set(node.get("required", ()))
        members: list[tuple[str, bool]] = []
        listed: list[str] = []
        for name, subschema in node.get("properties", {}).items():
            quoted = literal(json.dumps(name, ensure_ascii=False))  # as serde_json writes it
            listed.append(quoted)
            key = self.rule(quoted) if name in self.shared_names else quoted
            value = self.value(subschema, f"{path}/properties/{_pointer_part(name)}")
            members.append((f"{key} colon {value}", name in required))
        extra = node.get("additionalProperties", True)
        if extra is not False:
            value = self.value(extra, f"{path}/additionalProperties")
            one = f"{self.other_names(listed)} colon {value}"
            members.append((self.rule(f"{one} (sep {one})*"), False))
        self.width = max(self.width, sum(not needed for _, needed in members) + 1)
        if not members:
            return "eobj"
        sequence = _Members(self, members)
        if sequence.required(0, len(members)):
            return self.rule(f"lbrace {sequence.unprefixed(0, len(members))} rbrace")
        return self.rule(f"eobj | lbrace {sequence.nonempty(0, len(members))} rbrace")

    def other_names(self, listed: list[str]) -> str:
        """A terminal for the names of members `properties` does not list (as llguidance's
        JSON compiler writes it)."""
        name = f"NAME{self.terminals}"
        self.terminals += 1
        if listed:
            self.lines.append(f"{name}: {_OTHER_NAME} & ~({' | '.join(listed)})")
        else:
            self.lines.append(f"{name}: {_ANY_NAME}")
        return self.rule(name)

    def array(self, node: dict[str, Any], path: str) -> str:
        other = sorted(set(node) - _ARRAY_KEYS - {"type"})
        prefix: list[Any] = node.get("prefixItems", [])
        low: int = node.get("minItems", 0)
        high: int | None = node.get("maxItems")
        if not other and max(len(prefix), low, high or 0) > _MAX_UNROLLED_ITEMS:
            other = ["maxItems" if high else "minItems" if low else "prefixItems"]
        if other:
            found = self.block(node, FALLBACK_NODES)
            if found is None:
                raise self.too_large(path, other[0], f"{other[0]!r} on an array")
            return found
        items = node.get("items", True)
        slots = [self.value(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        tail = None if items is False else self.value(items, f"{path}/items")
        # As llguidance writes arrays: positions up to maxItems (or up to the prefix and
        # minItems, then any number of `items`), the first minItems of them required, every
        # further one present only after the one before it.
        if tail is None:
            length = len(slots) if high is None else min(high, len(slots))
        else:
            length = max(len(slots), low) if high is None else high
        endless = tail is not None and high is None
        if low:
            (first, count), *more = _positions(slots, tail, 0, low)
            head = [first] + ([_repeated(first, count - 1)] if count > 1 else [])
            head += [_repeated(name, n) for name, n in more]
            rest = _optional(slots, tail, low, length, endless)
            return self.rule(f"lbrack {' '.join(head)} {rest} rbrack".replace("  ", " "))
        if length == 0 and not endless:
            return "earr"
        if length:
            first = _positions(slots, tail, 0, 1)[0][0]
            rest = _optional(slots, tail, 1, length, endless)
        else:
            first, rest = str(tail), f"(sep {tail})*"
        return self.rule(f"earr | lbrack {first} {rest} rbrack".replace("  ", " "))

    # -- errors -----------------------------------------------------------------------------

    def too_large(self, path: str, keyword: str | None, what: str) -> GrammarError:
        return GrammarError(
            f"JSON schema at {path or '/'}: a schema of more than {LARGE_NODES} subschemas "
            "compiles on llguidance as grammar rules, with what rules cannot express left to its "
            f"JSON compiler in parts of at most {FALLBACK_NODES} subschemas (the definitions "
            f"they refer to included); rules cannot express {what}, and this part is larger; "
            f"simplify it, or move {keyword or 'it'} into a smaller subschema",
            kind="json_schema",
            backend=NAME,
            keyword=keyword,
            path=path or "/",
            limit="block_nodes",
        )


class _Members:
    """The members of an object in the schema's order, each required or not, as Lark rules
    (llguidance's `ordered_sequence`). Of a run of members, `prefixed` writes a separator
    before each present one, `unprefixed` none before the first, `nonempty` is `unprefixed`
    with at least one present. Runs are halves of halves, so that rules refer to rules about
    log2(n) deep (llguidance compiles references recursively); within a short run each
    member is one rule, "this member and the rest, or the rest", so that each costs one
    symbol (an optional group `(...)?` is a symbol of its own each time it is written)."""

    def __init__(self, writer: _Writer, members: list[tuple[str, bool]]) -> None:
        self.rule = writer.rule
        self.members = members
        self.counts = [0]
        for _, needed in members:
            self.counts.append(self.counts[-1] + needed)

    def required(self, low: int, high: int) -> bool:
        return self.counts[high] > self.counts[low]

    def prefixed(self, low: int, high: int) -> str:
        if high - low > _MEMBERS_PER_RULE:
            middle = (low + high) // 2
            return self.rule(f"{self.prefixed(low, middle)} {self.prefixed(middle, high)}")
        rest = ""
        for member, needed in reversed(self.members[low:high]):
            present = f"sep {member} {rest}".strip()
            rest = self.rule(present if needed else f"{present} | {rest or _EMPTY}")
        return rest

    def unprefixed(self, low: int, high: int) -> str:
        """Only for runs with a required member (never empty)."""
        if high - low <= _MEMBERS_PER_RULE:
            options = []
            for first in range(low, high):
                member, needed = self.members[first]
                options.append(f"{member} {self.prefixed(first + 1, high)}".strip())
                if needed:
                    break
            return self.rule(" | ".join(options))
        middle = (low + high) // 2
        if self.required(low, middle):
            return self.rule(f"{self.unprefixed(low, middle)} {self.prefixed(middle, high)}")
        return self.rule(
            f"{self.nonempty(low, middle)} {self.prefixed(middle, high)} | "
            f"{self.unprefixed(middle, high)}"
        )

    def nonempty(self, low: int, high: int) -> str:
        """Only for runs of optional members."""
        if high - low <= _MEMBERS_PER_RULE:
            return self.rule(
                " | ".join(
                    f"{self.members[first][0]} {self.prefixed(first + 1, high)}".strip()
                    for first in range(low, high)
                )
            )
        middle = (low + high) // 2
        return self.rule(
            f"{self.nonempty(low, middle)} {self.prefixed(middle, high)} | "
            f"{self.nonempty(middle, high)}"
        )


def _positions(slots: list[str], tail: str | None, start: int, stop: int) -> list[tuple[str, int]]:
    """The items of an array at positions start..stop-1: (rule, 1) for each prefix item, then
    (`tail`, how many) for the positions past the prefix."""
    out = [(slot, 1) for slot in slots[start:stop]]
    extra = stop - max(start, len(slots))
    if extra > 0 and tail is not None:
        out.append((tail, extra))
    return out


def _repeated(name: str, count: int) -> str:
    """`count` more items of `name`, each after a separator."""
    return f"sep {name}" if count == 1 else f"(sep {name}){{{count},{count}}}"


def _optional(slots: list[str], tail: str | None, start: int, stop: int, endless: bool) -> str:
    """The array items at positions start..stop-1, each present only after the one before it,
    then (`endless`) any number of `tail` items."""
    rest = f"(sep {tail})*" if endless else ""
    for name, count in reversed(_positions(slots, tail, start, stop)):
        if count > 1:  # the positions past the prefix, last of all
            rest = f"(sep {name}){{0,{count}}}"
        else:
            rest = f"(sep {name} {rest})?" if rest else f"(sep {name})?"
    return rest


def _pointer_part(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _by_type(node: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """`node` split by the types it allows, each part with its own keywords (a keyword applies
    to values of its type only): the object part, the array part, one part for the scalars."""
    declared = node.get("type")
    kinds = [declared] if isinstance(declared, str) else declared
    parts: list[tuple[str, dict[str, Any]]] = []
    for kind, keywords in (("object", _OBJECT_ONLY), ("array", _ARRAY_ONLY)):
        if kinds is None or kind in kinds:
            part = {k: v for k, v in node.items() if k in keywords}
            parts.append((kind, {"type": kind, **part}))
    scalars = [k for k in (kinds or _SCALAR_TYPES) if k not in ("object", "array")]
    if scalars:
        rest = {k: v for k, v in node.items() if k in _SCALAR_KEYS}
        parts.append(("scalar", {"type": scalars[0] if len(scalars) == 1 else scalars, **rest}))
    return parts


def _refs(node: Any) -> set[str]:
    """The `$ref`s inside `node`, not following them."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict) and isinstance(item.get("$ref"), str):
            found.add(item["$ref"])
        stack.extend(subschemas(item))
    return found


def _components(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of `graph`, each after every component it reaches
    (Tarjan's algorithm, without recursion); edges to nodes outside `graph` are ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, at = work.pop()
            if at == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = graph[node]
            while at < len(targets) and (
                targets[at] not in graph or (targets[at] in index and targets[at] not in on_stack)
            ):
                at += 1
            if at < len(targets):
                target = targets[at]
                work.append((node, at + 1))
                if target in on_stack:
                    low[node] = min(low[node], index[target])
                else:
                    work.append((target, 0))
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def _depth_bound(edges: dict[str, list[str]], start: str) -> int:
    """How deep a depth-first walk from `start` may go, at most: the longest path through the
    strongly connected components, each counting its size (a path visits a rule once)."""
    components = _components(edges)
    owner = {rule: i for i, component in enumerate(components) for rule in component}
    deepest = [0] * len(components)
    for i, component in enumerate(components):  # after every component it reaches
        below = 0
        for rule in component:
            for target in edges.get(rule, ()):
                j = owner.get(target)
                if j is not None and j != i:
                    below = max(below, deepest[j])
        deepest[i] = len(component) + below
    return deepest[owner[start]] if start in owner else 0
