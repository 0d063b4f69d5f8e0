"""The Node client packed with its platform package installs into a fresh project with
npm, offline, and its Client.spawn() finds the bundled binary with no configuration,
where no Swift toolchain can be found."""
import os
import subprocess

from conftest import ROOT
from test_dist import TOOLCHAIN, dist_binary

PROGRAM = """
import { Client, chatStart } from "chatcore-client";
const alice = Client.spawn("alice", { dataDir: "data" });
const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "from npm" }));
console.log(chat.chatId);
await alice.close();
"""


def test_the_packed_client_installs_and_spawns_its_bundled_binary(tmp_path):
    packed = subprocess.run([str(ROOT / "packaging" / "npm_packages.sh"), str(dist_binary()), str(tmp_path)],
                            capture_output=True, text=True, check=True).stdout.split()
    assert len(packed) == 2, packed
    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text('{"name": "trying-chatcore", "version": "1.0.0", "type": "module"}\n')
    subprocess.run(["npm", "install", "--offline", "--no-audit", "--no-fund", *(str(tmp_path / name) for name in packed)],
                   cwd=project, capture_output=True, check=True, timeout=300)
    (project / "program.mjs").write_text(PROGRAM)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    unshare = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    done = subprocess.run(unshare + ["sh", "-c", f"mount -t tmpfs none {TOOLCHAIN} && cd {project} && exec node program.mjs"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
