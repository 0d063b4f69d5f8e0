import ArgumentParser
import Configuration
import Foundation
import SystemPackage
import Yams

/// `chatcore serve`'s options from outside its command line. Each option not given as a flag
/// is looked up as `CHATCORE_<NAME>` in the environment (`--max-line-bytes`:
/// `CHATCORE_MAX_LINE_BYTES`), then as `<name>` in the YAML file of `--config` (or
/// `CHATCORE_CONFIG`), and handed to the argument parser as if it had been typed, so that one
/// parser checks every value wherever it came from: flags > environment > file > default.
struct Settings {
    /// One option of a command, as its `--help` describes it.
    struct Option: Equatable {
        let name: String
        let isFlag: Bool
        let isRepeating: Bool
        let defaultValue: String?

        var environmentName: String { Settings.environmentPrefix + name.uppercased().replacingOccurrences(of: "-", with: "_") }
    }

    /// Where an option's value came from.
    enum Source: Equatable, CustomStringConvertible {
        case commandLine
        case environment(String)
        case file(String)
        case none

        var description: String {
            switch self {
            case .commandLine: "the command line"
            case .environment(let name): "\(name) in the environment"
            case .file(let path): "the config file \(path)"
            case .none: "default"
            }
        }
    }

    /// A problem with the environment or the file, said in one sentence.
    struct Problem: Error, CustomStringConvertible {
        let description: String
    }

    static let configOption = "config"
    /// What every variable of chatcore's starts with (`--max-sessions`: `CHATCORE_MAX_SESSIONS`).
    static let environmentPrefix = "CHATCORE_"
    static let configVariable = environmentPrefix + "CONFIG"
    static let showOption = "show-config"

    /// Whether the environment or a config file may add to `arguments` (or `--show-config`
    /// asks what they did): else the command line is all there is, and the options need
    /// not be listed (`options(of:)` lists them through ArgumentParser's help dump, about
    /// a fifth of the CPU a start took).
    static func mayAdd(to arguments: [String], environment: [String: String]) -> Bool {
        let given = givenOnCommandLine(arguments)
        return given.contains(configOption) || given.contains(showOption)
            || environment.keys.contains { $0.uppercased().hasPrefix(environmentPrefix) }
    }

    /// The arguments to parse: the command line's, then what the environment and the file add.
    private(set) var arguments: [String]
    /// Each option's values and where they came from, in `--help`'s order.
    private(set) var resolved: [(option: Option, values: [String], source: Source)] = []

    /// The options of `command` that settings may give: all but `--help`, `--version` and
    /// `--config` itself.
    static func options(of command: ParsableCommand.Type) -> [Option] {
        struct Dump: Decodable {
            struct Command: Decodable { let arguments: [Argument]? }
            struct Argument: Decodable {
                struct Name: Decodable {
                    let kind: String
                    let name: String
                }
                let kind: String
                let names: [Name]?
                let isRepeating: Bool
                let defaultValue: String?
            }
            let command: Command
        }
        guard let dump = try? JSONDecoder().decode(Dump.self, from: Data(command._dumpHelp().utf8)) else { return [] }
        return (dump.command.arguments ?? []).compactMap { argument in
            guard argument.kind != "positional", let long = argument.names?.first(where: { $0.kind == "long" })?.name,
                !["help", "version", configOption, showOption].contains(long)
            else { return nil }
            return Option(name: long, isFlag: argument.kind == "flag", isRepeating: argument.isRepeating, defaultValue: argument.defaultValue)
        }
    }

    /// `arguments` as the command line gave them (without the program's name), completed from
    /// `environment` and the config file.
    init(arguments: [String], options: [Option], environment: [String: String]) async throws {
        self.arguments = arguments
        let given = Self.givenOnCommandLine(arguments)
        if given.contains("help") || arguments.contains("-h") {
            return
        }
        let environmentProvider = EnvironmentVariablesProvider(environmentVariables: environment)
        var file: (path: String, provider: any ConfigProvider, keys: [String: String])?
        if let path = Self.values(of: Self.configOption, isFlag: false, in: arguments).last
            ?? environment[Self.configVariable].flatMap({ $0.isEmpty ? nil : $0 })
        {
            let (provider, keys) = try await Self.open(path, options: options)
            file = (path, provider, keys)
        }
        for option in options {
            if given.contains(option.name) {
                resolved.append((option, Self.values(of: option.name, isFlag: option.isFlag, in: arguments), .commandLine))
                continue
            }
            var found: (values: [String], source: Source)?
            if let values = try Self.lookUp(option, in: environmentProvider, key: ["chatcore", option.name], named: option.environmentName) {
                found = (values, .environment(option.environmentName))
            } else if let file, let key = file.keys[option.name],
                let values = try Self.lookUp(option, in: file.provider, key: [key], named: "\(key) in \(file.path)")
            {
                found = (values, .file(file.path))
            }
            guard let found else {
                resolved.append((option, option.defaultValue.map { [$0] } ?? [], .none))
                continue
            }
            resolved.append((option, found.values, found.source))
            if option.isFlag {
                if found.values == ["true"] { self.arguments.append("--\(option.name)") }
            } else {
                self.arguments += found.values.map { "--\(option.name)=\($0)" }
            }
        }
    }

    /// The long option names the command line gives (`--name value` or `--name=value`), up to a `--`.
    static func givenOnCommandLine(_ arguments: [String]) -> Set<String> {
        var names: Set<String> = []
        for argument in arguments {
            if argument == "--" { break }
            guard argument.hasPrefix("--") else { continue }
            names.insert(String(argument.dropFirst(2).prefix { $0 != "=" }))
        }
        return names
    }

