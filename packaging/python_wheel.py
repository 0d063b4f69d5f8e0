"""Builds the Python client's wheel with the chatcore binary in it, the way ruff's and
uv's wheels carry theirs: the binary is the wheel's script, so `pip install` puts the
`chatcore` command in the environment's bin directory, and `Client.spawn()` finds it there.

    python3 packaging/python_wheel.py BINARY OUTPUT_DIRECTORY
"""
import base64
import hashlib
import os
import pathlib
import platform
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIENT = ROOT / "clients" / "python"


def digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main(binary, output):
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    tag = f"py3-none-linux_{platform.machine()}"
    wheel = pathlib.Path(output) / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    files = []
    for path in sorted((CLIENT / "chatcore").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            files.append((f"chatcore/{path.relative_to(CLIENT / 'chatcore')}", path.read_bytes(), 0o644))
    files.append((f"{name}-{version}.data/scripts/chatcore", pathlib.Path(binary).read_bytes(), 0o755))
    metadata = "\n".join([
        "Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", f"Summary: {project['description']}",
        f"Requires-Python: {project['requires-python']}", "License: Apache-2.0",
        "Description-Content-Type: text/markdown", "", (CLIENT / "README.md").read_text()])
    files += [
        (f"{info}/METADATA", metadata.encode(), 0o644),
        (f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: chatcore packaging\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(), 0o644),
        (f"{info}/top_level.txt", b"chatcore\n", 0o644),
        (f"{info}/LICENSE", (ROOT / "LICENSE").read_bytes(), 0o644),
    ]
    record = "".join(f"{path},{digest(data)},{len(data)}\n" for path, data, _ in files) + f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode(), 0o644))
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data, mode in files:
            entry = zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0))
            entry.external_attr = (0o100000 | mode) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, data)
    print(wheel)


if __name__ == "__main__":
    main(*sys.argv[1:])
