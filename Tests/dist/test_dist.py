"""`make dist`'s binary runs where no Swift toolchain can be found: a mount namespace in
which /opt/swift (the toolchain, with its runtime libraries) is an empty directory."""
import json
import os
import pathlib
import shutil
import subprocess
import tempfile

from conftest import ROOT

TOOLCHAIN = pathlib.Path(os.environ.get("SWIFT_TOOLCHAIN", "/opt/swift"))


def dist_binary():
    found = sorted((ROOT / "dist").glob("chatcore-*/chatcore"))
    assert found, "no dist/chatcore-*/chatcore: run make dist"
    return found[-1]


def test_the_binary_needs_no_swift_library():
    linked = subprocess.run(["ldd", str(dist_binary())], capture_output=True, text=True).stdout
    for library in ("swift", "Foundation", "dispatch", "yajl", "sqlite", "stdc++"):
        assert library not in linked, f"linked against {library}:\n{linked}"


def test_the_archive_holds_the_binary_the_license_the_readme_and_the_unit():
    archive = dist_binary().parent
    for name in ("chatcore", "LICENSE", "README.md", "CHANGELOG.md", "chatcore.service", "chatcore.yaml"):
        assert (archive / name).exists(), name
    assert (archive.parent / f"{archive.name}.tar.gz").exists()


def test_a_conversation_without_the_toolchain():
    assert TOOLCHAIN.is_dir(), f"{TOOLCHAIN} is not the toolchain's directory (set SWIFT_TOOLCHAIN)"
    with tempfile.TemporaryDirectory() as work:
        binary = pathlib.Path(work) / "chatcore"
        shutil.copy(dist_binary(), binary)
        lines = [{"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "no swift here"}},
                 {"chatMessageSend": {"cookie": "m", "chatId": "1", "tag": "Text", "content": "hello"}}]
        script = (f"mount -t tmpfs none {TOOLCHAIN} && test -z \"$(ls {TOOLCHAIN})\" && "
                  f"! command -v swift && exec {binary} serve --user alice --data-dir {work}/data")
        unshare = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
        env = {"PATH": "/usr/bin:/bin", "HOME": work}
        done = subprocess.run(unshare + ["sh", "-c", script], input="".join(json.dumps(l) + "\n" for l in lines),
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        answers = [json.loads(line) for line in done.stdout.splitlines()]
        sent = [a["listAdd"]["elements"][0] for a in answers if a.get("listAdd", {}).get("cookie") == "m"]
        assert sent and sent[0]["state"] == "Sent" and sent[0]["content"] == "hello", answers
        version = subprocess.run(unshare + ["sh", "-c", f"mount -t tmpfs none {TOOLCHAIN} && exec {binary} --version"],
                                 capture_output=True, text=True, timeout=30, env=env).stdout.strip()
        assert version == subprocess.run([str(dist_binary()), "--version"], capture_output=True, text=True).stdout.strip()
        assert version == (ROOT / "Sources" / "chatcore" / "Chatcore.swift").read_text().split('static let version = "')[1].split('"')[0]
