"""Runs the Python example against the real binary, and without one."""
import os
import pathlib
import shutil
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).with_name("chat.py")
CLIENT = pathlib.Path(__file__).resolve().parents[2] / "clients" / "python"


def with_client(env):
    """The example imports the installed package: here, the repository's copy."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(CLIENT), env.get("PYTHONPATH")]))}


def test_the_python_example_chats_through_the_client():
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=with_client(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "alice is bbmpim://user/id/0",
        "started chat 1 'Lunch'",
        "sent message 2 Sent",
        "  1 Join ",
        "  2 Text Noon?",
        "refused: InvalidParameter unknown field 'misspelled'",
    ]


def test_without_a_binary_the_example_says_how_to_point_at_one(tmp_path):
    # A copy of the example and the client outside the repository, where no build is found.
    root = pathlib.Path(__file__).resolve().parents[2]
    shutil.copytree(root / "clients" / "python" / "chatcore", tmp_path / "clients" / "python" / "chatcore")
    (tmp_path / "Examples" / "python").mkdir(parents=True)
    shutil.copy(EXAMPLE, tmp_path / "Examples" / "python")
    env = {key: value for key, value in os.environ.items() if key != "CHATCORE_BINARY"}
    env["PATH"] = os.path.dirname(sys.executable)
    env["PYTHONPATH"] = str(tmp_path / "clients" / "python")
    result = subprocess.run([sys.executable, str(tmp_path / "Examples" / "python" / "chat.py")], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "CHATCORE_BINARY" in result.stderr
