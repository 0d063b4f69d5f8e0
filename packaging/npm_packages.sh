#!/bin/sh
# Packs the Node client with the binary, the way esbuild ships its binaries: a package for
# this platform (chatcore-client-<platform>-<arch>, with bin/chatcore), and the client
# naming it as an optional dependency; `npm install` of both gives a Client.spawn() that
# finds the binary with no configuration.
#   packaging/npm_packages.sh BINARY OUTPUT_DIRECTORY
set -eu
binary=$1 output=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
client="$here/../clients/typescript"
platform=$(node -p 'process.platform') arch=$(node -p 'process.arch')
version=$(node -p "require('$client/package.json').version")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/platform/bin"
install -m 0755 "$binary" "$work/platform/bin/chatcore"
cp "$here/../LICENSE" "$work/platform/"
cat > "$work/platform/package.json" <<JSON
{
  "name": "chatcore-client-$platform-$arch",
  "version": "$version",
  "description": "The chatcore binary for $platform-$arch, for chatcore-client",
  "os": ["$platform"],
  "cpu": ["$arch"],
  "files": ["bin/chatcore", "LICENSE"],
  "license": "Apache-2.0"
}
JSON
mkdir -p "$work/client"
cp -R "$client/client.js" "$client/client.d.ts" "$client/core.js" "$client/browser.js" "$client/browser.d.ts" "$client/protocol.js" "$client/protocol.d.ts" "$client/example.mjs" \
  "$client/README.md" "$client/package.json" "$here/../LICENSE" "$work/client/"
node -e "
const fs = require('fs'), file = '$work/client/package.json', p = JSON.parse(fs.readFileSync(file));
p.optionalDependencies = { 'chatcore-client-$platform-$arch': p.version };
p.files.push('LICENSE');
fs.writeFileSync(file, JSON.stringify(p, null, 2) + '\n');"
(cd "$output" && npm pack --silent "$work/platform" && npm pack --silent "$work/client")
