"""What only chatcore's user should read. The data directory holds every message:
chatcore makes it readable by its own user only (before, a new store was readable by
every user of the machine: a 0755 directory of 0644 files). A directory that exists
keeps its mode, and the log says when others may read it, or the secret that signs
tokens."""
import os
import stat
import subprocess
import tempfile

from conftest import chatcore_binary


def serve(directory):
    return subprocess.run([chatcore_binary(), "serve", "--user", "alice", "--data-dir", directory],
                          input=b'{"chatStart":{"cookie":"c","invitees":[{"userId":"bob"}],"subject":"private"}}\n',
                          capture_output=True, timeout=60)


def test_a_new_data_directory_is_only_for_its_user():
    with tempfile.TemporaryDirectory() as work:
        os.chmod(work, 0o755)
        directory = os.path.join(work, "made", "store")
        done = serve(directory)
        assert done.returncode == 0, done
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert b"may read the data directory" not in done.stderr
        # Parents it had to make are made as any other directory.
        assert stat.S_IMODE(os.stat(os.path.join(work, "made")).st_mode) == 0o777 & ~current_umask()


def test_an_existing_directory_keeps_its_mode_and_the_log_says_who_may_read_it():
    with tempfile.TemporaryDirectory() as work:
        os.chmod(work, 0o750)
        done = serve(work)
        assert done.returncode == 0, done
        assert stat.S_IMODE(os.stat(work).st_mode) == 0o750
        assert b"other users of this machine may read the data directory" in done.stderr, done.stderr
        assert b"mode=750" in done.stderr


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_log_warns_when_others_may_read_the_token_secret():
    with tempfile.TemporaryDirectory() as work:
        secret = os.path.join(work, "secret")
        with open(secret, "wb") as f:
            f.write(b"0123456789abcdef0123456789abcdef")
        for mode, warned in ((0o644, True), (0o600, False)):
            os.chmod(secret, mode)
            done = subprocess.run([chatcore_binary(), "serve", "--auth-secret-file", secret, "--data-dir", os.path.join(work, "d")],
                                  input=b"", capture_output=True, timeout=60)
            assert done.returncode == 0, done
            assert (b"may read --auth-secret-file" in done.stderr) == warned, (oct(mode), done.stderr)