    /// Every value the command line gives `--name` (`--name value` or `--name=value`; a
    /// flag's is `true`), up to a `--`.
    static func values(of name: String, isFlag: Bool, in arguments: [String]) -> [String] {
        var values: [String] = []
        var index = 0
        while index < arguments.count, arguments[index] != "--" {
            let argument = arguments[index]
            if argument == "--\(name)" {
                if isFlag {
                    values.append("true")
                } else if index + 1 < arguments.count {
                    values.append(arguments[index + 1])
                    index += 1
                }
            } else if argument.hasPrefix("--\(name)=") {
                values.append(String(argument.dropFirst(name.count + 3)))
            }
            index += 1
        }
        return values
    }

    /// The file, read, with every key it has checked against the options: each option's key as
    /// the file writes it (`max-line-bytes`, or `max_line_bytes` as YAML often has it).
    private static func open(_ path: String, options: [Option]) async throws -> (any ConfigProvider, [String: String]) {
        let text: String
        do {
            text = try String(contentsOfFile: path, encoding: .utf8)
        } catch {
            throw Problem(description: "cannot read the config file \(path): \((error as NSError).localizedFailureReason ?? "\(error)")")
        }
        let written: [String]
        do {
            // A file of comments only (or nothing) sets nothing.
            guard let root = try Yams.compose(yaml: text) else { return (InMemoryProvider(values: [:]), [:]) }
            guard let mapping = root.mapping else { throw Problem(description: "the config file \(path) must be a mapping of option names to values") }
            written = mapping.keys.map { $0.string ?? "\($0)" }
        } catch let problem as Problem {
            throw problem
        } catch {
            throw Problem(description: "the config file \(path) is not YAML: \(error)")
        }
        let known = Set(options.map(\.name))
        var keys: [String: String] = [:]
        var unknown: [String] = []
        for key in written {
            let name = key.replacingOccurrences(of: "_", with: "-")
            guard known.contains(name) else {
                unknown.append(key)
                continue
            }
            if let other = keys[name] { throw Problem(description: "the config file \(path) sets --\(name) twice: as '\(other)' and as '\(key)'") }
            keys[name] = key
        }
        guard unknown.isEmpty else {
            throw Problem(
                description:
                    "the config file \(path) has \(unknown.map { "'\($0)'" }.joined(separator: ", ")), which \(unknown.count == 1 ? "is not an option" : "are not options") of chatcore serve: its keys are the long options of `chatcore serve --help` without the dashes (listen, max-line-bytes, ...)"
            )
        }
        do {
            return (try await FileProvider<YAMLSnapshot>(filePath: FilePath(path)), keys)
        } catch {
            throw Problem(description: "the config file \(path): \(error)")
        }
    }

    /// An option's values in one provider: nil when it has none; a flag's is `["true"]` or `["false"]`.
    private static func lookUp(_ option: Option, in provider: some ConfigProvider, key: [String], named name: String) throws -> [String]? {
        let key = AbsoluteConfigKey(key)
        func content(_ type: ConfigType) throws -> ConfigContent? { try provider.value(forKey: key, type: type).value?.content }
        do {
            if option.isFlag {
                guard let content = try content(.bool) else { return nil }
                guard case .bool(let on) = content else { return nil }
                return [on ? "true" : "false"]
            }
            if option.isRepeating, let content = try? content(.stringArray), case .stringArray(let values) = content {
                let values = values.filter { !$0.isEmpty }
                return values.isEmpty ? nil : values
            }
            guard let content = try content(.string), case .string(let value) = content, !value.isEmpty else { return nil }
            return [value]
        } catch {
            throw Problem(
                description: option.isFlag
                    ? "\(name) must be true or false (it stands for --\(option.name))"
                    : "\(name) must be \(option.isRepeating ? "a value or a list of values" : "one value") (it stands for --\(option.name))")
        }
    }

    /// Where the options named in `message` (an error of the parser) came from, when not from
    /// the command line: the lines to print after it.
    func origins(of message: String) -> [String] {
        resolved.compactMap { option, _, source in
            switch source {
            case .environment, .file:
                message.contains("--\(option.name)") ? "--\(option.name) came from \(source)." : nil
            case .commandLine, .none:
                nil
            }
        }
    }

    /// The settings in effect as a config file (YAML), each with where it came from.
    var yaml: String {
        var lines = ["# chatcore serve: the settings in effect (flags > CHATCORE_* > config file > default)"]
        for (option, values, source) in resolved {
            let origin = "  # \(source)"
            if option.isFlag {
                lines.append("\(option.name): \(values.last ?? "false")\(origin)")
            } else if values.isEmpty {
                lines.append("# \(option.name):\(origin == "  # default" ? "  # not set" : origin)")
            } else if option.isRepeating {
                lines.append("\(option.name): [\(values.map(Self.quoted).joined(separator: ", "))]\(origin)")
            } else {
                lines.append("\(option.name): \(Self.quoted(values[values.count - 1]))\(origin)")
            }
        }
        return lines.joined(separator: "\n")
    }

    /// A YAML scalar for `value`: plain when it is only letters, digits and `./_@-` (and does
    /// not start with `-`), quoted otherwise. Settings are read as strings, so `true` and `64`
    /// need no quotes.
    private static func quoted(_ value: String) -> String {
        let plain = !value.isEmpty && !value.hasPrefix("-") && value.allSatisfy { $0.isLetter || $0.isNumber || "./_@-".contains($0) }
        return plain ? value : "'" + value.replacingOccurrences(of: "'", with: "''") + "'"
    }
}
