"""Workers forked from the warm process, side by side with the same command spawned as torch spawns
it: what the script sees (argv, sys.path, __file__, environment, directory, session, parent,
command line, streams), exit codes, tracebacks, signals, threads and atexit at shutdown, modules
run with -m; when the warm process cannot be used it says why; orphans of a killed worker are
reaped. Each case runs in a stand-in agent process of its own (it becomes a child subreaper)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import worker_env

AGENT = textwrap.dedent("""
    # A stand-in agent: starts a warm process, runs each command of the request warm and then
    # spawned (as torch's SubprocessHandler does), and prints what happened as JSON.
    import json, os, subprocess, sys, time
    from agent.warm_workers import WarmProcess, become_subreaper, reap_orphans
    request = json.loads(sys.argv[1])
    become_subreaper()
    warm = WarmProcess(request.get("preload", []), os.environ)
    results = []
    for run in request["runs"]:
        round_keys = {*run.get("env", {}), "OBSERVE_TO"}
        env = {**os.environ, **run.get("env", {})}
        reason = warm.unusable_for(run["argv"], env, round_keys)
        outcome = {"reason": reason}
        if not reason:
            for how in ("warm", "spawn"):
                env["OBSERVE_TO"] = run["out"] + f".{how}.json"
                out, err = (open(run["out"] + f".{how}.{name}", "w") for name in ("out", "err"))
                if how == "warm":
                    proc = warm.fork(run["argv"], env, [0, out.fileno(), err.fileno()])
                else:
                    proc = subprocess.Popen(run["argv"], env=env, stdout=out, stderr=err, start_new_session=True)
                if run.get("kill_after"):
                    time.sleep(run["kill_after"])
                    os.killpg(proc.pid, 9)
                outcome[how] = {"pid": proc.pid, "code": proc.wait(60)}
        outcome["reaped"] = reap_orphans(keep={warm.pid})
        deadline = time.monotonic() + 10  # a killed worker's children may take a moment to exit
        while outcome["reaped"] < run.get("orphans", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
            outcome["reaped"] += reap_orphans(keep={warm.pid})
        results.append(outcome)
    if request.get("kill_warm"):
        os.kill(warm.pid, 9)
        warm._process.wait()
        try:
            warm.fork(request["runs"][0]["argv"], dict(os.environ), [0, 1, 2])
        except OSError:
            pass
        results.append({"problem": warm.problem})
    print(json.dumps({"agent": os.getpid(), "results": results, "refused": warm.refused}))
    warm.close()
""")

OBSERVER = textwrap.dedent("""
    # Writes what a worker process sees as JSON to the path in OBSERVE_TO.
    import atexit, json, os, sys, threading, time
    import numpy, psutil
    seen = {
        "argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
        "rank": os.environ.get("RANK"), "cwd": os.getcwd(), "session_leader": os.getsid(0) == os.getpid(),
        "parent": os.getppid(), "cmdline": psutil.Process().cmdline(), "main_module_file": sys.modules["__main__"].__file__,
        "numpy_draw": float(numpy.random.random()), "stdin_is_agents": os.path.samestat(os.fstat(0), os.stat("/proc/%d/fd/0" % os.getppid())),
    }
    print("to stdout")
    print("to stderr", file=sys.stderr)
    def late():  # a non-daemon thread the interpreter waits for at shutdown
        time.sleep(0.3)
        print("late thread done", flush=True)
    threading.Thread(target=late).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    with open(os.environ["OBSERVE_TO"], "w") as f:
        json.dump(seen, f)
""")


def run_agent(tmp_path: Path, runs: list[dict], **request) -> dict:
    proc = subprocess.run([sys.executable, "-c", AGENT, json.dumps({"runs": runs, **request})], cwd=tmp_path,
                          env=worker_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / "scripts" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def torchrun_argv(target: str, *args: str) -> list[str]:
    return [sys.executable, "-u", target, *args]  # what torchrun's config_from_args makes


def outputs(run: dict, how: str) -> tuple[str, str]:
    return tuple(Path(run["out"] + f".{how}.{name}").read_text() for name in ("out", "err"))


def test_a_forked_worker_sees_what_a_spawned_one_sees(tmp_path):
    script(tmp_path, "observer.py", OBSERVER)
    run = {"argv": torchrun_argv("scripts/observer.py", "--flag", "two words"), "env": {"RANK": "3"},
           "out": str(tmp_path / "run")}
    again = {**run, "out": str(tmp_path / "again")}
    report = run_agent(tmp_path, [run, again])
    first = report["results"][0]
    assert first["reason"] == "" and first["warm"]["code"] == first["spawn"]["code"] == 0
    warm, spawned = (json.loads(Path(run["out"] + f".{how}.json").read_text()) for how in ("warm", "spawn"))
    for field in ("argv", "path0", "file", "name", "rank", "cwd", "session_leader", "main_module_file",
                  "stdin_is_agents"):
        assert warm[field] == spawned[field], field
    assert warm["argv"] == ["scripts/observer.py", "--flag", "two words"] and warm["rank"] == "3"
    assert warm["parent"] == spawned["parent"] == report["agent"]  # the agent's child, as a spawned one
    assert first["warm"]["pid"] not in (report["agent"], first["spawn"]["pid"])
    # The command line as a spawned worker's ("two words" shows as two: the title is one string).
    assert warm["cmdline"] == [sys.executable, "-u", "scripts/observer.py", "--flag", "two", "words"]
    assert spawned["cmdline"] == run["argv"]
    for how in ("warm", "spawn"):  # streams, a non-daemon thread at shutdown, atexit
        assert outputs(run, how) == ("to stdout\nlate thread done\natexit ran\n", "to stderr\n")
    # Two workers forked from one warm process draw different numbers, as two spawned ones do.
    second = json.loads(Path(again["out"] + ".warm.json").read_text())
    assert second["numpy_draw"] != warm["numpy_draw"]


@pytest.mark.parametrize("body, code", [
    ("import sys\nsys.exit(3)\n", 3),
    ("raise ValueError('boom')\n", 1),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", -15),
    ("import time\nprint('hi')\n", 0),
])
def test_exit_codes_and_tracebacks_are_a_spawned_workers(tmp_path, body, code):
    script(tmp_path, "ends.py", "def helper():\n    pass\n" + body)
    run = {"argv": torchrun_argv("scripts/ends.py"), "out": str(tmp_path / "run")}
    [result] = run_agent(tmp_path, [run])["results"]
    assert result["warm"]["code"] == result["spawn"]["code"] == code
    assert outputs(run, "warm") == outputs(run, "spawn")  # the same traceback, line for line


def test_a_module_runs_as_python_m_runs_it(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(OBSERVER)
    run = {"argv": [sys.executable, "-u", "-m", "pkg.job", "x"], "out": str(tmp_path / "run")}
    [result] = run_agent(tmp_path, [run])["results"]
    assert result["warm"]["code"] == result["spawn"]["code"] == 0, outputs(run, "warm")
    warm, spawned = (json.loads(Path(run["out"] + f".{how}.json").read_text()) for how in ("warm", "spawn"))
    for field in ("argv", "path0", "file", "name", "main_module_file"):
        assert warm[field] == spawned[field], field


def test_what_a_warm_process_cannot_start_is_spawned_with_the_reason(tmp_path):
    script(tmp_path, "ok.py", "pass\n")
    results = run_agent(tmp_path, [
        {"argv": ["/usr/bin/env", "python3", "-u", "scripts/ok.py"], "out": str(tmp_path / "a")},  # --no-python
        {"argv": [sys.executable, "-X", "dev", "scripts/ok.py"], "out": str(tmp_path / "b")},
        {"argv": [sys.executable, "-u", "-X", "dev", "scripts/ok.py"], "out": str(tmp_path / "c")},
    ])["results"]
    assert results[0]["reason"].startswith("the worker's command '/usr/bin/env' is not this Python")
    assert results[1]["reason"].startswith("the worker's interpreter flags ['-X', 'dev'] are not ['-u']")
    assert results[2]["reason"] == "the worker's interpreter option '-X' is not one a warm process can take"


def test_an_environment_variable_not_of_the_round_makes_workers_spawn(tmp_path):
    script(tmp_path, "ok.py", "pass\n")
    agent = AGENT.replace('env = {**os.environ, **run.get("env", {})}',
                          'env = {**os.environ, **run.get("env", {}), "PYTHONHASHSEED": "7"}')
    proc = subprocess.run([sys.executable, "-c", agent, json.dumps({"runs": [
        {"argv": torchrun_argv("scripts/ok.py"), "out": str(tmp_path / "a")}]})],
        cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads(proc.stdout.splitlines()[-1])["results"]
    assert result["reason"] == "environment variables differ from the warm process's: PYTHONHASHSEED"


@pytest.mark.parametrize("preload, refusal", [
    (["no_such_module_here"], "importing the preload modules failed: ModuleNotFoundError"),
    (["threaded"], "the preload imports started Python threads (poller)"),
])
def test_a_warm_process_that_cannot_be_used_says_why(tmp_path, preload, refusal):
    script(tmp_path, "ok.py", "pass\n")
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(60,), name='poller', daemon=True).start()\n")
    run = {"argv": torchrun_argv("scripts/ok.py"), "out": str(tmp_path / "a")}
    agent = AGENT.replace("become_subreaper()", "become_subreaper(); sys.path.insert(0, os.getcwd())")
    env = {**worker_env(), "PYTHONPATH": f"{tmp_path}:{worker_env()['PYTHONPATH']}"}
    proc = subprocess.run([sys.executable, "-c", agent, json.dumps({"runs": [run], "preload": preload})],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["results"][0]["reason"].startswith(refusal) and report["refused"].startswith(refusal)


def test_a_warm_process_that_died_is_reported_gone(tmp_path):
    script(tmp_path, "ok.py", "pass\n")
    run = {"argv": torchrun_argv("scripts/ok.py"), "out": str(tmp_path / "a")}
    report = run_agent(tmp_path, [run], kill_warm=True)
    assert report["results"][0]["warm"]["code"] == 0
    assert report["results"][1]["problem"].startswith("the warm process is gone")
    assert report["refused"] == ""  # a new one would do: the agent starts another


def test_orphans_of_a_killed_worker_are_reaped(tmp_path):
    # The worker starts a child that outlives it; killed with its worker's process group, the
    # child is re-parented to the subreaper agent, which reaps it.
    script(tmp_path, "parent.py", "import subprocess, sys, time\n"
                                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                                  "time.sleep(60)\n")
    run = {"argv": torchrun_argv("scripts/parent.py"), "out": str(tmp_path / "a"), "kill_after": 3, "orphans": 2}
    [result] = run_agent(tmp_path, [run])["results"]
    assert result["warm"]["code"] == result["spawn"]["code"] == -9
    assert result["reaped"] == 2  # the warm and the spawned worker's children, and nothing else


STALLED_AGENT = textwrap.dedent("""
    # A stand-in agent whose warm process stops answering while asked to fork (SIGSTOP, as a
    # process stalled mid-fork): the fork must give up, and end the warm process with what it
    # might still fork, before the agent spawns that worker instead. Then the warm process is
    # let go on (SIGCONT), as a stalled one would.
    import json, os, signal, sys, time
    from agent import warm_workers
    from agent.warm_workers import WarmProcess, become_subreaper
    become_subreaper()
    warm_workers.REPLY_WAIT_S = 1.0
    warm = WarmProcess([], os.environ)
    assert warm.wait_ready() == ""
    os.kill(warm.pid, signal.SIGSTOP)
    try:
        warm.fork([sys.executable, "-u", sys.argv[1]], dict(os.environ), [0, 1, 2])
        outcome = "forked"
    except TimeoutError:
        outcome = "timed out"
    try:
        os.kill(warm.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    time.sleep(2)
    print(json.dumps({"outcome": outcome, "problem": warm.problem, "alive": warm.alive()}))
""")


def test_a_warm_process_stalled_mid_fork_is_ended_before_the_worker_is_spawned(tmp_path):
    marker = tmp_path / "ran"
    worker = script(tmp_path, "mark.py", f"open({str(marker)!r}, 'a').write('x')\n")
    proc = subprocess.run([sys.executable, "-c", STALLED_AGENT, str(worker)], cwd=tmp_path, env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["outcome"] == "timed out" and not report["alive"]
    assert report["problem"].startswith("the warm process did not fork a worker")
    assert not marker.exists()  # no late copy of the worker beside the one the agent spawns
