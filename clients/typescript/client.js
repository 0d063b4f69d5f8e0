// chatcore's Node client: spawn `chatcore serve --user` or connect over TCP or a Unix socket,
// send requests and await their outcome, iterate over events (the session itself is core.js,
// which browser.js shares). Types: client.d.ts.
import { spawn } from "node:child_process";
import { accessSync, constants, mkdtempSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { connect as netConnect } from "node:net";
import { tmpdir } from "node:os";
import { dirname, delimiter, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { Client as CoreClient, ConnectionClosed } from "./core.js";

export * from "./core.js";

/** "host:port", "tcp://host:port", "[::1]:port" (IPv6 in brackets) as net.connect's options. */
function tcpOptions(address) {
  const rest = address.replace(/^tcp:\/\//, "");
  const at = rest.lastIndexOf(":");
  let host = rest.slice(0, at);
  const port = rest.slice(at + 1);
  const bracketed = host.startsWith("[") && host.endsWith("]");
  if (at < 0 || !/^\d+$/.test(port) || (host.includes(":") && !bracketed)) {
    throw new TypeError(`${JSON.stringify(address)} is not an address: expected unix:/path, host:port or [ipv6]:port`);
  }
  if (bracketed) host = host.slice(1, -1);
  return { host: host || "127.0.0.1", port: Number(port) };
}

function executable(path) {
  try {
    accessSync(path, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

/** The package carrying this platform's binary, installed beside this one as an optional
 * dependency (the way esbuild ships its binaries). */
const PLATFORM_PACKAGE = `chatcore-client-${process.platform}-${process.arch}`;

function givenExecutable(path, givenAs) {
  const absolute = resolve(path);
  if (!executable(absolute)) throw new Error(`${givenAs} is ${absolute}, which is not an executable file: point it at the chatcore binary`);
  return absolute;
}

/** The chatcore executable: `binary`, else $CHATCORE_BINARY, else the one installed with this
 * package (its platform package), else `chatcore` on PATH, else a build in the current
 * directory or above (.build/release/chatcore, then debug). A `binary` or $CHATCORE_BINARY
 * that is not an executable file throws. */
export function findBinary(binary) {
  if (binary) return givenExecutable(binary, "binary");
  if (process.env.CHATCORE_BINARY) return givenExecutable(process.env.CHATCORE_BINARY, "CHATCORE_BINARY");
  try {
    const bundled = join(dirname(createRequire(import.meta.url).resolve(`${PLATFORM_PACKAGE}/package.json`)), "bin", "chatcore");
    if (executable(bundled)) return bundled;
  } catch {
    // Not installed with its platform package (a checkout of the repository).
  }
  for (const directory of (process.env.PATH ?? "").split(delimiter)) {
    if (directory && executable(join(directory, "chatcore"))) return join(directory, "chatcore");
  }
  for (const start of [process.cwd(), dirname(fileURLToPath(import.meta.url))]) {
    for (let directory = resolve(start); ; directory = dirname(directory)) {
      for (const kind of ["release", "debug"]) {
        const candidate = join(directory, ".build", kind, "chatcore");
        if (executable(candidate)) return candidate;
      }
      if (dirname(directory) === directory) break;
    }
  }
  throw new Error("chatcore was not found: build it (`make build`, or `swift build -c release --product chatcore` in the " +
    "chatcore repository), then set CHATCORE_BINARY=/path/to/chatcore, put it on PATH, or pass { binary }");
}

/** A Node stream pair (and the child whose they are, if any) as a client's transport. */
function streams(input, output, child) {
  return {
    start({ data, end }) {
      output.setEncoding("utf8");
      output.on("data", data);
      output.on("end", () => end());
      output.on("close", () => end());
      output.on("error", (error) => end(error));
      input.on("error", () => {});
    },
    write(text) {
      input.write(text + "\n");
    },
    end() {
      input.end();
    },
    async dispose() {
      if (output.destroy) output.destroy();
      if (child && child.exitCode === null) {
        await new Promise((resolveExit) => {
          const timer = setTimeout(() => child.kill("SIGKILL"), 10000);
          child.once("exit", () => { clearTimeout(timer); resolveExit(); });
        });
      }
    },
  };
}

export class Client extends CoreClient {
  constructor(input, output, child = null) {
    super(streams(input, output, child));
  }

  /** `chatcore serve --user USER` as a child process, over its standard input/output. */
  static spawn(user, { dataDir, binary, args = [] } = {}) {
    const quiet = args.includes("--log-level") ? [] : ["--log-level", "warning"];
    const command = ["serve", "--user", user, ...quiet, ...args, ...(dataDir ? ["--data-dir", dataDir] : [])];
    const child = spawn(findBinary(binary), command, { stdio: ["pipe", "pipe", "inherit"] });
    const client = new Client(child.stdin, child.stdout, child);
    // A binary that cannot be started fails the client's requests, not the process.
    child.once("error", (error) => child.stdout.destroy(error));
    return client;
  }

  /** Connects to a serving chatcore: "unix:/path", "host:port", "tcp://host:port" or "[::1]:port". */
  static connect(address) {
    return new Promise((resolveClient, reject) => {
      const options = address.startsWith("unix:") ? { path: address.slice("unix:".length) } : tcpOptions(address);
      const socket = netConnect({ ...options, allowHalfOpen: true });
      socket.once("connect", () => resolveClient(new Client(socket, socket)));
      socket.once("error", reject);
    });
  }
}

/** Whether something accepts a connection on the Unix socket `path` (the probe is closed). */
function accepts(path) {
  return new Promise((resolveAccepted) => {
    const probe = netConnect(path);
    probe.once("connect", () => { probe.destroy(); resolveAccepted(true); });
    probe.once("error", () => { probe.destroy(); resolveAccepted(false); });
  });
}

/** A chatcore serving a Unix socket in a directory of its own, for scripts and tests that need
 * several users at once. By default any token is accepted (--insecure-no-auth). */
export class Server {
  constructor(child, socket, directory) {
    this.child = child;
    this.address = `unix:${socket}`;
    this.directory = directory;
  }

  static async start({ dataDir, binary, args = ["--insecure-no-auth", "--log-level", "warning"], timeout = 30000 } = {}) {
    const directory = mkdtempSync(join(tmpdir(), "chatcore-"));
    const socket = join(directory, "chatcore.sock");
    const child = spawn(findBinary(binary), ["serve", "--listen", `unix:${socket}`, "--data-dir", dataDir ?? join(directory, "data"), ...args],
      { stdio: ["ignore", "ignore", "inherit"] });
    let failed = null;
    child.once("error", (error) => { failed = error; });
    const started = Date.now();
    // The socket file appears when chatcore binds it, a moment before it listens: it is
    // ready once a connection is accepted.
    while (!(await accepts(socket))) {
      if (failed) throw new ConnectionClosed(`chatcore could not be started: ${failed.message}`);
      if (child.exitCode !== null || Date.now() - started > timeout) {
        throw new ConnectionClosed(`chatcore did not start serving ${socket} (exit ${child.exitCode})`);
      }
      await new Promise((r) => setTimeout(r, 20));
    }
    return new Server(child, socket, directory);
  }

  /** A new session; authenticated as `user` when given. */
  async connect(user, token = "any") {
    const client = await Client.connect(this.address);
    if (user !== undefined) await client.authenticate(user, token);
    return client;
  }

  async stop() {
    if (this.child.exitCode === null) {
      await new Promise((resolveExit) => {
        const timer = setTimeout(() => this.child.kill("SIGKILL"), 20000);
        this.child.once("exit", () => { clearTimeout(timer); resolveExit(); });
        this.child.kill("SIGTERM");
      });
    }
    rmSync(this.directory, { recursive: true, force: true });
  }

  /** `await using server = await Server.start()` stops it at the end of the scope. */
  [Symbol.asyncDispose ?? Symbol.for("Symbol.asyncDispose")]() {
    return this.stop();
  }
}
