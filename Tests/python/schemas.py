"""Loads Schemas/ into a jsonschema registry, shared by the Python tests."""
import json
import pathlib

from jsonschema import Draft202012Validator
from referencing import Registry, Resource  # jsonschema >= 4.18

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "Schemas"


def load_all():
    docs = {}
    for path in sorted(SCHEMAS.rglob("*.json")):
        docs[path.relative_to(SCHEMAS).as_posix()] = json.loads(path.read_text())
    return docs


def registry(docs=None):
    docs = docs or load_all()
    return Registry().with_resources(
        (doc["$id"], Resource.from_contents(doc)) for doc in docs.values()
    )


def validator(name, docs=None):
    """A validator for Schemas/<name> (e.g. 'request.json' or 'event.json')."""
    docs = docs or load_all()
    return Draft202012Validator(docs[name], registry=registry(docs))
