"""The installer's distro detection and package choice, shellcheck, and `vagrant validate`.

install.sh defines its functions without running anything when sourced, so each
supported /etc/os-release is fed to the real shell function.
"""

import os
import shutil
import signal
import subprocess
import time

import pytest
from support.paths import ROOT

OS_RELEASES = {
    "debian12": (
        'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian\n',
        "debian",
    ),
    "ubuntu2204": (
        'NAME="Ubuntu"\nVERSION="22.04.4 LTS (Jammy Jellyfish)"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="22.04"\n',
        "debian",
    ),
    "ubuntu2404": (
        'PRETTY_NAME="Ubuntu 24.04.1 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\nID_LIKE=debian\n',
        "debian",
    ),
    "fedora40": (
        'NAME="Fedora Linux"\nVERSION="40 (Cloud Edition)"\nID=fedora\nVERSION_ID=40\nPLATFORM_ID="platform:f40"\n',
        "fedora",
    ),
    "rocky9": (
        'NAME="Rocky Linux"\nVERSION="9.4 (Blue Onyx)"\nID="rocky"\nID_LIKE="rhel centos fedora"\nVERSION_ID="9.4"\n',
        "fedora",
    ),
    "linuxmint": ('NAME="Linux Mint"\nID=linuxmint\nID_LIKE="ubuntu debian"\n', "debian"),
}
UNSUPPORTED = {
    "alpine": 'NAME="Alpine Linux"\nID=alpine\nVERSION_ID=3.20.0\n',
    "arch": 'NAME="Arch Linux"\nID=arch\n',
    "empty": "",
}


def shell(func_call):
    script = f'source "{ROOT}/install.sh"; {func_call}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True)


