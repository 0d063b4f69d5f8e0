"""The Python client's wheel carries the binary: installed into a fresh virtual environment
with nothing else, where no Swift toolchain can be found, it gives a working `chatcore`
command and a `Client.spawn()` that needs no configuration."""
import os
import pathlib
import subprocess
import sys

from conftest import ROOT
from test_dist import TOOLCHAIN, dist_binary

PROGRAM = """
import asyncio
from chatcore import Client, protocol

async def main():
    alice = await Client.spawn("alice", data_dir="data")
    chat = await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="from a wheel"))
    print(chat["chatId"])
    await alice.close()

asyncio.run(main())
"""


def test_the_wheel_installs_into_a_fresh_environment_and_spawns_its_binary(tmp_path):
    built = subprocess.run([sys.executable, str(ROOT / "packaging" / "python_wheel.py"), str(dist_binary()), str(tmp_path)],
                           capture_output=True, text=True, check=True).stdout.strip()
    wheel = pathlib.Path(built)
    assert wheel.name.endswith(f"-py3-none-linux_{os.uname().machine}.whl")
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", str(wheel)], check=True)
    (tmp_path / "program.py").write_text(PROGRAM)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    unshare = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    script = (f"mount -t tmpfs none {TOOLCHAIN} && {tmp_path}/venv/bin/chatcore --version && "
              f"cd {tmp_path} && exec {python} program.py")
    done = subprocess.run(unshare + ["sh", "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    version, chat = done.stdout.split()
    assert version == subprocess.run([str(dist_binary()), "--version"], capture_output=True, text=True).stdout.strip()
    assert chat == "1"
