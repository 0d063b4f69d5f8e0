#!/bin/sh
# Builds chatcore's Debian package from a self-contained binary (make dist):
#   packaging/build_deb.sh BINARY VERSION OUTPUT_DIRECTORY
# It installs /usr/bin/chatcore, the system user chatcore, /var/lib/chatcore (0700, the
# user's), the hardened unit chatcore.service and its options in /etc/chatcore/chatcore.yaml
# (a conffile: an upgrade keeps the operator's edits).
set -eu
binary=$1 version=$2 output=$3
here=$(cd "$(dirname "$0")" && pwd)
case $(uname -m) in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; *) arch=$(uname -m) ;; esac
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
install -D -m 0755 "$binary" "$root/usr/bin/chatcore"
install -D -m 0644 "$here/chatcore.service" "$root/lib/systemd/system/chatcore.service"
install -D -m 0640 "$here/chatcore.yaml" "$root/etc/chatcore/chatcore.yaml"
install -D -m 0644 "$here/../LICENSE" "$root/usr/share/doc/chatcore/copyright"
install -D -m 0644 "$here/../README.md" "$root/usr/share/doc/chatcore/README.md"
mkdir -p "$root/DEBIAN"
cat > "$root/DEBIAN/control" <<CONTROL
Package: chatcore
Version: $version
Architecture: $arch
Maintainer: chatcore developers <chatcore@localhost>
Section: net
Priority: optional
Depends: libc6, adduser
Installed-Size: $(du -k -s "$root" | cut -f1)
Description: chat core speaking BBMDS JSON over sockets and standard input/output
 Chats, participants, messages with delivery and read states, threads, attachments,
 search and change feeds, durable in SQLite or PostgreSQL, for applications in any
 language (and bbmcore applications, unmodified).
CONTROL
echo /etc/chatcore/chatcore.yaml > "$root/DEBIAN/conffiles"
cat > "$root/DEBIAN/postinst" <<'POSTINST'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    getent group chatcore >/dev/null || addgroup --system chatcore
    getent passwd chatcore >/dev/null || adduser --system --ingroup chatcore --home /var/lib/chatcore --no-create-home --shell /usr/sbin/nologin chatcore
    install -d -o chatcore -g chatcore -m 0700 /var/lib/chatcore
    chgrp chatcore /etc/chatcore/chatcore.yaml
    if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
fi
POSTINST
cat > "$root/DEBIAN/prerm" <<'PRERM'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then systemctl stop chatcore.service || true; fi
PRERM
cat > "$root/DEBIAN/postrm" <<'POSTRM'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
if [ "$1" = purge ]; then
    rm -rf /var/lib/chatcore
    getent passwd chatcore >/dev/null && deluser --system chatcore >/dev/null || true
fi
POSTRM
chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm" "$root/DEBIAN/postrm"
mkdir -p "$output"
dpkg-deb --root-owner-group --build "$root" "$output/chatcore_${version}_${arch}.deb" >/dev/null
echo "$output/chatcore_${version}_${arch}.deb"
