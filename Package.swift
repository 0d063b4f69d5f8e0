// swift-tools-version: 6.1
import PackageDescription

// chatcore: a BBMDS-style chat core speaking newline-delimited JSON.
// Modules, from the bytes up (imports only point down this list; no module shares a
// type's name):
//   CYAJL         – the system YAJL library (libyajl-dev)
//   CMalloc       – the C library's heap introspection (malloc.h)
//   Threads       – chatcore's own threads name themselves (for top -H and /proc); state they share (Locked)
//   ChatWire      – line framing, YAJL reader, JSON writer, JSONValue, the decoding runtime
//   ChatProtocol  – the messages, generated from Schemas/ by Codegen
//   Storage       – the storage protocol the engine needs (ChatStore), and its rows
//   SQLiteStorage – that protocol on SQLite (GRDB)
//   PostgresStorage – that protocol on PostgreSQL (postgres-nio)
//   Attachments   – the service's own copies of attached files (content-addressed)
//   ChatMetrics   – what the service counts and measures (swift-metrics; exported by ChatServer)
//   ChatEngine    – the chat semantics: one place that decides (Engine)
//   ChatSession   – authentication, per-session output and backpressure (Session)
//   ChatServer    – transports: stdio, TCP and Unix sockets (SwiftNIO); the metrics endpoint
//   Notifier      – notifications of offline recipients to the application's server (outbox → HTTP)
//   chatcore      – the command line
let package = Package(
    name: "chatcore",
    platforms: [.macOS(.v14)],
    products: [
        .executable(name: "chatcore", targets: ["chatcore"]),
        .executable(name: "chatcore-codegen", targets: ["Codegen"])
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-nio", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-crypto", from: "4.5.2"),
        .package(url: "https://github.com/vapor/jwt-kit", from: "5.8.0"),
        .package(url: "https://github.com/groue/GRDB.swift", from: "7.10.0"),
        .package(url: "https://github.com/apple/swift-metrics", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus", from: "2.4.1"),
        .package(url: "https://github.com/vapor/postgres-nio", from: "1.33.2"),
        .package(url: "https://github.com/apple/swift-nio-ssl", from: "2.37.6"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
        .package(url: "https://github.com/apple/swift-configuration", from: "1.4.0", traits: ["YAML"]),
        .package(url: "https://github.com/jpsim/Yams", from: "6.2.2"),
        .package(url: "https://github.com/apple/swift-system", from: "1.8.1"),
        .package(url: "https://github.com/swift-server/async-http-client", from: "1.37.0")
    ],
    targets: [
        .systemLibrary(
            name: "CYAJL",
            pkgConfig: "yajl",
            providers: [.apt(["libyajl-dev"])]
        ),
        .systemLibrary(name: "CMalloc"),
        .target(name: "ChatWire", dependencies: ["CYAJL"]),
        .target(name: "ChatProtocol", dependencies: ["ChatWire"]),
        .target(name: "Storage", dependencies: ["Threads"]),
        .target(name: "Threads"),
        .target(
            name: "ChatMetrics",
            dependencies: [
                "ChatProtocol", "Threads", .product(name: "CoreMetrics", package: "swift-metrics"), .product(name: "Metrics", package: "swift-metrics")
            ]
        ),
        .target(
            name: "Attachments",
            dependencies: ["Threads", .product(name: "Crypto", package: "swift-crypto")]
        ),
        .target(
            name: "SQLiteStorage",
            dependencies: ["Storage", "Threads", .product(name: "GRDB", package: "GRDB.swift")]
        ),
        .target(
            name: "PostgresStorage",
            dependencies: [
                "Storage", "Threads",
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log")
            ]
        ),
        .target(
            name: "ChatEngine",
            dependencies: [
                "ChatProtocol", "Storage", "Attachments", "ChatMetrics", "CMalloc", "Threads",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log")
            ],
            // The engine thread checked, at run time, every access to a record's or its own
            // stored properties for overlap: 18% of its time delivering into a chat of 250
            // (perf). Release builds leave the check out here; debug builds, the tests and
            // the sanitizer builds (`make asan`, `make tsan`) keep it, and the compiler's
            // static check stays on in all of them.
            swiftSettings: [.unsafeFlags(["-enforce-exclusivity=unchecked"], .when(configuration: .release))]
        ),
        .target(
            name: "ChatSession",
            dependencies: [
                "ChatEngine", "ChatProtocol", "ChatWire", "ChatMetrics", "Threads",
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log")
            ]
        ),
        .target(
            name: "ChatServer",
            dependencies: [
                "ChatSession", "ChatProtocol", "ChatWire", "ChatMetrics", "Threads",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOWebSocket", package: "swift-nio"),
                .product(name: "NIOTLS", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log")
            ]
        ),
        .target(
            name: "Notifier",
            dependencies: [
                "ChatEngine", "ChatProtocol", "ChatWire", "ChatMetrics", "Storage",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log")
            ]
        ),
        .executableTarget(
            name: "chatcore",
            dependencies: [
                "ChatServer", "Notifier", "ChatSession", "ChatEngine", "Storage", "SQLiteStorage", "PostgresStorage", "Attachments", "ChatMetrics", "Threads",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Configuration", package: "swift-configuration"),
                .product(name: "Yams", package: "Yams"),
                .product(name: "SystemPackage", package: "swift-system"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log")
            ]
        ),
        .executableTarget(name: "Codegen", dependencies: ["ChatWire"], path: "Sources/Codegen"),
        .executableTarget(
            name: "chatcore-fuzz",
            dependencies: ["ChatWire", "ChatProtocol", "ChatEngine", "SQLiteStorage", .product(name: "Logging", package: "swift-log")],
            path: "Fuzz/Sources/chatcore-fuzz"
        ),
        .executableTarget(
            name: "chatcore-bench",
            dependencies: ["ChatProtocol", "ChatWire", "CYAJL"],
            path: "Benchmarks/Sources/chatcore-bench"
        ),
        .testTarget(
            name: "WireTests",
            dependencies: ["ChatWire", "ChatProtocol"]
        ),
        .testTarget(
            name: "EngineTests",
            dependencies: [
                "ChatEngine", "SQLiteStorage", "Storage", "ChatProtocol", "ChatWire", "Attachments", "CMalloc",
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "Logging", package: "swift-log")
            ]
        ),
        .testTarget(
            name: "CodegenTests",
            dependencies: ["Codegen"],
            exclude: ["Schemas", "Expected"]
        ),
        .testTarget(
            name: "StoreTests",
            dependencies: ["SQLiteStorage", "Storage", .product(name: "GRDB", package: "GRDB.swift")]
        ),
        .testTarget(
            name: "FixtureTests",
            dependencies: ["ChatWire", "ChatSession", "chatcore", .product(name: "Crypto", package: "swift-crypto")],
            path: "Tests/FixtureTests",
            exclude: []
        )
    ],
    swiftLanguageModes: [.v6]
)
