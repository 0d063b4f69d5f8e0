"""The clients are typed the way their users' checkers see them: `mypy --strict` and
`tsc --strict` accept the examples and a program that uses every request builder (and which
runs, so the types are the ones the service answers with), and reject a program that reads a
field an answer does not have. `make setup` installs both checkers (mypy from PyPI, tsc from
Debian's node-typescript)."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, chatcore_binary

PYTHON_CLIENT = ROOT / "clients" / "python"
NODE_CLIENT = ROOT / "clients" / "typescript"
sys.path.insert(0, str(ROOT / "Examples" / "node"))


def tool(name):
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `make setup`")
    return found


def mypy(*paths):
    return subprocess.run([tool("mypy"), "--strict", "--cache-dir", str(ROOT / ".build" / "mypy-cache"), *map(str, paths)],
                          env={**os.environ, "MYPYPATH": str(PYTHON_CLIENT)}, capture_output=True, text=True, timeout=300)


def tsc(project):
    return subprocess.run([tool("tsc"), "-p", str(project)], capture_output=True, text=True, timeout=300)


def test_mypy_strict_accepts_the_client_the_examples_and_a_program_using_every_builder():
    checked = mypy(PYTHON_CLIENT / "chatcore", PYTHON_CLIENT / "example.py", PYTHON_CLIENT / "tests" / "every_builder.py",
                   ROOT / "Examples" / "python" / "chat.py", ROOT / "Examples" / "simple-chat" / "simple_chat.py")
    assert checked.returncode == 0, checked.stdout


def test_mypy_strict_rejects_a_field_an_answer_does_not_have(tmp_path):
    program = tmp_path / "wrong.py"
    program.write_text(
        "from chatcore import Client, protocol\n\n\n"
        "async def main(client: Client) -> None:\n"
        "    chat = await client.request(protocol.chat_start(invitees=[{'userId': 'bob'}], subject='Plans'))\n"
        "    print(chat['chatIdentifier'])\n"
        "    listed = await client.request(protocol.request_list_all(type='user'))\n"
        "    print(listed['elements'][0]['subject'])\n"
        "    sent = await client.request(protocol.chat_message_send(chatId='1', tag='Text'))\n"
        "    number: int = sent['messageId']\n")
    checked = mypy(program)
    assert checked.returncode == 1
    assert 'TypedDict "Chat" has no key "chatIdentifier"' in checked.stdout
    assert 'TypedDict "User" has no key "subject"' in checked.stdout
    assert 'expression has type "str", variable has type "int"' in checked.stdout


def builders(source, pattern):
    return sorted(set(re.findall(pattern, source, re.MULTILINE)) - {"_message"})


def test_the_programs_use_every_builder():
    python_builders = builders((PYTHON_CLIENT / "chatcore" / "protocol.py").read_text(), r"^def (\w+)\(")
    python_program = (PYTHON_CLIENT / "tests" / "every_builder.py").read_text()
    assert len(python_builders) > 30
    assert [name for name in python_builders if f"protocol.{name}(" not in python_program] == []
    node_builders = builders((NODE_CLIENT / "protocol.js").read_text(), r"^export function (\w+)\(")
    node_program = (NODE_CLIENT / "test" / "every_builder.mjs").read_text()
    assert len(node_builders) == len(python_builders)
    assert [name for name in node_builders if f"{name}(" not in node_program.split("from \"chatcore-client\";", 1)[1]] == []


def test_the_python_program_using_every_builder_runs():
    done = subprocess.run([sys.executable, str(PYTHON_CLIENT / "tests" / "every_builder.py")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(PYTHON_CLIENT), "CHATCORE_BINARY": chatcore_binary()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "every builder answered as typed"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_program_using_every_builder_runs():
    done = subprocess.run(["node", str(NODE_CLIENT / "test" / "every_builder.mjs")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CHATCORE_BINARY": chatcore_binary()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "every builder answered as typed"


def test_tsc_strict_accepts_the_package_example_and_a_program_using_every_builder():
    checked = tsc(NODE_CLIENT)
    assert checked.returncode == 0, checked.stdout


def node_project(directory, program):
    """A project of a user's: the client installed as its package.json says, a strict tsconfig."""
    from test_node_client import installed_copy
    installed_copy(directory)
    (directory / "program.mjs").write_text(program)
    shutil.copy(NODE_CLIENT / "test" / "node.d.ts", directory)
    options = json.loads((NODE_CLIENT / "tsconfig.json").read_text())["compilerOptions"]
    (directory / "tsconfig.json").write_text(json.dumps({"compilerOptions": options, "files": ["client.mjs", "program.mjs", "node.d.ts"]}))
    return directory


def test_tsc_strict_accepts_the_node_example_as_a_user_installs_it(tmp_path):
    checked = tsc(node_project(tmp_path, "export {};\n"))
    assert checked.returncode == 0, checked.stdout


def test_tsc_strict_rejects_a_field_an_answer_does_not_have(tmp_path):
    program = """// @ts-check
import { Client, chatStart, chatMessageSend, requestListAll } from "chatcore-client";
const client = Client.spawn("alice");
const chat = await client.request(chatStart({ invitees: [{ userId: "bob" }], subject: "Plans" }));
console.log(chat.chatIdentifier);
const listed = await client.request(requestListAll({ type: "user" }));
console.log(listed.elements[0].subject);
const sent = await client.request(chatMessageSend({ chatId: "1", tag: "Text" }));
/** @type {number} */
const number = sent.messageId;
const controller = new AbortController();
await client.request(chatStart({ invitees: [] }), { signal: controller.signal, timeout: "soon" });
"""
    checked = tsc(node_project(tmp_path, program))
    assert checked.returncode != 0
    assert "Property 'chatIdentifier' does not exist on type 'Chat'" in checked.stdout
    assert "Property 'subject' does not exist on type 'User'" in checked.stdout
    assert "program.mjs(10,7): error TS2322: Type 'string' is not assignable to type 'number'" in checked.stdout
    assert "program.mjs(12,80): error TS2769: No overload matches this call" in checked.stdout  # timeout: "soon"
