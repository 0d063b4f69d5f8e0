#!/bin/sh
# Two chatcore nodes on one PostgreSQL, on this machine, to try "Several nodes on
# PostgreSQL" (README) by hand: `make run-nodes`, or
#
#     Examples/two-nodes.sh [CHATCORE] [FIRST_PORT]
#
# makes a throwaway PostgreSQL cluster (initdb, in a temporary directory, on a Unix socket
# there only), starts node A on 127.0.0.1:FIRST_PORT (default 7400) and node B on the next
# port, both accepting any token (loopback only), and prints how to talk to them. Ctrl-C
# (or SIGTERM) stops both nodes and the cluster and removes the directory. Needs Debian's
# `postgresql` package and netcat (`make setup` installs both).
set -eu

chatcore=${1:-.build/release/chatcore}
first=${2:-7400}
second=$((first + 1))

bin=$(dirname "$(command -v initdb 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1)")
if [ ! -x "$bin/initdb" ]; then
    echo "PostgreSQL is not installed: apt-get install postgresql (or make setup)" >&2
    exit 1
fi
dir=$(mktemp -d /tmp/chatcore-nodes.XXXXXX)
chmod 755 "$dir"
# initdb and pg_ctl refuse to run as root: as root the cluster is the postgres user's.
owner=""
if [ "$(id -u)" = 0 ]; then
    chown postgres: "$dir"
    owner="runuser -u postgres --"
fi

pids=""
stop() {
    trap - INT TERM EXIT
    for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in $pids; do wait "$pid" 2>/dev/null || true; done
    $owner "$bin/pg_ctl" -D "$dir/data" -m fast stop >/dev/null 2>&1 || true
    rm -rf "$dir"
    echo "stopped both nodes and PostgreSQL"
}
trap stop EXIT
trap 'exit 0' INT TERM

$owner "$bin/initdb" -D "$dir/data" -U chatcore --auth=trust -E UTF8 --locale=C >/dev/null
$owner "$bin/pg_ctl" -D "$dir/data" -o "-k $dir -c listen_addresses=''" -l "$dir/postgresql.log" -w start >/dev/null
psql -h "$dir" -U chatcore -d postgres -qc "CREATE DATABASE chatcore"
store="postgres://chatcore@/chatcore?host=$dir"

# Every node gets the same key, out of band (never in the database): a node relaying a
# --user session vouches for its user with it.
(umask 077; head -c 32 /dev/urandom > "$dir/node.key")

# The first node becomes the writer (it decides); the second relays to it, and takes over
# if it goes.
"$chatcore" serve --store "$store" --listen "127.0.0.1:$first" --data-dir "$dir/a" --insecure-no-auth --node-key-file "$dir/node.key" --log-level warning &
pids="$!"
until [ -n "$(psql -h "$dir" -U chatcore -d chatcore -qAtc "SELECT address FROM writer_node" 2>/dev/null)" ]; do
    kill -0 "$pids" 2>/dev/null || { echo "node A did not start" >&2; exit 1; }
    sleep 0.1
done
"$chatcore" serve --store "$store" --listen "127.0.0.1:$second" --data-dir "$dir/b" --insecure-no-auth --node-key-file "$dir/node.key" --log-level warning &
pids="$pids $!"
until nc -z 127.0.0.1 "$second" 2>/dev/null; do
    kill -0 "$!" 2>/dev/null || { echo "node B did not start" >&2; exit 1; }
    sleep 0.1
done

cat <<EOF

Two chatcore nodes serve one domain: A on 127.0.0.1:$first (deciding), B on 127.0.0.1:$second
(relaying to A), with PostgreSQL in $dir. In one terminal, bob on B:
    nc 127.0.0.1 $second
    {"authToken":{"userId":"bob","authToken":"any"}}
In another, alice on A starts a chat with him (bob sees it, and what she sends into it):
    nc 127.0.0.1 $first
    {"authToken":{"userId":"alice","authToken":"any"}}
    {"chatStart":{"cookie":"c1","invitees":[{"userId":"bob"}],"subject":"across nodes"}}
    {"chatMessageSend":{"chatId":"1","tag":"Text","content":"hi bob","cookie":"m1"}}
Stop node A (kill $(echo "$pids" | cut -d' ' -f1)) and B takes over within a second; connect again.
Ctrl-C stops everything.

EOF
wait
