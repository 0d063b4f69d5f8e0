#!/usr/bin/env python3
"""`make test-postgres`: every transcript and every Python test, with chatcore's store in
PostgreSQL instead of SQLite: a cluster is made in a temporary directory (initdb, a Unix
socket there only), each chatcore the tests start gets a database of its own
(chatcore-on-postgres), and the cluster is removed at the end.

    python3 Tests/postgres/run.py [--if-available] [BINARY]

--if-available: exit 0 with a note when PostgreSQL is not installed (`make test` on a
machine without it; `make setup` installs it), and leave out the Python tests the store
takes no part in (STORE_INDIFFERENT_FILES: they run on SQLite in the same `make test`).
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from postgres_cluster import Cluster, postgres_bin  # noqa: E402

# Tests of SQLite's own files (its lock file, its disk faults, its migrations, the store of
# an older release): the same behaviours on PostgreSQL are PostgreSQL's, tested by
# Tests/postgres/test_postgres_store.py.
SQLITE_ONLY_FILES = [
    "Tests/python/test_store_faults.py",
    "Tests/python/test_release_store.py",
    # SQLite's search index file (search.sqlite); PostgreSQL searches its own table,
    # tested by Tests/postgres/test_postgres_search.py.
    "Tests/python/test_search_index.py",
]

# Tests of what the store does not take part in (the wire and its limits, sign-in,
# configuration, documents, the client package, back-pressure, hostile sockets, TLS and
# WebSocket): `make test` (CI, --if-available) runs them on SQLite only, which keeps it
# within its 30 minutes; `make test-postgres` runs them on PostgreSQL too.
STORE_INDIFFERENT_FILES = [
    "Tests/python/test_config.py",
    "Tests/python/test_schemas.py",
    "Tests/python/test_extreme_values.py",
    "Tests/python/test_tokens.py",
    "Tests/python/test_websocket.py",
    "Tests/python/test_tls.py",
    "Tests/python/test_logs.py",
    "Tests/python/test_readme.py",
    "Tests/python/test_links.py",
    "Tests/python/test_docs.py",
    "Tests/python/test_documented_texts.py",
    "Tests/python/test_arguments.py",
    "Tests/python/test_framing_limits.py",
    "Tests/python/test_deep_lines.py",
    "Tests/python/test_version.py",
    "Tests/python/test_listen_problems.py",
    "Tests/python/test_hostile_clients.py",
    "Tests/python/test_output_bound.py",
    "Tests/python/test_metrics.py",
    "clients/python/tests",
]
SQLITE_ONLY_TESTS = [
    "test_a_damaged_store_refuses_to_start_with_a_clear_message",
    "test_a_clean_stop_spares_the_next_start_the_whole_file_check_a_crash_does_not",
    "test_damage_found_after_a_crash_stops_the_service_with_a_clear_message",
    "test_a_clean_stop_before_the_check_ended_leaves_the_store_to_be_checked_again",
    "test_a_copied_store_is_checked_in_the_background_and_its_damage_still_stops_the_service",
]


def main():
    arguments = sys.argv[1:]
    if_available = "--if-available" in arguments
    arguments = [a for a in arguments if a != "--if-available"]
    binary = os.path.abspath(arguments[0] if arguments else os.path.join(ROOT, ".build", "debug", "chatcore"))
    # Collecting costs seconds and finds a broken import (these tests import Tests/python's
    # modules) before the long steps, and also where PostgreSQL is not installed.
    if subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "Tests/postgres"], cwd=ROOT,
                      stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "Tests/postgres"], cwd=ROOT)
        print("test-postgres: Tests/postgres does not even load")
        return 1
    if postgres_bin() is None:
        print("test-postgres: PostgreSQL is not installed (make setup installs it)")
        return 0 if if_available else 1
    started = time.monotonic()
    with Cluster() as cluster:
        environment = dict(os.environ,
                           CHATCORE_BINARY=os.path.join(HERE, "chatcore-on-postgres"),
                           CHATCORE_REAL_BINARY=binary,
                           CHATCORE_TEST_POSTGRES=cluster.socket_directory)
        steps = [
            ["swift", "test", "--skip-build", "--filter", "FixtureTests"],
            # (A directory named here would be collected even if also --ignore'd.)
            [sys.executable, "-m", "pytest", "-q", "Tests/python", "Examples"] + ([] if if_available else ["clients/python/tests"])
            + [f"--ignore={path}" for path in SQLITE_ONLY_FILES + (STORE_INDIFFERENT_FILES if if_available else [])]
            + ["-k", "not (" + " or ".join(SQLITE_ONLY_TESTS) + ")", "--durations=10"],
            [sys.executable, "-m", "pytest", "-q", "Tests/postgres", "--durations=10"],
        ]
        failed = []
        for step in steps:
            print("test-postgres:", " ".join(step), flush=True)
            if subprocess.run(step, cwd=ROOT, env=environment).returncode != 0:
                failed.append(" ".join(step[-1:]) if step[0] != "swift" else "transcripts")
    print(f"test-postgres: {'failed: ' + ', '.join(failed) if failed else 'passed'} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
