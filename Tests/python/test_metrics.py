"""--metrics serves Prometheus text whose counters match what was sent."""
import contextlib
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from chatcore_harness import scrape
from conftest import BOUND_SCALE, chatcore_binary


@contextlib.contextmanager
def serving_metrics():
    """chatcore on a Unix socket of its own with --metrics on a free port, until the block
    ends: (its socket's path, the metrics port)."""
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "s")
        server = subprocess.Popen([chatcore_binary(), "serve", "--listen", "unix:" + path, "--insecure-no-auth", "--data-dir",
                                   os.path.join(work, "d"), "--metrics", "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
        try:
            port = None
            for line in server.stderr:
                if "serving metrics" in line:
                    port = int(re.search(r"port=(\d+)", line).group(1))
                if "listening" in line:
                    break
            assert port
            yield path, port
        finally:
            server.terminate()
            server.wait(timeout=20)


def requests_of(samples):
    return {dict(labels)["request"]: int(value) for (name, labels), value in samples.items() if name == "chatcore_requests_total" and value}


def test_metrics_count_what_was_sent():
    with serving_metrics() as (path, port):
        before = scrape(port)
        assert requests_of(before) == {}
        assert before[("chatcore_sessions", frozenset())] == 0
        assert ("chatcore_requests_total", frozenset({("request", "chatMessageSend")})) in before  # every request, at 0

        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        reader = client.makefile("rb")
        lines = [{"authToken": {"userId": "alice", "authToken": "x"}},
                 {"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "subject": "m"}}]
        lines += [{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": f"m{n}", "cookie": f"c{n}"}} for n in range(5)]
        lines += [{"requestListAll": {"type": "chat", "cookie": "l"}}, {"chatLeave": {"chatIds": ["99"]}},
                  {"noSuchRequest": {}}, "not json", {"identitiesGet": {"cookie": "i", "appUserIds": ["alice"]}}]
        client.sendall(b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines))
        while b'"identities"' not in reader.readline():
            pass
        during = scrape(port)
        assert requests_of(during) == {"authToken": 1, "chatStart": 1, "chatMessageSend": 5, "requestListAll": 1, "chatLeave": 1,
                                       "unknown": 2, "identitiesGet": 1}
        failures = {tuple(sorted(dict(labels).items())): int(value) for (name, labels), value in during.items()
                    if name == "chatcore_request_failures_total"}
        assert failures == {(("error", "NotFound"), ("request", "chatLeave")): 1,
                            (("error", "UnknownRequest"), ("request", "unknown")): 1,
                            (("error", "ParseError"), ("request", "unknown")): 1}
        assert during[("chatcore_sessions", frozenset())] == 1
        assert during[("chatcore_commit_duration_seconds_count", frozenset())] >= 1
        assert during[("chatcore_output_bytes_total", frozenset())] > 1000
        assert during[("chatcore_store_bytes", frozenset())] > 0
        reader.close()  # the socket closes once its file is closed too
        client.close()
        deadline = time.time() + 10
        while scrape(port)[("chatcore_sessions", frozenset())] != 0 and time.time() < deadline:
            time.sleep(0.05)
        assert scrape(port)[("chatcore_sessions", frozenset())] == 0
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
            assert False, "only /metrics is served"
        except urllib.error.HTTPError as error:
            assert error.code == 404


def test_metrics_needs_a_host_and_port():
    done = subprocess.run([chatcore_binary(), "serve", "--metrics", "unix:/tmp/x"], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "--metrics unix:/tmp/x: expected HOST:PORT" in done.stderr


def rss_mb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def test_the_metrics_port_cannot_take_memory_or_descriptors():
    """A client that pipelines scrapes and never reads the answers got every one built
    and kept (750 MB in 20 s, 80 MB in these 5 s of a debug build); now nothing more is read from it until it takes what was
    written. At most 16 connections are served at once: when all are taken, the one that
    has waited longest for a request makes room for a newcomer (a scraper always gets in),
    and one whose request has not come whole within 5 s is closed."""
    with tempfile.TemporaryDirectory() as work:
        server = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", os.path.join(work, "d"), "--metrics", "127.0.0.1:0"],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            port = None
            for line in server.stderr:
                if "serving metrics" in line:
                    port = int(re.search(r"port=(\d+)", line).group(1))
                    break
            assert port
            scrape(port)
            before = rss_mb(server.pid)
            greedy = socket.create_connection(("127.0.0.1", port))
            greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            greedy.settimeout(0.2)
            requests = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 100
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    greedy.sendall(requests)
                except socket.timeout:
                    pass
            grown = rss_mb(server.pid) - before
            assert grown < 25 * BOUND_SCALE, f"memory grew by {grown} MB for a client that does not read"
            # It does not hold up anyone else.
            scrape(port)
            # Sixteen connections that say nothing (with the greedy one, more than the
            # port serves): a scraper still gets its answer at once, in the place of the
            # one that has waited longest.
            others = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
            time.sleep(0.3)
            started = time.monotonic()
            scrape(port)
            assert time.monotonic() - started < 2
            # Connections whose request never comes are closed after a few seconds.
            others[-1].settimeout(10)
            assert others[-1].recv(1) == b"", "a silent connection is closed"
            # A request sent a byte at a time, too slowly, is closed as well.
            slow = socket.create_connection(("127.0.0.1", port))
            slow.settimeout(10)
            closed_at = None
            for byte in b"GET /metrics HTTP/1.1\r\n":
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_at = time.monotonic()
                    break
                time.sleep(0.5)
            assert closed_at is not None or slow.recv(1) == b"", "a request dribbled byte by byte is closed"
            greedy.close()
            for sock in others:
                sock.close()
            time.sleep(0.3)
            scrape(port)
        finally:
            server.stdin.close()
            server.wait(timeout=30)


def test_the_scrape_follows_prometheus_conventions():
    """Parsed by Prometheus' own Python client: every family has its HELP and TYPE, no two
    families parse to one name, the build and the process are described, and requests are
    timed by name."""
    from prometheus_client.parser import text_string_to_metric_families

    with serving_metrics() as (path, port):
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        reader = client.makefile("rb")
        lines = [{"authToken": {"userId": "alice", "authToken": "x"}},
                 {"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "subject": "m"}},
                 {"identitiesGet": {"cookie": "i", "appUserIds": ["alice"]}}]
        client.sendall(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        while b'"identities"' not in reader.readline():
            pass
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        helps = re.findall(r"^# HELP (\S+) (.+)$", text, re.M)
        types = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
        families = list(text_string_to_metric_families(text))
        names = [family.name for family in families]
        assert len(names) == len(set(names)), f"families that parse to one name: {sorted(n for n in names if names.count(n) > 1)}"
        assert {name for name, _ in types} == {name for name, _ in helps}, "a family without HELP or without TYPE"
        for family in families:
            assert family.documentation, f"{family.name} has no HELP"
        by_name = {family.name: family for family in families}
        build = by_name["chatcore_build_info"].samples[0]
        version = subprocess.run([chatcore_binary(), "--version"], capture_output=True, text=True).stdout.strip()
        assert build.labels == {"version": version} and build.value == 1
        for name in ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds", "process_max_fds",
                     "process_start_time_seconds"):
            assert by_name[name].samples[0].value > 0, name
        assert abs(by_name["process_start_time_seconds"].samples[0].value - time.time()) < 600
        durations = by_name["chatcore_request_duration_seconds"]
        assert durations.type == "histogram"
        counted = {s.labels["request"]: s.value for s in durations.samples if s.name.endswith("_count")}
        assert counted.get("chatStart") == 1 and counted.get("identitiesGet") == 1 and counted.get("authToken") == 1, counted
        reader.close()
        client.close()
