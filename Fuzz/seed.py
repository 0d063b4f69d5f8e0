#!/usr/bin/env python3
"""Seeds the fuzz corpora from the fixtures: every request line of every transcript
(Tests/Fixtures) becomes an input of the `decoder` target; for the `request` target,
each transcript's requests of one session become one multi-line input, so the engine is
fuzzed from realistic conversations."""
import collections
import hashlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ROOT / "Fuzz" / "corpus")
