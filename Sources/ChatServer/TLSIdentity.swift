import NIOSSL
import Threads

/// The certificate chain and private key the `tls://` and `wss://` listeners present
/// (PEM files), read again on SIGHUP: connections accepted after a reload get the new
/// ones, those open keep theirs. TLS 1.2 and later only.
public final class TLSIdentity: Sendable {
    public let certificatePath: String
    public let keyPath: String
    private let current: Locked<NIOSSLContext>

    /// Reads both files; throws, saying which file and why, when they cannot serve.
    public init(certificate: String, key: String) throws {
        certificatePath = certificate
        keyPath = key
        current = Locked(try TLSIdentity.context(certificate: certificate, key: key))
    }

    /// The context new connections are given.
    var context: NIOSSLContext { current.withLock { $0 } }

    /// Reads the files again; on failure (thrown) the identity in use stays.
    public func reload() throws {
        let context = try TLSIdentity.context(certificate: certificatePath, key: keyPath)
        current.withLock { $0 = context }
    }

    private static func context(certificate: String, key: String) throws -> NIOSSLContext {
        let chain = try certificates(in: certificate, called: "the certificate chain")
        let privateKey: NIOSSLPrivateKey
        do {
            privateKey = try NIOSSLPrivateKey(file: key, format: .pem)
        } catch {
            throw TLSIdentityError("cannot read the private key in \(key) (PEM expected): \(error)")
        }
        var configuration = TLSConfiguration.makeServerConfiguration(certificateChain: chain.map { .certificate($0) }, privateKey: .privateKey(privateKey))
        configuration.minimumTLSVersion = .tlsv12
        do {
            return try NIOSSLContext(configuration: configuration)
        } catch {
            throw TLSIdentityError("the key in \(key) and the certificate in \(certificate) cannot serve together: \(error)")
        }
    }
}

extension TLSIdentity {
    /// The certificates of a PEM file (`called`: what they are, as errors say it); throws,
    /// naming the file, when it cannot be read or holds none.
    static func certificates(in path: String, called: String) throws -> [NIOSSLCertificate] {
        let certificates: [NIOSSLCertificate]
        do {
            certificates = try NIOSSLCertificate.fromPEMFile(path)
        } catch {
            throw TLSIdentityError("cannot read \(called) in \(path) (PEM expected): \(error)")
        }
        guard !certificates.isEmpty else { throw TLSIdentityError("\(path) holds no certificate (PEM expected)") }
        return certificates
    }
}

public struct TLSIdentityError: Error, CustomStringConvertible {
    public let description: String
    init(_ description: String) { self.description = description }
}
