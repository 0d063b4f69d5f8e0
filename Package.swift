// swift-tools-version: 6.1
import PackageDescription

// chatcore: a BBMDS-style chat core speaking newline-delimited JSON.
// Modules, from the bytes up (imports only point down this list):
//   CYAJL       – the system YAJL library (libyajl-dev)
//   CMalloc     – the C library's heap introspection (malloc.h)
//   Threads     – chatcore's own threads name themselves (for top -H and /proc); state they share (Locked)
//   Wire        – line framing, YAJL reader, JSON writer, JSONValue, the decoding runtime
//   Protocol    – the messages, generated from Schemas/ by Codegen
//   Store       – the storage protocol the engine needs, and its records
//   SQLiteStore – that protocol on SQLite (GRDB)
//   PostgresStore – that protocol on PostgreSQL (postgres-nio)
//   Attachments – the service's own copies of attached files (content-addressed)
//   ServiceMetrics – what the service counts and measures (swift-metrics; exported by Server)
//   Engine      – the chat semantics: one place that decides
//   Session     – authentication, per-session output and backpressure
//   Server      – transports: stdio, TCP and Unix sockets (SwiftNIO); the metrics endpoint
//   chatcore    – the command line
let package = Package(
    name: "chatcore",
    platforms: [.macOS(.v14)],
    products: [
        .executable(name: "chatcore", targets: ["chatcore"]),
        .executable(name: "chatcore-codegen", targets: ["Codegen"]),
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
    ],
    targets: [
        .systemLibrary(
            name: "CYAJL",
            pkgConfig: "yajl",
            providers: [.apt(["libyajl-dev"])]
        ),
        .systemLibrary(name: "CMalloc"),
        .target(name: "Wire", dependencies: ["CYAJL"]),
        .target(name: "Protocol", dependencies: ["Wire"]),
        .target(name: "Store"),
        .target(name: "Threads"),
        .target(
            name: "ServiceMetrics",
            dependencies: ["Protocol", .product(name: "CoreMetrics", package: "swift-metrics"), .product(name: "Metrics", package: "swift-metrics")]
        ),
        .target(
            name: "Attachments",
            dependencies: [.product(name: "Crypto", package: "swift-crypto")]
        ),
        .target(
            name: "SQLiteStore",
            dependencies: ["Store", "Threads", .product(name: "GRDB", package: "GRDB.swift")]
        ),
        .target(
            name: "PostgresStore",
            dependencies: [
                "Store", "Threads",
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .target(
            name: "Engine",
            dependencies: [
                "Protocol", "Store", "Attachments", "ServiceMetrics", "CMalloc", "Threads",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .target(
            name: "Session",
            dependencies: [
                "Engine", "Protocol", "Wire", "ServiceMetrics", "Threads",
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .target(
            name: "Server",
            dependencies: [
                "Session", "Protocol", "Wire", "ServiceMetrics", "Threads",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .executableTarget(
            name: "chatcore",
            dependencies: [
                "Server", "Session", "Engine", "Store", "SQLiteStore", "PostgresStore", "Attachments", "ServiceMetrics", "Threads",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .executableTarget(name: "Codegen", dependencies: ["Wire"], path: "Sources/Codegen"),
        .executableTarget(
            name: "chatcore-fuzz",
            dependencies: ["Wire", "Protocol", "Engine", "SQLiteStore", .product(name: "Logging", package: "swift-log")],
            path: "Fuzz/Sources/chatcore-fuzz"
        ),
        .executableTarget(
            name: "chatcore-bench",
            dependencies: ["Protocol", "Wire", "CYAJL"],
            path: "Benchmarks/Sources/chatcore-bench"
        ),
        .testTarget(
            name: "WireTests",
            dependencies: ["Wire", "Protocol"]
        ),
        .testTarget(
            name: "EngineTests",
            dependencies: [
                "Engine", "SQLiteStore", "Store", "Protocol", "Wire", "Attachments", "CMalloc",
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .testTarget(
            name: "CodegenTests",
            dependencies: ["Codegen"],
            exclude: ["Schemas", "Expected"]
        ),
        .testTarget(
            name: "StoreTests",
            dependencies: ["SQLiteStore", "Store", .product(name: "GRDB", package: "GRDB.swift")]
        ),
        .testTarget(
            name: "FixtureTests",
            dependencies: ["Wire", "Session", "chatcore", .product(name: "Crypto", package: "swift-crypto")],
            path: "Tests/FixtureTests",
            exclude: []
        ),
    ],
    swiftLanguageModes: [.v6]
)
