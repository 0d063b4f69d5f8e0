"""Framing under stress: a huge line is never buffered; a bad-JSON corpus gets one ParseError per line."""
import json
import subprocess
import sys
import tempfile

from conftest import BOUND_SCALE, chatcore_binary


# Runs a command and prints the peak memory of it alone (RUSAGE_CHILDREN of this test
# process would include every server earlier tests ran).
PEAK = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:], stderr=subprocess.DEVNULL); "
        "sys.stderr.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(code)")


def test_a_200_mb_line_does_not_raise_peak_memory_above_100_mb():
    with tempfile.TemporaryDirectory() as data:
        process = subprocess.Popen([sys.executable, "-c", PEAK, chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        chunk = b"x" * (1 << 20)
        for _ in range(200):
            process.stdin.write(chunk)
        process.stdin.write(b"\n" + json.dumps({"identitiesGet": {"cookie": "after", "appUserIds": ["alice"]}}).encode() + b"\n")
        process.stdin.close()
        out = process.stdout.read().decode().splitlines()
        assert process.wait(timeout=60) == 0
    peak_kb = int(process.stderr.read())
    assert json.loads(out[0])["requestFailed"]["error"] == "TooLarge"
    assert json.loads(out[1])["identities"]["cookie"] == "after"
    assert peak_kb < 100 * 1024 * BOUND_SCALE, f"peak memory {peak_kb} KB"


BAD = [
    b"[1,2]", b"{", b"}", b'{"a"}', b'{"a":}', b'{"a":{},}', b"nul", b"tru", b'{"a":{}}x', b'{"a":{}}{"b":{}}',
    b"\xff", b'{"a":"\xc3\x28"}', b'{"a":"\xed\xa0\x80"}', b"{'a':{}}", b'{"a":{"b":01}}', b'{"a":{"b":-}}',
    b'{"a":{"b":1e}}', b'{"a":{"b":.5}}', b'{"a":{"b":0x10}}', b'{"a":{"b":Infinity}}', b'{"a":{"b":"\\x"}}',
    b'{"a":{"b":"\\u12"}}', b'{"a":{"b":"tab\tin"}}', b"\x00", b'{"a":{}}\x0c', b"\x0b{}", b"\xef\xbb\xbf{}",
    b'{"a":[' * 500, b"/* c */ {}", b'{"a":{}} // c',
]


def test_every_malformed_line_gets_exactly_one_parse_error_and_the_session_goes_on():
    text = b"\n".join(BAD) + b"\n" + json.dumps({"identitiesGet": {"cookie": "end"}}).encode() + b"\n"
    with tempfile.TemporaryDirectory() as data:
        result = subprocess.run([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                                input=text, capture_output=True, timeout=60, check=True)
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert len(lines) == len(BAD) + 1
    for number, event in enumerate(lines[:-1], 1):
        failed = event["requestFailed"]
        assert failed["error"] == "ParseError", (BAD[number - 1], event)
        assert failed["line"] == number
    assert lines[-1]["identities"]["cookie"] == "end"
