// Debian packages no @types/node: these are the few Node.js APIs the checked examples use,
// declared as Node documents them, so that `tsc` can check the examples offline.
declare module "node:fs" {
  export function mkdtempSync(prefix: string): string;
  export function rmSync(path: string, options?: { recursive?: boolean; force?: boolean }): void;
}
declare module "node:os" {
  export function tmpdir(): string;
}
declare module "node:path" {
  export function join(...paths: string[]): string;
}
declare var process: { exit(code?: number): never; env: Record<string, string | undefined>; argv: string[] };
