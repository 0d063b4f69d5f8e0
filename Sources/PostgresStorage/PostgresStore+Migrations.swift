import Dispatch
import Foundation
import Logging
import NIOCore
import NIOPosix
import NIOSSL
import PostgresNIO
import Storage
import Synchronization
import Threads

// The schema, as named, append-only migrations: never edit one that has shipped.

extension PostgresStore {
    // MARK: migrations

    /// How many search rows a node takes at once (`takeNumbers`): a round trip on the
    /// engine thread every 16,384 messages (with 1,024, 59 of them in the benchmark's
    /// 60,000 sends, under load), and what is left of a block when the node stops is a gap
    /// no larger than a search's first window (`PostgresSearchIndex.firstWindow`). It is
    /// the increment of the sequence `search_row` (`v7-numbers`): changing it is a
    /// migration that alters the sequence.
    static let searchRowBlock: Int64 = 16_384

    /// Named, append-only migrations, applied in order under a transaction-level advisory
    /// lock (two processes starting at once do not both apply one). Never edit one that
    /// has shipped: add the next.
    static let migrations: [(name: String, sql: [String])] = [
        (
            "v1-chatcore",
            [
                """
                CREATE TABLE "user" (
                    "number" bigint PRIMARY KEY,
                    "userId" text NOT NULL UNIQUE,
                    "regId" bigint NOT NULL UNIQUE
                )
                """,
                """
                CREATE TABLE endpoint (
                    id bigint PRIMARY KEY,
                    "user" bigint NOT NULL,
                    description text NOT NULL,
                    nickname text NOT NULL,
                    "isLegacyDelegate" boolean NOT NULL,
                    ordinal bigint NOT NULL
                )
                """,
                #"CREATE INDEX endpoint_by_user ON endpoint("user", ordinal)"#,
                """
                CREATE TABLE chat (
                    "number" bigint PRIMARY KEY,
                    subject text NOT NULL,
                    "isOneToOne" boolean NOT NULL,
                    "invitePolicy" text NOT NULL,
                    "isDefunct" boolean NOT NULL,
                    data text,
                    "lastMessage" bigint NOT NULL,
                    "lastActivity" bigint NOT NULL
                )
                """,
                """
                CREATE TABLE member (
                    chat bigint NOT NULL,
                    "user" bigint NOT NULL,
                    "isActive" boolean NOT NULL,
                    "isAdmin" boolean NOT NULL,
                    "joinedAt" bigint NOT NULL,
                    "leftAt" bigint,
                    "isHidden" boolean NOT NULL,
                    "localData" text,
                    "privateData" text,
                    "deliveredUpTo" bigint NOT NULL,
                    "readUpTo" bigint NOT NULL,
                    "numUnread" bigint NOT NULL,
                    PRIMARY KEY (chat, "user")
                )
                """,
                #"CREATE INDEX member_by_user ON member("user")"#,
                """
                CREATE TABLE message (
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    sender bigint NOT NULL,
                    tag text NOT NULL,
                    content text,
                    data text,
                    "timestamp" bigint NOT NULL,
                    "isControl" boolean NOT NULL,
                    "neverCountsUnread" boolean NOT NULL,
                    "isRecalled" boolean NOT NULL,
                    "changeSeq" bigint NOT NULL,
                    "searchRow" bigint NOT NULL,
                    "thumbName" text,
                    "thumbBlob" text,
                    "fileName" text,
                    "fileBlob" text,
                    "fileSize" bigint,
                    attachment text,
                    PRIMARY KEY (chat, id)
                )
                """,
                #"CREATE INDEX message_by_change ON message(chat, "changeSeq")"#,
                #"CREATE INDEX message_by_tag ON message(chat, tag, id)"#,
                #"CREATE INDEX message_by_search_row ON message("searchRow") WHERE "searchRow" > 0"#,
                """
                CREATE TABLE message_ref (
                    chat bigint NOT NULL,
                    source bigint NOT NULL,
                    tag text NOT NULL,
                    target bigint NOT NULL,
                    PRIMARY KEY (chat, source, tag)
                )
                """,
                #"CREATE INDEX message_ref_by_target ON message_ref(chat, target, tag, source)"#,
                """
                CREATE TABLE message_user (
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    "user" bigint NOT NULL,
                    "localData" text,
                    "isDeleted" boolean NOT NULL,
                    "thumbDetached" boolean NOT NULL,
                    "fileDownloaded" boolean NOT NULL,
                    PRIMARY KEY (chat, id, "user")
                )
                """,
                """
                CREATE TABLE ref_count (
                    chat bigint NOT NULL,
                    target bigint NOT NULL,
                    tag text NOT NULL,
                    count bigint NOT NULL,
                    newest bigint NOT NULL,
                    PRIMARY KEY (chat, target, tag)
                )
                """,
                """
                CREATE TABLE range_change (
                    chat bigint NOT NULL,
                    "lastSeq" bigint NOT NULL,
                    "firstSeq" bigint NOT NULL,
                    "firstId" bigint NOT NULL,
                    "lastId" bigint NOT NULL,
                    PRIMARY KEY (chat, "lastSeq")
                )
                """,
                "CREATE TABLE blob (hash text PRIMARY KEY, uses bigint NOT NULL)",
                "CREATE TABLE counter (name text PRIMARY KEY, value bigint NOT NULL)",
                #"INSERT INTO counter (name, value) VALUES ('changeSeq', 0), ('searchRow', 0)"#
            ]
        ),
        (
            "v2-writer-address",
            [
                // Where the node holding the writer lock accepts connections (other nodes
                // relay theirs there).
                "CREATE TABLE writer_node (id int PRIMARY KEY CHECK (id = 1), address text NOT NULL, since timestamptz NOT NULL DEFAULT now())"
            ]
        ),
        (
            "v3-writer-epoch",
            [
                // Each writer takes the next epoch; its commits check it (see the type's doc).
                "CREATE TABLE writer_epoch (id int PRIMARY KEY CHECK (id = 1), epoch bigint NOT NULL, since timestamptz NOT NULL DEFAULT now())",
                "INSERT INTO writer_epoch (id, epoch) VALUES (1, 0)",
                // FOR SHARE, not FOR KEY SHARE: the increment (an UPDATE of a non-key column)
                // must wait for the commits holding it.
                """
                CREATE FUNCTION chatcore_fence(expected bigint) RETURNS void LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM 1 FROM writer_epoch WHERE id = 1 AND epoch = expected FOR SHARE;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'another chatcore process became the writer (epoch % is not the current one)', expected
                            USING ERRCODE = 'CCW01';
                    END IF;
                END
                $$
                """,
                // The writer's heartbeat (a row of its own: beats must not wait for commits).
                "CREATE TABLE writer_beat (id int PRIMARY KEY CHECK (id = 1), node text NOT NULL, epoch bigint NOT NULL, beat timestamptz NOT NULL)"
            ]
        ),
        (
            "v4-node-credential",
            [
                // What a node relaying its standard input/output session to the writer shows
                // it (made by each writer when it advertises; see `advertise`).
                "ALTER TABLE writer_node ADD COLUMN credential text NOT NULL DEFAULT ''"
            ]
        ),
        (
            "v5-search-in-the-database",
            [
                // The search index, written in each commit (`PostgresSearchIndex`): a row per
                // searchable message with its keys (`SearchText.keys`), found through GIN.
                """
                CREATE TABLE message_search (
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    "searchRow" bigint NOT NULL,
                    keys int4[] NOT NULL,
                    PRIMARY KEY (chat, id)
                )
                """,
                "CREATE INDEX message_search_by_key ON message_search USING gin (keys)",
                // Searches read the newest rows first, a window of search rows at a time.
                #"CREATE INDEX message_search_by_row ON message_search ("searchRow")"#,
                // Messages up to `searchIndexFrom` (those of a store from before this
                // migration) are added by the index's refill, which has got as far as
                // `searchIndexUpTo`; later ones are added by their commits.
                #"INSERT INTO counter (name, value) SELECT 'searchIndexFrom', value FROM counter WHERE name = 'searchRow'"#,
                #"INSERT INTO counter (name, value) VALUES ('searchIndexUpTo', 0)"#
            ]
        ),
        (
            "v6-chat-versions",
            [
                // Each chat's version (`StoreBatch.chatVersions`), in a table of its own: a
                // commit's clauses may not touch one row twice, and the chat's row is written
                // by another clause. A chat the store does not have yet is at 0.
                "CREATE TABLE chat_version (chat bigint PRIMARY KEY, version bigint NOT NULL)",
                #"INSERT INTO chat_version (chat, version) SELECT "number", 1 FROM chat"#,
                // Moves each chat on from the version the commit was decided on, or raises
                // `CCC01` (the commit conflicts) when another commit moved one first. The
                // UPDATE takes the rows' locks: a commit on the same chat from another node
                // waits for this one, then finds the version moved.
                """
                CREATE FUNCTION chatcore_claim(chats bigint[], expected bigint[]) RETURNS void LANGUAGE plpgsql AS $$
                DECLARE
                    moved bigint;
                    made bigint;
                BEGIN
                    UPDATE chat_version v SET version = v.version + 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE v.chat = c.chat AND v.version = c.version AND c.version > 0;
                    GET DIAGNOSTICS moved = ROW_COUNT;
                    INSERT INTO chat_version (chat, version) SELECT c.chat, 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE c.version = 0 ON CONFLICT (chat) DO NOTHING;
                    GET DIAGNOSTICS made = ROW_COUNT;
                    IF moved + made <> cardinality(chats) THEN
                        RAISE EXCEPTION 'another chatcore node committed first to a chat this commit changes' USING ERRCODE = 'CCC01';
                    END IF;
                END
                $$
                """
            ]
        ),
        (
            "v7-numbers",
            [
                // New chats' and users' numbers, and search rows (`takeNumbers`): deciding
                // nodes that numbered them from memory would take the same ones. Each sequence
                // goes on after the highest number stored. The search rows' moves on by a block
                // at a time, and its last value replaces the counter `searchRow`, which every
                // commit of every node would otherwise write.
                "CREATE SEQUENCE chat_number AS bigint",
                #"SELECT setval('chat_number', coalesce((SELECT max("number") FROM chat), 0) + 1, false)"#,
                "CREATE SEQUENCE user_number AS bigint",
                #"SELECT setval('user_number', coalesce((SELECT max("number") FROM "user"), 0) + 1, false)"#,
                // INCREMENT BY is `searchRowBlock`, written out: a migration's text never changes.
                "CREATE SEQUENCE search_row AS bigint MINVALUE 0 INCREMENT BY 16384",
                #"SELECT setval('search_row', greatest((SELECT value FROM counter WHERE name = 'searchRow'), (SELECT coalesce(max("searchRow"), 0) FROM message)))"#,
                "DELETE FROM counter WHERE name = 'searchRow'"
            ]
        ),
        (
            "v8-claims-in-chat-order",
            [
                // v6's claim locked the version rows in whatever order its plan read them, so
                // two commits claiming overlapping chats in different orders could each hold
                // one the other waits for, until PostgreSQL broke the deadlock after
                // `deadlock_timeout` (a second). Locking them in chat order first, every commit
                // waits only for commits that hold a lower chat, never in a circle; a row
                // another commit moved on while this one waited is then found moved (each
                // statement of the function reads what is committed when it starts).
                """
                CREATE OR REPLACE FUNCTION chatcore_claim(chats bigint[], expected bigint[]) RETURNS void LANGUAGE plpgsql AS $$
                DECLARE
                    moved bigint;
                    made bigint;
                BEGIN
                    PERFORM 1 FROM chat_version WHERE chat = ANY(chats) ORDER BY chat FOR UPDATE;
                    UPDATE chat_version v SET version = v.version + 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE v.chat = c.chat AND v.version = c.version AND c.version > 0;
                    GET DIAGNOSTICS moved = ROW_COUNT;
                    INSERT INTO chat_version (chat, version) SELECT c.chat, 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE c.version = 0 ORDER BY c.chat ON CONFLICT (chat) DO NOTHING;
                    GET DIAGNOSTICS made = ROW_COUNT;
                    IF moved + made <> cardinality(chats) THEN
                        RAISE EXCEPTION 'another chatcore node committed first to a chat this commit changes' USING ERRCODE = 'CCC01';
                    END IF;
                END
                $$
                """
            ]
        ),
        (
            "v9-all-nodes-decide",
            [
                // What each deciding node's commits changed, for the others to follow
                // (`othersActivity`; docs/several-deciding-nodes.md): one row per commit,
                // numbered in commit order per slot, kept a minute (`trimFollowed`).
                """
                CREATE TABLE node_commit (
                    "number" bigserial PRIMARY KEY, slot int NOT NULL, at timestamptz NOT NULL DEFAULT now(), "feedUpTo" bigint NOT NULL,
                    chats bigint[] NOT NULL, users bigint[] NOT NULL, "rewrittenChat" bigint[] NOT NULL, "rewrittenId" bigint[] NOT NULL,
                    "insertedChat" bigint[] NOT NULL, "insertedId" bigint[] NOT NULL, "memberChat" bigint[] NOT NULL, "memberUser" bigint[] NOT NULL)
                """,
                "CREATE INDEX node_commit_slot ON node_commit (slot, \"number\")",
                "CREATE INDEX node_commit_at ON node_commit (at)",
                // Per slot, the last row trimmed: a follower that had not read it fell behind.
                "CREATE TABLE node_commit_trimmed (slot int PRIMARY KEY, \"upTo\" bigint NOT NULL)",
                // Who has a session on the node of each slot.
                "CREATE TABLE node_online (slot int NOT NULL, \"user\" bigint NOT NULL, PRIMARY KEY (slot, \"user\"))",
                // Typing and chat events (never stored otherwise), kept a minute.
                """
                CREATE TABLE node_event (
                    "number" bigserial PRIMARY KEY, slot int NOT NULL, at timestamptz NOT NULL DEFAULT now(), kind text NOT NULL,
                    "user" bigint NOT NULL, chat bigint NOT NULL, tag text, data text)
                """,
                // Each feed slot's epoch: a node taking a slot moves it on, and the commits of
                // a node that lost its slot fail (`CCW01`), as a writer's do after a takeover.
                "CREATE TABLE slot_epoch (slot int PRIMARY KEY, epoch bigint NOT NULL)",
                "INSERT INTO slot_epoch (slot, epoch) SELECT s, 0 FROM generate_series(0, 7) s",
                """
                CREATE FUNCTION chatcore_slot_fence(which int, expected bigint) RETURNS void LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM 1 FROM slot_epoch WHERE slot = which AND epoch = expected FOR SHARE;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'another chatcore node took feed slot % (epoch % is not the current one)', which, expected
                            USING ERRCODE = 'CCW01';
                    END IF;
                END
                $$
                """
            ]
        ),
        (
            "v10-notify-followers",
            [
                // Every deciding node listens on chatcore_follow (`listenIfDeaf`) and reads the
                // others' doings when told of them, instead of looking every few milliseconds:
                // "c" and the slot for a commit, "t" and the slot for who is connected or a
                // transient event (one notification per transaction and payload).
                """
                CREATE FUNCTION chatcore_notify_followers() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF TG_OP = 'DELETE' THEN
                        PERFORM pg_notify('chatcore_follow', TG_ARGV[0] || OLD.slot::text);
                    ELSE
                        PERFORM pg_notify('chatcore_follow', TG_ARGV[0] || NEW.slot::text);
                    END IF;
                    RETURN NULL;
                END
                $$
                """,
                "CREATE TRIGGER node_commit_notifies AFTER INSERT ON node_commit FOR EACH ROW EXECUTE FUNCTION chatcore_notify_followers('c')",
                "CREATE TRIGGER node_online_notifies AFTER INSERT OR DELETE ON node_online FOR EACH ROW EXECUTE FUNCTION chatcore_notify_followers('t')",
                "CREATE TRIGGER node_event_notifies AFTER INSERT ON node_event FOR EACH ROW EXECUTE FUNCTION chatcore_notify_followers('t')",
                // Each slot's events after a number, by the index (as node_commit_slot for commits).
                "CREATE INDEX node_event_slot ON node_event (slot, \"number\")"
            ]
        ),
        (
            "v11-no-credential-in-the-database",
            [
                // v4's credential made a session of any user for whoever read it (any role
                // that could SELECT writer_node, or saw a relay's first line): it is blanked
                // and never written again (the column stays, empty, for nodes of an older
                // release, whose relayed --user sessions are then refused). Nodes vouch for
                // relayed users with a key given to them out of band (--node-key-file); the
                // writer advertises only a random value of its own, to which their tokens
                // are bound.
                "ALTER TABLE writer_node ADD COLUMN instance text NOT NULL DEFAULT ''",
                "UPDATE writer_node SET credential = ''"
            ]
        ),
        (
            "v12-external-ids",
            [
                // A sender's own identifier of a message: a send that names one already used
                // in the chat is answered with that message instead of posting another.
                #"ALTER TABLE message ADD COLUMN "externalId" text"#,
                #"CREATE INDEX message_by_external_id ON message(chat, sender, "externalId") WHERE "externalId" IS NOT NULL"#
            ]
        ),
        (
            "v13-reactions",
            [
                // Each user's reactions to a message, kept with what else they did to it alone.
                #"ALTER TABLE message_user ADD COLUMN reactions text"#
            ]
        ),
        (
            "v14-mentions",
            [
                // Whom a message mentions (shown on it), each member's unread mentions, and
                // each user's mentions across chats, newest first.
                #"ALTER TABLE message ADD COLUMN mentions text"#,
                #"ALTER TABLE message ADD COLUMN "mentionsAll" boolean NOT NULL DEFAULT false"#,
                #"ALTER TABLE member ADD COLUMN "numUnreadMentions" bigint NOT NULL DEFAULT 0"#,
                """
                CREATE TABLE message_mention (
                    "user" bigint NOT NULL,
                    timestamp bigint NOT NULL,
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    PRIMARY KEY ("user", timestamp, chat, id)
                )
                """
            ]
        ),
        (
            "v15-pins",
            [
                // Who may pin (set when a chat starts: admins in a group, both in a one-to-one
                // chat), and the chat's pinned messages.
                #"ALTER TABLE chat ADD COLUMN "pinPolicy" text NOT NULL DEFAULT 'AdminsOnly'"#,
                #"UPDATE chat SET "pinPolicy" = 'ParticipantsOnly' WHERE "isOneToOne""#,
                #"ALTER TABLE chat ADD COLUMN pins text"#
            ]
        ),
        (
            "v16-notifications",
            [
                // Notifications waiting to be sent to the application's server, written with
                // the messages they are about (`NotificationOutbox`), and what each endpoint
                // is woken with.
                #"ALTER TABLE endpoint ADD COLUMN "pushToken" text"#,
                """
                CREATE TABLE notification_outbox (
                    seq bigserial PRIMARY KEY,
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    "user" bigint NOT NULL,
                    created bigint NOT NULL,
                    due bigint NOT NULL,
                    attempts bigint NOT NULL DEFAULT 0
                )
                """,
                "CREATE INDEX notification_by_due ON notification_outbox(due)"
            ]
        ),
        (
            "v17-moderation",
            [
                // Members muted or banned by a chat's admins, and what users chose for
                // themselves (presence hidden, whom they block) and when they were last seen.
                #"ALTER TABLE member ADD COLUMN "mutedUntil" bigint"#,
                #"ALTER TABLE member ADD COLUMN "isBanned" boolean NOT NULL DEFAULT false"#,
                """
                CREATE TABLE user_settings (
                    "user" bigint PRIMARY KEY,
                    "presenceHidden" boolean NOT NULL DEFAULT false,
                    "lastActive" bigint,
                    blocked text NOT NULL DEFAULT ''
                )
                """
            ]
        )
    ]

    func migrate(_ connection: PostgresConnection) throws {
        try run(connection, "BEGIN")
        try run(connection, "SELECT pg_advisory_xact_lock(\(PostgresStore.writerLockKey + 1))")
        try run(connection, "CREATE TABLE IF NOT EXISTS chatcore_migration (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
        let applied = Set(try run(connection, "SELECT name FROM chatcore_migration").map { try $0.decode(String.self) })
        for migration in PostgresStore.migrations where !applied.contains(migration.name) {
            logger.info("applying a store migration", metadata: ["migration": "\(migration.name)"])
            for statement in migration.sql { try run(connection, "\(unescaped: statement)") }
            try run(connection, "INSERT INTO chatcore_migration (name) VALUES (\(migration.name))")
        }
        try run(connection, "COMMIT")
    }
}