@pytest.mark.parametrize("name", sorted(OS_RELEASES))
def test_supported_distro_detected(tmp_path, name):
    text, family = OS_RELEASES[name]
    f = tmp_path / "os-release"
    f.write_text(text)
    out = shell(f"distro_family {f}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == family


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_distro_rejected(tmp_path, name):
    f = tmp_path / "os-release"
    f.write_text(UNSUPPORTED[name])
    out = shell(f"distro_family {f}")
    assert out.returncode != 0
    assert out.stdout.strip() == "unknown"


def test_missing_os_release_rejected(tmp_path):
    out = shell(f"distro_family {tmp_path}/nope")
    assert out.returncode != 0


@pytest.mark.parametrize(
    "family,must_have,must_not",
    [
        (
            "debian",
            ["bpfcc-tools", "python3-bpfcc", "systemtap-sdt-dev", "libjemalloc2", "prometheus", "golang-go"],
            ["python3-bcc"],
        ),
        (
            "fedora",
            ["bcc", "python3-bcc", "kernel-devel", "jemalloc", "systemtap-sdt-devel", "golang", "chromium"],
            ["python3-bpfcc"],
        ),
    ],
)
def test_package_lists(family, must_have, must_not):
    out = shell(f"distro_packages {family}")
    assert out.returncode == 0
    pkgs = out.stdout.split()
    for p in must_have:
        assert p in pkgs
    for p in must_not:
        assert p not in pkgs


def test_debian_package_alternatives_resolved_by_what_apt_has(tmp_path):
    # Debian 13 renamed libtcmalloc-minimal4 (t64) and libmimalloc2.0 (libmimalloc3): the
    # list names both, and the one the archive has is installed. apt-cache is faked here.
    fake = tmp_path / "apt-cache"
    # apt-cache show: exit 0 but no record for names only referenced; a long record for the
    # others (a reader that stops early must not turn the writer's SIGPIPE into "missing").
    fake.write_text(
        '#!/bin/sh\ncase "$3" in libtcmalloc-minimal4t64|libmimalloc3|gcc)\n'
        '  echo "Package: $3"; i=0; while [ $i -lt 20000 ]; do echo " description"; i=$((i+1)); done ;;\n'
        'esac\nexit 0\n'
    )
    fake.chmod(0o755)
    out = subprocess.run(
        [
            "bash",
            "-c",
            f'source "{ROOT}/install.sh"; PATH="{tmp_path}:$PATH"; resolve_packages $(distro_packages debian)',
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    pkgs = out.stdout.split()
    assert "libtcmalloc-minimal4t64" in pkgs and "libmimalloc3" in pkgs
    assert not any("|" in p for p in pkgs)
    assert "libtcmalloc-minimal4" not in pkgs and "libmimalloc2.0" not in pkgs
    # Nothing known: the first name, for apt-get's error message.
    out = subprocess.run(
        ["bash", "-c", f'source "{ROOT}/install.sh"; PATH="{tmp_path}:$PATH"; resolve_packages "nope1|nope2" gcc'],
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["nope1", "gcc"]


def test_installer_refuses_non_root_and_bad_options():
    # Unknown options are refused before anything is installed.
    out = subprocess.run([str(ROOT / "install.sh"), "--bogus"], capture_output=True, text=True)
    assert out.returncode != 0 and "unknown option" in out.stderr


SCRIPTS = ["install.sh", ".ci/run", "vagrant/run-tests.sh", "vagrant/build-box.sh"]


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (./install.sh installs it)")
    out = subprocess.run(["shellcheck", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def vagrant_validate():
    """`vagrant validate` without a provider's checks: a machine with Vagrant but no usable
    provider (the test VMs themselves: no vagrant-libvirt there) validates too, and it names
    every machine the Vagrantfile defines."""
    if shutil.which("vagrant") is None:
        pytest.skip("vagrant not installed (./install.sh installs it)")
    return subprocess.run(
        ["vagrant", "validate", "--ignore-provider"], cwd=ROOT / "vagrant", capture_output=True, text=True, timeout=300
    )


def test_vagrantfile_valid():
    out = vagrant_validate()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "validated successfully" in out.stdout


def test_vagrantfile_defines_three_boxes_provisioned_by_installer():
    out = vagrant_validate()
    for box in ("debian12", "debian13", "fedora", "ubuntu"):
        assert f"==> {box}: " in out.stdout, out.stdout
    text = (ROOT / "vagrant" / "Vagrantfile").read_text()
    assert "./install.sh" in text and "libvirt" in text and "virtualbox" in text


def _run_tests_sh(tmp_path, *args, env=None):
    """vagrant/run-tests.sh's main with its VM steps replaced: building a box and running
    one (run_local_box) append to an events file; debian13's suite "fails"."""
    script = f"""
        source "{ROOT}/vagrant/run-tests.sh"
        id() {{ echo 0; }}
        build_box() {{ echo "build $1" >>"$EVENTS"; echo "/cache/$1.box"; }}
        run_local_box() {{
            echo "start $1" >>"$EVENTS"; sleep 1; echo "end $1" >>"$EVENTS"
            echo "=== 3 passed in 1.00s ===" >>"$2"
            [ "$1" = debian12 ]
        }}
        main "$@"
    """
    events = tmp_path / "events"
    env = dict(os.environ, EVENTS=str(events), PYMTRACE_VM_LOGS=str(tmp_path / "logs"), **(env or {}))
    out = subprocess.run(
        ["bash", "-c", script, "run-tests.sh", *args], capture_output=True, text=True, env=env, timeout=60
    )
    return out, events.read_text().split("\n")[:-1]


def test_vm_runner_runs_the_local_boxes_at_once_and_prints_a_line_each(tmp_path):
    out, events = _run_tests_sh(tmp_path, "all")
    assert out.returncode == 1, out.stderr  # debian13 failed
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["debian12", "PASS"], ["debian13", "FAIL"]]
    assert all(line.endswith("3 passed in 1.00s") for line in lines)
    # both boxes built (one after the other) before either VM starts, then both VMs at once
    assert events[:2] == ["build debian12", "build debian13"]
    assert sorted(events[2:4]) == ["start debian12", "start debian13"]
    assert sorted(events[4:]) == ["end debian12", "end debian13"]


def test_vm_runner_one_box_after_the_other_when_asked(tmp_path):
    out, events = _run_tests_sh(tmp_path, "debian12", "debian13", env={"PYMTRACE_VM_PARALLEL": "0"})
    assert out.returncode == 1
    assert [line.split()[1] for line in out.stdout.splitlines()] == ["PASS", "FAIL"]
    assert events == ["start debian12", "end debian12", "start debian13", "end debian13"]
    (tmp_path / "one").mkdir()
    out, events = _run_tests_sh(tmp_path / "one", "debian12")
    assert out.returncode == 0 and out.stdout.split()[:2] == ["debian12", "PASS"]
    assert events == ["start debian12", "end debian12"]


FAKE_IP = r"""#!/bin/bash
# ip for run_local_box: netns add/delete logged; netns exec runs a stand-in for the box's run
# (run-tests.sh --inside), which on TERM does what that run's EXIT trap does and exits.
case "$1 $2" in
    "netns add"|"netns delete") echo "ip $2 ${3##*-}" >>"$EVENTS" ;;
    "netns list") ;;
    "netns exec")
        for a; do [ "${prev:-}" = --inside ] && name=$a; prev=$a; done
        trap 'echo "guest stopped $name" >>"$EVENTS"; exit 143' TERM
        echo "suite started $name" >>"$EVENTS"
        sleep 121.7 & wait $!
        echo "suite ended $name" >>"$EVENTS" ;;
esac
"""


def _fake_bin(tmp_path, **tools):
    """TMP_PATH/bin with each TOOL=script as an executable: put first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in tools.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def _interrupted_run(tmp_path, *args, env=None):
    """run-tests.sh's main with run_local_box's real steps (lock, state, namespace, process
    group) but a fake `ip` whose netns exec stands in for the guest's suite; TERM once every
    started run is in its suite. -> (exit status, stdout, events, cache dir, stderr)."""

    bindir, cache, events = _fake_bin(tmp_path, ip=FAKE_IP), tmp_path / "cache", tmp_path / "events"
    cache.mkdir()
    events.touch()
    script = f"""
        source "{ROOT}/vagrant/run-tests.sh"
        id() {{ echo 0; }}
        build_box() {{ echo "build $1" >>"$EVENTS"; echo "/cache/$1-0123.box"; }}
        ensure_libvirt_user() {{ :; }}
        main "$@"
    """
    env = dict(
        os.environ,
        PATH=f"{bindir}:{os.environ['PATH']}",
        EVENTS=str(events),
        PYMTRACE_VM_CACHE=str(cache),
        PYMTRACE_VM_LOGS=str(tmp_path / "logs"),
        **(env or {}),
    )
    main = subprocess.Popen(
        ["bash", "-c", script, "run-tests.sh", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    started = [f"suite started {b}" for b in args if b != "all"] or ["suite started debian12", "suite started debian13"]
    deadline = time.monotonic() + 30
    while not all(s in events.read_text() for s in started[: 1 if env.get("PYMTRACE_VM_PARALLEL") == "0" else 2]):
        if main.poll() is not None or time.monotonic() > deadline:
            main.kill()
            pytest.fail(f"the runs did not start: {events.read_text()} {main.stderr.read()}")
        time.sleep(0.1)
    try:
        t0 = time.monotonic()
        main.terminate()
        out, err = main.communicate(timeout=30)
        assert time.monotonic() - t0 < 10, "the runs took too long to stop"
    finally:
        main.kill()
        left = subprocess.run(["pkill", "-e", "-f", "sleep 121.7"], capture_output=True, text=True).stdout
    assert not left, f"processes of the stopped runs were left: {left}"
    return main.returncode, out, events.read_text().splitlines(), cache, err


def test_vm_runner_stops_every_box_on_sigterm(tmp_path):
    """TERM to run-tests.sh (a `kill`, a closed SSH session's HUP alike): each box's run gets
    it in its own process group, stops its guest, its namespace and state go, each box
    prints FAIL "interrupted", and the script exits 143. Before, the runs went on alone."""
    rc, out, events, cache, err = _interrupted_run(tmp_path, "all")
    assert rc == 143, err
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines] == [["debian12", "FAIL"], ["debian13", "FAIL"]], out
    assert all(line.endswith("interrupted") for line in lines), out
    for b in ("debian12", "debian13"):
        assert f"guest stopped {b}" in events and f"ip delete {b}" in events, events
        assert f"suite ended {b}" not in events
    assert not list(cache.glob("run.*")), "a run's state directory was left"


def test_vm_runner_one_after_the_other_stops_before_the_next_box(tmp_path):
    rc, out, events, _, err = _interrupted_run(tmp_path, "debian12", "debian13", env={"PYMTRACE_VM_PARALLEL": "0"})
    assert rc == 143, err
    assert out.split()[:2] == ["debian12", "FAIL"] and len(out.splitlines()) == 1, out
    assert "guest stopped debian12" in events and not any("debian13" in e for e in events), events


FAKE_VAGRANT = r"""#!/bin/bash
# vagrant for inside(): the box is in the store, up returns at once, the suite's ssh sleeps
case "$1" in
    box) echo "pymtrace/debian12-0123 (libvirt, 0)" ;;
    up) echo "up $2" >>"$EVENTS" ;;
    ssh) case "$*" in *install.sh*) echo "suite started" >>"$EVENTS"; exec sleep 121.8 ;; esac ;;
    destroy) echo "destroyed $3" >>"$EVENTS" ;;
esac
"""


def test_vm_runner_stops_the_guest_suite_at_once_on_sigterm(tmp_path):
    """The box's run inside its namespace (run-tests.sh --inside), with fake daemons and a
    fake vagrant whose suite sleeps: TERM to its process group, as run_box sends it, ends the
    suite's step at once, destroys the VM and stops the daemons. Before, `timeout` (in a
    process group of its own) kept the suite running to its end, up to an hour and more."""
    bindir = _fake_bin(tmp_path, vagrant=FAKE_VAGRANT)
    cache, events, state = tmp_path / "cache", tmp_path / "events", tmp_path / "state"
    cache.mkdir()
    state.mkdir()
    events.touch()
    script = f"""
        source "{ROOT}/vagrant/run-tests.sh"
        private_libvirt() {{ :; }}
        start_daemons() {{ :; }}
        ensure_pool() {{ :; }}
        stop_daemons() {{ echo "daemons stopped" >>"$EVENTS"; }}
        inside debian12 /cache/debian12-0123.box pymtrace/debian12-0123 "{state}" "{tmp_path}/timings"
    """
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", EVENTS=str(events), PYMTRACE_VM_CACHE=str(cache))
    run = subprocess.Popen(
        ["bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while "suite started" not in events.read_text():
            assert run.poll() is None and time.monotonic() < deadline, f"the suite did not start: {run.stderr.read()}"
            time.sleep(0.1)
        t0 = time.monotonic()
        os.killpg(run.pid, signal.SIGTERM)
        try:
            _, err = run.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the run went on with its suite after TERM")
        assert time.monotonic() - t0 < 10, "the run took too long to stop"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        left = subprocess.run(["pkill", "-e", "-f", "sleep 121.8"], capture_output=True, text=True).stdout
    assert not left, f"the suite's step was left running: {left}"
    assert run.returncode == 1, err
    assert events.read_text().splitlines() == ["up debian12", "suite started", "destroyed debian12", "daemons stopped"]
    assert "run-tests: interrupted" in err


def test_vm_runner_removes_what_a_killed_run_left_without_errors(tmp_path):
    """A run killed outright (SIGKILL, a machine stopped) leaves its namespace and its state
    with the pid files of daemons that are gone: the next run removes both and says so, and a
    vanished pid prints no error (it did: "/proc/N/cmdline: No such file or directory")."""
    bindir, cache, events = tmp_path / "bin", tmp_path / "cache", tmp_path / "events"
    bindir.mkdir()
    (bindir / "ip").write_text(
        '#!/bin/bash\ncase "$1 $2" in\n'
        '"netns list") echo "pymtrace-vm-123-debian12 (id: 0)"; echo "pymtrace-vm-9-debian13" ;;\n'
        '"netns delete") echo "ip delete $3" >>"$EVENTS" ;;\nesac\n'
    )
    (bindir / "ip").chmod(0o755)
    state = cache / "run.debian12.AbCdEf"
    state.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (state / "libvirtd.pid").write_text(f"{gone.pid}\n")
    (state / "virtlogd.pid").write_text("not a pid\n")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", EVENTS=str(events), PYMTRACE_VM_CACHE=str(cache))
    out = subprocess.run(
        ["bash", "-c", f'source "{ROOT}/vagrant/run-tests.sh"; remove_killed_runs debian12'],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert events.read_text().splitlines() == ["ip delete pymtrace-vm-123-debian12"]  # not debian13's
    assert not state.exists()
    assert out.stderr.splitlines() == [
        "run-tests: debian12: removing the namespace left by an earlier run: pymtrace-vm-123-debian12",
        f"run-tests: debian12: removing the state left by an earlier run: {state}",
    ]


def test_vm_runner_refuses_an_unknown_box(tmp_path):
    out = subprocess.run([str(ROOT / "vagrant" / "run-tests.sh"), "debian99"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown box debian99" in out.stderr
