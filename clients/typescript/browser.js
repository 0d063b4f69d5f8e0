// chatcore's client for browsers (and any runtime with a WebSocket): the same `Client` as the
// Node one (core.js), over a WebSocket listener of chatcore (`--listen ws://HOST:PORT/PATH`),
// one message per text frame. Nothing here needs Node. Types: browser.d.ts.
import { Client as CoreClient, ConnectionClosed } from "./core.js";

export * from "./core.js";

/** A WebSocket as a client's transport: each frame one line. */
function webSocket(socket) {
  return {
    start({ data, end }) {
      socket.addEventListener("message", (message) => {
        if (typeof message.data === "string") data(message.data + "\n");
      });
      socket.addEventListener("close", (closed) => {
        // 1000: the session ended as asked; 1005: no code given. Anything else says why.
        end(closed.code === 1000 || closed.code === 1005 ? undefined : new Error(`closed with ${closed.code}: ${closed.reason}`));
      });
    },
    write(text) {
      socket.send(text);
    },
    end() {
      if (socket.readyState <= 1) socket.close(1000);
    },
  };
}

export class Client extends CoreClient {
  /**
   * Connects to a chatcore WebSocket listener, "ws://host:port/path" or "wss://…"; resolves
   * once it is open. `WebSocket`: the implementation to use (the runtime's by default).
   */
  static connect(url, { WebSocket: Implementation = globalThis.WebSocket } = {}) {
    if (!Implementation) return Promise.reject(new TypeError("no WebSocket here: pass { WebSocket } (the ws package, say)"));
    return new Promise((resolveClient, reject) => {
      const socket = new Implementation(url);
      const failed = (event) => {
        socket.removeEventListener("open", opened);
        reject(new ConnectionClosed(`could not open ${url}${event?.code ? ` (${event.code} ${event.reason ?? ""})` : ""}`));
      };
      const opened = () => {
        socket.removeEventListener("error", failed);
        socket.removeEventListener("close", failed);
        resolveClient(new Client(webSocket(socket)));
      };
      socket.addEventListener("open", opened, { once: true });
      socket.addEventListener("error", failed, { once: true });
      socket.addEventListener("close", failed, { once: true });
    });
  }
}
