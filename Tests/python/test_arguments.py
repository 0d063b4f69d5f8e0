"""Command-line arguments (and $XDG_DATA_HOME or $HOME when they name the store) must be
UTF-8. Swift reads other bytes as U+FFFD, so before this check `--data-dir /tmp/x<FF>`
made and used the directory `/tmp/x\uFFFD`, and `--user al<FF>ice` served the user
`al\uFFFDice`, whom `al<FE>ice` would also have been."""
import os
import subprocess
import tempfile

from conftest import chatcore_binary


def test_an_argument_that_is_not_utf8_stops_chatcore_before_anything_is_made():
    with tempfile.TemporaryDirectory() as work:
        for arguments in ([b"--user", b"al\xffice", b"--data-dir", os.path.join(work, "d").encode()],
                          [b"--user", b"alice", b"--data-dir", os.path.join(work, "x").encode() + b"\xff"]):
            done = subprocess.run([chatcore_binary().encode(), b"serve", *arguments], input=b"", capture_output=True, timeout=60)
            assert done.returncode == 64, done
            assert b"is not UTF-8" in done.stderr, done.stderr
            assert not made_with_replacement_characters(work)
        # The same in UTF-8 is served.
        done = subprocess.run([chatcore_binary(), "serve", "--user", "al\u00efce", "--data-dir", os.path.join(work, "x\u00ff")],
                              input=b'{"identitiesGet":{"cookie":"c","appUserIds":["al\\u00efce"]}}\n', capture_output=True, timeout=60)
        assert done.returncode == 0, done
        assert b'"appUserId":"al\xc3\xafce"' in done.stdout, done.stdout
        assert "x\u00ff" in os.listdir(work)
        assert not made_with_replacement_characters(work)


def made_with_replacement_characters(directory):
    """What chatcore made under a name it had read with U+FFFD. (On PostgreSQL the test
    wrapper makes the data directory it is given before chatcore reads its arguments.)"""
    return [name for name in os.listdir(os.fsencode(directory)) if "\ufffd".encode() in name]


def test_a_data_directory_from_the_environment_must_be_utf8_too():
    with tempfile.TemporaryDirectory() as work:
        environment = dict(os.environb, XDG_DATA_HOME=os.path.join(work, "x").encode() + b"\xff")
        done = subprocess.run([chatcore_binary(), "serve", "--user", "alice"], input=b"", capture_output=True, timeout=60, env=environment)
        assert done.returncode == 64, done
        assert b"$XDG_DATA_HOME is not UTF-8" in done.stderr, done.stderr
        assert not made_with_replacement_characters(work)


def test_a_token_whose_key_file_is_missing_says_so_in_one_sentence(tmp_path):
    missing = tmp_path / "secret"
    done = subprocess.run([chatcore_binary(), "token", "--user", "alice", "--auth-secret-file", str(missing)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"Error: cannot read --auth-secret-file: cannot read the secret file {missing}: The file doesn’t exist."]
