"""Every option of `chatcore serve` can be given as a flag, as CHATCORE_<NAME> in the
environment, or as <name> in the YAML file of --config (or CHATCORE_CONFIG): flags win over
the environment, which wins over the file. Values from outside the command line are checked
as flags are, and an error says where the value came from."""
import json
import os
import socket
import subprocess

import pytest

from conftest import chatcore_binary

# A value of each kind the options take (by their value names in --help), valid alone.
SAMPLES = {"bytes": "3 MiB", "n": "7", "seconds": "11", "MiB": "5", "level": "debug", "format": "json", "address": "127.0.0.1:7777",
           "url": "postgres://chatcore@localhost/example"}
SAMPLE_OVERRIDES = {"max-output-total": "5 MiB", "metrics": "127.0.0.1:9777", "writer-timeout": "13", "notify-url": "http://127.0.0.1:9/hook",
                    "ws-allowed-origins": "https://chat.example"}


def serve_options():
    dump = subprocess.run([settings_binary(), "serve", "--experimental-dump-help"], capture_output=True, text=True, check=True)
    for argument in json.loads(dump.stdout)["command"]["arguments"]:
        names = [name["name"] for name in argument.get("names", []) if name["kind"] == "long"]
        if names and names[0] not in ("help", "version", "config", "show-config"):
            yield names[0], argument


def environment_name(option):
    return "CHATCORE_" + option.upper().replace("-", "_")


def sample(option, argument):
    if argument["kind"] == "flag":
        return True
    return SAMPLE_OVERRIDES.get(option) or SAMPLES.get(argument.get("valueName"), f"/somewhere/{option}")


def settings_binary():
    """The binary itself: --show-config opens no store, so the PostgreSQL run's wrapper (which
    adds --store to the command line) is not needed and would show its own flags."""
    return os.environ.get("CHATCORE_REAL_BINARY") or chatcore_binary()


def run(*arguments, environment=None, config=None, tmp_path=None, stdin=b""):
    env = {key: value for key, value in os.environ.items() if not key.startswith("CHATCORE_") or key in ("CHATCORE_REAL_BINARY", "CHATCORE_TEST_POSTGRES")}
    env.update(environment or {})
    arguments = list(arguments)
    if config is not None:
        path = tmp_path / "chatcore.yaml"
        path.write_text(config)
        arguments += ["--config", str(path)]
    binary = settings_binary() if "--show-config" in arguments else chatcore_binary()
    return subprocess.run([binary, "serve", *arguments], env=env, input=stdin, capture_output=True, timeout=60)


def shown(done):
    """--show-config's lines, by option: (value, where it came from)."""
    assert done.returncode == 0, done.stderr.decode()
    settings = {}
    for line in done.stdout.decode().splitlines():
        if line.startswith("#"):
            continue
        setting, origin = line.split("  # ", 1)
        name, value = setting.split(": ", 1)
        settings[name] = (value, origin)
    return settings


def yaml_scalar(value):
    return "true" if value is True else json.dumps(value)


# A flag that needs others to be valid is given with them on the command line.
COMPANIONS = {"listen": ["--insecure-no-auth"], "auth-audience": [],
              # Options of the nodes of a shared store.
              "advertise": ["--store", "postgres://chatcore@/x"], "node-tls-ca": ["--store", "postgres://chatcore@/x"],
              "notify-url": ["--notify-secret-file", "/somewhere/secret"],
              "tls-cert": ["--listen", "tls://127.0.0.1:7443", "--insecure-no-auth", "--tls-key", "/somewhere/key"],
              "tls-key": ["--listen", "tls://127.0.0.1:7443", "--insecure-no-auth", "--tls-cert", "/somewhere/cert"]}


@pytest.mark.parametrize("source", ["environment", "file"])
def test_every_option_has_an_environment_variable_and_a_config_key_that_take_effect(source, tmp_path):
    options = list(serve_options())
    assert len(options) > 30
    for option, argument in options:
        value = sample(option, argument)
        companions = COMPANIONS.get(option, [])
        if source == "environment":
            done = run(*companions, "--show-config", environment={environment_name(option): "true" if value is True else value})
            origin = f"{environment_name(option)} in the environment"
        else:
            done = run(*companions, "--show-config", config=f"{option}: {yaml_scalar(value)}\n", tmp_path=tmp_path)
            origin = f"the config file {tmp_path / 'chatcore.yaml'}"
        settings = shown(done)
        assert option in settings, f"--show-config does not show {option}: {done.stdout.decode()}"
        got, where = settings[option]
        expected = "true" if value is True else value
        assert got.strip("[]'") == expected and where == origin, (option, settings[option])


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path):
    config = "max-line-bytes: 1 KiB\nmax-sessions: 9\nidle-timeout: 5\n"
    environment = {"CHATCORE_MAX_LINE_BYTES": "2 KiB", "CHATCORE_MAX_SESSIONS": "8"}
    settings = shown(run("--max-line-bytes", "4 KiB", "--show-config", environment=environment, config=config, tmp_path=tmp_path))
    assert settings["max-line-bytes"] == ("'4 KiB'", "the command line")
    assert settings["max-sessions"] == ("8", "CHATCORE_MAX_SESSIONS in the environment")
    assert settings["idle-timeout"] == ("5", f"the config file {tmp_path / 'chatcore.yaml'}")
    assert settings["max-endpoints"] == ("100", "default")


def oversized_line_refused(done):
    answer = json.loads(done.stdout.decode().splitlines()[0])
    return answer.get("requestFailed", {}).get("error") == "TooLarge"


