"""Requests whose values sit at the ends of what their schemas allow, built from Schemas/:
for each request (each variant of a union), one with every field given, and then the
request with one field at an end: an integer or id at 0, -1, the largest id (as a string
and as a number), past it, or the schema's minimum and maximum; a string with a byte
limit at the limit (in two-byte characters), past it, or empty; an array empty, at its
item limit, or past it. Each both whole and with only what the request requires (and each
other member beside the field).

Used by test_extreme_values.py and as fuzzing seeds (Fuzz/seed.py). The lines expect a
user with chat "1" (with bob) holding a few messages.
"""
import json
import os

from schemas import load_all

LARGEST = 9223372036854775807
# Request fields that would end the session or its setup, and so the sweep.
LEFT_OUT = {"authToken", "endpointDeregister", "syncStart", "setupRetry"}
LAST = {"chatLeave", "participantRemove"}
STRINGS = {"chatId": "1", "chatIds": "1", "appUserIds": "bob", "userUri": "bbmpim://user/id/2", "senderUri": "bbmpim://user/id/2", "userId": "bob",
           "tag": "Text", "notRefTag": "Quote", "since": "1", "text": "hello", "content": "hello"}


class Schemas:
    def __init__(self):
        self.docs = load_all()

    def resolve(self, node, base):
        """The schema `node` stands for, and the document it is in."""
        while "$ref" in node:
            ref = node["$ref"]
            path, _, pointer = ref.partition("#")
            if path:
                base = os.path.normpath(os.path.join(os.path.dirname(base), path))
            document = self.docs[base]
            target = document
            for part in [p for p in pointer.split("/") if p]:
                target = target[part]
            node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return node, base

    def instances(self, node, base, name=""):
        """(value, numbers, required) for each variant of a schema: one value with every
        field given, the paths of its integer and id fields with what each may be at its
        ends, and the required members of each object in it, by path."""
        node, base = self.resolve(node, base)
        if "oneOf" in node:
            variants = []
            for variant in node["oneOf"]:
                variants += self.instances({**{k: v for k, v in node.items() if k != "oneOf"}, **variant}, base, name)
            return variants
        if "const" in node:
            return [(node["const"], [], {})]
        if "enum" in node:
            return [(node["enum"][0], [], {})]
        kind = node.get("type")
        if isinstance(kind, list):
            # An id: a decimal string or a JSON integer.
            if "integer" in kind:
                return [("1", [((), ["0", str(LARGEST), LARGEST, "18446744073709551615", -1])], {})]
            return [({}, [], {})]
        if kind == "object" and "properties" in node:
            value, numbers, required = {}, [], {(): set(node.get("required", []))}
            for key, field in node["properties"].items():
                value[key], inner, inner_required = self.instances(field, base, key)[0]
                numbers += [((key,) + path, extremes) for path, extremes in inner]
                required.update({(key,) + path: keys for path, keys in inner_required.items()})
            return [(value, numbers, required)]
        if kind == "array":
            # Arrays empty, and as long as they may be and one more.
            item, inner, inner_required = self.instances(node.get("items", {}), base, name)[0]
            most = node.get("maxItems")
            ends = [[]] + ([[item] * most, [item] * (most + 1)] if most else [])
            return [([item], [((), ends)] + [((0,) + path, extremes) for path, extremes in inner],
                     {(0,) + path: keys for path, keys in inner_required.items()})]
        if kind == "integer":
            low, high = node.get("minimum", -LARGEST - 1), node.get("maximum", LARGEST)
            return [(max(low, min(high, 1)), [((), sorted({low, high, min(max(0, low), high)}))], {})]
        if kind == "boolean":
            return [(False, [], {})]
        if kind == "string":
            # Strings too: at their byte limit in two-byte characters, and past it.
            most = node.get("x-maxBytes")
            ends = ["\u00e9" * (most // 2), "x" * most + "x", ""] if most else []
            return [(STRINGS.get(name, "x"), [((), ends)] if ends else [], {})]
        # A free-form value (data, localData) or an object of any members.
        return [({}, [], {})]


def pruned(value, required, path, sibling=None, at=()):
    """`value` with only the required members of each object and those on `path` (and
    `sibling`, a member of the object the path ends in)."""
    if isinstance(value, dict):
        keep = required.get(at, set()) | ({path[0]} if path else set()) | ({sibling} if sibling and len(path) == 1 else set())
        return {k: pruned(v, required, path[1:] if path and k == path[0] else (), sibling, at + (k,))
                for k, v in value.items() if k in keep}
    if isinstance(value, list):
        return [pruned(v, required, path[1:] if path else (), sibling, at + (0,)) for v in value]
    return value


def siblings(value, path):
    """The other members of the object `path` ends in."""
    for part in path[:-1]:
        value = value[part]
    return [key for key in value if key != path[-1]] if isinstance(value, dict) else []


def with_value(value, path, replacement):
    copy = json.loads(json.dumps(value))
    target = copy
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = replacement
    return copy


def sweep():
    """Each request whole, and then each of its numbers at its ends, in the request whole
    and in the request with only what it requires."""
    schemas = Schemas()
    request = schemas.docs["request.json"]
    lines = []
    for name, field in request["properties"].items():
        if name in LEFT_OUT:
            continue
        for value, numbers, required in schemas.instances(field, "request.json"):
            lines.append({name: value})
            for path, extremes in numbers:
                for extreme in extremes:
                    lines.append({name: with_value(value, path, extreme)})
                    for sibling in [None] + siblings(value, path):
                        lines.append({name: with_value(pruned(value, required, path, sibling), path, extreme)})
    # Leaving the chat (or removing bob from it) last: what comes after needs both in it.
    return sorted(lines, key=lambda line: next(iter(line)) in LAST)
