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

// Where the store is: the URL, TLS and the connection's settings.

extension PostgresStore {
    /// Where the database is and who connects (from `--store`).
    public struct Location: Sendable, CustomStringConvertible {
        public enum Address: Sendable {
            case tcp(host: String, port: Int)
            case unix(path: String)
        }

        /// Whether and how TLS protects a TCP connection (libpq's `sslmode`; a Unix
        /// socket never uses TLS).
        public enum TLSMode: String, Sendable, CaseIterable {
            /// Never.
            case disable
            /// When the server offers it, without checking its certificate (libpq's default).
            case prefer
            /// Always; the certificate is not checked unless `sslrootcert` is given, then
            /// as for verify-ca (libpq does the same).
            case require
            /// Always, with a certificate signed by `sslrootcert` (or the system's roots).
            case verifyCA = "verify-ca"
            /// As verify-ca, and the certificate names the host connected to.
            case verifyFull = "verify-full"
        }

        public var address: Address
        public var user: String
        public var database: String
        public var password: String?
        public var tlsMode: TLSMode
        /// The certificates (PEM) a server's certificate must chain to (`sslrootcert`).
        public var rootCertificates: String?
        let tls: PostgresConnection.Configuration.TLS
        /// The same for the pool (`PostgresClient` takes the configuration, not a context).
        let poolTLS: PostgresClient.Configuration.TLS

        /// `postgres://USER@HOST[:PORT]/DATABASE[?sslmode=MODE&sslrootcert=FILE]`, or
        /// `postgres://USER@/DATABASE?host=/run/postgresql` (a Unix socket in that
        /// directory), in libpq's spelling. A password in the URL is refused: command lines
        /// are visible to every user of the machine.
        public init(url text: String, password: String?) throws {
            guard let url = URLComponents(string: text), let scheme = url.scheme, scheme == "postgres" || scheme == "postgresql" else {
                throw OpenError(description: "--store must be a postgres:// URL (postgres://USER@HOST[:PORT]/DATABASE), not \(text)")
            }
            guard url.password == nil else {
                throw OpenError(
                    description: "--store must not carry a password (command lines are visible to every user of the machine): "
                        + "use --store-password-file or PGPASSWORD")
            }
            let database = url.path.hasPrefix("/") ? String(url.path.dropFirst()) : url.path
            guard !database.isEmpty else { throw OpenError(description: "--store names no database: postgres://USER@HOST/DATABASE") }
            let socketDirectory = url.queryItems?.first { $0.name == "host" }?.value
            let port = url.port ?? 5432
            if let socketDirectory, socketDirectory.hasPrefix("/") {
                address = .unix(path: socketDirectory + "/.s.PGSQL.\(port)")
            } else if let host = url.host, !host.isEmpty {
                address = .tcp(host: host, port: port)
            } else {
                address = .unix(path: "/var/run/postgresql/.s.PGSQL.\(port)")
            }
            user = url.user ?? ProcessInfo.processInfo.environment["USER"] ?? "postgres"
            self.database = database
            self.password = password
            let query = url.queryItems ?? []
            if let unknown = query.first(where: { !["host", "sslmode", "sslrootcert"].contains($0.name) }) {
                throw OpenError(description: "--store: unknown parameter \(unknown.name) (known: host, sslmode, sslrootcert)")
            }
            let mode = query.first { $0.name == "sslmode" }?.value ?? TLSMode.prefer.rawValue
            guard let tlsMode = TLSMode(rawValue: mode) else {
                throw OpenError(description: "--store: sslmode must be one of \(TLSMode.allCases.map(\.rawValue).joined(separator: ", ")), not \(mode)")
            }
            self.tlsMode = tlsMode
            rootCertificates = query.first { $0.name == "sslrootcert" }?.value
            // A Unix socket never uses TLS (as with libpq): no context is made for it.
            if case .tcp = address, tlsMode != .disable {
                let configuration = try Location.tlsConfiguration(tlsMode, rootCertificates: rootCertificates)
                let context: NIOSSLContext
                do {
                    context = try NIOSSLContext(configuration: configuration)
                } catch {
                    throw OpenError(description: "--store: cannot set up TLS (sslmode=\(tlsMode.rawValue)): \(error)")
                }
                tls = tlsMode == .prefer ? .prefer(context) : .require(context)
                poolTLS = tlsMode == .prefer ? .prefer(configuration) : .require(configuration)
            } else {
                tls = .disable
                poolTLS = .disable
            }
        }

        /// What postgres-nio is told: TLS is offered (prefer) or demanded (the others),
        /// with the certificate checks the mode asks for.
        private static func tlsConfiguration(_ mode: TLSMode, rootCertificates: String?) throws -> TLSConfiguration {
            var configuration = TLSConfiguration.makeClientConfiguration()
            switch mode {
            case .disable, .prefer: configuration.certificateVerification = .none
            case .require: configuration.certificateVerification = rootCertificates == nil ? .none : .noHostnameVerification
            case .verifyCA: configuration.certificateVerification = .noHostnameVerification
            case .verifyFull: configuration.certificateVerification = .fullVerification
            }
            if let rootCertificates {
                guard FileManager.default.isReadableFile(atPath: rootCertificates) else {
                    throw OpenError(description: "--store: sslrootcert \(rootCertificates) cannot be read")
                }
                configuration.trustRoots = .file(rootCertificates)
            }
            return configuration
        }

        public var description: String {
            switch address {
            case .tcp(let host, let port): "postgres://\(user)@\(host):\(port)/\(database) (sslmode \(tlsMode.rawValue))"
            case .unix(let path): "postgres://\(user)@/\(database) (socket \(path))"
            }
        }

        var configuration: PostgresConnection.Configuration {
            var configuration: PostgresConnection.Configuration
            switch address {
            case .tcp(let host, let port):
                configuration = .init(host: host, port: port, username: user, password: password, database: database, tls: tls)
            case .unix(let path):
                configuration = .init(unixSocketPath: path, username: user, password: password, database: database)
            }
            configuration.options.connectTimeout = .seconds(PostgresStore.connectionPatience.components.seconds)
            // Every connection of this process is named after it: a node taking over
            // from a writer that stopped answering ends exactly that writer's sessions.
            configuration.options.additionalStartupParameters = [("application_name", PostgresStore.nodeName)]
            return configuration
        }

        /// The pool's configuration: the same server, TLS, attempt bound and name as
        /// `configuration`; `durableCommits`: its connections set `synchronous_commit` on
        /// (`PostgresStore.makeCommitsDurable` says why).
        func poolConfiguration(durableCommits: Bool) -> PostgresClient.Configuration {
            var configuration: PostgresClient.Configuration
            switch address {
            case .tcp(let host, let port):
                configuration = .init(host: host, port: port, username: user, password: password, database: database, tls: poolTLS)
            case .unix(let path):
                configuration = .init(unixSocketPath: path, username: user, password: password, database: database)
            }
            configuration.options.connectTimeout = PostgresStore.connectionPatience
            configuration.options.additionalStartupParameters = [("application_name", PostgresStore.nodeName)]
            if durableCommits { configuration.options.additionalStartupParameters.append(("synchronous_commit", "on")) }
            return configuration
        }
    }
}