def test_a_limit_from_the_environment_or_the_file_is_the_one_the_service_keeps(tmp_path):
    data = str(tmp_path / "data")
    line = json.dumps({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "x" * 3000}}).encode() + b"\n"
    base = ["--user", "alice", "--data-dir", data]
    assert not oversized_line_refused(run(*base, stdin=line))
    assert oversized_line_refused(run(*base, environment={"CHATCORE_MAX_LINE_BYTES": "2 KiB"}, stdin=line))
    assert oversized_line_refused(run(*base, config="max-line-bytes: 2 KiB\n", tmp_path=tmp_path, stdin=line))
    # The command line wins over both.
    assert not oversized_line_refused(run(*base, "--max-line-bytes", "1 MiB", environment={"CHATCORE_MAX_LINE_BYTES": "2 KiB"}, stdin=line))


def listening(process):
    for line in process.stderr:
        if b"listening" in line:
            return
    raise AssertionError("chatcore did not listen")


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def signs_in(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b'{"authToken":{"userId":"alice","authToken":"t"}}\n')
        return b'"value":"Ok"' in client.makefile("rb").readline()


def test_listeners_from_a_file_named_by_CHATCORE_CONFIG_and_a_list_in_the_environment(tmp_path):
    first, second, third = free_port(), free_port(), free_port()
    config = tmp_path / "service.yaml"
    config.write_text(f"# the service\ninsecure-no-auth: true\nlisten:\n  - 127.0.0.1:{first}\n  - 127.0.0.1:{second}\ndata-dir: {tmp_path / 'data'}\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("CHATCORE_") or key in ("CHATCORE_REAL_BINARY", "CHATCORE_TEST_POSTGRES")}
    for environment, ports in (({"CHATCORE_CONFIG": str(config)}, [first, second]),
                               ({"CHATCORE_CONFIG": str(config), "CHATCORE_LISTEN": f"127.0.0.1:{third}"}, [third])):
        server = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", str(tmp_path / "data")], env={**env, **environment},
                                  stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            listening(server)
            assert all(signs_in(port) for port in ports)
        finally:
            server.terminate()
            server.wait(timeout=30)


@pytest.mark.parametrize("environment,config,message", [
    ({"CHATCORE_MAX_LINE_BYTES": "lots"}, None,
     "--max-line-bytes came from CHATCORE_MAX_LINE_BYTES in the environment."),
    ({}, "max-sessions: -3\n", "--max-sessions came from the config file"),
    ({"CHATCORE_INSECURE_NO_AUTH": "perhaps"}, None, "CHATCORE_INSECURE_NO_AUTH must be true or false (it stands for --insecure-no-auth)"),
    ({}, "max-line-byte: 2 KiB\nlisten: [127.0.0.1:1]\n", "has 'max-line-byte', which is not an option of chatcore serve"),
    ({}, "listen: [127.0.0.1:1\n", "is not YAML"),
    ({}, "- listen\n", "must be a mapping of option names to values"),
    ({}, "max-line-bytes: [1, 2]\n", "max-line-bytes in "),
    ({"CHATCORE_CONFIG": "/nonexistent/chatcore.yaml"}, None, "cannot read the config file /nonexistent/chatcore.yaml"),
    ({}, "max_line_bytes: 2 KiB\nmax-line-bytes: 3 KiB\n", "sets --max-line-bytes twice: as 'max_line_bytes' and as 'max-line-bytes'"),
])
def test_a_bad_setting_outside_the_command_line_says_where_it_is(environment, config, message, tmp_path):
    done = run("--user", "alice", "--data-dir", str(tmp_path / "data"), environment=environment, config=config, tmp_path=tmp_path)
    assert done.returncode == 64, done.stderr.decode()
    assert message in done.stderr.decode(), done.stderr.decode()
    assert not (tmp_path / "data").exists() or os.listdir(tmp_path / "data") in ([], ["postgres-database"])


def test_an_empty_variable_is_unset_and_help_needs_no_valid_settings(tmp_path):
    settings = shown(run("--show-config", environment={"CHATCORE_MAX_LINE_BYTES": "", "CHATCORE_USER": ""}))
    assert settings["max-line-bytes"] == ("'1 MiB'", "default")
    done = run("--help", environment={"CHATCORE_CONFIG": "/nonexistent.yaml", "CHATCORE_MAX_LINE_BYTES": "lots"})
    assert done.returncode == 0 and b"CHATCORE_<NAME>" in done.stdout


def test_show_config_prints_a_file_that_gives_the_same_settings(tmp_path):
    first = run("--max-line-bytes", "2 KiB", "--listen", "127.0.0.1:7001", "--listen", "unix:/tmp/x y.sock", "--insecure-no-auth",
                "--log-format", "json", "--show-config")
    saved = tmp_path / "chatcore.yaml"
    saved.write_text(first.stdout.decode())
    again = run("--config", str(saved), "--show-config")
    values = lambda done: {name: value for name, (value, _) in shown(done).items()}
    assert values(first) == values(again)
    assert shown(again)["listen"] == ("['127.0.0.1:7001', 'unix:/tmp/x y.sock']", f"the config file {saved}")


def test_keys_may_be_written_with_underscores_and_a_file_of_comments_sets_nothing(tmp_path):
    settings = shown(run("--show-config", config="# the service\nmax_line_bytes: 2 KiB\nlog_format: json\n", tmp_path=tmp_path))
    assert settings["max-line-bytes"][0] == "'2 KiB'" and settings["log-format"][0] == "json"
    settings = shown(run("--show-config", config="# nothing set yet\n", tmp_path=tmp_path))
    assert settings["max-line-bytes"] == ("'1 MiB'", "default")
