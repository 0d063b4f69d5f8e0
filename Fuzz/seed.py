#!/usr/bin/env python3
"""Seeds the fuzz corpora from the fixtures: every request line of every transcript
(Tests/Fixtures) becomes an input of the `decoder` target; for the `request` target,
each transcript's requests of one session become one multi-line input, so the engine is
fuzzed from realistic conversations. Requests with their numbers at the ends of their
schemas (Tests/python/extremes.py) seed both, behind a conversation that makes chat "1"."""
import collections
import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "Tests" / "python"))
from extremes import sweep  # noqa: E402

# What the extreme requests expect before them: chat "1" with bob, and a few messages.
CONVERSATION = [
    b'{"chatStart":{"cookie":"c","invitees":[{"userId":"bob"}],"subject":"numbers"}}',
    b'{"chatMessageSend":{"chatId":"1","tag":"Text","content":"one"}}',
    b'{"chatMessageSend":{"chatId":"1","tag":"Text","content":"two"}}',
]


def main(out):
    out = pathlib.Path(out)
    for target in ("decoder", "request"):
        (out / target).mkdir(parents=True, exist_ok=True)
    for transcript in sorted((ROOT / "Tests" / "Fixtures").rglob("*.transcript")):
        sessions = collections.defaultdict(list)
        for line in transcript.read_text(encoding="utf-8", errors="replace").splitlines():
            if "> " in line and not line.startswith(("#", "!")):
                name, request = line.split("> ", 1)
                if "${" in request:
                    continue
                sessions[name].append(request.encode())
                (out / "decoder" / hashlib.sha1(request.encode()).hexdigest()).write_bytes(request.encode())
        for requests in sessions.values():
            data = b"\n".join(requests)
            (out / "request" / hashlib.sha1(data).hexdigest()).write_bytes(data)
    # Deep and wide lines, so that mutations start near the nesting limit and past it
    # (a deep union member before its discriminator is decoded twice).
    for seed in deep_and_wide():
        for target in ("decoder", "request"):
            (out / target / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    for request in sweep():
        line = json.dumps(request, separators=(",", ":")).encode()
        (out / "decoder" / hashlib.sha1(line).hexdigest()).write_bytes(line)
        data = b"\n".join(CONVERSATION + [line])
        (out / "request" / hashlib.sha1(data).hexdigest()).write_bytes(data)


def deep_and_wide():
    for depth in (127, 128, 129, 3000):
        yield b'{"requestListElements":{"deep":' + b"[" * depth + b"]" * depth + b"}}"
        yield b'{"requestListMatching":{"criteria":' + b'{"a":' * depth + b"1" + b"}" * depth + b',"type":"chatMessage"}}'
        yield b'{"requestListChange":{"elements":[' + b"[" * depth + b"]" * depth + b'],"type":"chat"}}'
        yield b'{"chatMessageSend":{"chatId":"1","tag":"T","data":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}}"
    yield b'{"requestListElements":{"type":"chat","elements":[' + b",".join([b'{"chatId":"1"}'] * 4000) + b"]}}"
    yield b'{"chatMessageSend":{"chatId":"1","tag":"T","data":{' + b",".join(b'"k%d":[1,2,{"x":null}]' % n for n in range(2000)) + b"}}}"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ROOT / "Fuzz" / "corpus")
